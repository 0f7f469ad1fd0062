"""The trainer's own host steps (tiers/inline_steps.py, issue #37).

On a CPU-only host the trainer and the worker share every core, and the trainer sleeps while a
step it waits for runs. There the trainer runs that step itself, with the worker's kernel code
(worker/arena_steps.py), reading each grad where backward left it: no staging copy, no round
trip. Everything else stays the worker's: speculated steps, nvme subgroups, inverse mode's
checked steps, and every step on a host whose cores are split.

What is promised, and checked here against a run whose worker steps (split cores, or
HostTier(inline=False)):
- the same bits, for every state format, in pieces that span several params (one kernel call a
  run of each) and in q8 pieces (staged whole: a block of 256 is never cut);
- a piece with a non-finite grad in any of its runs steps none of them, as the worker's;
- a kernel error names the subgroup and leaves the committed state as it was;
- the trainer keeps its thread count for it (the worker is idle), and gets it back after.
"""

import os

import pytest
import torch
from helpers import assert_bitwise_equal, inputs, load, make_grads, make_states, ref_step
from torch import nn

import cpu_kernels
from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.host import HostTier
from hybrid_opt.worker import arena_steps
from hybrid_opt.worker import protocol as proto

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share")
SLOT = 4096
NUMELS = [1, 100, SLOT, SLOT + 1, 10_000 + 17]  # one element, a slot, a slot + 1, ragged pieces


# ----------------------------------------------------------------------------- the host tier
def _tier_states(tier) -> list:
    """Each subgroup's committed state (an nvme one's read from its file), sorted by key."""
    out = []
    for sg in range(len(tier.numels)):
        st = tier.state(sg)
        out.append([st[k].clone() for k in sorted(st)])
    return out


@TWO_CORES
@pytest.mark.parametrize(
    "fmt",
    [
        dict(),
        dict(amsgrad=True),
        dict(grad_dtype=torch.bfloat16),
        dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
        dict(copy_dtype=torch.bfloat16),
    ],
    ids=["fp32", "amsgrad", "bf16_grads", "bf16_moments", "bf16_copy"],
)
def test_a_shared_core_tier_steps_in_the_trainer_with_the_workers_bits(fmt):
    """Sharing every core, the tier's waited steps run in the trainer (no piece staged or sent):
    bitwise the worker's steps and the kernel's direct step, over three steps."""
    grad_dtype = fmt.get("grad_dtype", torch.float32)
    amsgrad = fmt.get("amsgrad", False)
    kw = dict(slot_numel=SLOT, staging_slots=3, timeout_s=20.0, **fmt)
    inline, worker = HostTier(NUMELS, **kw), HostTier(NUMELS, inline=False, **kw)
    try:
        assert inline.cores.shared and inline.inline is not None and worker.inline is None
        assert "runs the host steps step() waits for itself" in inline.describe()
        assert "the worker steps on all" in worker.describe()
        moment_dtype = fmt.get("exp_avg_dtype", torch.float32)
        states = make_states(NUMELS, amsgrad=amsgrad, moment_dtype=moment_dtype, seed=4)
        load(inline, states)
        load(worker, states)
        for step in (1, 2, 3):
            grads = make_grads(NUMELS, grad_dtype, seed=step)
            inp = inputs(step, amsgrad=amsgrad)
            for sg, g in enumerate(grads):
                inline.stepping.step(sg, g, inp)
                worker.stepping.step(sg, g, inp)
                if not fmt:
                    ref_step(states[sg], g, inp)
        pieces = sum(-(-n // SLOT) for n in NUMELS) * 3
        assert inline.inline.count == pieces and inline.stats["worker_seconds"] > 0
        assert inline.stats["remote_gathered"] == 0  # nothing reached the worker
        for sg, (a, b) in enumerate(zip(_tier_states(inline), _tier_states(worker))):
            for k, (x, y) in enumerate(zip(a, b)):
                assert_bitwise_equal(x, y, f"subgroup {sg} tensor {k}")
        for sg, s in enumerate(states if not fmt else []):  # the kernel's own step, directly
            assert_bitwise_equal(inline.master(sg), s["p"], f"subgroup {sg} master")
            assert_bitwise_equal(inline.moments(sg)["exp_avg_sq"], s["v"], f"subgroup {sg} exp_avg_sq")
    finally:
        inline.close()
        worker.close()


@TWO_CORES
def test_a_split_tier_leaves_every_step_to_the_worker():
    split = HostTier([SLOT], slot_numel=SLOT, worker_share=0.5, timeout_s=20.0)
    try:
        assert split.inline is None and not split.cores.shared
        assert "the trainer runs" not in split.describe()
    finally:
        split.close()


@TWO_CORES
def test_nvme_subgroups_are_stepped_by_the_trainer_too_between_the_workers_read_and_write(
    tmp_path, monkeypatch
):
    """A tier with nvme subgroups on shared cores: the worker reads each one's state into a bank
    and writes it back to its file; the trainer steps it in between, on every core. Bitwise the
    worker's steps, the state read back from the files."""
    numels, nvme = [SLOT, SLOT + 1, 3000], [False, True, True]
    kw = dict(slot_numel=SLOT, staging_slots=3, timeout_s=20.0, nvme=nvme, io_banks=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    inline = HostTier(numels, nvme_path=str(tmp_path / "a"), **kw)
    worker = HostTier(numels, nvme_path=str(tmp_path / "b"), inline=False, **kw)
    seen = []
    real = arena_steps.ArenaSteps.adam

    def spy(self, t, runs):
        seen.append((t.subgroup, cpu_kernels.get_num_threads()))
        return real(self, t, runs)

    monkeypatch.setattr(arena_steps.ArenaSteps, "adam", spy)
    try:
        assert inline.inline is not None and inline.cores.shared
        states = make_states(numels, seed=9)
        load(inline, states)
        load(worker, states)
        for step in (1, 2, 3):
            grads = make_grads(numels, seed=step)
            for t in (inline, worker):
                t.stepping.finish({sg: (g, inputs(step)) for sg, g in enumerate(grads)})
        cores = len(os.sched_getaffinity(0))
        assert sorted({sg for sg, _ in seen}) == [0, 1, 2] and {n for _, n in seen} == {cores}
        for t in (inline, worker):
            t.held.settle_writes()  # the writes behind the last step land: the files hold the state
            t.held.release_reads()
        for sg, (a, b) in enumerate(zip(_tier_states(inline), _tier_states(worker))):
            for k, (x, y) in enumerate(zip(a, b)):
                assert_bitwise_equal(x, y, f"subgroup {sg} tensor {k}")
    finally:
        inline.close()
        worker.close()


# ----------------------------------------------------------------------------- the optimizer
class Two(nn.Module):
    """Two Linear(64, 64) (4,160 elements each): a 8,192-element subgroup holds the first's
    weight and bias and most of the second's weight, so its pieces span params."""

    def __init__(self, dtype):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64).to(dtype), nn.Linear(64, 64).to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype))))


