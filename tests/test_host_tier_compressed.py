"""The host and nvme tiers with compressed state (#16): bf16 moments, each on its own, and a bf16
subgroup's fp32 master kept as remainders (its bf16 high half — the model's param — plus an
int16 low half; HostTier(remainders=True, params=...)).

Everything exact is asserted bitwise: a compressed subgroup is stepped by the same kernel as
the in-process path (cpu_kernels.adam_step_ with `remainder=`, what the device tier runs on a
CPU-only host) on the same inputs, so its state must equal those direct steps bit for bit
through speculation, commit, redo (clipping), rollback (overflow) and worker restarts, whether
it lives in a bank or in a swap file. Remainders are lossless: the decoded master equals an
fp32-master tier's over many steps, and the params differ from that tier's bf16 copy only on
exact ties (the encoding rounds ties away from zero, the cast to even).
"""

import os
from contextlib import ExitStack

import pytest
import torch
from helpers import assert_bitwise_equal, inputs, make_grads, wait_gone, with_fp32_masters
from test_nvme_tier import BIG, NUMELS, NVME_FLAGS, _trajectory_plan, nvme_dir  # noqa: F401

import cpu_kernels as ck
from cpu_kernels.reference import bf16_round_reference, encode_remainder_reference
from hybrid_opt.state.state_format import StateFormat
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.compressed import _independent_moment_dtypes
from hybrid_opt.tiers.host import AdamInputs, HostTier
from hybrid_opt.worker import protocol as proto

SLOT = 4096
TIMEOUT_S = 20.0
FAULT_ENV = "HYBRID_OPT_WORKER_FAULT"
BF16, F32 = torch.bfloat16, torch.float32

mixed_moments = pytest.mark.skipif(
    not _independent_moment_dtypes(),
    reason="this cpu_kernels build needs exp_avg and exp_avg_sq of one dtype",
)

FORMATS = [
    pytest.param(dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), id="bf16_moments"),
    pytest.param(
        dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=F32, amsgrad=True), id="bf16_m_amsgrad", marks=mixed_moments
    ),
    pytest.param(dict(exp_avg_dtype=F32, exp_avg_sq_dtype=BF16), id="bf16_v", marks=mixed_moments),
    pytest.param(dict(remainders=True), id="remainders"),
    pytest.param(
        dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, remainders=True, amsgrad=True),
        id="bf16_moments_remainders_amsgrad",
    ),
]


# ----------------------------------------------------------------------------- helpers
def new_tier(numels, nvme=None, nvme_path=None, *, params=None, **kw):
    base = dict(slot_numel=SLOT, staging_slots=3, timeout_s=TIMEOUT_S, copy_dtype=BF16)
    base.update(kw)
    if not base.get("remainders"):
        params = None
    return HostTier(list(numels), nvme=nvme, nvme_path=nvme_path, params=params, **base)


def start_states(numels, config, seed, fp32_subgroups=()):
    """Mid-training states in the tier's format (moments rounded to their dtypes), as the direct
    steps keep them: a remainder subgroup as (hi, rem), any other as an fp32 master p."""
    gen = torch.Generator().manual_seed(seed)
    m_dt, v_dt = config.get("exp_avg_dtype", F32), config.get("exp_avg_sq_dtype", F32)
    states = []
    for sg, n in enumerate(numels):
        master = torch.randn(n, generator=gen)
        s = dict(
            m=(torch.randn(n, generator=gen) * 0.1).to(m_dt), v=(torch.rand(n, generator=gen) * 1e-2).to(v_dt)
        )
        if config.get("amsgrad"):
            s["vmax"] = (s["v"].float() * 2 * torch.rand(n, generator=gen)).to(v_dt)
        if config.get("remainders") and sg not in fp32_subgroups:
            s["hi"], s["rem"] = ck.encode_remainder(master)
        else:
            s["p"] = master
        states.append(s)
    return states


def master_of(s):
    return ck.decode_remainder(s["hi"], s["rem"]) if "rem" in s else s["p"]


def model_params(states):
    """The model's flat params: bf16 for remainder subgroups (their high half), else fp32."""
    return [s["hi"].clone() if "rem" in s else s["p"].clone() for s in states]


def load(tier, states):
    for sg, s in enumerate(states):
        tier.load_state(sg, master_of(s), s["m"], s["v"], s.get("vmax"))


