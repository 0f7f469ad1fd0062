"""The host tier: speculation, exact and inverse rollback, worker faults, and clean shutdown.

What is exact is asserted bitwise (integer views, so -0.0 vs +0.0 would show): rollback,
redo, commit and speculative-vs-plain all run the same kernel on the same inputs, so the
reference is `cpu_kernels.adam_step_` applied to clones of the state. Only the inverse
rollback is judged with a tolerance. Worker faults are injected with
HYBRID_OPT_WORKER_FAULT="STAGE:K" (read by the first worker a tier starts, at its start).
"""

import gc
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from helpers import (
    _id,
    assert_bitwise_equal,
    child_pids,
    inputs,
    load,
    make_grads,
    make_states,
    ref_step,
    stopped,
    thread_masks,
    wait_gone,
)

import cpu_kernels as ck
from hybrid_opt.tiers.host import AdamInputs, HostTier
from hybrid_opt.tiers.host_io import TornState
from hybrid_opt.worker import client as worker_client
from hybrid_opt.worker.client import WorkerError, WorkerTimeout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOT = 4096
# one element, a few, exactly one slot, one slot + 1, and three pieces with a ragged tail
NUMELS = [1, 100, SLOT, SLOT + 1, 10_000 + 17]
FAULT_ENV = "HYBRID_OPT_WORKER_FAULT"
TIMEOUT_S = 20.0  # a hung worker fails the test in seconds, not the default two minutes


# ----------------------------------------------------------------------------- helpers
def snapshot(tier):
    out = []
    for sg in tier.numels:
        mo = tier.moments(sg)
        s = dict(p=tier.master(sg).clone(), m=mo["exp_avg"].clone(), v=mo["exp_avg_sq"].clone())
        if "max_exp_avg_sq" in mo:
            s["vmax"] = mo["max_exp_avg_sq"].clone()
        out.append(s)
    return out


def assert_tier_equals(tier, states, what=""):
    got = snapshot(tier)
    assert len(got) == len(states)
    for sg, (g, want) in enumerate(zip(got, states)):
        assert set(g) == set(want), f"{what} subgroup {sg}: state keys {set(g)} vs {set(want)}"
        for k in want:
            assert_bitwise_equal(g[k], want[k], f"{what} subgroup {sg} {k}")


def tier_kwargs(**kw):
    base = dict(slot_numel=SLOT, staging_slots=3, timeout_s=TIMEOUT_S)
    base.update(kw)
    return base


def new_tier(numels=NUMELS, **kw):
    return HostTier(list(numels), **tier_kwargs(**kw))


# One tier per configuration for this module: each tier starts a worker process and
# narrows the trainer's affinity, so tests that only need a clean state share one.
_SHARED: dict = {}


def shared_tier(numels=NUMELS, **kw):
    assert FAULT_ENV not in os.environ, "a shared tier must not carry an injected fault"
    key = (tuple(numels), tuple(sorted((k, str(v)) for k, v in kw.items())))
    tier = _SHARED.get(key)
    if tier is None or tier.closed:
        tier = _SHARED[key] = new_tier(numels, **kw)
    elif tier.stepping.speculated():  # a previous test failed mid-step: start this one clean
        tier.stepping.finish({}, overflow=True)
    return tier


def close_shared_tiers():
    # newest first: only the first tier narrowed the trainer's cores, so it restores last
    for tier in reversed(list(_SHARED.values())):
        tier.close()
    _SHARED.clear()


@pytest.fixture(scope="module", autouse=True)
def _close_shared_tiers_at_module_end():
    yield
    close_shared_tiers()


def run_script(tmp_path, name, source, timeout=60, **kw):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop(FAULT_ENV, None)
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


# ------------------------------------------------------------------ 1. exact rollback
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_exact_rollback_after_overflow_is_bitwise_never_stepping(decoupled, amsgrad, grad_dtype):
    tier = shared_tier(grad_dtype=grad_dtype, amsgrad=amsgrad)
    states = make_states(NUMELS, amsgrad=amsgrad, seed=1)
    load(tier, states)
    grads = make_grads(NUMELS, grad_dtype, seed=1, scale=1024.0)
    inp = inputs(7, decoupled=decoupled, grad_scale=1 / 1024, amsgrad=amsgrad)
    for sg, g in enumerate(grads):
        assert tier.stepping.speculate(sg, g, inp), f"subgroup {sg} was not speculated"
    assert tier.stepping.speculated() == list(range(len(NUMELS)))
    assert tier.stepping.finish({}, overflow=True) == {sg: "dropped" for sg in range(len(NUMELS))}
    assert tier.stepping.speculated() == []
    assert_tier_equals(tier, states, "after the dropped step")
    # the dropped spare banks left nothing behind: the next step starts from the original
    out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
    assert set(out.values()) == {"stepped"}
    for s, g in zip(states, grads):
        ref_step(s, g, inp)
    assert_tier_equals(tier, states, "the step after the dropped one")


# ------------------------------------------------------------------ 2. redo and commit
@pytest.mark.parametrize(
    "change",
    [
        dict(lr=5e-4),
        dict(grad_scale=0.5),
        dict(grad_version=(1, 2)),
        dict(step=8),
        dict(weight_decay=0.0),
        dict(decoupled=False),
    ],
)
def test_redo_with_changed_inputs_is_bitwise_a_direct_step(change):
    tier = shared_tier(amsgrad=True)
    states = make_states(NUMELS, amsgrad=True, seed=2)
    load(tier, states)
    grads = make_grads(NUMELS, seed=2)
    a = inputs(7, grad_version=(1, 1), amsgrad=True)
    b = AdamInputs(**{**a.__dict__, **change})
    for sg, g in enumerate(grads):
        assert tier.stepping.speculate(sg, g, a)
    assert tier.stepping.finish({sg: (g, b) for sg, g in enumerate(grads)}) == {
        sg: "redone" for sg in range(len(NUMELS))
    }
    for s, g in zip(states, grads):
        ref_step(s, g, b)
    assert_tier_equals(tier, states, f"redone with {change}")


def test_redo_with_different_grads_at_finish_uses_the_final_grads():
    """A redo is stepped from the grads handed to finish(), not the ones staged earlier."""
    tier = shared_tier()
    states = make_states(NUMELS, seed=3)
    load(tier, states)
    early, final = make_grads(NUMELS, seed=3), make_grads(NUMELS, seed=4)
    for sg, g in enumerate(early):
        assert tier.stepping.speculate(sg, g, inputs(2, grad_version=(0,)))
    out = tier.stepping.finish({sg: (g, inputs(2, grad_version=(1,))) for sg, g in enumerate(final)})
    assert set(out.values()) == {"redone"}
    for s, g in zip(states, final):
        ref_step(s, g, inputs(2, grad_version=(1,)))
    assert_tier_equals(tier, states)


@pytest.mark.parametrize(
    "copy_dtype,moment_dtype",
    [(None, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)],
    ids=["fp32", "bf16_copy", "fp16_copy_bf16_moments"],
)
def test_committed_trajectory_is_bitwise_the_direct_steps(copy_dtype, moment_dtype):
    tier = shared_tier(copy_dtype=copy_dtype, moment_dtype=moment_dtype)
    states = make_states(NUMELS, moment_dtype=moment_dtype, seed=5)
    load(tier, states)
    for step in range(1, 6):
        grads = make_grads(NUMELS, seed=10 + step, scale=64.0)
        inp = inputs(step, lr=1e-2, grad_scale=1 / 64)
        for sg, g in enumerate(grads):
            assert tier.stepping.speculate(sg, g, inp)
        assert tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}) == {
            sg: "committed" for sg in range(len(NUMELS))
        }
        for sg, (s, g) in enumerate(zip(states, grads)):
            copy = ref_step(s, g, inp, copy_dtype)
            if copy_dtype is not None:
                assert_bitwise_equal(tier.param_copy(sg), copy, f"step {step} param_copy {sg}")
                assert_bitwise_equal(
                    tier.param_copy(sg),
                    tier.master(sg).to(copy_dtype),
                    f"step {step} param_copy {sg} vs master cast",
                )
        assert_tier_equals(tier, states, f"step {step}")


def _ref_runs(state, grad, inp: AdamInputs):
    """The direct step of each (offset, numel, step) run on its slice; the rest untouched."""
    for off, n, step in inp.ranges(state["p"].numel()):
        part = {k: t[off : off + n].clone() for k, t in state.items()}
        ref_step(part, grad[off : off + n], AdamInputs(**{**inp.__dict__, "step": step, "runs": ()}))
        for k, t in part.items():
            state[k][off : off + n] = t


