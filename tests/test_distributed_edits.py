"""process_group=: grads edited in place after backward (clip_grad_norm_, a GradScaler's
unscale_, a framework's clipping) are refused on every rank at the same step, with nothing
stepped (hybrid_opt/distributed/zero_edits.py); a DDP wrapper's own write of the averages is not an edit;
one rank's checkpoint is refused on another rank. 2 gloo ranks (tests/dist_scripts/zero_edits.py)."""

import pytest
import torch
from dist_launch import DIST_MARKS, launch

pytestmark = DIST_MARKS

CASES = (
    "clip",
    "clip_rank1",
    "mul",
    "ddp",
    "ddp_clip",
    "ddp_unbitten_clip",
    "unscale",
    "rank0_checkpoint",
    "takeover",
    "ddp_unused",
    "ddp_unused_lazy",
    "ddp_bucket_view",
    "ddp_overflow",
    "grant_set",
    "grant_set_lazy",
    "sparse_rank1",
)
DDP_CASES = ("ddp", "ddp_unbitten_clip", "ddp_clip")
RECIPE = (
    "HybridAdamW(..., max_grad_norm=",
    "attach_grad_scaler",
    "TrainingArguments(max_grad_norm=0)",
    "gradient_clip_val=None",
    "accelerator.clip_grad_norm_",
)


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


def test_ddp_with_grads_as_bucket_views_is_refused_naming_the_wrapper(edited):
    """DDP(gradient_as_bucket_view=True): its grads are views of its buckets, averaged in place
    while our reduction reads them, and one is a grad of its own (a replacement). Every rank
    refuses it, nothing stepped, the message naming the wrapper."""
    for res in edited:
        r = res["ddp_bucket_view"]
        assert r["is_edit"] and r["steps"] == 0 and r["unchanged"], r
        assert "drop the DDP wrapper" in r["message"], r["message"]


def test_ddp_with_a_grad_scaler_skips_an_overflow_on_one_rank(edited):
    """accelerate's prepare() + fp16: DDP's average of an inf is inf, which must not pass for a
    clip that bit (inf - inf is nan, never within the tolerance): the overflow skips the step on
    every rank instead of failing it."""
    for res in edited:
        r = res["ddp_overflow"]
        assert r["error"] is None, r["message"]
        assert r["skipped"] == [True, False, False], r["skipped"]


@pytest.mark.parametrize("case", ["grant_set", "grant_set_lazy"])
def test_a_grad_set_by_hand_for_a_param_unused_here_is_refused_with_either_counts(edited, case):
    """Rank 1 sets a grad by hand for a param it did not use, after backward. With the counts
    read in step() (CUDA's way) it could pass for the averaged grad another rank's use grants;
    it is refused on every rank, as with the counts read in backward."""
    for rank, res in enumerate(edited):
        r = res[case]
        assert r["error"] == ("GradsEditedError" if rank == 1 else "PeerStepFailed"), (rank, r["message"])
        assert r["steps"] == 0


def test_a_grad_refused_on_one_rank_stops_both_even_where_the_sharding_part_fails_on_it(edited):
    """A sparse grad on rank 1 only: step()'s checks refuse it, and the sharding part's start of
    the step then raised on it (zero_chunk of a sparse tensor) before the decision all_reduce:
    rank 0 waited there for the process group's timeout. Now that error joins the decision."""
    r1, r0 = edited[1]["sparse_rank1"], edited[0]["sparse_rank1"]
    assert r1["error"] not in (None, "PeerStepFailed") and "sparse" in r1["message"], r1
    assert r0["error"] == "PeerStepFailed" and r0["steps"] == 0 and r0["unchanged"], r0


@pytest.fixture(scope="module")
def edited_3_ranks(tmp_path_factory):
    return launch(
        "zero_edits.py", str(tmp_path_factory.mktemp("zero_edits3")), *DDP_CASES, nproc=3, timeout_s=170
    )


def test_ddp_averages_at_3_ranks_are_recognised_whatever_their_rounding(edited_3_ranks):
    """From 3 ranks DDP's average (divide, then sum) and ours (sum, then divide) differ in
    the last bits: still DDP's write, not an edit (refused at every step before)."""
    for res in edited_3_ranks:
        for case in ("ddp", "ddp_unbitten_clip"):
            assert res[case]["error"] is None and res[case]["steps"] == 1, (case, res[case])
        assert res["ddp_clip"]["is_edit"] and res["ddp_clip"]["steps"] == 0