def ref_step(state, grad, inp: AdamInputs):
    """The direct in-process step of each run on `state` (remainders: in place on hi + rem)."""
    n = state["m"].numel()
    for off, k, step in inp.ranges(n):
        part = {key: t[off : off + k].clone() for key, t in state.items()}
        kw = dict(
            max_exp_avg_sq=part["vmax"] if inp.amsgrad else None,
            step=step,
            lr=inp.lr,
            beta1=inp.beta1,
            beta2=inp.beta2,
            eps=inp.eps,
            weight_decay=inp.weight_decay,
            decoupled=inp.decoupled,
            grad_scale=inp.grad_scale,
        )
        if "rem" in part:
            ck.adam_step_(part["hi"], grad[off : off + k], part["m"], part["v"], remainder=part["rem"], **kw)
        else:
            ck.adam_step_(part["p"], grad[off : off + k], part["m"], part["v"], **kw)
        for key, t in part.items():
            state[key][off : off + k] = t


def tier_state(tier, sg):
    st = {k: v.clone() for k, v in tier.state(sg).items()}
    st["master"] = st.pop("param")
    return st


def assert_matches(tier, states, params, what):
    """The tier's committed state (decoded master, moments) and the model's params are the
    direct steps', bitwise."""
    for sg, want in enumerate(states):
        got = tier_state(tier, sg)
        assert_bitwise_equal(got["master"], master_of(want), f"{what} subgroup {sg} master")
        for k, key in (("exp_avg", "m"), ("exp_avg_sq", "v"), ("max_exp_avg_sq", "vmax")):
            assert (k in got) == (key in want), f"{what} subgroup {sg}: {k}"
            if key in want:
                assert_bitwise_equal(got[k], want[key], f"{what} subgroup {sg} {k}")
        if "rem" in want:
            assert_bitwise_equal(params[sg], want["hi"], f"{what} subgroup {sg} model param")


def committer(params, steps):
    """The optimizer's part of a commit: the new bf16 param (param_copy) into the model, for the
    elements each subgroup's runs stepped."""

    def on_commit(sg, views):
        if params is None or params[sg].dtype != BF16:
            return
        assert set(views) == {"param_copy"}, (
            f"subgroup {sg}: a remainder subgroup commits its bf16 param only"
        )
        for off, k, _ in steps[sg][1].ranges(params[sg].numel()):
            params[sg][off : off + k].copy_(views["param_copy"][off : off + k])

    return on_commit


def with_amsgrad(inp, amsgrad):
    return {sg: AdamInputs(**{**i.__dict__, "amsgrad": amsgrad}) for sg, i in inp.items()}


# ------------------------------------------------------------------ 1. trajectories, host and nvme
@pytest.mark.parametrize("config", FORMATS)
def test_compressed_trajectory_is_bitwise_the_direct_steps_in_banks_and_files(nvme_dir, config):
    """Every outcome (commit, overflow drop, clip redo, plain step, runs) on a tier mixing nvme
    and resident subgroups and on an all-resident one: both equal the in-process direct steps."""
    amsgrad = config.get("amsgrad", False)
    with ExitStack() as stack:
        states = start_states(NUMELS, config, seed=1)
        params_nv, params_host = model_params(states), model_params(states)
        nv = new_tier(NUMELS, NVME_FLAGS, nvme_dir, io_banks=3, params=params_nv, **config)
        stack.callback(nv.close)
        host = new_tier(NUMELS, params=params_host, **config)
        stack.callback(host.close)
        load(nv, states)
        load(host, states)
        assert_matches(nv, states, params_nv, "loaded nvme")
        assert_matches(host, states, params_host, "loaded host")
        seen = set()
        for k, (spec_sgs, spec_inp, step_sgs, final, overflow) in enumerate(_trajectory_plan()):
            grads = make_grads(NUMELS, seed=10 + k, scale=4.0)
            spec_inp, final = with_amsgrad(spec_inp, amsgrad), with_amsgrad(final, amsgrad)
            before = [tier_state(nv, sg) for sg in range(len(NUMELS))]
            for sg in spec_sgs:
                assert nv.stepping.speculate(sg, grads[sg], spec_inp[sg]), f"iteration {k}: subgroup {sg}"
                assert host.stepping.speculate(sg, grads[sg], spec_inp[sg])
            steps = {sg: (grads[sg], final[sg]) for sg in step_sgs}
            out = nv.stepping.finish(steps, overflow=overflow, on_commit=committer(params_nv, steps))
            assert out == host.stepping.finish(
                steps, overflow=overflow, on_commit=committer(params_host, steps)
            )
            seen |= set(out.values())
            if overflow:  # exact rollback: nothing changed, bit for bit
                for sg in range(len(NUMELS)):
                    after = tier_state(nv, sg)
                    for key, t in before[sg].items():
                        assert torch.equal(
                            after[key].view(torch.int16 if t.element_size() == 2 else torch.int32),
                            t.view(torch.int16 if t.element_size() == 2 else torch.int32),
                        ), (k, sg, key)
            else:
                for sg in step_sgs:
                    ref_step(states[sg], grads[sg], final[sg])
            assert_matches(nv, states, params_nv, f"iteration {k} nvme")
            assert_matches(host, states, params_host, f"iteration {k} host")
        assert seen == {"committed", "redone", "stepped", "dropped"}
        assert nv.stats["worker_restarts"] == host.stats["worker_restarts"] == 0