@pytest.mark.parametrize("path", ["committed", "redone", "stepped", "dropped"])
def test_runs_step_only_their_ranges_each_at_its_own_step(path):
    """Params without a grad this iteration are not touched; each param keeps its own step."""
    numels = [10_000 + 17]
    tier = shared_tier(numels, amsgrad=True)
    states = make_states(numels, amsgrad=True, seed=21)
    load(tier, states)
    (g,) = make_grads(numels, seed=21)
    # a run across a slot boundary, a gap, a one-element run, a run to the end
    runs = ((0, 5000, 3), (6000, 1, 7), (7000, 3017, 3))
    inp = inputs(3, amsgrad=True, runs=runs)
    if path != "stepped":
        assert tier.stepping.speculate(
            0, g, inputs(3, amsgrad=True, runs=runs, lr=1e-2 if path == "redone" else 1e-3)
        )
    if path == "dropped":
        assert tier.stepping.finish({}, overflow=True) == {0: "dropped"}
    else:
        assert tier.stepping.finish({0: (g, inp)}) == {0: path}
        _ref_runs(states[0], g, inp)
    assert_tier_equals(tier, states, path)


def test_a_callable_grad_provider_fills_each_piece():
    """The optimizer hands a gatherer (dst, offset, numel) instead of one flat grad."""
    numels = [10_000 + 17]
    tier = shared_tier(numels)
    states = make_states(numels, seed=22)
    load(tier, states)
    (g,) = make_grads(numels, seed=22)
    calls = []

    def gather(dst, offset, numel):
        calls.append((offset, numel))
        dst.copy_(g[offset : offset + numel])

    assert tier.stepping.speculate(0, gather, inputs(1))
    assert tier.stepping.finish({0: (gather, inputs(1))}) == {0: "committed"}
    assert calls == [(0, SLOT), (SLOT, SLOT), (2 * SLOT, numels[0] - 2 * SLOT)]
    ref_step(states[0], g, inputs(1))
    assert_tier_equals(tier, states)


# ------------------------------------------------------------------ 3. speculative == plain
def test_speculative_and_plain_steps_are_bitwise_equal_over_mixed_outcomes():
    numels = NUMELS
    spec = shared_tier(amsgrad=True, spare_banks=2)
    plain = new_tier(amsgrad=True)
    try:
        states = make_states(numels, amsgrad=True, seed=6)
        load(spec, states)
        load(plain, states)
        all_sg = range(len(numels))
        outcomes = []
        # (speculated subgroups, their inputs, stepped subgroups, final inputs, overflow)
        a = dict(amsgrad=True)
        plan = [
            (all_sg, inputs(1, **a), all_sg, inputs(1, **a), False),  # committed
            (all_sg, inputs(2, **a), all_sg, inputs(2, **a), True),  # skipped
            (all_sg, inputs(2, **a), all_sg, inputs(2, grad_scale=0.25, **a), False),  # clipped: redone
            ([0, 2, 4], inputs(3, **a), [1, 2, 3, 4], inputs(3, **a), False),  # mixed
            ([1, 3], inputs(4, grad_version=(5,), **a), all_sg, inputs(4, grad_version=(6,), **a), False),
            (all_sg, inputs(5, lr=3e-3, **a), all_sg, inputs(5, lr=3e-3, **a), False),
        ]
        for k, (spec_sgs, spec_inp, step_sgs, final, overflow) in enumerate(plan):
            grads = make_grads(numels, seed=20 + k)
            for sg in spec_sgs:
                spec.stepping.speculate(sg, grads[sg], spec_inp)  # False (no spare) is allowed
            steps = {sg: (grads[sg], final) for sg in step_sgs}
            outcomes.append(spec.stepping.finish(steps, overflow=overflow))
            if not overflow:
                plain.stepping.finish(steps)
            assert_tier_equals(spec, snapshot(plain), f"iteration {k}")
        seen = {o for out in outcomes for o in out.values()}
        assert seen == {"committed", "redone", "stepped", "dropped"}, outcomes
    finally:
        plain.close()


# ------------------------------------------------------------------ 4. bounded spare pool
def test_spare_pool_of_one_bank_bounds_speculation_and_finish_steps_all():
    numels = [3000, 5000, 700]
    tier = shared_tier(numels, spare_banks=1)
    states = make_states(numels, seed=7)
    load(tier, states)
    grads = make_grads(numels, seed=7)
    inp = inputs(3)
    assert tier.stepping.speculate(0, grads[0], inp) is True
    assert tier.stepping.speculate(1, grads[1], inp) is False
    assert tier.stepping.speculate(2, grads[2], inp) is False
    assert tier.stepping.speculated() == [0]
    out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
    assert out == {0: "committed", 1: "stepped", 2: "stepped"}
    for s, g in zip(states, grads):
        ref_step(s, g, inp)
    assert_tier_equals(tier, states)
    # with the spare back in the pool, the next step can speculate again
    assert tier.stepping.speculate(2, grads[2], inputs(4)) is True
    tier.stepping.finish({}, overflow=True)


@pytest.mark.parametrize("mode", ["exact", "inverse", "nvme"])
def test_a_hooks_speculation_short_of_staging_slots_sends_nothing_and_keeps_no_bank(mode, tmp_path):
    """wait=False (a grad hook) never waits for the worker: a step needing more staging slots
    than are free is refused before any task is sent — the slots are counted as the staging
    starts (HostIO.stage_steps), an nvme step's before its swap-in — and the banks it took go
    back; finish() then steps it, bitwise the reference."""
    numels = [2 * SLOT + 5, 100]  # 3 pieces, 1 piece
    kw = dict(staging_slots=2, spare_banks=1) if mode == "exact" else dict(staging_slots=2)
    if mode == "inverse":
        kw["rollback"] = "inverse"
    if mode == "nvme":
        kw.update(nvme=[True, True], nvme_path=str(tmp_path), io_banks=2)
    tier = new_tier(numels, **kw)
    try:
        states, grads, inp = make_states(numels, seed=3), make_grads(numels, seed=3), inputs(1)
        load(tier, states)
        sent, send = [], tier.client.send
        tier.client.send = lambda task, gather=(): sent.append(task.op) or send(task, gather)
        free_banks = list(tier.pool.free)
        assert tier.stepping.speculate(0, grads[0], inp, wait=False) is False
        assert sent == [] and tier.stepping.speculated() == [] and tier.pool.free == free_banks
        assert tier.io.free_slots == 2 and tier.io.pieces_in_flight == 0
        assert tier.stepping.speculate(1, grads[1], inp, wait=False) is True  # one piece: it fits
        assert tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}) == {
            0: "stepped",
            1: "committed",
        }
        for sg, (st, g) in enumerate(zip(states, grads)):
            ref_step(st, g, inp)
            got = tier.state(sg)
            for key, want in (("param", "p"), ("exp_avg", "m"), ("exp_avg_sq", "v")):
                assert_bitwise_equal(got[key], st[want], f"{mode} subgroup {sg} {key}")
    finally:
        tier.close()


def test_a_hooks_speculation_failing_before_it_sent_anything_does_not_wait_for_the_worker():
    """The worker's traffic failing as a speculation starts (here its poll, injected once)
    leaves nothing of it behind and returns at once: the other subgroup's pieces in flight
    are not waited for (their results stay uncollected) — waiting is for a launch that sent."""
    numels = [SLOT + 3, 100]
    tier = new_tier(numels, spare_banks=2)
    try:
        states, grads, inp = make_states(numels, seed=4), make_grads(numels, seed=4), inputs(1)
        load(tier, states)
        assert tier.stepping.speculate(0, grads[0], inp, wait=False) is True
        in_flight, free_banks, poll = tier.io.pieces_in_flight, list(tier.pool.free), tier.client.poll
        assert in_flight == 2

        def failing_poll(*a, **k):
            tier.client.poll = poll
            raise RuntimeError("injected: the worker's pipe failed")

        tier.client.poll = failing_poll
        with pytest.raises(RuntimeError, match="injected"):
            tier.stepping.speculate(1, grads[1], inp, wait=False)
        assert tier.io.pieces_in_flight == in_flight and tier.stepping.speculated() == [0]
        assert tier.pool.free == free_banks
        assert tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}) == {
            0: "committed",
            1: "stepped",
        }
        for st, g in zip(states, grads):
            ref_step(st, g, inp)
        assert_tier_equals(tier, states)
    finally:
        tier.close()