FORMATS = {
    "fp32": (torch.float32, {}),
    "amsgrad_clip": (torch.float32, dict(amsgrad=True, max_grad_norm=0.05)),
    "bf16_remainders": (
        torch.bfloat16,
        dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ),
    "q8": (torch.float32, dict(exp_avg_dtype="q8", exp_avg_sq_dtype="q8")),
}
# formats whose fields move by different strides (a mix-up of two fields shows): remainders with an
# fp32 exp_avg beside bf16 exp_avg_sq and max (param 2 B, exp_avg 4, exp_avg_sq 2), and a bf16
# model with an fp32 master (param 4 B, its bf16 copy 2)
MIXED = {
    "remainders_fp32_m_amsgrad": (
        torch.bfloat16,
        dict(store_param_remainders=True, exp_avg_sq_dtype=torch.bfloat16, amsgrad=True),
    ),
    "bf16_master_copy": (torch.bfloat16, {}),
}


def _train(fmt: str, steps=4, **kw):
    dtype, extra = {**FORMATS, **MIXED}[fmt]
    torch.manual_seed(0)
    net = Two(dtype)
    opt = HybridAdamW(
        net.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        offload_fraction=1.0,
        subgroup_numel=8192,
        speculative=False,
        **extra,
        **kw,
    )
    g = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(steps):
            opt.zero_grad()
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
            ((net(x).float() - y) ** 2).mean().backward()
            opt.step()
        inline = debug_view(opt).host.inline
        count = None if inline is None else inline.count
        state = opt.state_dict()
    return [p.detach().clone() for p in net.parameters()], state, count