# ------------------------------------------------------------------ 2. remainders = an fp32 master
@pytest.mark.parametrize("moments", [F32, BF16], ids=["fp32_moments", "bf16_moments"])
def test_remainders_give_the_fp32_masters_bits_over_many_steps_in_banks_and_files(nvme_dir, moments):
    """A remainder tier and an fp32-master tier, the same grads from a fixed stream, 25 steps
    (speculated; every 5th clipped: redone; every 7th an overflow: dropped): the decoded masters
    and the moments stay bitwise equal, and the params differ from the fp32 tier's bf16 copy
    only where the master's low half is exactly 0x8000 (a tie)."""
    numels = [SLOT + 1, 3 * SLOT + 17, 100]
    flags = [True, False, True]
    fmt = dict(exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    gen = torch.Generator().manual_seed(3)
    masters = [torch.randn(n, generator=gen) for n in numels]
    # ties on purpose: masters whose low half is 0x8000 (the param rounds away from zero)
    for m in masters:
        bits = m.view(torch.int32)
        bits[::97] = (bits[::97] & ~0xFFFF) | 0x8000
    with ExitStack() as stack:
        params = [ck.encode_remainder(m)[0] for m in masters]
        rem = new_tier(numels, flags, nvme_dir, io_banks=2, remainders=True, params=params, **fmt)
        stack.callback(rem.close)
        full = new_tier(numels, flags, nvme_dir, io_banks=2, **fmt)
        stack.callback(full.close)
        copies = [m.to(BF16) for m in masters]
        for sg, m in enumerate(masters):
            rem.load_state(sg, m)
            full.load_state(sg, m)
        ties = [0]

        def check(what):
            for sg in range(len(numels)):
                a, b = tier_state(rem, sg), tier_state(full, sg)
                for key in b:
                    assert_bitwise_equal(a[key], b[key], f"{what} subgroup {sg} {key}")
                tie = (b["master"].view(torch.int32) & 0xFFFF) == 0x8000
                assert_bitwise_equal(params[sg], ck.encode_remainder(b["master"])[0], f"{what} {sg} param")
                assert torch.equal(params[sg][~tie].view(torch.int16), copies[sg][~tie].view(torch.int16))
                ties[0] += int((params[sg][tie].view(torch.int16) != copies[sg][tie].view(torch.int16)).sum())

        check("loaded")
        for step in range(1, 26):
            grads = make_grads(numels, seed=100 + step)
            inp = inputs(step)
            final = inputs(step, grad_scale=0.5) if step % 5 == 0 else inp
            overflow = step % 7 == 0
            for tier in (rem, full):
                for sg, g in enumerate(grads):
                    tier.stepping.speculate(sg, g, inp)
            steps = {sg: (g, final) for sg, g in enumerate(grads)}
            out = rem.stepping.finish(steps, overflow=overflow, on_commit=committer(params, steps))

            def fp32_commit(sg, views):
                copies[sg].copy_(views["param_copy"])

            assert out == full.stepping.finish(steps, overflow=overflow, on_commit=fp32_commit)
            check(f"step {step}")
        assert ties[0] > 0  # the tie rows above are exercised: those params do differ from the cast


# ------------------------------------------------------------------ 3. faults
@pytest.mark.parametrize("fault", ["mid_step:2", "mid_step:12", "after_step:17"])
def test_a_killed_worker_loses_nothing_with_compressed_state(monkeypatch, nvme_dir, fault):
    """SIGKILL inside a speculated step, a redo and a plain step (bf16 moments, remainders, a
    resident and two nvme subgroups): the worker is replaced and every bit is the direct steps'."""
    monkeypatch.setenv(FAULT_ENV, fault)
    numels, flags = [3000, 9000, 500], [True, False, True]
    config = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, remainders=True, amsgrad=True)
    states = start_states(numels, config, seed=12)
    params = model_params(states)
    # inline=False: the worker steps the resident subgroup too (sharing every core, the trainer
    # would step it itself: tiers/inline_steps.py), so the kill can land in its steps
    tier = new_tier(
        numels, flags, nvme_dir, params=params, staging_slots=2, io_banks=2, inline=False, **config
    )
    try:
        first_pid = tier.client.pid
        load(tier, states)
        for step, (spec, change) in enumerate(((True, {}), (True, dict(lr=2e-3)), (False, {})), 1):
            grads = make_grads(numels, seed=40 + step)
            inp = inputs(step, amsgrad=True)
            if spec:
                for sg, g in enumerate(grads):
                    tier.stepping.speculate(sg, g, inp)
            final = AdamInputs(**{**inp.__dict__, **change})
            steps = {sg: (g, final) for sg, g in enumerate(grads)}
            tier.stepping.finish(steps, on_commit=committer(params, steps))
            for s, g in zip(states, grads):
                ref_step(s, g, final)
            assert_matches(tier, states, params, f"step {step}")
        assert tier.stats["worker_restarts"] == 1 and tier.client.pid != first_pid
        assert wait_gone(first_pid, 5)
    finally:
        tier.close()