# ------------------------------------------------------------------ 5. inverse rollback
# atol: a few ulp of the largest term the step rounded at, which for a near-zero moment is
# not the moment itself: |p| ~ 1, (1 - beta1)|g| <~ 0.4, beta2 v + (1 - beta2) g^2 <~ 0.03
INVERSE_TOL = dict(p=dict(rtol=1e-6, atol=1e-7), m=dict(rtol=1e-6, atol=6e-8), v=dict(rtol=1e-6, atol=4e-9))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_inverse_rollback_restores_the_state_within_a_few_ulp(decoupled, grad_dtype):
    tier = shared_tier(rollback="inverse", grad_dtype=grad_dtype, staging_slots=8)
    states = make_states(NUMELS, seed=8)
    load(tier, states)
    grads = make_grads(NUMELS, grad_dtype, seed=8, scale=1024.0)
    inp = inputs(9, decoupled=decoupled, grad_scale=1 / 1024)
    speculated = [sg for sg, g in enumerate(grads) if tier.stepping.speculate(sg, g, inp)]
    assert speculated == list(range(len(NUMELS)))
    assert set(tier.stepping.finish({}, overflow=True).values()) == {"dropped"}
    for sg, (got, orig) in enumerate(zip(snapshot(tier), states)):
        # the same two kernels, step then fp64 inverse, on clones give the same bits
        want = {k: t.clone() for k, t in orig.items()}
        ref_step(want, grads[sg], inp)
        ck.adam_inverse_(
            want["p"],
            grads[sg],
            want["m"],
            want["v"],
            step=inp.step,
            lr=inp.lr,
            beta1=inp.beta1,
            beta2=inp.beta2,
            eps=inp.eps,
            weight_decay=inp.weight_decay,
            decoupled=inp.decoupled,
            grad_scale=inp.grad_scale,
        )
        for k in ("p", "m", "v"):
            assert torch.isfinite(got[k]).all(), f"subgroup {sg} {k} has a non-finite element"
            assert_bitwise_equal(got[k], want[k], f"subgroup {sg} {k} vs step+inverse on clones")
            torch.testing.assert_close(
                got[k], orig[k], **INVERSE_TOL[k], msg=lambda m: f"subgroup {sg} {k} not recovered: {m}"
            )
        assert (got["v"] >= 0).all()


def test_inverse_rollback_commit_and_redo_match_direct_steps():
    tier = shared_tier(rollback="inverse", staging_slots=8)
    states = make_states(NUMELS, seed=9)
    load(tier, states)
    for step, change in ((1, {}), (2, dict(lr=2e-3))):
        grads = make_grads(NUMELS, seed=30 + step)
        inp = inputs(step)
        for sg, g in enumerate(grads):
            assert tier.stepping.speculate(sg, g, inp)
        final = AdamInputs(**{**inp.__dict__, **change})
        out = tier.stepping.finish({sg: (g, final) for sg, g in enumerate(grads)})
        assert set(out.values()) == {"committed" if not change else "redone"}
        for s, g in zip(states, grads):
            ref_step(s, g, final)
        if not change:
            assert_tier_equals(tier, states, "inverse mode, committed")
        else:  # the redo starts from an inverted state: a few ulp away from the direct step
            for sg, (got, want) in enumerate(zip(snapshot(tier), states)):
                for k in ("p", "m", "v"):
                    torch.testing.assert_close(got[k], want[k], **INVERSE_TOL[k])
            load(tier, states)


def test_inverse_rollback_with_amsgrad_is_rejected_clearly():
    with pytest.raises(ValueError, match=r"rollback='inverse' cannot undo amsgrad.*rollback='exact'"):
        HostTier([10], amsgrad=True, rollback="inverse")


def test_inverse_rollback_leaves_a_subgroup_with_non_finite_grads_unstepped():
    numels = [1000, 3000, 2000]  # one piece each
    tier = shared_tier(numels, rollback="inverse", staging_slots=4)
    states = make_states(numels, seed=10)
    load(tier, states)
    grads = make_grads(numels, seed=10)
    grads[1][17] = float("inf")
    grads[2][0] = float("nan")
    grads[2][-1] = -float("inf")
    inp = inputs(4)
    for sg, g in enumerate(grads):
        assert tier.stepping.speculate(sg, g, inp)
    stats = [tier.stepping.grad_stats(sg) for sg in range(3)]
    assert [finite for _, finite in stats] == [True, False, False]
    assert tier.stepping.finish({}, overflow=True) == {0: "dropped", 1: "dropped", 2: "dropped"}
    after = snapshot(tier)
    for sg in (1, 2):  # not stepped at all: nothing to undo, not even an ulp
        for k in ("p", "m", "v"):
            assert_bitwise_equal(after[sg][k], states[sg][k], f"non-finite subgroup {sg} {k}")
    for k in ("p", "m", "v"):
        assert torch.isfinite(after[0][k]).all()
        torch.testing.assert_close(after[0][k], states[0][k], **INVERSE_TOL[k])


def test_inverse_rollback_leaves_a_multi_piece_subgroup_with_one_bad_piece_unstepped():
    numels = [3 * SLOT]
    tier = shared_tier(numels, rollback="inverse", staging_slots=4)
    states = make_states(numels, seed=11)
    load(tier, states)
    (g,) = make_grads(numels, seed=11)
    g[-1] = float("inf")  # in the last piece only
    assert tier.stepping.speculate(0, g, inputs(2))
    tier.stepping.finish({}, overflow=True)
    for k, t in snapshot(tier)[0].items():
        assert_bitwise_equal(t, states[0][k], f"subgroup 0 {k}")


# ------------------------------------------------------------------ 6. worker killed (exact)
def _faulty_trajectory(tier, numels, states):
    """Three iterations: speculated+committed, speculated+redone, plain. Returns outcomes."""
    outcomes = []
    for step, (spec, change) in enumerate(((True, {}), (True, dict(lr=2e-3)), (False, {})), 1):
        grads = make_grads(numels, seed=40 + step)
        inp = inputs(step, amsgrad=tier.amsgrad)
        if spec:
            for sg, g in enumerate(grads):
                tier.stepping.speculate(sg, g, inp)  # False when the spare pool is empty
        final = AdamInputs(**{**inp.__dict__, **change})
        outcomes.append(tier.stepping.finish({sg: (g, final) for sg, g in enumerate(grads)}))
        for s, g in zip(states, grads):
            ref_step(s, g, final)
        assert_tier_equals(tier, states, f"step {step}")
    return outcomes


FAULT_NUMELS = [3000, 9000]  # 1 + 3 pieces: step tasks 1-4 speculate step 1, 9-12 redo step 2


@pytest.mark.parametrize(
    "stage,k,spare_banks",
    [(stage, k, None) for stage in ("before_step", "mid_step", "after_step") for k in (1, 2, 9)]
    + [("mid_step", 2, 1), ("mid_step", 10, 1)],
)  # one spare: finish() waits for banks mid-redo
def test_killed_worker_is_replaced_and_the_trajectory_is_bitwise_unchanged(
    monkeypatch, stage, k, spare_banks
):
    monkeypatch.setenv(FAULT_ENV, f"{stage}:{k}")
    # inline=False: the worker steps what finish() waits for (sharing every core, the trainer
    # would itself: tiers/inline_steps.py), so it can die in those steps too
    tier = new_tier(FAULT_NUMELS, amsgrad=True, staging_slots=2, spare_banks=spare_banks, inline=False)
    try:
        first_pid = tier.client.pid
        states = make_states(FAULT_NUMELS, amsgrad=True, seed=12)
        load(tier, states)
        outcomes = _faulty_trajectory(tier, FAULT_NUMELS, states)
        if spare_banks is None:
            assert [set(o.values()) for o in outcomes] == [{"committed"}, {"redone"}, {"stepped"}]
        assert tier.client.pid != first_pid
        assert not psutil.pid_exists(first_pid) or wait_gone(first_pid, 5)
        assert tier.stats["worker_restarts"] == 1
    finally:
        tier.close()