@TWO_CORES
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_hybrid_adamw_on_a_cpu_only_host_steps_in_the_trainer_with_the_workers_bits(fmt):
    """The default on a CPU-only host (every core shared) steps in the trainer; the split
    (worker_share=0.5) leaves it to the worker. Params and every state tensor are bitwise equal."""
    params, state, count = _train(fmt)
    split_params, split_state, split_count = _train(fmt, worker_share=0.5)
    assert count and count > 0 and split_count is None
    for i, (a, b) in enumerate(zip(params, split_params)):
        assert torch.equal(a, b), f"param {i}"
    assert state["state"].keys() == split_state["state"].keys()
    for i, st in state["state"].items():
        for k, v in st.items():
            w = split_state["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"state[{i}][{k}]"


@TWO_CORES
@pytest.mark.parametrize("fmt", ["fp32", "amsgrad_clip", "bf16_remainders", *MIXED])
def test_a_pieces_adam_calls_are_packed_as_ctypes_builds_each_run(fmt, monkeypatch):
    """The trainer's Adam calls of a piece that spans several params go as one AdamArgs array made
    by the C library from the call's fields and each run's offset (ArenaSteps._adam_argv,
    _lib.expand_runs): byte for byte the structs ctypes builds from each run's fields (its
    addresses worked out at its own offset), for every format's fields."""
    seen = []
    real = arena_steps.ArenaSteps._adam_argv

    def check(self, t, runs, out_bank, m_dtype, v_dtype):
        argv = real(self, t, runs, out_bank, m_dtype, v_dtype)
        want = [
            self.AdamArgs(*self._adam_args(t, g, out_bank, m_dtype, v_dtype, off, n)) for g, off, n in runs
        ]
        assert [bytes(a) for a in argv] == [bytes(w) for w in want]
        seen.append(len(runs))
        return argv

    monkeypatch.setattr(arena_steps.ArenaSteps, "_adam_argv", check)
    _train(fmt, steps=2)
    assert seen and max(seen) > 1  # pieces of several runs were packed


@TWO_CORES
@pytest.mark.parametrize("clip", [None, 1e-3], ids=["committed", "clip_bites_redone"])
def test_speculated_at_the_worker_then_committed_or_redone_in_the_trainer_bitwise(clip):
    """speculative=True on shared cores: the worker steps during backward; step() commits those
    steps, or redoes them in the trainer where clipping bit. The same bits as the split run."""
    kw = dict(max_grad_norm=clip) if clip else {}
    counts = []

    def run(**more):
        torch.manual_seed(0)
        net = Two(torch.float32)
        g = torch.Generator().manual_seed(1)
        opt = HybridAdamW(net.parameters(), lr=1e-2, offload_fraction=1.0, subgroup_numel=8192, **kw, **more)
        with opt:
            spec = {"committed": 0, "redone": 0}
            for _ in range(4):
                opt.zero_grad()
                x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
                ((net(x) - y) ** 2).mean().backward()
                opt.step()
                for k in spec:
                    spec[k] += opt.stats["speculation"][k]
            inline = debug_view(opt).host.inline
            counts.append((spec, None if inline is None else inline.count))
            return [p.detach().clone() for p in net.parameters()], opt.state_dict()["state"]

    params, state = run(speculative=True)
    split_params, split_state = run(worker_share=0.5, speculative=False)
    (spec, inline), _ = counts
    if clip:
        assert spec["redone"] > 0 and inline > 0
    else:
        assert spec["committed"] > 0 and spec["redone"] == 0 and inline == 0
    assert all(torch.equal(a, b) for a, b in zip(params, split_params))
    assert _state_equal({"state": state}, {"state": split_state})


def _grads(net, seed):
    g = torch.Generator().manual_seed(seed)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _state_equal(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(v, b["state"][i][k]) if isinstance(v, torch.Tensor) else v == b["state"][i][k]
        for i, st in a["state"].items()
        for k, v in st.items()
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16)


@TWO_CORES
@pytest.mark.parametrize("where", ["a", "b"])
def test_an_inf_in_one_param_of_a_piece_is_stepped_as_the_worker_steps_it(where):
    """A piece spanning both Linears, an inf in one of them, no GradScaler: the step is taken, as
    torch takes it (its param goes non-finite), the same bits as the worker's (NaN's included)."""
    runs = []
    for kw in ({}, dict(worker_share=0.5)):
        torch.manual_seed(0)
        net = Two(torch.float32)
        with HybridAdamW(
            net.parameters(), offload_fraction=1.0, subgroup_numel=8192, speculative=False, **kw
        ) as opt:
            for seed in (1, 2):
                _grads(net, seed)
                if seed == 2:
                    getattr(net, where).weight.grad[3, 5] = float("inf")
                opt.step()
            runs.append(([p.detach().clone() for p in net.parameters()], opt.state_dict()["state"]))
            assert (debug_view(opt).host.inline is not None) == (not kw)
    (params, state), (worker_params, worker_state) = runs
    assert not getattr(net, where).weight.isfinite().all()
    for a, b in zip(params, worker_params):
        assert torch.equal(_bits(a), _bits(b))
    for i, st in state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(_bits(v), _bits(worker_state[i][k])), (i, k)


@TWO_CORES
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf_in_the_second_run"])
def test_a_task_that_skips_non_finite_grads_steps_none_of_its_runs(bad):
    """InlineSteps keeps a task's skip_nonfinite as the worker does (step() waits for none that
    sets it today; a speculation does, and goes to the worker): an inf in the second of a piece's
    two runs steps neither; finite grads step both, bitwise the kernel's direct step, with the sum
    of squares of both."""
    tier = HostTier([SLOT], slot_numel=SLOT, timeout_s=20.0)
    try:
        (state,) = make_states([SLOT], seed=6)
        load(tier, [state])
        before = _tier_states(tier)
        grad = make_grads([SLOT], seed=6)[0]
        if bad:
            grad[3000] = float("inf")
        first, second = grad[:1000].clone(), grad[1000:].clone()  # two runs, apart in memory
        inp = inputs(1)
        task = proto.Task(
            proto.OP_STEP,
            0,
            0,
            SLOT,
            tier.pool.committed[0],
            proto.NO_BANK,
            0,
            0,
            skip_nonfinite=1,
            step=1,
            lr=inp.lr,
            beta1=inp.beta1,
            beta2=inp.beta2,
            eps=inp.eps,
            weight_decay=inp.weight_decay,
        )
        runs = [(0, first.data_ptr(), 4000), (4000, second.data_ptr(), 4 * (SLOT - 1000))]
        r = tier.inline.step(task, runs)
        if bad:
            assert r.status == proto.STATUS_NONFINITE and not r.finite
            for x, y in zip(_tier_states(tier), before):
                assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(x, y))
        else:
            assert r.status == proto.STATUS_OK and r.finite
            assert r.sum_sq == pytest.approx(float((grad.double() ** 2).sum()), rel=1e-12)
            ref_step(state, grad, inp)
            assert_bitwise_equal(tier.master(0), state["p"], "master")
            assert_bitwise_equal(tier.moments(0)["exp_avg_sq"], state["v"], "exp_avg_sq")
    finally:
        tier.close()