# ------------------------------------------------------------------ 4. bytes per element
@pytest.mark.parametrize(
    "fmt",
    [
        StateFormat(),
        StateFormat(BF16, BF16),
        StateFormat(BF16, F32),
        StateFormat(F32, F32, True),
        StateFormat(BF16, BF16, True),
    ],
    ids=["fp32", "bf16_moments", "bf16_m", "remainders", "both"],
)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_bank_file_and_spare_bytes_are_the_formats_state_bytes(nvme_dir, fmt, amsgrad):
    """Per element of a bf16 model: a bank (committed or spare) holds StateFormat.state_bytes
    plus the 2-byte param copy (with remainders: the master's high half); an nvme file slot
    holds state_bytes alone (the high half is the model's own param). Both options: 8 and 6."""
    if fmt.exp_avg_dtype != fmt.exp_avg_sq_dtype and not _independent_moment_dtypes():
        pytest.skip("this cpu_kernels build needs exp_avg and exp_avg_sq of one dtype")
    n = 1 << 16  # every region a whole number of pages: the bytes are exact
    params = [torch.zeros(n, dtype=BF16) for _ in range(3)]
    tier = new_tier(
        [n] * 3,
        [False, False, True],
        nvme_dir,
        params=params,
        amsgrad=amsgrad,
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        remainders=fmt.store_param_remainders,
        spare_banks=2,
        io_banks=1,
    )
    try:
        state = fmt.state_bytes(BF16, amsgrad)
        assert tier.bank_bytes == 2 * n * (state + 2)  # two resident subgroups
        assert tier.spare_bytes == (2 + 2 * 1) * n * (state + 2)  # spares + two per io bank
        assert tier.io_bytes == n * state
        assert os.path.getsize(tier.swap.file(2)) == 2 * n * state  # two slots
        if fmt == StateFormat(BF16, BF16, True) and not amsgrad:
            assert (state + 2, state) == (8, 6)
    finally:
        tier.close()