def test_fault_injection_without_a_fault_restarts_nothing():
    """The control for the test above: the same trajectory, no restart."""
    tier = new_tier(FAULT_NUMELS, amsgrad=True, staging_slots=2)
    try:
        pid = tier.client.pid
        states = make_states(FAULT_NUMELS, amsgrad=True, seed=12)
        load(tier, states)
        _faulty_trajectory(tier, FAULT_NUMELS, states)
        assert tier.client.pid == pid and tier.stats["worker_restarts"] == 0
    finally:
        tier.close()


@pytest.mark.parametrize("when", ["between_steps", "while_speculating"])
def test_worker_killed_externally_is_detected_within_a_second(when):
    tier = new_tier(FAULT_NUMELS)
    try:
        states = make_states(FAULT_NUMELS, seed=13)
        load(tier, states)
        _faulty_trajectory(tier, FAULT_NUMELS, states)
        grads = make_grads(FAULT_NUMELS, seed=50)
        inp = inputs(4)
        old = tier.client.pid
        if when == "while_speculating":  # subgroup 0 is out, then the worker dies
            assert tier.stepping.speculate(0, grads[0], inp)
        os.kill(old, signal.SIGKILL)
        t0 = time.perf_counter()
        for sg, g in enumerate(grads):
            if sg not in tier.stepping.speculated():
                assert tier.stepping.speculate(sg, g, inp)
        out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
        elapsed = time.perf_counter() - t0
        print(f"kill {when}: detected, worker restarted and step finished in {elapsed * 1e3:.0f} ms")
        assert elapsed < 1.0, f"a killed worker took {elapsed:.2f} s to be noticed and replaced"
        assert set(out.values()) == {"committed"}
        for s, g in zip(states, grads):
            ref_step(s, g, inp)
        assert_tier_equals(tier, states, f"after a kill {when}")
        assert tier.client.pid != old and tier.stats["worker_restarts"] == 1
    finally:
        tier.close()


# ------------------------------------------------------------------ 7. worker killed (inverse)
def _inverse_tier_with_fault(monkeypatch, fault: str, seed: int):
    """An inverse-mode tier of three subgroups whose worker carries `fault`, its states loaded;
    (tier, states, grads)."""
    monkeypatch.setenv(FAULT_ENV, fault)
    numels = [1000, 2000, 500]
    tier = new_tier(numels, rollback="inverse", staging_slots=4, inline=False)  # the worker steps it all
    states = make_states(numels, seed=seed)
    load(tier, states)
    return tier, states, make_grads(numels, seed=seed)


def test_inverse_mode_worker_killed_mid_step_names_the_torn_subgroups(monkeypatch):
    tier, states, grads = _inverse_tier_with_fault(monkeypatch, "mid_step:2", seed=14)
    try:
        assert tier.stepping.speculate(0, grads[0], inputs(1))
        assert tier.stepping.speculate(1, grads[1], inputs(1))  # its step task is the one killed
        with pytest.raises(RuntimeError, match=r"subgroups \[1\] may be torn") as info:
            tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)})
        assert "rollback='exact'" in str(info.value)
        assert "SIGKILL" in str(info.value)
        assert tier.stats["worker_restarts"] == 1
    finally:
        tier.close()


def test_inverse_mode_worker_killed_idle_is_replaced_and_loses_nothing():
    """A worker that dies between steps has nothing in flight: it is replaced and the next
    step runs as if nothing happened: no TornState, and the speculations it dropped are undone
    bitwise."""
    numels = [1000, 2000]
    tier = new_tier(numels, rollback="inverse", staging_slots=4)
    try:
        states = make_states(numels, seed=16)
        load(tier, states)
        for step in (1, 2):
            old = tier.client.pid
            if step == 2:
                os.kill(old, signal.SIGKILL)
                assert wait_gone(old, 5)
            grads = make_grads(numels, seed=16 + step)
            assert all(tier.stepping.speculate(sg, g, inputs(step)) for sg, g in enumerate(grads))
            out = tier.stepping.finish({sg: (g, inputs(step)) for sg, g in enumerate(grads)})
            assert set(out.values()) == {"committed"}
            for s, g in zip(states, grads):
                ref_step(s, g, inputs(step))
            assert_tier_equals(tier, states, f"step {step}")
        assert tier.stats["worker_restarts"] == 1 and tier.client.pid != old
    finally:
        tier.close()


def test_inverse_mode_worker_killed_mid_step_commits_the_subgroups_it_finished(monkeypatch):
    """A plain step (no speculation): the worker dies before its second task. Subgroup 0 was
    stepped in place, so it is committed (on_commit: the caller counts it stepped) and the
    error names only what may be torn, not subgroup 0."""
    tier, states, grads = _inverse_tier_with_fault(monkeypatch, "before_step:2", seed=17)
    try:
        committed = []
        with pytest.raises(TornState, match=r"SIGKILL.*may be torn; restore them") as info:
            tier.stepping.finish(
                {sg: (g, inputs(1)) for sg, g in enumerate(grads)},
                on_commit=lambda sg, views: committed.append(sg),
            )
        torn = info.value.subgroups
        assert committed == [0] and 1 in torn and 0 not in torn
        ref_step(states[0], grads[0], inputs(1))
        want = snapshot(tier)
        for sg in range(3):
            if sg not in torn:  # stepped and committed (0), or never sent (2)
                for k in ("p", "m", "v"):
                    assert torch.equal(want[sg][k], states[sg][k]), (sg, k)
        assert tier.stepping.speculated() == [] and tier.io.pieces_in_flight == 0
        assert tier.stats["worker_restarts"] == 1
        # the tier goes on: a step of the subgroups not torn is the direct step
        out = tier.stepping.finish({0: (grads[0], inputs(2))})
        assert out == {0: "stepped"}
        ref_step(states[0], grads[0], inputs(2))
        assert torch.equal(tier.master(0), states[0]["p"])
    finally:
        tier.close()


def _speculated_at_a_stopped_worker(**kw):
    """(tier, states, grads, the worker's pid): both subgroups speculated at a worker stopped
    (SIGSTOP) first, a 1 s timeout."""
    numels = [1000, 2000]
    tier = new_tier(numels, staging_slots=4, timeout_s=1.0, **kw)
    states = make_states(numels, seed=18)
    load(tier, states)
    grads = make_grads(numels, seed=18)
    old = tier.client.pid
    os.kill(old, signal.SIGSTOP)
    assert all(tier.stepping.speculate(sg, g, inputs(1)) for sg, g in enumerate(grads))
    return tier, states, grads, old


def test_a_worker_that_does_not_answer_is_replaced_and_the_exact_step_goes_on():
    """A worker stopped (SIGSTOP: as one swapped out or stuck) after speculation, exact mode:
    after the timeout it is killed and replaced like a dead one, its tasks sent again, and
    finish() goes on, warned of — the speculations commit bitwise the direct step, with no
    failure since nothing was lost. (A replacement that did not answer either
    would fail the wait: two timeouts, never more.)"""
    tier, states, grads, old = _speculated_at_a_stopped_worker()
    try:
        t0 = time.monotonic()
        with pytest.warns(
            RuntimeWarning,
            match=r"not stepped within 1 s: the worker \(pid \d+\) did not "
            r"answer, so it was killed and a new one was sent its tasks",
        ):
            out = tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)})
        assert out == {0: "committed", 1: "committed"} and time.monotonic() - t0 < 4.0
        assert wait_gone(old, 5) and tier.client.pid != old and tier.stats["worker_restarts"] == 1
        for s, g in zip(states, grads):
            ref_step(s, g, inputs(1))
        assert_tier_equals(tier, states, "the step the new worker finished")
    finally:
        tier.close()


@pytest.mark.parametrize("rollback", ["inverse"])
def test_a_worker_that_does_not_answer_is_killed_replaced_and_named(rollback):
    """A worker stopped (SIGSTOP: as one swapped out or stuck) after in-place speculation
    (inverse): finish() fails after the timeout naming the torn subgroups, and the worker is
    killed and replaced like a dead one, so the pending speculations end at once (no later
    cancel waits the timeout again) and the next step is the direct step."""
    tier, states, grads, old = _speculated_at_a_stopped_worker(rollback=rollback)
    try:
        t0 = time.monotonic()
        want = (
            (
                WorkerTimeout,
                r"not stepped within 1 s: the worker \(pid \d+\) did not answer, so it "
                r"was killed and a new one started",
            )
            if rollback == "exact"
            else (
                TornState,
                r"did not answer within 1 s and was killed \(SIGKILL\).*subgroups \[0, 1\] may be torn",
            )
        )
        with pytest.raises(want[0], match=want[1]):
            tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)})
        assert time.monotonic() - t0 < 4.0
        assert wait_gone(old, 5) and tier.client.pid != old and tier.stats["worker_restarts"] == 1
        t0 = time.monotonic()
        for sg, g in enumerate(grads):  # backward's speculation of the retried step
            assert tier.stepping.speculate(sg, g, inputs(1), replace=True)
        assert time.monotonic() - t0 < 0.9  # less than one timeout: nothing waited one out
        assert set(tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)}).values()) == {
            "committed"
        }
        if rollback == "exact":  # the committed state survived: the retried step is the direct one
            for s, g in zip(states, grads):
                ref_step(s, g, inputs(1))
            assert_tier_equals(tier, states, "the retried step")
    finally:
        tier.close()