@TWO_CORES
def test_a_kernel_error_in_the_trainer_names_the_subgroup_and_keeps_the_committed_state(monkeypatch):
    """An error in the trainer's step comes back as the worker's would: step() names the
    subgroup and the cause, nothing is stepped, and step() again steps once the cause is gone."""
    torch.manual_seed(0)
    net = Two(torch.float32)
    with HybridAdamW(net.parameters(), offload_fraction=1.0, subgroup_numel=8192) as opt:
        _grads(net, 1)
        opt.step()
        params, state = [p.detach().clone() for p in net.parameters()], opt.state_dict()
        real = arena_steps.ArenaSteps.adam

        def broken(self, t, runs):
            raise MemoryError("injected")

        monkeypatch.setattr(arena_steps.ArenaSteps, "adam", broken)
        with pytest.raises(
            RuntimeError,
            match=r"(?s)host/nvme tier: hybrid_opt host step in the trainer failed on subgroup \d+: "
            r"MemoryError: injected.*Nothing was stepped",
        ):
            opt.step()
        for a, b in zip(params, net.parameters()):
            assert torch.equal(a, b.detach())
        assert _state_equal(state, opt.state_dict())
        monkeypatch.setattr(arena_steps.ArenaSteps, "adam", real)
        opt.step()  # the same grads: it steps now
        assert not all(torch.equal(a, b.detach()) for a, b in zip(params, net.parameters()))


@TWO_CORES
def test_the_trainer_steps_on_its_own_thread_count_and_keeps_it(monkeypatch):
    """The worker is idle while the trainer steps: its kernels run on the trainer's count (every
    core), not the one thread it keeps while the worker steps."""
    torch.manual_seed(0)
    net = Two(torch.float32)
    counts = torch.get_num_threads(), cpu_kernels.get_num_threads()
    seen = []
    real = arena_steps.ArenaSteps.adam

    def spy(self, t, runs):
        seen.append((torch.get_num_threads(), cpu_kernels.get_num_threads()))
        return real(self, t, runs)

    monkeypatch.setattr(arena_steps.ArenaSteps, "adam", spy)
    with HybridAdamW(net.parameters(), offload_fraction=1.0, subgroup_numel=8192) as opt:
        _grads(net, 1)
        opt.step()
    assert seen and set(seen) == {counts} and counts[0] == len(os.sched_getaffinity(0))
    assert (torch.get_num_threads(), cpu_kernels.get_num_threads()) == counts
