"""process_group=: grads edited in place after backward (clip_grad_norm_, a GradScaler's
unscale_, a framework's clipping) are refused on every rank at the same step, with nothing
stepped (hybrid_opt/zero_edits.py); a DDP wrapper's own write of the averages is not an edit;
one rank's checkpoint is refused on another rank. 2 gloo ranks (tests/dist_scripts/zero_edits.py)."""
import pytest
import torch

from dist_launch import DIST_MARKS, launch

pytestmark = DIST_MARKS

CASES = ("clip", "clip_rank1", "mul", "ddp", "ddp_clip", "ddp_unbitten_clip", "unscale", "rank0_checkpoint")
RECIPE = ("HybridAdamW(..., max_grad_norm=", "attach_grad_scaler", "TrainingArguments(max_grad_norm=0)",
          "gradient_clip_val=None", "accelerator.clip_grad_norm_")


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    return launch("zero_edits.py", str(tmp_path_factory.mktemp("zero_edits")), *CASES, timeout_s=170)


@pytest.mark.parametrize("case", ["clip", "mul", "ddp_clip", "unscale"])
def test_an_edit_after_backward_is_refused_on_every_rank_with_nothing_stepped(edited, case):
    for rank, res in enumerate(edited):
        r = res[case]
        assert r["is_edit"], (rank, r)
        assert r["steps"] == 0 and r["unchanged"], (rank, r)
        for fix in RECIPE:
            assert fix in r["message"], (rank, fix, r["message"])
        assert "Nothing was stepped, on any rank" in r["message"]


def test_a_clip_with_coefficient_one_is_still_seen(edited):
    # clip_grad_norm_ multiplies in place even when it does not bite: the version moves
    assert "version moved by 1" in edited[0]["clip"]["message"]


def test_an_edit_on_one_rank_stops_the_other_rank_too(edited):
    assert edited[1]["clip_rank1"]["is_edit"]
    other = edited[0]["clip_rank1"]
    assert other["error"] == "PeerStepFailed" and "rank 1" in other["message"], other
    assert other["steps"] == 0 and other["unchanged"]


def test_ddp_writing_its_averages_and_a_clip_that_does_not_bite_are_not_edits(edited):
    """Under a DDP wrapper p.grad holds the average: DDP's own write, and HF Trainer's
    clip_grad_norm_(params, inf) after it, change nothing the step uses — the same params."""
    for res in edited:
        for case in ("ddp", "ddp_unbitten_clip"):
            assert res[case]["error"] is None and res[case]["steps"] == 1, res[case]
        for a, b in zip(res["ddp"]["params"], res["ddp_unbitten_clip"]["params"]):
            assert torch.equal(a, b)


def test_ddp_and_a_clip_that_bites_is_refused_naming_the_wrapper(edited):
    for res in edited:
        msg = res["ddp_clip"]["message"]
        assert "DistributedDataParallel" in msg and "drop the DDP wrapper" in msg, msg


def test_scaler_unscale_is_named(edited):
    assert "scaler.unscale_(optimizer) was called after backward" in edited[0]["unscale"]["message"]


def test_one_ranks_checkpoint_loaded_on_another_rank_is_refused(edited):
    """HF Trainer saves optimizer.pt from rank 0 only: rank 1 loading it would take rank 0's
    chunks as its own (1e-2 off after 3 steps, silently, before)."""
    r0 = edited[0]["rank0_checkpoint"]  # its own file: refused too, so that no rank trains on alone
    assert r0["error"] == "ValueError" and "another rank was given a state_dict" in r0["message"], r0
    r1 = edited[1]["rank0_checkpoint"]
    assert r1["error"] == "ValueError" and "holds rank 0's chunks" in r1["message"], r1
    assert "torch.distributed.checkpoint" in r1["message"]
    assert r0["state_kept"] and r1["state_kept"]