def test_a_ping_the_worker_does_not_answer_says_what_to_check():
    """WorkerClient.wait's timeout names its own bound and what to look at, not an argument
    HybridAdamW does not have (it said 'raise timeout_s')."""
    tier = new_tier([100])
    try:
        os.kill(tier.client.pid, signal.SIGSTOP)
        with pytest.raises(WorkerTimeout, match=r"did not answer within 1 s.*check the machine") as info:
            tier.client.ping(timeout_s=1.0)
        assert "timeout_s" not in str(info.value)
    finally:
        tier.close()


# ------------------------------------------------------------------ 8. worker errors
@pytest.mark.parametrize("speculated", [True, False], ids=["speculated", "plain"])
def test_worker_exception_names_the_subgroup_and_leaves_committed_state_intact(monkeypatch, speculated):
    monkeypatch.setenv(FAULT_ENV, "raise:2")
    numels = [1000, 2000]
    tier = new_tier(numels, inline=False)  # the worker steps what finish() waits for (as above)
    try:
        states = make_states(numels, seed=15)
        load(tier, states)
        grads = make_grads(numels, seed=15)
        inp = inputs(1)
        if speculated:
            for sg, g in enumerate(grads):
                assert tier.stepping.speculate(sg, g, inp)
        with pytest.raises(WorkerError, match=r"subgroup 1: RuntimeError: fault injected"):
            tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
        assert_tier_equals(tier, states, "after the failed step")
        out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
        assert set(out.values()) <= {"committed", "redone", "stepped"}
        for s, g in zip(states, grads):
            ref_step(s, g, inp)
        assert_tier_equals(tier, states, "the retried step")
        assert tier.stats["worker_restarts"] == 0
    finally:
        tier.close()


# ------------------------------------------------------------------ 9. no leaks


def test_close_is_idempotent_and_leaves_no_process_fd_shm_or_core_change_behind():
    close_shared_tiers()  # measure against a trainer that no other tier has touched
    gc.collect()
    me = psutil.Process()
    children = child_pids()
    fds = me.num_fds()
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    masks, threads = thread_masks(), torch.get_num_threads()

    tier = new_tier(amsgrad=True, copy_dtype=torch.bfloat16, worker_share=0.5)  # a GPU host's split
    pid = tier.client.pid
    assert pid in {c.pid for c in me.children()}
    if len(os.sched_getaffinity(0)) >= 2:  # the split took effect, so the restore below is real
        assert os.sched_getaffinity(0) == set(tier.cores.trainer)
        assert torch.get_num_threads() == len(tier.cores.trainer)
        assert set(psutil.Process(pid).cpu_affinity()) == set(tier.cores.worker)
    states = make_states(NUMELS, amsgrad=True, seed=16)
    load(tier, states)
    grads = make_grads(NUMELS, seed=16)
    inp = inputs(1, amsgrad=True)
    for sg, g in enumerate(grads):
        tier.stepping.speculate(sg, g, inp)
    tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
    kept = tier.master(0).clone()
    for s, g in zip(states, grads):
        ref_step(s, g, inp)

    t0 = time.perf_counter()
    tier.close()
    tier.close()
    assert time.perf_counter() - t0 < 5.0
    assert wait_gone(pid, 5.0), f"worker {pid} still running after close()"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert child_pids() == children
    assert me.num_fds() == fds
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) - shm == set()
    after = thread_masks()
    assert {t: m for t, m in after.items() if t in masks} == {t: m for t, m in masks.items() if t in after}
    assert torch.get_num_threads() == threads
    assert_bitwise_equal(kept, states[0]["p"], "a clone taken before close")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
@pytest.mark.parametrize("order", ["first_opened_first", "last_opened_first"])
def test_two_tiers_closed_in_either_order_give_the_process_its_cores_back(order):
    """Two optimizers in one process (a GAN's pair): whichever closes first, the process
    ends with its own masks and thread count, not pinned to the trainer's share."""
    close_shared_tiers()
    masks, threads = thread_masks(), torch.get_num_threads()
    a = new_tier(worker_share=0.5)  # a GPU host's split (a CPU-only host's default shares every core)
    b = new_tier(worker_share=0.5)
    assert os.sched_getaffinity(0) == set(b.cores.trainer) != masks[os.getpid()]
    first, second = (a, b) if order == "first_opened_first" else (b, a)
    first.close()
    assert os.sched_getaffinity(0) == set(second.cores.trainer)  # the other one still runs split
    assert torch.get_num_threads() == len(second.cores.trainer)
    second.close()
    after = thread_masks()
    assert {t: m for t, m in after.items() if t in masks} == {t: m for t, m in masks.items() if t in after}
    assert torch.get_num_threads() == threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share")
def test_a_cpu_only_host_shares_every_core_with_a_sleeping_worker():
    """Params on the CPU (no pin): the trainer keeps its cores and thread count (its forward and
    backward need them all); the worker may run on every core, with half of them in threads
    that sleep when idle (OMP_WAIT_POLICY=PASSIVE), so it fills the trainer's idle moments."""
    close_shared_tiers()
    masks, threads = thread_masks(), torch.get_num_threads()
    tier = new_tier()
    try:
        cpus = sorted(os.sched_getaffinity(0))
        assert tier.cores.shared and tier.cores.trainer == tier.cores.worker == cpus
        assert thread_masks()[os.getpid()] == masks[os.getpid()] and torch.get_num_threads() == threads
        worker = psutil.Process(tier.client.pid)
        assert sorted(worker.cpu_affinity()) == cpus
        env = worker.environ()
        assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == str(
            max(1, round(len(cpus) / 2))
        )
        states = make_states(NUMELS, seed=3)
        load(tier, states)
        grads, inp = make_grads(NUMELS, seed=3), inputs(1)
        for sg, g in enumerate(grads):
            tier.stepping.step(sg, g, inp)
            ref_step(states[sg], g, inp)
        assert_tier_equals(tier, states, "shared cores")
    finally:
        tier.close()
    assert thread_masks()[os.getpid()] == masks[os.getpid()] and torch.get_num_threads() == threads


def _run_during_backward(tier) -> None:
    """Until the worker has answered every task sent, polled as the grad hooks do: a blocking
    wait (a ping) would tell it the trainer waits, and its queued speculations would widen."""
    deadline = time.monotonic() + TIMEOUT_S
    while tier.client.pending:
        assert time.monotonic() < deadline, "the worker did not finish the speculated steps"
        tier.client.poll()
        time.sleep(0.002)


def test_a_step_the_trainer_waits_for_runs_on_every_shared_core():
    """Sharing the trainer's cores, a speculated step (during backward) runs on the worker's
    own threads, half of the cores; a step the trainer waits for (finish(): after backward,
    the trainer idle) runs on all of them (Task.threads). The worker's thread count shows
    which: OpenMP starts a thread only for a parallel region that asks for it."""
    close_shared_tiers()
    numels, slot = [1 << 20, 1 << 20], 1 << 20  # pieces the kernels step in parallel
    tier = new_tier(numels, slot_numel=slot, inline=False)  # the worker's waited steps
    try:
        if not tier.cores.shared or tier.cores.waited_threads <= tier.cores.worker_threads:
            pytest.skip("one core: no core the trainer leaves the worker")
        worker = psutil.Process(tier.client.pid)
        states = make_states(numels, seed=5)
        load(tier, states)
        grads = make_grads(numels, seed=5)
        for sg, g in enumerate(grads):
            assert tier.stepping.speculate(sg, g, inputs(1))
        _run_during_backward(tier)
        assert worker.num_threads() <= tier.cores.worker_threads
        assert tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)}) == {
            0: "committed",
            1: "committed",
        }
        for sg, g in enumerate(grads):
            ref_step(states[sg], g, inputs(1))
        for sg, g in enumerate(grads):
            tier.stepping.step(sg, g, inputs(2))
            ref_step(states[sg], g, inputs(2))
        assert worker.num_threads() == tier.cores.waited_threads == len(os.sched_getaffinity(0))
        assert_tier_equals(tier, states, "waited steps on every core")
    finally:
        tier.close()


