"""process_group=: the comm buffers cover a bounded window of buckets (hybrid_opt/distributed/zero_pool.py)
and release_grads=True frees each full p.grad once its bucket is reduced, keeping only this
rank's averaged chunk (hybrid_opt/distributed/zero_release.py) — both with the params bitwise those of the
default run. 2 gloo ranks (tests/dist_scripts/zero_release.py), 4 buckets of the common model."""

import sys

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch
from tolerances import DIST_RTOL

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402

pytestmark = DIST_MARKS

NAMES = (
    "base",
    "release",
    "window1",
    "window1_overlap",
    "window1_rs",
    "window1_ar_overlap",
    "release_window1_overlap",
    "scaler",
    "release_scaler",
    "accumulate",
    "release_accumulate",
    "release_two_backwards",
    "release_grad_set",
    "release_zero_grad_keep",
    "zero_grad_keep_unused",
    "release_zero_grad_keep_unused",
    "release_zero_grad_keep_unused_lazy",
    "release_zero_grad_keep_unused_rs",
    "release_zero_grad_keep_unused_ar",
    "late_edit_half",
    "release_late_edit_half",
    "late_edit_inf",
    "release_late_edit_inf",
    "late_edit_replace",
    "release_late_edit_replace",
    "grad_set",
    "grad_set_by_hand",
    "grad_zeroed_early",
    "retry_late_edit_replace",
    "release_retry_late_edit_replace",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch("zero_release.py", str(tmp_path_factory.mktemp("zero_release")), *NAMES, timeout_s=240)


def _assert_same_params(a, b, what):
    assert len(a["params"]) == len(b["params"]) == C.STEPS, what
    for step, (pa, pb) in enumerate(zip(a["params"], b["params"])):
        for x, y in zip(pa, pb):
            assert torch.equal(x, y), (what, step)


@pytest.mark.parametrize(
    "name,ref",
    [
        ("release", "base"),
        ("window1", "base"),
        ("window1_overlap", "base"),
        ("window1_rs", "base"),
        ("window1_ar_overlap", "base"),
        ("release_window1_overlap", "base"),
        ("release_scaler", "scaler"),
        ("release_accumulate", "accumulate"),
        ("release_zero_grad_keep", "base"),
    ],
)
def test_params_match_the_default_run_bitwise(runs, name, ref):
    for rank, res in enumerate(runs):
        assert res[name]["error"] is None and res[ref]["error"] is None, (rank, res[name]["message"])
        _assert_same_params(res[name], res[ref], (rank, name))
        assert res[name]["skipped"] == res[ref]["skipped"], (rank, name)


def test_a_param_no_rank_used_is_stepped_from_its_kept_zero_grad_with_released_grads(runs):
    """zero_grad(set_to_none=False), and at the last step the middle Linear (its weight a bucket
    reduced straight from p.grad) and the last bias unused on every rank: torch steps them from
    their kept zero grads (weight decay, the moments' update). release_grads=True keeps no
    p.grad, so the optimizer's zero_grad tells the sharding, whose reductions count them as
    zeros: bitwise the params of release_grads=False (also with the has-grad counts read in
    step(), as on CUDA, and over reduce_scatter and all_reduce), which follow torch.optim.AdamW
    on the global batch. They were not stepped (zero_grad kept no zero grad for them)."""
    ref, _ = C.reference_ranked(C.loss_unused_everywhere, "AdamW", max_grad_norm=1.0, set_to_none=False)
    for k in (2, 3, 5):  # unused on every rank at the last step, and stepped by torch
        assert not torch.equal(ref[-1][k], ref[-2][k]), k
    for rank, res in enumerate(runs):
        base = res["zero_grad_keep_unused"]
        for name in ("release_zero_grad_keep_unused", "release_zero_grad_keep_unused_lazy"):
            assert res[name]["error"] is None and base["error"] is None, (rank, res[name]["message"])
            _assert_same_params(res[name], base, (rank, name))
        for step, (ours, theirs) in enumerate(zip(base["params"], ref)):
            for k, (a, b) in enumerate(zip(ours, theirs)):
                assert C.rel_err(a, b) <= DIST_RTOL, (rank, step, k, C.rel_err(a, b))


def test_an_overflow_on_one_rank_is_still_skipped_with_released_grads(runs):
    """GradScaler's own inf check sees no p.grad in release mode: the chunks' flag stands in."""
    for res in runs:
        assert res["scaler"]["skipped"][1] and res["release_scaler"]["skipped"][1]
        assert res["release_scaler"]["skipped"] == res["scaler"]["skipped"]


def test_released_grads_hold_one_rank_share(runs):
    """After backward + reduction the default keeps every full p.grad (one fp32 model) and the
    averaged chunks; release_grads keeps only the chunks (~1/world), p.grad reads None, and
    after step() too (zero_grad still works, in either mode)."""
    for res in runs:
        base, rel = res["base"], res["release"]
        full = base["full_bytes"]
        assert base["grad_bytes"] == [full] * C.STEPS
        assert rel["grad_bytes"] == [0] * C.STEPS
        for chunks in rel["chunk_bytes"]:
            # this rank's chunks, padded to the longest rank's: about full / world
            assert full / 2 * 0.8 <= chunks <= full / 2 * 1.25, (chunks, full)
        assert all(all(none) for none in rel["grad_none_after_backward"])
        assert all(all(none) for none in rel["grad_none_after_step"])
        assert not any(any(none) for none in base["grad_none_after_backward"])


def test_comm_bytes_are_the_storages_held_and_bounded_by_the_window(runs):
    for res in runs:
        for name in ("base", "release", "window1", "window1_overlap", "window1_rs", "window1_ar_overlap"):
            r = res[name]
            assert r["comm"] == r["held"], name
            assert r["comm"] == [r["comm"][0]] * C.STEPS, name  # made once, reused
        # window1: one slot for the 4 buckets (the default window covers them all: they are
        # far below WINDOW_FLOOR_BYTES), so less comm memory for the same bits
        assert res["window1"]["slots"] == [1] and res["base"]["slots"] == [4]
        assert res["window1_rs"]["zero"]["collectives"] == "reduce_scatter"
        assert res["window1_ar_overlap"]["zero"]["collectives"] == "all_reduce"
        assert res["window1"]["comm"][0] < res["base"]["comm"][0]


def test_a_second_reducing_backward_before_step_is_refused(runs):
    for res in runs:
        r = res["release_two_backwards"]
        assert r["error"] == "RuntimeError" and r["failed_at"] == 0, r
        assert "set_gradient_accumulation_boundary(False)" in r["message"]


def test_a_grad_given_to_a_released_param_is_refused_on_every_rank(runs):
    for res in runs:
        r = res["release_grad_set"]
        assert r["error"] == "GradsEditedError" and r["failed_at"] == 1, r
        assert "release_grads=True" in r["message"] and "Nothing was stepped" in r["message"]
        assert len(r["params"]) == 1


@pytest.mark.parametrize("how", ["half", "inf"])
def test_an_edit_in_a_hook_after_the_reduction_read_the_grad_is_refused_with_released_grads(runs, how):
    """A user's grad hook registered after the optimizer's edits rank 1's grad once its
    reduction has read it (halves it; or writes an inf, GradScaler attached): refused as with
    release_grads=False — GradsEditedError on rank 1, PeerStepFailed on rank 0, nothing stepped.
    The released grad's version carries over to its placeholder, so the halving is not ignored
    and the inf not lost."""
    for rank, res in enumerate(runs):
        for name in (f"late_edit_{how}", f"release_late_edit_{how}"):
            r = res[name]
            assert r["error"] == ("GradsEditedError" if rank == 1 else "PeerStepFailed"), (
                rank,
                name,
                r["message"],
            )
            assert r["failed_at"] == 1 and len(r["params"]) == 1, (rank, name)
            if rank == 1:
                assert "changed in place after backward" in r["message"], r["message"]


def test_a_grad_replaced_on_one_rank_after_its_reduction_read_the_old_one_is_refused(runs):
    """`p.grad = p.grad * 0.5` in a hook registered after the optimizer's, on rank 1 only (reducing
    it again on rank 1 alone would be a collective rank 0 never enters): refused as an in-place
    edit is, with or without release_grads: GradsEditedError on rank 1, PeerStepFailed on rank 0,
    nothing stepped, no hang."""
    for rank, res in enumerate(runs):
        for name in ("late_edit_replace", "release_late_edit_replace"):
            r = res[name]
            assert r["error"] == ("GradsEditedError" if rank == 1 else "PeerStepFailed"), (
                rank,
                name,
                r["message"],
            )
            assert r["failed_at"] == 1 and len(r["params"]) == 1, (rank, name)
            if rank == 1:
                assert "replaced after backward" in r["message"], r["message"]
                assert "set_gradient_accumulation_boundary(False)" in r["message"], r["message"]


def test_a_grad_set_by_hand_after_a_reducing_backward_is_refused_on_every_rank(runs):
    for res in runs:
        r = res["grad_set"]
        assert r["error"] == "GradsEditedError" and r["failed_at"] == 1, r
        assert "Nothing was stepped, on any rank" in r["message"] and len(r["params"]) == 1


def test_the_recipe_for_grads_set_by_hand_steps_them(runs):
    """The refusal's recipe: the backward under set_gradient_accumulation_boundary(False)
    reduces nothing, step() reduces the grad set by hand — bitwise the run whose hook zeroes
    that grad before the optimizer's reduction reads it, and not the run that keeps it."""
    for rank, res in enumerate(runs):
        a, b = res["grad_set_by_hand"], res["grad_zeroed_early"]
        assert a["error"] is None and b["error"] is None, (rank, a["message"], b["message"])
        _assert_same_params(a, b, (rank, "grad_set_by_hand"))
        assert not torch.equal(a["params"][1][0], res["base"]["params"][1][0])


def test_step_again_after_a_refused_step_with_released_grads_is_refused_not_partial(runs):
    """release_grads=True, a refused step, then step() again with no backward: the refused
    step's grads were released (a retry would reduce zeros for every param but the replaced
    one and step that one alone from half a grad), so it is refused on every rank, nothing
    stepped; without release_grads the retry reduces the grads as they are, on every
    rank, and steps."""
    for rank, res in enumerate(runs):
        r = res["release_retry_late_edit_replace"]
        assert r["retry"][0] == "RuntimeError" and "called again after a step that failed" in r["retry"][1], (
            r["retry"]
        )
        assert all(torch.equal(a, b) for a, b in zip(r["params"][0], r["params"][1])), rank
        k = res["retry_late_edit_replace"]
        assert k["retry"] is None and not any(
            torch.equal(a, b) for a, b in zip(k["params"][0], k["params"][1])
        )
