"""The spare pool grows to what backward fills (#35): dormant spare banks cost no memory (the
OS's allocated pages and both processes' Rss say so), a speculation that found no free bank while
the worker idled wakes one after step(), one refused while the worker was busy wakes none, a
pinned arena registers only what is awake, and a fixed offload_fraction starts at two awake
spares without changing a bit of the trajectory."""

import os
import time

import pytest
import torch
from helpers import arena_rss, assert_bitwise_equal, inputs, load, make_grads, make_states, ref_step, stopped

from hybrid_opt import HybridAdamW, shm
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.host import HostTier

TIMEOUT_S = 30.0
N = 1 << 18  # elements a subgroup: a bank of ~3 MB, whole pages


def _allocated(tier) -> int:
    return os.fstat(tier.arena.fd).st_blocks * 512


def _wait_for_worker(tier, deadline_s=TIMEOUT_S):
    """Polls until every pending speculation's results are back (the worker idles)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        tier.io.poll()
        if tier.stepping.worker_idle():
            return
        time.sleep(0.01)
    raise AssertionError("the worker did not finish its speculated steps")


def _tier(**kw):
    return HostTier([N] * 6, spare_banks=6, spares_awake=2, timeout_s=TIMEOUT_S, slot_numel=N, **kw)


def test_dormant_spares_are_neither_allocated_nor_mapped_until_woken():
    tier = _tier()
    try:
        tier.arena.wait_populated(timeout_s=TIMEOUT_S)
        stride = tier.banks.bank_stride
        full = tier.arena.nbytes
        assert tier.spares_awake == 2 and len(tier.pool.dormant) == 4
        assert _allocated(tier) == full - 4 * stride
        pid, ino = tier.client.pid, os.fstat(tier.arena.fd).st_ino
        deadline = time.monotonic() + 60
        while arena_rss(pid, ino) < full - 4 * stride and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker maps its part in the background
        assert arena_rss(pid, ino) == full - 4 * stride, "the worker touched dormant banks"
        assert arena_rss("self", ino) == full - 4 * stride, "the trainer touched dormant banks"
        assert tier.wake_spares(3) == 3 and tier.spares_awake == 5
        assert _allocated(tier) == full - stride
        assert arena_rss("self", ino) == full - stride
        assert tier.wake_spares(5) == 1 and tier.wake_spares(1) == 0  # one left, then none
        assert _allocated(tier) == full
    finally:
        tier.close()


def test_speculation_refused_while_the_worker_idled_wakes_spares_and_keeps_the_bits():
    numels = [N] * 6
    tier = _tier()
    try:
        states = make_states(numels, seed=3)
        load(tier, states)
        grads = make_grads(numels, seed=3)
        inp = inputs(1)
        for step, found_none in ((1, 3), (2, 4)):
            inp = inputs(step)
            took = [tier.stepping.speculate(sg, g, inp, wait=False) for sg, g in enumerate(grads[:2])]
            _wait_for_worker(tier)  # the worker idles, and the next subgroups find no bank
            took += [
                tier.stepping.speculate(sg, g, inp, wait=False)
                for sg, g in enumerate(grads[: 2 + found_none])
                if sg >= 2
            ]
            assert took == [True, True] + [False] * found_none
            out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
            assert out == {sg: "committed" if sg < 2 else "stepped" for sg in range(6)}
            for s, g in zip(states, grads):
                ref_step(s, g, inp)
            if step == 1:  # one iteration's evidence wakes nothing (a first backward is slow)
                assert tier.spares_awake == 2 and _allocated(tier) < tier.arena.nbytes
        # three, then four found no bank while the worker idled: three more wake
        assert tier.spares_awake == 5 and len(tier.pool.dormant) == 1
        assert _allocated(tier) == tier.arena.nbytes - tier.banks.bank_stride
        for sg, want in enumerate(states):
            assert_bitwise_equal(tier.master(sg), want["p"], f"subgroup {sg}")
            assert_bitwise_equal(tier.moments(sg)["exp_avg"], want["m"], f"subgroup {sg} exp_avg")
            assert_bitwise_equal(tier.moments(sg)["exp_avg_sq"], want["v"], f"subgroup {sg} exp_avg_sq")
        took = [tier.stepping.speculate(sg, g, inputs(3), wait=False) for sg, g in enumerate(grads)]
        assert took == [True] * 5 + [False], "five subgroups speculate with five spares awake"
        tier.stepping.finish({}, overflow=True)
    finally:
        tier.close()


def test_a_worker_still_busy_when_speculation_finds_no_bank_wakes_nothing():
    """More banks would only have held queued steps: the pool stays as it is. The worker is
    stopped (SIGSTOP) while speculation is refused, so it is busy then for certain."""
    numels = [N] * 6
    tier = _tier()
    try:
        load(tier, make_states(numels, seed=4))
        grads = make_grads(numels, seed=4)
        pid = tier.client.pid
        for step in (1, 2):
            with stopped(pid) as resume_in:
                took = [
                    tier.stepping.speculate(sg, g, inputs(step), wait=False) for sg, g in enumerate(grads)
                ]
                assert took == [True, True, False, False, False, False]
                resume_in(1.0)
                tier.stepping.finish({sg: (g, inputs(step)) for sg, g in enumerate(grads)})
        assert tier.spares_awake == 2 and len(tier.pool.dormant) == 4
        assert _allocated(tier) == tier.arena.nbytes - 4 * tier.banks.bank_stride
    finally:
        tier.close()


class _Runtime:
    """Records cudaHostRegister/Unregister calls (no CUDA here; the real one runs on GPU hosts)."""

    def __init__(self):
        self.calls = []

    def register(self, ptr, nbytes):
        self.calls.append(("register", ptr, nbytes))
        return 0

    def unregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def clear_error(self):
        return 0

    def error_string(self, code):
        return "error"


def test_a_pinned_arena_registers_what_is_awake_and_each_bank_as_it_wakes(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(shm, "cuda_runtime", lambda: runtime)
    tier = _tier(pin=True)
    try:
        base, stride = shm.address(tier.arena.mm), tier.banks.bank_stride
        regs = [(p - base, n) for op, p, n in runtime.calls if op == "register"]
        dormant = [(base_off, stride) for base_off, _ in tier.arena.dormant]
        assert len(dormant) == 4
        covered = sum(n for _, n in regs)
        assert covered == tier.arena.nbytes - 4 * stride, "dormant banks were pinned"
        for off, n in regs:  # no registered range overlaps a dormant bank
            assert all(off + n <= d or d + stride <= off for d, _ in dormant)
        assert tier.wake_spares(2) == 2
        new = [(p - base, n) for op, p, n in runtime.calls[len(regs) :] if op == "register"]
        assert new == dormant[:2]
    finally:
        tier.close()
    unregistered = [c[1] for c in runtime.calls if c[0] == "unregister"]
    assert sorted(unregistered) == sorted(p for op, p, *_ in runtime.calls if op == "register")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).to(dtype)


def _slow_backward(model, seconds):
    """Each layer's backward sleeps: backward then outlasts the worker's host steps."""
    for m in model:
        if isinstance(m, torch.nn.Linear):
            m.weight.register_hook(lambda g: (time.sleep(seconds), g)[1])


def _train(opt, model, steps):
    torch.manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256, dtype=dtype)).float().square().mean().backward()
        opt.step()


# q8: a bf16 model with q8 moments and remainders, whose spare banks' copy slots are pooled (a
# dormant bank's slot is dormant with it)
FORMATS = {
    "fp32": (torch.float32, {}),
    "q8": (torch.bfloat16, dict(exp_avg_dtype="q8", exp_avg_sq_dtype="q8", store_param_remainders=True)),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("slow", [True, False], ids=["long_backward", "plain"])
def test_a_fixed_offload_starts_with_two_awake_spares_and_grows_under_a_long_backward(slow, fmt):
    dtype, state = FORMATS[fmt]
    model, ref = _model(dtype), _model(dtype)
    if slow:
        _slow_backward(model, 0.02)
    kw = dict(offload_fraction=1.0, subgroup_numel=256 * 257, worker_share=0.5, lr=1e-3, **state)
    with HybridAdamW(model.parameters(), speculative=True, **kw) as opt:
        host = debug_view(opt).host
        n_host = len(opt.plan.subgroups("host"))
        assert opt.plan.spare_banks == n_host > 4 and opt.plan.spares_awake == 2
        assert host.spares_awake == 2
        if fmt == "q8":
            assert host.spare_bank_bytes > host.banks.bank_stride  # its copy slot too
        before = opt.allocated_bytes["host"]
        assert before == os.fstat(host.arena.fd).st_blocks * 512
        _train(opt, model, steps=4)
        if slow:
            assert host.spares_awake > 2, "a long backward left the worker idle: spares should wake"
            grown = host.spares_awake - 2
            assert opt.allocated_bytes["host"] == before + grown * host.spare_bank_bytes
        with HybridAdamW(ref.parameters(), speculative=False, **kw) as plain:
            _train(plain, ref, steps=4)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_bitwise_equal(a, b, "speculative with a growing pool vs no speculation")