def _thread_cores(pid: int) -> dict:
    """{thread id: its allowed cores} of every thread of process `pid`, from the OS."""
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_split_worker_steps_on_the_trainers_cores_too_while_step_waits(monkeypatch):
    """Split (worker_share), the worker speculates on its own cores and steps on every core while
    the trainer waits in step(): its OpenMP threads move onto the trainer's cores for such a step
    and back before the next speculated one (the H200's worker stepped on 8 of 16 cores at 0.55x
    the in-process kernel's rate). The OS's masks and thread count show where they are; the bits
    are the sequential reference's throughout. No core is left to the trainer's thread here, so
    that 2 cores widen (test_node.py holds the default's count)."""
    close_shared_tiers()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    monkeypatch.setattr(worker_client, "WAITED_TRAINER_CORES", 0)
    numels, slot = [1 << 20, 1 << 20], 1 << 20  # pieces the kernels step in parallel
    tier = new_tier(numels, slot_numel=slot, worker_share=0.5)
    try:
        split = tier.cores
        assert split.widens and not split.shared
        own, every = frozenset(split.worker), frozenset(split.waited_cores)
        assert own < every and every == frozenset(os.sched_getaffinity(0)) | own
        assert "threads on cores" in split.describe()
        pid = tier.client.pid
        states = make_states(numels, seed=6)
        load(tier, states)
        grads = make_grads(numels, seed=6)
        for speculated, waited in ((1, 2), (3, 4)):
            for sg, g in enumerate(grads):
                assert tier.stepping.speculate(sg, g, inputs(speculated))
            _run_during_backward(tier)
            # speculated: every thread on the worker's own cores (step 3: moved back there)
            assert set(_thread_cores(pid).values()) == {own}, f"step {speculated}"
            assert tier.stepping.finish({sg: (g, inputs(speculated)) for sg, g in enumerate(grads)}) == {
                0: "committed",
                1: "committed",
            }
            for sg, g in enumerate(grads):
                ref_step(states[sg], g, inputs(speculated))
            for sg, g in enumerate(grads):
                tier.stepping.step(sg, g, inputs(waited))
                ref_step(states[sg], g, inputs(waited))
            cores = _thread_cores(pid)
            assert len(cores) >= split.waited_threads == len(every)
            assert sum(c == every for c in cores.values()) >= split.waited_threads, f"step {waited}"
            assert_tier_equals(tier, states, f"split, step {waited}")
    finally:
        tier.close()


@pytest.mark.parametrize("arrangement", ["split", "shared"])
def test_speculated_steps_still_queued_when_step_waits_run_on_the_waited_threads(arrangement, monkeypatch):
    """Speculated steps the worker has not run when the trainer starts waiting in step() (a
    backward shorter than the host step: the H200's 2.7 against ~40 ms) run as the steps step()
    sends do, on every core: finish() tells the worker (OP_TRAINER_WAITS), which gives its queued
    ones the waited threads. 32 pieces queued at once; the last run shows it in the OS's masks
    (split) or thread count (shared: OpenMP starts a thread only for a region that asks for it).
    Bitwise the reference."""
    close_shared_tiers()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no core beyond the worker's")
    monkeypatch.setattr(worker_client, "WAITED_TRAINER_CORES", 0)  # 2 cores widen (see above)
    numels = [4 << 20, 4 << 20]
    share = {"worker_share": 0.5} if arrangement == "split" else {}
    tier = new_tier(numels, slot_numel=1 << 18, staging_slots=32, **share)
    try:
        every = frozenset(os.sched_getaffinity(0)) | frozenset(tier.cores.worker)
        assert tier.cores.waited_threads == len(every) > tier.cores.worker_threads
        states = make_states(numels, seed=7)
        load(tier, states)
        grads = make_grads(numels, seed=7)
        # the worker is stopped until finish() has told it the trainer waits: on a loaded host it
        # could otherwise run every piece on its own threads before step() comes
        pid = tier.client.pid
        with stopped(pid) as resume_in:
            for sg, g in enumerate(grads):
                assert tier.stepping.speculate(sg, g, inputs(1))
            resume_in(0.5)
            assert tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)}) == {
                0: "committed",
                1: "committed",
            }
        for sg, g in enumerate(grads):
            ref_step(states[sg], g, inputs(1))
        if arrangement == "split":
            cores = _thread_cores(pid)
            assert sum(c == every for c in cores.values()) >= tier.cores.waited_threads, cores
        else:
            assert psutil.Process(pid).num_threads() >= tier.cores.waited_threads
        assert_tier_equals(tier, states, f"{arrangement}: speculated, then waited for")
    finally:
        tier.close()


def test_a_raw_view_taken_before_close_stays_readable(tmp_path):
    # in a child process: if the view dangles, reading it kills the reader
    r = run_script(
        tmp_path,
        "raw_view.py",
        """
        import gc, torch
        from hybrid_opt.tiers.host import HostTier
        tier = HostTier([1000, 5000], slot_numel=4096)
        tier.load_state(0, torch.arange(1000, dtype=torch.float32))
        view = tier.master(0)
        tier.close()
        tier.close()
        print(float(view.sum()))
        del tier
        gc.collect()
        print(float(view.sum()), torch.equal(view, torch.arange(1000, dtype=torch.float32)))
    """,
    )
    assert r.returncode == 0, f"rc {r.returncode}; stderr:\n{r.stderr[-2000:]}"
    assert r.stdout.split() == ["499500.0", "499500.0", "True"]