# ------------------------------------------------------------------ 5. details
def test_load_state_rounds_moments_to_nearest_even_and_writes_the_encoded_param(nvme_dir):
    """fp32 moments given to a bf16 tier are rounded to nearest even (torch's cast and the
    bitwise reference agree); a master given to a remainder subgroup is stored losslessly —
    ±0, subnormals, infinities, ties — and its model param becomes the encoded high half."""
    n = 4096
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(n, generator=gen)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), 3.4e38, -3.4e38])
    master[: special.numel()] = special
    master.view(torch.int32)[100:200] = (master.view(torch.int32)[100:200] & ~0xFFFF) | 0x8000  # ties
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    params = [torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
    tier = new_tier(
        [n, n],
        [False, True],
        nvme_dir,
        params=params,
        remainders=True,
        exp_avg_dtype=BF16,
        exp_avg_sq_dtype=BF16,
    )
    try:
        for sg in range(2):
            tier.load_state(sg, master, m, v)
            st = tier.state(sg)
            assert_bitwise_equal(st["param"], master, f"subgroup {sg} master")
            assert_bitwise_equal(st["exp_avg"], m.to(BF16), f"subgroup {sg} exp_avg")
            assert_bitwise_equal(st["exp_avg_sq"], v.to(BF16), f"subgroup {sg} exp_avg_sq")
            assert_bitwise_equal(st["exp_avg"], bf16_round_reference(m), f"subgroup {sg} rne")
            hi, _ = encode_remainder_reference(master)
            assert_bitwise_equal(params[sg], hi, f"subgroup {sg} model param")
            assert not torch.equal(
                params[sg][100:200].view(torch.int16), master[100:200].to(BF16).view(torch.int16)
            )  # ties: away from zero
        assert_bitwise_equal(tier.master(0), master, "master(0)")
        assert set(tier.moments(0)) == {"exp_avg", "exp_avg_sq"}
    finally:
        tier.close()


def test_a_mixed_tier_keeps_fp32_masters_for_fp32_subgroups(nvme_dir):
    """remainders=True on a tier holding an fp32 subgroup (a norm) beside bf16 ones: the fp32
    one keeps its fp32 master (and on_commit gives it), the bf16 ones remainders; all bitwise
    the direct steps, resident and on nvme."""
    numels, flags = [300, 5000, 700], [False, True, True]
    config = dict(remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    states = start_states(numels, config, seed=8, fp32_subgroups=(2,))
    params = model_params(states)
    assert [p.dtype for p in params] == [BF16, BF16, F32]
    tier = new_tier(numels, flags, nvme_dir, params=params, **config)
    try:
        load(tier, states)
        for step in range(1, 4):
            grads = make_grads(numels, seed=step)
            steps = {sg: (g, inputs(step)) for sg, g in enumerate(grads)}
            seen = {}

            def on_commit(sg, views):
                seen[sg] = set(views)
                committer(params, steps)(sg, views)
                if sg == 2:
                    params[2].copy_(views["param"])

            tier.stepping.finish(steps, on_commit=on_commit)
            assert seen == {0: {"param_copy"}, 1: {"param_copy"}, 2: {"param", "param_copy"}}
            for s, g in zip(states, grads):
                ref_step(s, g, inputs(step))
            assert_matches(tier, states, params, f"step {step}")
    finally:
        tier.close()


def test_remainders_on_a_tier_without_bf16_params_change_nothing():
    """An fp32 model (no copy dtype) with remainders=True: fp32 masters, a plain tier's layout
    and bits (store_param_remainders on such a model is a no-op, not an error)."""
    n = 2 * SLOT
    params = [torch.zeros(n), torch.zeros(n)]
    states = start_states([n, n], {}, seed=6)
    with ExitStack() as stack:
        rem = new_tier([n, n], copy_dtype=None, remainders=True, params=params)
        stack.callback(rem.close)
        plain = new_tier([n, n], copy_dtype=None)
        stack.callback(plain.close)
        assert rem.bank_bytes == plain.bank_bytes and rem.io_bytes == plain.io_bytes
        for tier in (rem, plain):
            load(tier, states)
        grads = make_grads([n, n], seed=2)
        for tier in (rem, plain):
            tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(grads)})
        for s, g in zip(states, grads):
            ref_step(s, g, inputs(1))
        assert_matches(rem, states, params, "fp32 tier with remainders=True")
        assert all(torch.equal(p, torch.zeros(n)) for p in params)  # the model is not written


class _Event:
    def __init__(self, fill):
        self.fill, self.done = fill, False

    def query(self):
        return self.done

    def synchronize(self):
        self.complete()

    def complete(self):
        if not self.done:
            self.done = True
            self.fill()


class _Stager:
    """Stands in for the CUDA side stream: copies happen when the test completes their events."""

    def __init__(self):
        self.events = []

    def copy(self, fill):
        self.events.append(_Event(fill))
        return self.events[-1]


