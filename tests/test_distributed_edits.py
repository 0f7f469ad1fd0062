"""process_group=: grads edited in place after backward (clip_grad_norm_, a GradScaler's
unscale_, a framework's clipping) are refused on every rank at the same step, with nothing
stepped (hybrid_opt/zero_edits.py); a DDP wrapper's own write of the averages is not an edit.
2 gloo ranks (tests/dist_scripts/zero_edits.py)."""
import pytest

from dist_launch import DIST_MARKS, launch

pytestmark = DIST_MARKS

CASES = ("clip", "clip_rank1", "mul", "ddp", "ddp_clip", "unscale")
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


def test_ddp_writing_its_averages_is_not_an_edit_but_ddp_and_a_clip_is_named(edited):
    for res in edited:
        assert res["ddp"]["error"] is None and res["ddp"]["steps"] == 1, res["ddp"]
        msg = res["ddp_clip"]["message"]
        assert "DistributedDataParallel" in msg and "drop the DDP wrapper" in msg, msg


def test_scaler_unscale_is_named(edited):
    assert "scaler.unscale_(optimizer) was called after backward" in edited[0]["unscale"]["message"]