# ------------------------------------------------------------------ 10. no orphans
def test_worker_exits_when_the_trainer_is_killed(tmp_path):
    script = tmp_path / "killed_trainer.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        from hybrid_opt.tiers.host import HostTier
        tier = HostTier([1000, 5000], slot_numel=4096)
        print(tier.client.pid, flush=True)
        time.sleep(60)  # killed long before this ends
    """)
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop(FAULT_ENV, None)
    trainer = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = None
    try:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), f"no worker pid from the trainer: {line!r} {trainer.stderr.read()}"
        worker = int(line)
        assert psutil.Process(worker).ppid() == trainer.pid and psutil.Process(worker).is_running()
        trainer.kill()  # SIGKILL: no close(), no atexit, no finalizer runs
        trainer.wait(timeout=10)
        t0 = time.monotonic()
        gone = wait_gone(worker, 3.0)
        print(f"worker exited {1e3 * (time.monotonic() - t0):.0f} ms after its trainer was killed")
        assert gone, "the worker outlived its trainer by more than 3 s (an orphan)"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        trainer.stdout.close()
        trainer.stderr.close()
        if worker is not None and not wait_gone(worker, 0):
            os.kill(worker, signal.SIGKILL)


# ------------------------------------------------------------------ 11. no main guard
def test_a_training_script_without_a_main_guard_runs_once(tmp_path):
    r = run_script(
        tmp_path,
        "train.py",
        """
        import torch
        from hybrid_opt.tiers.host import HostTier, AdamInputs
        tier = HostTier([1000, 5000], slot_numel=4096)
        for sg, n in tier.numels.items():
            tier.load_state(sg, torch.randn(n))
        inp = AdamInputs(1, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        grads = [torch.randn(n) for n in tier.numels.values()]
        for sg, g in enumerate(grads):
            tier.stepping.speculate(sg, g, inp)
        assert set(tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}).values()) == {"committed"}
        print("OK")
        tier.close()
    """,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("OK") == 1, r.stdout


# ------------------------------------------------------------------ 12. many subgroups
def test_a_thousand_small_subgroups_speculated_and_committed_bitwise():
    gen = torch.Generator().manual_seed(17)
    numels = torch.randint(1, 301, (1000,), generator=gen).tolist()
    tier = new_tier(numels, staging_slots=8)
    try:
        states = make_states(numels, seed=17)
        load(tier, states)
        grads = make_grads(numels, seed=17)
        inp = inputs(1)
        assert all(tier.stepping.speculate(sg, g, inp) for sg, g in enumerate(grads))
        out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
        assert len(out) == 1000 and set(out.values()) == {"committed"}
        for s, g in zip(states, grads):
            ref_step(s, g, inp)
        assert_tier_equals(tier, states)
    finally:
        tier.close()


def test_a_subgroup_larger_than_the_staging_slot_is_stepped_in_pieces():
    numels = [10_000 + 17]
    tier = shared_tier(numels, staging_slots=2)  # fewer slots than pieces: slots are reused
    assert tier.slot_numel == SLOT
    states = make_states(numels, seed=18)
    load(tier, states)
    for step in (1, 2):
        (g,) = make_grads(numels, seed=18 + step)
        assert tier.stepping.speculate(0, g, inputs(step))
        assert tier.stepping.finish({0: (g, inputs(step))}) == {0: "committed"}
        ref_step(states[0], g, inputs(step))
        assert_tier_equals(tier, states, f"step {step}")
    (g,) = make_grads(numels, seed=30)
    assert tier.stepping.step(0, g, inputs(3)) == "stepped"
    ref_step(states[0], g, inputs(3))
    assert_tier_equals(tier, states, "plain step")


# ------------------------------------------------------------------ 13. round trip
def test_worker_round_trip_median():
    tier = shared_tier()
    for _ in range(20):
        tier.client.ping()
    median = statistics.median(tier.client.ping() for _ in range(300))
    print(f"worker empty-task round trip: median {median * 1e6:.0f} us (target < 200 us)")
    assert median < 2e-3  # a loose bound for a noisy shared machine; the benchmark reports the figure


# ------------------------------------------------------------------ 14. bad arguments
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(rollback="bogus"), ValueError, r"rollback must be 'exact' or 'inverse', got 'bogus'"),
        (dict(spare_banks=0), ValueError, r"rollback='exact' needs at least one spare bank"),
        (dict(staging_slots=0), ValueError, r"staging_slots must be >= 1"),
        (
            dict(rollback="inverse", moment_dtype=torch.bfloat16),
            ValueError,
            r"cannot undo a step with bf16 moments",
        ),
        (
            dict(rollback="inverse", exp_avg_sq_dtype=torch.bfloat16),
            ValueError,
            r"cannot undo a step with bf16 moments",
        ),
        (
            dict(exp_avg_dtype=torch.float16),
            TypeError,
            r"exp_avg_dtype must be torch.float32 or torch.bfloat16",
        ),
        (
            dict(remainders=True, copy_dtype=torch.float16, params=[torch.zeros(10, dtype=torch.bfloat16)]),
            ValueError,
            r"remainders=True with bf16 params needs a bf16 host tier",
        ),
        (
            dict(remainders=True, params=[torch.zeros(10, dtype=torch.bfloat16)]),
            ValueError,
            r"remainders=True with bf16 params needs a bf16 host tier",
        ),
        (dict(remainders=True, copy_dtype=torch.bfloat16), ValueError, r"remainders=True needs params="),
        (
            dict(remainders=True, copy_dtype=torch.bfloat16, params=[torch.zeros(9, dtype=torch.bfloat16)]),
            ValueError,
            r"params\[0\] must be a contiguous tensor of 10 elements",
        ),
        (
            dict(
                remainders=True,
                copy_dtype=torch.bfloat16,
                rollback="inverse",
                params=[torch.zeros(10, dtype=torch.bfloat16)],
            ),
            ValueError,
            r"rollback='inverse' needs an fp32 master",
        ),
        (dict(grad_dtype=torch.float64), TypeError, r"grad_dtype must be one of"),
        (dict(copy_dtype=torch.float32), TypeError, r"copy_dtype must be None"),
        (dict(numels=[]), ValueError, r"at least one subgroup"),
        (dict(numels=[10, 0]), ValueError, r"at least one element"),
        (dict(worker_share=0.0), ValueError, r"worker_share must be in \(0, 1\]"),
    ],
)
def test_bad_constructor_arguments_are_rejected_clearly(kwargs, exc, match):
    kwargs = dict(kwargs)
    numels = kwargs.pop("numels", [10])
    children = {c.pid for c in psutil.Process().children()}
    with pytest.raises(exc, match=match):
        HostTier(numels, **kwargs)
    assert {c.pid for c in psutil.Process().children()} <= children  # no worker left behind


@pytest.mark.parametrize("call", ["speculate", "finish"])
def test_a_grad_of_the_wrong_numel_is_rejected_and_changes_nothing(call):
    tier = shared_tier()
    states = make_states(NUMELS, seed=19)
    load(tier, states)
    grads = make_grads(NUMELS, seed=19)
    bad = torch.randn(NUMELS[1] - 1)
    with pytest.raises(ValueError, match=r"subgroup 1 has 100 elements, its grad 99"):
        if call == "speculate":
            tier.stepping.speculate(1, bad, inputs(1))
        else:
            tier.stepping.finish({0: (grads[0], inputs(1)), 1: (bad, inputs(1))})
    assert tier.stepping.speculated() == []
    assert_tier_equals(tier, states, f"after a bad grad to {call}")
    # and the tier still works, the bad call having left no bank or slot held
    for sg, g in enumerate(grads):
        assert tier.stepping.speculate(sg, g, inputs(1))
    assert set(tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)}).values()) == {
        "committed"
    }
    for s, g in zip(states, grads):
        ref_step(s, g, inputs(1))
    assert_tier_equals(tier, states)


def test_speculating_twice_on_a_subgroup_before_finish_is_rejected():
    tier = shared_tier()
    load(tier, make_states(NUMELS, seed=20))
    g = make_grads(NUMELS, seed=20)[2]
    assert tier.stepping.speculate(2, g, inputs(1))
    with pytest.raises(
        RuntimeError, match=r"subgroup 2 has a speculative step pending; call finish\(\) first"
    ):
        tier.stepping.speculate(2, g, inputs(1))
    with pytest.raises(RuntimeError, match=r"subgroup 2 has a speculative step pending"):
        tier.load_state(2, torch.zeros(NUMELS[2]))
    tier.stepping.finish({}, overflow=True)


@pytest.mark.parametrize("rollback", ["exact", "inverse"])
def test_speculate_with_replace_cancels_the_pending_speculation_first(rollback):
    tier = shared_tier(rollback=rollback)
    states = make_states(NUMELS, seed=21)
    load(tier, states)
    first, second = make_grads(NUMELS, seed=21)[3], make_grads(NUMELS, seed=22)[3]
    assert tier.stepping.speculate(3, first, inputs(1))
    assert tier.stepping.speculate(3, second, inputs(1), replace=True)  # cancel() + speculate()
    assert tier.stepping.speculated() == [3]
    assert tier.stepping.finish({3: (second, inputs(1))}) == {3: "committed"}
    ref_step(states[3], second, inputs(1))
    got = tier.master(3)
    if rollback == "exact":
        assert_bitwise_equal(got, states[3]["p"], "replaced speculation, committed")
    else:  # the first step was undone with the fp64 inverse: a few ulp
        torch.testing.assert_close(got, states[3]["p"], **INVERSE_TOL["p"])
    assert tier.stepping.speculate(3, first, inputs(2), replace=True)  # nothing pending: a plain speculate
    tier.stepping.finish({}, overflow=True)


@pytest.mark.parametrize("call", ["speculate", "finish"])
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(amsgrad=True), r"AdamInputs.amsgrad=True on a host tier built with amsgrad=False"),
        (dict(runs=((0, 50, 1), (90, 20, 1))), r"run \(90, 20\) is outside subgroup 1 of 100 elements"),
        (dict(runs=((-1, 5, 1),)), r"run \(-1, 5\) is outside subgroup 1"),
    ],
    ids=["amsgrad_without_layout", "run_past_the_end", "negative_run"],
)
def test_bad_step_inputs_are_rejected_before_anything_is_stepped(call, bad, match):
    tier = shared_tier()
    states = make_states(NUMELS, seed=23)
    load(tier, states)
    grads = make_grads(NUMELS, seed=23)
    with pytest.raises(ValueError, match=match):
        if call == "speculate":
            tier.stepping.speculate(1, grads[1], inputs(1, **bad))
        else:
            tier.stepping.finish({0: (grads[0], inputs(1)), 1: (grads[1], inputs(1, **bad))})
    assert tier.stepping.speculated() == []
    assert_tier_equals(tier, states, f"after bad inputs to {call}")
    # nothing half-launched is left to be committed by the next finish()
    assert tier.stepping.finish({1: (grads[1], inputs(1))}) == {1: "stepped"}
    ref_step(states[1], grads[1], inputs(1))
    assert_tier_equals(tier, states)


@pytest.mark.parametrize("sg", [len(NUMELS), -1])
def test_an_unknown_subgroup_is_rejected(sg):
    tier = shared_tier()
    with pytest.raises((IndexError, ValueError), match=r"subgroup"):
        tier.stepping.speculate(sg, torch.randn(10), inputs(1))
    assert tier.stepping.speculated() == []


def test_inverse_mode_worker_death_during_speculation_leaves_the_tier_usable(monkeypatch):
    """The death is reported (naming the torn subgroup); the speculation that was being
    launched is abandoned, not left half-registered, so the next finish() runs at once."""
    monkeypatch.setenv("HYBRID_OPT_WORKER_FAULT", "before_step:1")
    tier = HostTier([100, 100], rollback="inverse", timeout_s=20)
    try:
        inputs = AdamInputs(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
        g = torch.randn(100)
        tier.stepping.speculate(0, g, inputs)
        time.sleep(0.3)  # the worker dies on its first step
        with pytest.raises(RuntimeError, match=r"subgroups \[0\] may be torn"):
            tier.stepping.speculate(1, g, inputs)
        assert tier.stepping.speculated() == []
        t0 = time.monotonic()
        assert tier.stepping.finish({0: (g, inputs), 1: (g, inputs)}) == {0: "stepped", 1: "stepped"}
        assert time.monotonic() - t0 < 5.0
    finally:
        tier.close()


def _rss_kb_of_mapping(pid, nbytes) -> int:
    """Rss of the one mapping of exactly `nbytes` in /proc/PID/smaps (the arena)."""
    found, rss, hits = False, 0, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = hi - lo == nbytes
                hits += found
            elif found and head[0] == "Rss:":
                rss = int(head[1])
    assert hits == 1, f"{hits} mappings of {nbytes} bytes in process {pid}"
    return rss


def test_the_arena_is_mapped_in_both_processes_before_the_first_step():
    """Both the trainer's and the worker's mappings of the shared arena are populated at
    construction (MADV_POPULATE_WRITE): the worker's first steps on each spare bank would
    otherwise take a page fault per 4 KB — tens of times slower here."""
    tier = HostTier([3 << 20, 3 << 20], spare_banks=2, timeout_s=TIMEOUT_S)
    try:
        if not tier.arena.populated:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        tier.client.ping()  # the worker maps and populates before it serves
        # all but the ranges left to the background (the banks' moments and the spare banks),
        # at once, in both processes (the background may have done more: a lower bound)
        spare_at = tier.banks.bank_offset + 2 * tier.banks.bank_stride
        later = sum(n for _, n in tier.arena.later)  # none where the arena is pinned (CUDA)
        for pid in (os.getpid(), tier.client.pid):
            assert _rss_kb_of_mapping(pid, tier.arena.nbytes) * 1024 >= tier.arena.nbytes - later, pid
        # the spare banks behind: the trainer's thread is waited for, the worker's polled
        tier.arena.wait_populated(timeout_s=TIMEOUT_S)
        assert not tier.arena.populating and spare_at > 0
        assert _rss_kb_of_mapping(os.getpid(), tier.arena.nbytes) * 1024 == tier.arena.nbytes
        # polled up to 3 x TIMEOUT_S: a CI run once saw it unfinished at 20 s on a loaded host
        deadline = time.monotonic() + 3 * TIMEOUT_S
        while (mapped := _rss_kb_of_mapping(tier.client.pid, tier.arena.nbytes) * 1024) < tier.arena.nbytes:
            assert time.monotonic() < deadline, (
                f"the worker did not map its spare banks: {mapped} of {tier.arena.nbytes} bytes "
                f"mapped after {3 * TIMEOUT_S:.0f} s (worker alive: {tier.client.connected})"
            )
            time.sleep(0.05)
    finally:
        tier.close()


# the background part is reserved by fallocate there (populate.reserve), whose failure is tested below
@pytest.mark.usefixtures("shmem_without_huge_pages")
def test_memory_the_arena_cannot_get_is_an_error_at_construction(monkeypatch):
    """MADV_POPULATE_WRITE failing for want of memory (ENOMEM, or EFAULT from a full tmpfs)
    raises a MemoryError naming the size and what to do, and leaks no descriptor."""
    import ctypes
    import errno

    from hybrid_opt import populate as pop
    from hybrid_opt import shm

    class Libc:
        """libc as the populate module calls it, with one call failing for want of memory."""

        def __init__(self, failing):
            self.real, self.failing = pop._lib(), failing

        def __getattr__(self, name):
            fn = getattr(self.real, name)
            if name != self.failing:
                return fn

            def fail(*a):
                ctypes.set_errno(errno.ENOMEM if name == "madvise" else errno.ENOSPC)
                return -1

            return fail

    fds = psutil.Process().num_fds()
    # populating: ENOMEM (or EFAULT from a full tmpfs)
    monkeypatch.setattr(pop, "_libc", Libc("madvise"))
    with pytest.raises(MemoryError, match=r"cannot allocate 0\.01 GB of shared memory .*offload_fraction"):
        shm.SharedArena(8 << 20, "hybrid_opt-test")
    assert psutil.Process().num_fds() == fds
    # reserving the part populated in the background: ENOSPC
    monkeypatch.setattr(pop, "_libc", None)  # so that the next stand-in wraps libc, not the one above
    monkeypatch.setattr(pop, "_libc", Libc("fallocate"))
    with pytest.raises(MemoryError, match=r"cannot allocate 0\.00 GB of shared memory .*No space left"):
        shm.SharedArena(8 << 20, "hybrid_opt-test", later=[(4 << 20, 4 << 20)])
    assert psutil.Process().num_fds() == fds
    monkeypatch.setattr(pop, "_libc", None)
    # a kernel without MADV_POPULATE_WRITE answers EINVAL: pages then come on first touch
    monkeypatch.setattr(shm, "MADV_POPULATE_WRITE", 4242)
    arena = shm.SharedArena(8 << 20, "hybrid_opt-test")
    assert arena.populated is False
    arena.close()


def test_a_task_packs_every_field_in_declaration_order_and_unpacks_to_itself():
    """The request frame (worker/protocol.py): Task.pack reads its fields directly; the bytes
    are the struct of every field but the gather list, in declaration order (what
    dataclasses.astuple gave), then the gather list — and unpack gives the task back."""
    import struct
    from dataclasses import astuple

    from hybrid_opt.worker import protocol as proto

    tasks = [
        proto.Task(
            proto.OP_STEP,
            7,
            3,
            65536,
            1,
            2,
            64,
            5,
            1,
            2,
            1,
            0,
            1,
            9,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            -0.5,
            1,
            0xDEADBEEF,
            1,
            gather=proto.pack_gather([(0, 4096, 256), (256, 0, 64)]),
        ),
        proto.Task(proto.OP_SWAP_IN, 1 << 40, 12345, file_slot=1, crc=0xFFFFFFFF),
        proto.Task(proto.OP_PING, 0),
    ]
    for t in tasks:
        want = struct.Struct(proto.Task._STRUCT.format).pack(*astuple(t)[:-1]) + t.gather
        assert t.pack() == want
        assert proto.Task.unpack(t.pack()) == t


def test_write_task_sends_the_gather_entries_it_is_handed_as_the_tasks_gather_list():
    """The trainer hands a piece's gather entries to write_task (no copy of the Task to carry
    them); the frame is the one a Task holding the packed list gives, and the worker reads the
    list back as the Task's `gather`."""
    import os
    from dataclasses import replace

    from hybrid_opt.worker import protocol as proto

    entries = [(0, 4096, 256), (256, 0, 64)]
    task = proto.Task(proto.OP_STEP, 7, 3, 80, slot=2, lr=1e-3)
    r, w = os.pipe()
    try:
        proto.write_task(w, task, entries)
        proto.write_task(w, replace(task, gather=proto.pack_gather(entries)))
        proto.write_task(w, task)
        os.close(w)
        w = -1
        reader = proto.FrameReader(r)
        while not reader.eof:
            reader.feed()
        frames = list(reader.frames())
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert len(frames) == 3 and frames[0] == frames[1] != frames[2]
    got = proto.Task.unpack(frames[0])
    assert list(proto.GATHER.iter_unpack(got.gather)) == entries
    assert replace(got, gather=b"") == task and proto.Task.unpack(frames[2]) == task