def test_an_nvme_step_waits_for_the_high_half_copy_before_its_tasks_go(nvme_dir):
    """The high half reaches the read bank by an asynchronous copy on CUDA: the step's tasks go
    to the worker only once it has landed (a no-op task holds them back in the copy queue)."""
    n = 3 * SLOT
    config = dict(remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    states = start_states([n], config, seed=4)
    params = model_params(states)
    tier = new_tier([n], [True], nvme_dir, params=params, staging_slots=4, **config)
    try:
        load(tier, states)
        tier.io.set_remote_gather(False)
        stager = _Stager()
        tier.io.use_stager(stager)
        sent, send = [], tier.client.send

        def logged(task, gather=()):
            sent.append(task.op)
            return send(task, gather)

        tier.client.send = logged
        grad = make_grads([n], seed=9)[0]
        assert tier.stepping.speculate(0, grad, inputs(1))
        assert len(stager.events) == 4  # the high half, then three pieces of grads
        for ev in stager.events[1:]:
            ev.complete()
        tier.io.poll()
        assert proto.OP_STEP not in sent and proto.OP_PING not in sent  # held behind the high half
        stager.events[0].complete()
        tier.io.poll()
        assert sent.count(proto.OP_STEP) == 3 and sent.index(proto.OP_PING) < sent.index(proto.OP_STEP)
        steps = {0: (grad, inputs(1))}
        assert tier.stepping.finish(steps, on_commit=committer(params, steps)) == {0: "committed"}
        ref_step(states[0], grad, inputs(1))
        assert_matches(tier, states, params, "after the async high half")
    finally:
        tier.close()


@pytest.mark.gpu
def test_cuda_params_and_grads_with_remainders_match_the_direct_steps(nvme_dir):
    """CUDA bf16 params and grads (pinned arena): the nvme subgroups' high halves travel D2H on
    the side stream, load_state writes the params H2D, the commit copies them back — and every
    bit is still the CPU direct steps' (the host kernel does the arithmetic)."""
    dev = torch.device("cuda")
    numels, flags = [3 * SLOT + 5, 2 * SLOT, 700], [True, False, True]
    config = dict(remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, amsgrad=True)
    states = start_states(numels, config, seed=21)
    params = [p.to(dev) for p in model_params(states)]
    tier = new_tier(
        numels,
        flags,
        nvme_dir,
        params=params,
        grad_dtype=BF16,
        io_banks=2,
        staging_slots=4,
        pin=dev,
        **config,
    )
    try:
        load(tier, states)
        for step in range(1, 6):
            grads = [g.to(dev) for g in make_grads(numels, BF16, seed=50 + step)]
            inp = inputs(step, amsgrad=True)
            final = inputs(step, amsgrad=True, grad_scale=0.5) if step == 3 else inp
            for sg, g in enumerate(grads):
                tier.stepping.speculate(sg, g, inp, wait=False)
            steps = {sg: (g, final) for sg, g in enumerate(grads)}
            tier.stepping.finish(steps, overflow=step == 4, on_commit=committer(params, steps))
            if step != 4:
                for s, g in zip(states, grads):
                    ref_step(s, g.cpu(), final)
            assert_matches(tier, states, [p.cpu() for p in params], f"step {step}")
    finally:
        tier.close()


# ------------------------------------------------------------------ 6. through HybridAdamW
def _model(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(BF16)) for s in ((64, 48), (48,), (33, 17))]


def _stream_grads(params, step):
    g = torch.Generator().manual_seed(500 + step)
    return [(torch.randn(p.shape, generator=g) * (8.0 if step % 3 == 1 else 0.01)).to(BF16) for p in params]