def test_a_dropped_optimizer_in_a_cycle_is_taken_over_by_the_next(edited):
    """Rank 0 collects the dropped optimizer, rank 1 does not: the new one took its hooks over
    at construction, so no rank issues the old one's reductions (which would hang)."""
    for res in edited:
        assert res["takeover"]["error"] is None and res["takeover"]["steps"] == 2
    for a, b in zip(edited[0]["takeover"]["params"], edited[1]["takeover"]["params"]):
        assert torch.equal(a, b)


def test_a_refused_step_inside_scaler_step_leaves_the_next_step_unscaled_right(tmp_path):
    """GradScaler sets grad_scale / found_inf on the optimizer for one step() and deletes them
    only after it returns: a refused step must not leave them to scale the next one."""
    import sys

    import torch.distributed as dist
    from dist_launch import SCRIPTS

    sys.path.insert(0, SCRIPTS)
    import common as C

    from hybrid_opt import GradsEditedError, HybridAdamW

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:

        def train(refuse_first: bool) -> list:
            model = C.build_model()
            with HybridAdamW(
                model.parameters(),
                lr=C.LR,
                subgroup_numel=32,
                offload_fraction=0.5,
                process_group=dist.group.WORLD,
            ) as opt:
                scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
                opt.attach_grad_scaler(scaler)
                for i, x in enumerate(C.batches()):
                    opt.zero_grad()
                    scaler.scale(C.loss_fn(model, x)).backward()
                    if refuse_first and i == 0:
                        next(model.parameters()).grad.mul_(0.5)
                        with pytest.raises(GradsEditedError):
                            scaler.step(opt)
                        assert "grad_scale" not in opt.__dict__ and "found_inf" not in opt.__dict__
                        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # a fresh start
                        opt.attach_grad_scaler(scaler)
                        opt.zero_grad()
                        scaler.scale(C.loss_fn(model, x)).backward()
                    scaler.step(opt)
                    scaler.update()
                return [p.detach().clone() for p in model.parameters()]

        for a, b in zip(train(True), train(False)):
            assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


def test_a_user_hook_returning_a_tensor_gets_torchs_own_error(tmp_path):
    """`register_post_accumulate_grad_hook(lambda p: p.grad.clamp_(-1, 1))` returns the grad:
    torch hands it to the next hook and then refuses the hook ("should return None"). The
    optimizer's reduce hook, next, raised a bare KeyError before torch could say so."""
    import sys

    import torch.distributed as dist
    from dist_launch import SCRIPTS

    sys.path.insert(0, SCRIPTS)
    import common as C

    from hybrid_opt import HybridAdamW

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = C.build_model()
        next(model.parameters()).register_post_accumulate_grad_hook(lambda p: p.grad.clamp_(-1, 1))
        with HybridAdamW(
            model.parameters(),
            lr=C.LR,
            subgroup_numel=32,
            offload_fraction=0.5,
            process_group=dist.group.WORLD,
        ):
            with pytest.raises(RuntimeError, match="should return None"):
                C.loss_fn(model, C.batches()[0]).backward()
    finally:
        dist.destroy_process_group()


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


@pytest.mark.parametrize("case", ["ddp_unused", "ddp_unused_lazy"])
def test_a_ddp_wrapper_finding_unused_params_trains_like_torch(edited, case):
    """HF Trainer's DDP finds unused params: with a bias unused on rank 1, DDP's collectives and
    ours interleave differently on each rank (ours run on a group of their own, so gloo sees no
    collective mismatch), and with lazy counts DDP's average written into that bias's grad must
    not pass for a replaced grad reduced again on rank 1 alone (a hang)."""
    import sys

    from dist_launch import SCRIPTS

    sys.path.insert(0, SCRIPTS)
    import common as C

    ref, _ = C.reference_bias_unused("AdamW")
    for rank, res in enumerate(edited):
        assert res[case]["error"] is None and len(res[case]["params"]) == len(ref)
        for step, (ours, theirs) in enumerate(zip(res[case]["params"], ref)):
            for k, (a, b) in enumerate(zip(ours, theirs)):
                assert C.rel_err(a, b) < 1e-4, (case, rank, step, k, C.rel_err(a, b))