def test_every_placement_steps_the_same_bits_through_clipping_overflow_and_a_killed_worker(
    monkeypatch, nvme_dir
):
    """HybridAdamW with bf16 moments + remainders at offload 0 (device tier, in-process kernel),
    1 (host, speculated in backward) and nvme 1: one grad stream through autograd, a clip that
    bites every third step (speculated steps redone), a GradScaler overflow (rolled back: the
    state equals the one before, bitwise) and, on the host and nvme runs, a worker killed with
    SIGKILL mid-step — params, decoded masters and moments stay torch.equal across the three."""
    from hybrid_opt import HybridAdamW, fp32_master

    monkeypatch.setenv(FAULT_ENV, "mid_step:4")
    placements = {
        "device": dict(offload_fraction=0.0),
        "host": dict(offload_fraction=1.0, speculative=True),
        "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme_dir, speculative=True),
    }
    runs, opts, scalers = {}, {}, {}
    try:
        for name, kw in placements.items():
            runs[name] = _model(7)
            opts[name] = HybridAdamW(
                runs[name],
                lr=1e-2,
                weight_decay=0.05,
                max_grad_norm=1.0,
                subgroup_numel=1024,
                exp_avg_dtype=BF16,
                exp_avg_sq_dtype=BF16,
                store_param_remainders=True,
                **kw,
            )
            scalers[name] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
            opts[name].attach_grad_scaler(scalers[name])
        nvme = debug_view(opts["nvme"])
        assert debug_view(opts["host"]).host is not None and all(
            nvme.on_nvme(sg) for sg in nvme.host_subgroups()
        )
        assert debug_view(opts["device"]).host is None
        assert all(debug_view(opts["host"]).host.banks.remainders.values()) and all(
            debug_view(opts["nvme"]).host.banks.remainders.values()
        )
        for step in range(9):
            for name, params in runs.items():
                opt, scaler = opts[name], scalers[name]
                opt.zero_grad()
                handle = None
                if step == 5:  # one inf in one grad: the whole step is skipped
                    handle = params[0].register_hook(
                        lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                    )
                # cloned: the device tier's state_dict gives views of its live state
                before = (
                    {i: {k: t.clone() for k, t in st.items()} for i, st in opt.state_dict()["state"].items()}
                    if step == 5
                    else None
                )
                loss = sum((p.float() * g.float()).sum() for p, g in zip(params, _stream_grads(params, step)))
                scaler.scale(loss).backward()
                if handle is not None:
                    handle.remove()
                scaler.step(opt)
                scaler.update()
                assert opt.step_was_skipped == (step == 5), (name, step)
                if before is not None:
                    after = opt.state_dict()["state"]
                    for i in before:
                        for key, t in before[i].items():
                            assert torch.equal(after[i][key], t), (name, i, key)
            sds = {name: o.state_dict()["state"] for name, o in opts.items()}
            for i in range(3):
                assert torch.equal(runs["host"][i], runs["device"][i]), (step, i)
                assert torch.equal(runs["nvme"][i], runs["device"][i]), (step, i)
                # the master as the tiers keep it: its int16 low half (the param is its high half)
                for key in ("master_remainder", "exp_avg", "exp_avg_sq"):
                    assert sds["device"][i][key].dtype == (torch.int16 if key == "master_remainder" else BF16)
                    for name in ("host", "nvme"):
                        assert torch.equal(sds[name][i][key], sds["device"][i][key]), (step, name, i, key)
                for name in ("host", "nvme"):  # so the decoded masters are equal
                    assert torch.equal(
                        fp32_master(sds[name][i], runs[name][i]),
                        fp32_master(sds["device"][i], runs["device"][i]),
                    ), (step, name, i)
        for name in ("host", "nvme"):
            assert debug_view(opts[name]).host_stats["worker_restarts"] >= 1, name
            assert debug_view(opts[name]).host_stats["redone"] > 0, name
    finally:
        for o in opts.values():
            o.close()


# ------------------------------------------------------------------ 7. mixed dtypes, bytes
def _mixed_model(seed):
    """bf16 weights beside fp32 params (norms, biases): a host tier holding both keeps fp32
    masters for the fp32 subgroups and remainders for the bf16 ones (its "some" layout)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g).to(dt))
        for s, dt in (((64, 48), BF16), ((48,), F32), ((33, 17), BF16), ((500,), BF16), ((20,), F32))
    ]


def test_a_mixed_fp32_bf16_model_with_amsgrad_steps_the_same_bits_at_every_placement(nvme_dir):
    """bf16 weights with remainders beside fp32 params on the same host tier, amsgrad, bf16
    moments, one param without a grad every other step (its subgroup stepped in runs), a clip
    that bites every third step (speculated steps redone), a GradScaler overflow (state before
    == after): host, nvme and a device/host/nvme mix equal the device tier bit for bit (params,
    masters, moments), and every master equals an fp32-master run's (remainders are lossless;
    the grads do not depend on the params, so the runs see the same grads)."""
    from hybrid_opt import HybridAdamW

    placements = {
        "device": dict(offload_fraction=0.0),
        "host": dict(offload_fraction=1.0, speculative=True),
        "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme_dir, speculative=True),
        "mix": dict(offload_fraction=0.7, nvme_fraction=0.35, nvme_path=nvme_dir, speculative=True),
        "fp32_master": dict(offload_fraction=1.0, speculative=True),
    }
    runs, opts, scalers = {}, {}, {}
    try:
        for name, kw in placements.items():
            runs[name] = _mixed_model(3)
            opts[name] = HybridAdamW(
                runs[name],
                lr=1e-2,
                weight_decay=0.05,
                max_grad_norm=1.0,
                amsgrad=True,
                subgroup_numel=512,
                exp_avg_dtype=BF16,
                exp_avg_sq_dtype=BF16,
                store_param_remainders=name != "fp32_master",
                **kw,
            )
            scalers[name] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
            opts[name].attach_grad_scaler(scalers[name])
        for name in ("host", "nvme", "mix"):  # both kinds of master on one tier
            assert set(debug_view(opts[name]).host.banks.remainders.values()) == {True, False}, name
        assert set(opts["mix"].plan.tiers) == {"device", "host", "nvme"}
        for step in range(8):
            for name, params in runs.items():
                opt, scaler = opts[name], scalers[name]
                opt.zero_grad()
                grads = _stream_grads(params, step)
                live = [i for i in range(len(params)) if not (i == 3 and step % 2 == 0)]
                handle = None
                if step == 5:  # one inf in one grad: the whole step is skipped
                    handle = params[2].register_hook(
                        lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                    )
                    before = {
                        i: {k: t.clone() for k, t in st.items()}
                        for i, st in opt.state_dict()["state"].items()
                    }
                loss = sum((params[i].float() * grads[i].float()).sum() for i in live)
                scaler.scale(loss).backward()
                if handle is not None:
                    handle.remove()
                scaler.step(opt)
                scaler.update()
                assert opt.step_was_skipped == (step == 5), (name, step)
                if step == 5:
                    after = opt.state_dict()["state"]
                    for i in before:
                        for key, t in before[i].items():
                            assert torch.equal(after[i][key], t), (name, i, key)
            sds = {name: o.state_dict()["state"] for name, o in opts.items()}
            # every bf16 master as fp32: the remainder runs' decoded with their params
            masters = {name: with_fp32_masters(sd, runs[name]) for name, sd in sds.items()}
            for i, p in enumerate(runs["device"]):
                for name in ("host", "nvme", "mix"):
                    assert torch.equal(runs[name][i], p), (step, name, i)
                if i in sds["device"]:  # a bf16 param's master as the tier keeps it
                    assert ("master_remainder" in sds["device"][i]) == (p.dtype == BF16), (step, i)
                for name in ("host", "nvme", "mix"):  # a param with no grad yet has none
                    assert set(sds[name].get(i, {})) == set(sds["device"].get(i, {})), (step, name, i)
                assert set(masters["fp32_master"].get(i, {})) == set(masters["device"].get(i, {})), (step, i)
                for key, t in sds["device"].get(i, {}).items():
                    for name in ("host", "nvme", "mix"):
                        assert torch.equal(sds[name][i][key], t), (step, name, i, key)
                for key, t in masters["device"].get(i, {}).items():
                    if key != "master_param" or p.dtype == BF16:
                        assert torch.equal(masters["fp32_master"][i][key], t), (step, i, key)
        for name in ("host", "nvme", "mix"):
            assert debug_view(opts[name]).host_stats["redone"] > 0, name
    finally:
        for o in opts.values():
            o.close()


@pytest.mark.parametrize("model", [BF16, F32], ids=["bf16_model", "fp32_model"])
def test_the_cost_models_bytes_per_param_are_what_the_host_tier_allocates(nvme_dir, model):
    """`hybrid-opt plan` and the scheduler count Workload.tier_bytes() (StateFormat): a host
    tier built as the optimizer builds it for a model of one dtype (copy dtype: a bf16 model's
    own, none for fp32) allocates exactly the "host" bytes per element in every bank
    (committed, spare and nvme I/O alike) and the "nvme" bytes in each slot of a swap file."""
    from hybrid_opt.placement.cost_model import Workload

    n = 1 << 16  # every region a whole number of pages: the bytes are exact
    moments = [(F32, F32), (BF16, BF16)] + ([(BF16, F32)] if _independent_moment_dtypes() else [])
    size = torch.empty((), dtype=model).element_size()
    for (m, v), rem, amsgrad in [(mv, r, a) for mv in moments for r in (False, True) for a in (False, True)]:
        want = Workload(
            params=1e9,
            model_bytes=size,
            grad_bytes=size,
            amsgrad=amsgrad,
            state_format=StateFormat(m, v, rem),
        ).tier_bytes()
        params = [torch.zeros(n, dtype=model) for _ in range(2)]
        tier = HostTier(
            [n, n],
            grad_dtype=model,
            exp_avg_dtype=m,
            exp_avg_sq_dtype=v,
            remainders=rem,
            params=params,
            copy_dtype=None if model == F32 else model,
            amsgrad=amsgrad,
            nvme=[False, True],
            nvme_path=nvme_dir,
            spare_banks=1,
            io_banks=1,
            timeout_s=TIMEOUT_S,
        )
        try:
            what = (m, v, rem, amsgrad)
            assert tier.bank_bytes == n * want["host"], what  # one resident subgroup
            assert tier.spare_bytes == 3 * n * want["host"], what  # a spare + two io banks
            assert tier.io_bytes == n * want["nvme"], what
            assert os.path.getsize(tier.swap.file(1)) == 2 * n * want["nvme"], what
        finally:
            tier.close()
