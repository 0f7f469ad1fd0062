"""cpu_kernels against its fp64 references, torch.optim and torch's casts, at every SIMD level.

What is exact is asserted with torch.equal (bank mode vs in place, thread counts, SIMD
levels for grad_stats, param_copy vs torch's cast, bf16 moments vs the fp32 result
rounded); everything else with the per-dtype tolerances of tests/tolerances.py.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import _id
from tolerances import RTOL, assert_close

import cpu_kernels as ck
from cpu_kernels import adam_inverse_reference, adam_step_reference, grad_stats_reference

LEVELS = ck.available_simd_levels()
SIZES = (1, 15, 16, 17, 4099)
BIG = 1_000_003  # spans many 2048-element blocks and every thread's range
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COPY_DTYPES = (torch.bfloat16, torch.float16)
GRAD_SCALE = 0.7 / 1024  # 1/loss_scale x clip coefficient
HYPER = dict(step=7, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the `simd` fixture (every SIMD level this CPU offers) is in conftest.py
pytestmark = pytest.mark.usefixtures("restore_kernel_threads")


# ----------------------------------------------------------------------------- helpers
def make_state(n, grad_dtype=torch.float32, *, amsgrad=False, moment_dtype=torch.float32, seed=0):
    """A mid-training state: non-zero moments, loss-scaled grads, max_exp_avg_sq above v for
    about half the elements (so both branches of the amsgrad max are taken)."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1024).to(grad_dtype)
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-2
    vmax = exp_avg_sq * 2 * torch.rand(n, generator=gen) if amsgrad else None
    exp_avg, exp_avg_sq = exp_avg.to(moment_dtype), exp_avg_sq.to(moment_dtype)
    if vmax is not None:
        vmax = vmax.to(moment_dtype)
    return dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=vmax)


def _clone(state):
    return {k: (t.clone() if t is not None else None) for k, t in state.items()}


def _filled(like, offset=0):
    """An output buffer poisoned with NaN (so an unwritten element shows), starting
    `offset` elements into its storage (so it is not 64-byte aligned when offset > 0)."""
    return torch.full((like.numel() + offset,), float("nan"), dtype=like.dtype)[offset:]


def run_adam(state, *, bank, param_copy_dtype=None, out_offset=0, **hyper):
    """One adam_step_ on a clone of `state`. Returns (new (param, m, v, vmax), param_copy,
    the clone of the inputs as they are after the call)."""
    s = _clone(state)
    ams = s["max_exp_avg_sq"] is not None
    out = None
    if bank:
        out = tuple(
            _filled(s[k], out_offset)
            for k in ("param", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())
        )
    copy = _filled(s["param"].to(param_copy_dtype)) if param_copy_dtype else None
    ret = ck.adam_step_(
        s["param"],
        s["grad"],
        s["exp_avg"],
        s["exp_avg_sq"],
        max_exp_avg_sq=s["max_exp_avg_sq"],
        param_copy=copy,
        out=out,
        **hyper,
    )
    if bank:
        assert ret is out[0]
        new = out + (None,) * (4 - len(out))
    else:
        assert ret is s["param"]
        new = (s["param"], s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"])
    return new, copy, s


def reference(state, **hyper):
    """fp64 reference on the values the kernel sees (grads widened to fp32 exactly)."""
    return adam_step_reference(
        state["param"],
        state["grad"].float(),
        state["exp_avg"],
        state["exp_avg_sq"],
        max_exp_avg_sq=state["max_exp_avg_sq"],
        **hyper,
    )


def assert_matches_reference(new, ref, moment_dtype=torch.float32):
    names = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    for k, (got, want) in enumerate(zip(new, ref)):
        if want is None:
            assert got is None
            continue
        dtype = torch.float32 if k == 0 else moment_dtype
        assert got.dtype == dtype
        assert_close(got, want, dtype=dtype, msg=f"{names[k]} differs from the fp64 reference")


def assert_bitwise_equal(a, b, what):
    """torch.equal, plus a view as integers so -0.0 vs +0.0 would also show."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    assert torch.equal(a.view(ints), b.view(ints)), f"{what}: not bitwise equal"


# ------------------------------------------------------------------ adam_step_ vs fp64
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("grad_scale", [GRAD_SCALE, -GRAD_SCALE], ids=["scaled", "maximize"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_id)
def test_adam_step_matches_fp64_reference(simd, grad_dtype, grad_scale, decoupled, amsgrad, bank, n):
    state = make_state(n, grad_dtype, amsgrad=amsgrad, seed=n)
    hyper = dict(HYPER, decoupled=decoupled, grad_scale=grad_scale)
    new, _, _ = run_adam(state, bank=bank, **hyper)
    assert_matches_reference(new, reference(state, **hyper))


# The big size for a subset: every level x grad dtype, two opposite corners of the rest.
@pytest.mark.parametrize(
    "decoupled,amsgrad,bank,grad_scale",
    [(True, False, False, GRAD_SCALE), (False, True, True, -GRAD_SCALE)],
    ids=["adamw-in_place", "l2-amsgrad-bank-maximize"],
)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_id)
def test_adam_step_matches_fp64_reference_on_a_million_elements(
    simd, grad_dtype, decoupled, amsgrad, bank, grad_scale
):
    state = make_state(BIG, grad_dtype, amsgrad=amsgrad, seed=1)
    hyper = dict(HYPER, decoupled=decoupled, grad_scale=grad_scale)
    new, _, _ = run_adam(state, bank=bank, **hyper)
    assert_matches_reference(new, reference(state, **hyper))


def test_adam_step_on_empty_tensors_is_a_no_op():
    state = make_state(0, amsgrad=True)
    new, _, _ = run_adam(state, bank=False, **HYPER)
    assert all(t.numel() == 0 for t in new)


def test_adam_step_first_step_from_zero_state_matches_reference(simd):
    n = 4099
    state = make_state(n, torch.bfloat16, amsgrad=True)
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        state[k].zero_()
    hyper = dict(HYPER, step=1, grad_scale=GRAD_SCALE)
    new, _, _ = run_adam(state, bank=False, **hyper)
    assert_matches_reference(new, reference(state, **hyper))


# ------------------------------------------------------------------------ bf16 moments
BF16_MOMENT_CASES = [
    (d, a, b, n) for n in (17, 4099) for d in (True, False) for a in (False, True) for b in (False, True)
] + [(True, False, False, BIG), (False, True, True, BIG)]


@pytest.mark.parametrize(
    "decoupled,amsgrad,bank,n",
    BF16_MOMENT_CASES,
    ids=[
        f"{'adamw' if d else 'l2'}-{'amsgrad' if a else 'adam'}-{'bank' if b else 'in_place'}-{n}"
        for d, a, b, n in BF16_MOMENT_CASES
    ],
)
def test_bf16_moments_match_reference_within_bf16_tolerance(simd, decoupled, amsgrad, bank, n):
    state = make_state(n, torch.bfloat16, amsgrad=amsgrad, moment_dtype=torch.bfloat16, seed=n)
    hyper = dict(HYPER, decoupled=decoupled, grad_scale=GRAD_SCALE)
    new, _, _ = run_adam(state, bank=bank, **hyper)
    ref = reference(state, **hyper)
    # the param update uses the fp32 moments before they are rounded: fp32 accuracy
    assert_close(new[0], ref[0], dtype=torch.float32, msg="param")
    for got, want in zip(new[1:], ref[1:]):
        if want is not None:
            assert got.dtype == torch.bfloat16
            assert_close(got, want, dtype=torch.bfloat16)


@pytest.mark.parametrize("n", [17, 4099, BIG])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_bf16_moments_are_the_fp32_result_rounded_to_nearest_even(simd, amsgrad, bank, n):
    """The same step on the same values held in fp32 gives the fp32 moments; the bf16 run
    must store exactly torch's (round-to-nearest-even) cast of them, and the same param."""
    state16 = make_state(n, torch.float16, amsgrad=amsgrad, moment_dtype=torch.bfloat16, seed=3)
    state32 = {
        k: (t.float() if k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and t is not None else t)
        for k, t in state16.items()
    }
    hyper = dict(HYPER, decoupled=False, grad_scale=GRAD_SCALE)
    new16, _, _ = run_adam(state16, bank=bank, **hyper)
    new32, _, _ = run_adam(state32, bank=bank, **hyper)
    assert_bitwise_equal(new16[0], new32[0], "param (bf16 moments vs fp32 moments)")
    for name, got, fp32 in zip(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), new16[1:], new32[1:]):
        if fp32 is not None:
            assert_bitwise_equal(got, fp32.to(torch.bfloat16), f"{name} vs the fp32 value cast RNE")


@pytest.mark.parametrize("n", [17, 4099])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("bf16_moment", ["exp_avg", "exp_avg_sq"])
def test_one_bf16_moment_beside_an_fp32_one_is_the_fp32_step_with_that_moment_rounded(
    simd, bf16_moment, amsgrad, bank, n
):
    """exp_avg and exp_avg_sq in different dtypes (max_exp_avg_sq in exp_avg_sq's): the same
    step on the same values held all in fp32 gives the same param and fp32 moment bits, and
    the bf16 moment(s) exactly torch's cast of the fp32 ones."""
    bf16_names = ("exp_avg",) if bf16_moment == "exp_avg" else ("exp_avg_sq", "max_exp_avg_sq")
    state = make_state(n, torch.bfloat16, amsgrad=amsgrad, moment_dtype=torch.bfloat16, seed=n + 1)
    mixed = {
        k: (t.float() if k not in bf16_names and k != "grad" and t is not None else t)
        for k, t in state.items()
    }
    fp32 = {k: (t.float() if k != "grad" and t is not None else t) for k, t in state.items()}
    hyper = dict(HYPER, decoupled=True, grad_scale=GRAD_SCALE)
    new_mixed, _, _ = run_adam(mixed, bank=bank, **hyper)
    new32, _, _ = run_adam(fp32, bank=bank, **hyper)
    assert_bitwise_equal(new_mixed[0], new32[0], "param (mixed moments vs fp32 moments)")
    for name, got, want in zip(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), new_mixed[1:], new32[1:]):
        if want is None:
            continue
        if name in bf16_names:
            assert got.dtype == torch.bfloat16, name
            assert_bitwise_equal(got, want.to(torch.bfloat16), f"{name} vs the fp32 value cast RNE")
        else:
            assert got.dtype == torch.float32, name
            assert_bitwise_equal(got, want, f"{name} vs the all-fp32 step")


# ------------------------------------------------------------------------- param_copy
@pytest.mark.parametrize("n", [1, 17, 4099, BIG])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("copy_dtype", COPY_DTYPES, ids=_id)
def test_param_copy_is_bitwise_torchs_cast_of_the_new_param(simd, copy_dtype, bank, n):
    state = make_state(n, torch.bfloat16, amsgrad=bank, seed=5)
    state["param"][:: max(1, n // 7)] *= 1e5  # past fp16's range: must become inf
    state["param"][n // 2] = float("-inf")
    new, copy, _ = run_adam(
        state, bank=bank, param_copy_dtype=copy_dtype, **dict(HYPER, grad_scale=GRAD_SCALE)
    )
    assert not torch.isnan(new[0]).any()
    assert_bitwise_equal(copy, new[0].to(copy_dtype), "param_copy vs param_after.to(dtype)")


def _rounding_edge_values(n=4099, seed=0):
    """Random fp32 bit patterns (NaN excluded), exact bf16 and fp16 ties, fp16 subnormals,
    the overflow thresholds of both formats, infinities and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[100:612] = (torch.randint(0, 2**15, (512,), generator=gen, dtype=torch.int32) << 16) | 0x8000
    fp16_range = (0x33000000 >> 13, 0x47800000 >> 13)  # from fp16's smallest subnormal to inf
    bits[700:1212] = (torch.randint(*fp16_range, (512,), generator=gen, dtype=torch.int32) << 13) | 0x1000
    x = bits.view(torch.float32).clone()
    specials = torch.tensor(
        [
            float("inf"),
            -float("inf"),
            0.0,
            -0.0,
            65504.0,
            65519.996,
            65520.0,
            -65520.0,
            3.3895314e38,
            3.3961776e38,
            torch.finfo(torch.float32).max,
            5.9604645e-8,
            2.9802322e-8,
            2.9802326e-8,
            6.1035156e-5,
            6.097555e-5,
            1e-45,
            -1e-45,
            1.1754942e-38,
        ]
    )
    x[1300 : 1300 + len(specials)] = specials
    x[torch.isnan(x)] = 1.0
    return x


@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("copy_dtype", COPY_DTYPES, ids=_id)
def test_param_copy_rounds_ties_subnormals_and_overflow_like_torch(simd, copy_dtype, bank):
    """lr=0 and zero moments keep the param exactly as injected, so the copy sees every
    rounding edge case (ties to even, subnormals, overflow to inf) in vector and tail code."""
    x = _rounding_edge_values()
    n = x.numel()
    state = dict(
        param=x, grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), max_exp_avg_sq=None
    )
    new, copy, _ = run_adam(
        state, bank=bank, param_copy_dtype=copy_dtype, **dict(HYPER, lr=0.0, weight_decay=0.0)
    )
    assert_bitwise_equal(new[0], x, "param with lr=0")
    assert_bitwise_equal(copy, new[0].to(copy_dtype), "param_copy vs param_after.to(dtype)")


# ---------------------------------------------------------------------------- bank mode
def check_bank_mode_matches_in_place(n, moment_dtype, amsgrad, out_offset):
    """Bank mode leaves every input bitwise unchanged and writes exactly the in-place result."""
    state = make_state(n, torch.bfloat16, amsgrad=amsgrad, moment_dtype=moment_dtype, seed=7)
    hyper = dict(HYPER, decoupled=not amsgrad, grad_scale=GRAD_SCALE)
    banked, banked_copy, inputs_after = run_adam(
        state, bank=True, param_copy_dtype=torch.bfloat16, out_offset=out_offset, **hyper
    )
    for name, t in state.items():
        if t is not None:
            assert_bitwise_equal(inputs_after[name], t, f"bank mode changed input {name}")
    in_place, in_place_copy, _ = run_adam(state, bank=False, param_copy_dtype=torch.bfloat16, **hyper)
    assert len([t for t in banked if t is not None]) == (4 if amsgrad else 3)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), banked, in_place):
        if b is not None:
            assert_bitwise_equal(a, b, f"{name}: bank mode vs in place")
    assert_bitwise_equal(banked_copy, in_place_copy, "param_copy: bank mode vs in place")


@pytest.mark.parametrize("n", [17, 4099, BIG])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_bank_mode_leaves_inputs_bitwise_unchanged_and_matches_in_place(simd, moment_dtype, amsgrad, n):
    check_bank_mode_matches_in_place(n, moment_dtype, amsgrad, out_offset=0)


@pytest.mark.parametrize("level", LEVELS)
def test_bank_mode_with_misaligned_out_views_matches_in_place(level):
    """Out tensors that are views at odd offsets into a larger buffer (as a flat state bank
    hands out). Run in a child process: a crash there fails this test instead of the run."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "import torch, cpu_kernels as ck, test_cpu_kernels as t\n"
        f"ck.set_simd_level({level!r})\n"
        "for n in (17, 4099):\n"
        "    for md in (torch.float32, torch.bfloat16):\n"
        "        for ams in (False, True):\n"
        "            for off in (1, 4, 8, 15):\n"
        "                t.check_bank_mode_matches_in_place(n, md, ams, off)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"


# ------------------------------------------------------------------ thread-count invariance
ADAM_CONFIGS = {
    "fp32-in_place": dict(
        grad_dtype=torch.float32,
        moment_dtype=torch.float32,
        amsgrad=False,
        bank=False,
        copy=None,
        decoupled=True,
    ),
    "bf16grad-bank-copy": dict(
        grad_dtype=torch.bfloat16,
        moment_dtype=torch.float32,
        amsgrad=True,
        bank=True,
        copy=torch.bfloat16,
        decoupled=True,
    ),
    "fp16grad-bf16moments-l2": dict(
        grad_dtype=torch.float16,
        moment_dtype=torch.bfloat16,
        amsgrad=True,
        bank=False,
        copy=torch.float16,
        decoupled=False,
    ),
}


@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_adam_step_is_bitwise_identical_for_any_thread_count(simd, config):
    c = ADAM_CONFIGS[config]
    state = make_state(BIG, c["grad_dtype"], amsgrad=c["amsgrad"], moment_dtype=c["moment_dtype"], seed=11)
    hyper = dict(HYPER, decoupled=c["decoupled"], grad_scale=GRAD_SCALE)
    results = {}
    for threads in (1, 2, 3):
        ck.set_num_threads(threads)
        assert ck.get_num_threads() == threads
        results[threads] = run_adam(state, bank=c["bank"], param_copy_dtype=c["copy"], **hyper)
    (new1, copy1, _) = results[1]
    for threads in (2, 3):
        new, copy, _ = results[threads]
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), new, new1):
            if b is not None:
                assert_bitwise_equal(a, b, f"{name}: {threads} threads vs 1")
        if copy1 is not None:
            assert_bitwise_equal(copy, copy1, f"param_copy: {threads} threads vs 1")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 45, 4 * 16384 + 45], ids=["1", "45", "4_chunks_and_45"])
def test_bandwidth_probes_write_every_element_and_the_bank_probe_leaves_its_inputs(simd, n, threads):
    """The roofline probes (bench_cpu_adam.py's roof) cover the whole range at every level and
    thread count, tails and thread chunks included, and the bank probe writes only `out`."""
    ck.set_num_threads(threads)
    g = torch.Generator().manual_seed(3)
    p, grad, m, v = (torch.rand(n, generator=g) for _ in range(4))
    ins = [t.clone() for t in (p, grad, m, v)]
    out = tuple(torch.full((n,), float("nan")) for _ in range(3))
    ck.bandwidth_probe_bank_(p, grad, m, v, out)
    assert all(torch.equal(a, b) for a, b in zip((p, grad, m, v), ins))
    for split in ("chunks", "contiguous"):
        state = [t.clone() for t in (p, grad, m, v)]
        ck.bandwidth_probe_(*state, split=split)
        for new, old, written in zip((state[0], state[2], state[3]), (ins[0], ins[2], ins[3]), out):
            assert not torch.isnan(written).any()
            assert_close(new, old * 0.999 + ins[1], dtype=torch.float32)  # every element written
            assert_close(written, old * 0.999 + ins[1], dtype=torch.float32)
    with pytest.raises(ValueError, match="split must be"):
        ck.bandwidth_probe_(p, grad, m, v, split="halves")


def _xor16(tensors) -> int:
    """The XOR of every 16-bit word of the tensors (what the pattern probe returns)."""
    words = torch.cat([t.view(torch.int16) for t in tensors]).numpy()
    return int(np.bitwise_xor.reduce(words)) & 0xFFFF


def _int_view(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 45, 4 * 16384 + 45], ids=["1", "45", "4_chunks_and_45"])
def test_bandwidth_probe_pattern_reads_updates_and_writes_every_element_of_its_streams(simd, n, threads):
    """The per-pattern roofline probe (bench_cpu_adam.py's roof of each row) moves every element
    of every stream at every level and thread count, in both splits: it returns the XOR of the
    read streams' 16-bit words, adds one to each updated element (as an integer of its width),
    sets every written element's bytes to 0xFF, and leaves the read streams as they were."""
    ck.set_num_threads(threads)
    g = torch.Generator().manual_seed(5)
    read = [
        torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=g).view(torch.bfloat16),
        torch.rand(n, generator=g),
    ]
    update = [
        torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g),
        torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=g),
        torch.rand(n, generator=g),
    ]
    read0, update0 = [_int_view(t).clone() for t in read], [_int_view(t).clone() for t in update]
    runs = (("chunks", 1024), ("contiguous", 2048), ("chunks", 0))
    for split, prefetch in runs:
        write = [torch.zeros(n, dtype=torch.int16)]
        write_nt = [torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)]
        got = ck.bandwidth_probe_pattern_(
            read=read, update=update, write=write, write_nt=write_nt, split=split, prefetch=prefetch
        )
        assert got == _xor16(read), split
        assert all(bool((_int_view(t) == -1).all()) for t in write + write_nt), split
    assert all(torch.equal(_int_view(t), t0) for t, t0 in zip(read, read0))
    for t, t0 in zip(update, update0):  # each probe +1 with the width's wrap-around
        assert torch.equal(_int_view(t), t0 + len(runs)), t.dtype


def test_bandwidth_probe_pattern_error_inputs():
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at least one stream"):
        ck.bandwidth_probe_pattern_()
    with pytest.raises(ValueError, match="split must be"):
        ck.bandwidth_probe_pattern_(read=[a], split="halves")
    with pytest.raises(ValueError, match="prefetch must be"):
        ck.bandwidth_probe_pattern_(read=[a], prefetch=-1)
    with pytest.raises(ValueError, match="expected 64"):
        ck.bandwidth_probe_pattern_(read=[a], update=[torch.zeros(65)])
    with pytest.raises(TypeError, match="dtype"):
        ck.bandwidth_probe_pattern_(read=[torch.zeros(64, dtype=torch.float64)])
    with pytest.raises(ValueError, match="overlaps"):
        ck.bandwidth_probe_pattern_(read=[a], update=[a])
    with pytest.raises(ValueError, match="at most 12"):
        ck.bandwidth_probe_pattern_(read=[b] * 13)
    assert ck.bandwidth_probe_pattern_(read=[a, a]) == 0  # reads may share bytes


# --------------------------------------------------------------------------- grad_stats
@pytest.mark.parametrize("n", [1, 15, 16, 17, 4099, 16384 * 5 + 77, BIG])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=_id)
def test_grad_stats_matches_fp64_reference(simd, dtype, n):
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 300).to(dtype)
    total, finite = ck.grad_stats(grad)
    ref_total, ref_finite = grad_stats_reference(grad)
    assert isinstance(total, float) and isinstance(finite, bool)
    assert finite is True and ref_finite is True
    assert math.isclose(total, ref_total, rel_tol=1e-12), (total, ref_total)


def test_grad_stats_of_an_empty_grad_is_zero_and_finite():
    assert ck.grad_stats(torch.empty(0)) == (0.0, True)


def test_grad_stats_keeps_the_largest_finite_values_finite(simd):
    for dtype in GRAD_DTYPES:
        grad = torch.full((16384 * 2 + 5,), torch.finfo(dtype).max, dtype=dtype)
        total, finite = ck.grad_stats(grad)
        assert finite is True and math.isfinite(total)
        assert math.isclose(total, grad_stats_reference(grad)[0], rel_tol=1e-12)


NON_FINITE_N = 16384 * 2 + 37  # three chunks, the last one with a 5-element tail


@pytest.mark.parametrize(
    "position", [0, 1, 16384, NON_FINITE_N // 2, NON_FINITE_N - 5, NON_FINITE_N - 3, NON_FINITE_N - 1]
)
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=_id)
def test_grad_stats_reports_a_non_finite_element_at_any_position(simd, dtype, bad, position):
    grad = torch.randn(NON_FINITE_N, generator=torch.Generator().manual_seed(2)).to(dtype)
    grad[position] = bad
    total, finite = ck.grad_stats(grad)
    assert finite is False, f"{bad} at {position} not reported"
    assert not math.isfinite(total)


@pytest.mark.parametrize("n", [15, 17])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=_id)
def test_grad_stats_reports_a_non_finite_element_in_a_short_tail(simd, dtype, n):
    for position in range(n):
        grad = torch.ones(n, dtype=dtype)
        grad[position] = float("nan") if position % 2 else float("inf")
        assert ck.grad_stats(grad)[1] is False, f"non-finite at {position} of {n} not reported"


@pytest.mark.parametrize("n", [16384 * 5 + 77, BIG])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=_id)
def test_grad_stats_is_bitwise_identical_across_levels_and_thread_counts(dtype, n):
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(4)) * 7).to(dtype)
    saved = ck.simd_level()
    seen = {}
    try:
        for level in LEVELS:
            ck.set_simd_level(level)
            for threads in (1, 2, 3):
                ck.set_num_threads(threads)
                total, finite = ck.grad_stats(grad)
                assert finite is True
                seen[(level, threads)] = total.hex()
    finally:
        ck.set_simd_level(saved)
    assert len(set(seen.values())) == 1, seen


# ------------------------------------------------------------------------ adam_inverse_
def _ulp32(x):
    x = x.float().abs()
    return (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()


# Max ulp error of the recovered state, measured with this test's data (1_000_003 elements,
# worst over portable/avx2/avx512; worst over six other seeds in brackets):
# AdamW p 3.0 [3.5], m 2.5 [2.5], v 1.5 [1.5]; Adam (L2) p 3.0 [4.0], m 9.0 [9.0], v 3.5 [3.5].
# The bounds sit just above.
INVERSE_ULP_BOUND = {True: dict(p=5, m=4, v=2), False: dict(p=5, m=12, v=4)}


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_inverse_step_recovers_the_state_within_a_few_ulp(simd, decoupled):
    """Error in ulps of the largest fp32 value the forward step rounded at that element:
    max(|x0|, |x1|), and for m also (1 - beta1)|g|. Near-zero originals make an error in
    ulps of x0 alone unbounded (the step's own rounding happened at the larger scale)."""
    state = make_state(BIG, torch.float32, seed=21)
    hyper = dict(HYPER, decoupled=decoupled, grad_scale=GRAD_SCALE)
    p0, g, m0, v0 = state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"]
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    ck.adam_step_(p, g, m, v, **hyper)
    p1, m1, v1 = p.clone(), m.clone(), v.clone()
    ck.adam_inverse_(p, g, m, v, **hyper)
    g_eff = g.double() * GRAD_SCALE + (0.0 if decoupled else HYPER["weight_decay"] * p0.double())
    scales = dict(
        p=torch.maximum(p0.abs(), p1.abs()),
        m=torch.maximum(torch.maximum(m0.abs(), m1.abs()), ((1 - HYPER["beta1"]) * g_eff.abs()).float()),
        v=torch.maximum(v0, v1),
    )
    measured = {}
    for name, rec, orig in (("p", p, p0), ("m", m, m0), ("v", v, v0)):
        assert torch.isfinite(rec).all()
        measured[name] = ((rec.double() - orig.double()).abs() / _ulp32(scales[name])).max().item()
    bound = INVERSE_ULP_BOUND[decoupled]
    assert all(measured[k] <= bound[k] for k in bound), (
        f"max ulp error of the recovered state {measured} exceeds {bound} at {simd}"
    )
    assert (v >= 0).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_id)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_inverse_step_matches_fp64_reference(decoupled, grad_dtype, n):
    state = make_state(n, grad_dtype, seed=n)
    hyper = dict(HYPER, decoupled=decoupled, grad_scale=-GRAD_SCALE)
    p, m, v = state["param"].clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    ck.adam_inverse_(p, state["grad"], m, v, **hyper)
    ref = adam_inverse_reference(
        state["param"], state["grad"].float(), state["exp_avg"], state["exp_avg_sq"], **hyper
    )
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref):
        assert_close(got, want, dtype=torch.float32, msg=name)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_id)
def test_inverse_step_leaves_non_finite_grad_elements_unchanged(grad_dtype):
    n = 4099
    state = make_state(n, grad_dtype, seed=8)
    bad_at = [0, 1, 17, 2048, n // 2, n - 2, n - 1]
    for k, i in enumerate(bad_at):
        state["grad"][i] = (float("inf"), -float("inf"), float("nan"))[k % 3]
    hyper = dict(HYPER, decoupled=True, grad_scale=GRAD_SCALE)
    p, m, v = state["param"].clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    ck.adam_inverse_(p, state["grad"], m, v, **hyper)
    for name, after, before in (
        ("param", p, state["param"]),
        ("exp_avg", m, state["exp_avg"]),
        ("exp_avg_sq", v, state["exp_avg_sq"]),
    ):
        assert torch.isfinite(after).all(), f"{name} has a non-finite element"
        assert_bitwise_equal(after[bad_at], before[bad_at], f"{name} at non-finite grads")
        assert (after[bad_at] != 0).all(), f"{name} zeroed at non-finite grads"
        good = torch.ones(n, dtype=torch.bool)
        good[bad_at] = False
        assert not torch.equal(after[good], before[good]), f"{name}: finite elements not inverted"


def test_inverse_step_leaves_non_finite_state_elements_unchanged():
    p = torch.tensor([float("inf"), 1.0, 1.0, 0.5])
    m = torch.tensor([0.1, float("nan"), 0.1, 0.2])
    v = torch.tensor([0.01, 0.01, -float("inf"), 0.03])
    grad = torch.tensor([0.3, 0.3, 0.3, 0.3])
    before = (p.clone(), m.clone(), v.clone())
    ck.adam_inverse_(p, grad, m, v, **dict(HYPER, step=3))
    for after, orig in zip((p, m, v), before):
        assert_bitwise_equal(after[:3], orig[:3], "non-finite state element")
        assert not torch.equal(after[3:], orig[3:])


def test_inverse_step_keeps_v_non_negative():
    """A grad whose square outweighs v1 would give a negative v0: it is clamped at 0."""
    n = 4099
    gen = torch.Generator().manual_seed(9)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 1e-6
    grad = torch.randn(n, generator=gen) * 10
    ck.adam_inverse_(p, grad, m, v, **HYPER)
    assert (v >= 0).all() and torch.isfinite(v).all()
    assert (v == 0).float().mean() > 0.5  # most were clamped: the case was exercised


def test_inverse_step_leaves_elements_whose_recovered_state_overflows_fp32_unchanged():
    fmax = torch.finfo(torch.float32).max
    p = torch.tensor([1.0, 1.0, 3e38])
    m = torch.tensor([0.1, fmax, 0.0])
    v = torch.tensor([fmax, 0.01, 0.0])
    grad = torch.tensor([0.0, -fmax, 0.0])
    before = (p.clone(), m.clone(), v.clone())
    # element 0: v0 = FLT_MAX / beta2; element 1: m0 = (FLT_MAX + 0.1 FLT_MAX) / beta1;
    # element 2 (second call, lr*wd = 0.5): p0 = 3e38 / 0.5 -- all finite in fp64 only
    ck.adam_inverse_(p[:2], grad[:2], m[:2], v[:2], **dict(HYPER, weight_decay=0.0))
    ck.adam_inverse_(p[2:], grad[2:], m[2:], v[2:], **dict(HYPER, lr=0.5, weight_decay=1.0))
    for after, orig in zip((p, m, v), before):
        assert torch.isfinite(after).all()
        assert_bitwise_equal(after, orig, "elements whose inverse overflows fp32")


def test_inverse_step_is_bitwise_identical_for_any_thread_count():
    state = make_state(BIG, torch.bfloat16, seed=12)
    results = []
    for threads in (1, 2, 3):
        ck.set_num_threads(threads)
        p, m, v = state["param"].clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        ck.adam_inverse_(p, state["grad"], m, v, **dict(HYPER, decoupled=False))
        results.append((p, m, v))
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert_bitwise_equal(a, b, "inverse step across thread counts")


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(beta1=0.0), "beta1 > 0"),
        (dict(beta2=0.0), "beta2 > 0"),
        (dict(lr=0.5, weight_decay=2.0), "lr \\* weight_decay != 1"),
    ],
)
def test_inverse_step_rejects_non_invertible_hyperparameters(bad, match):
    state = make_state(8)
    with pytest.raises(ValueError, match=match):
        ck.adam_inverse_(
            state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"], **dict(HYPER, **bad)
        )


def test_inverse_step_rejects_bf16_moments():
    state = make_state(8, moment_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="exp_avg must have dtype"):
        ck.adam_inverse_(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"], **HYPER)


# ----------------------------------------------------------------- trajectory vs torch.optim
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam], ids=lambda c: c.__name__)
def test_twenty_steps_match_torch_optim_foreach_false(simd, optimizer, amsgrad, maximize):
    n, steps = 4099, 20
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.05
    gen = torch.Generator().manual_seed(13)
    p0 = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = optimizer(
        [ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize, foreach=False
    )
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    for t in range(1, steps + 1):
        grad = torch.randn(n, generator=gen) * (1 + t % 3)
        ref.grad = grad.clone()
        opt.step()
        ck.adam_step_(
            p,
            grad,
            m,
            v,
            step=t,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=wd,
            decoupled=optimizer is torch.optim.AdamW,
            grad_scale=-1.0 if maximize else 1.0,
            max_exp_avg_sq=vmax,
        )
    state = opt.state[ref]
    scale = ref.detach().abs().max().item()
    torch.testing.assert_close(p, ref.detach(), rtol=RTOL[torch.float32], atol=RTOL[torch.float32] * scale)
    assert_close(m, state["exp_avg"], dtype=torch.float32, msg="exp_avg")
    assert_close(v, state["exp_avg_sq"], dtype=torch.float32, msg="exp_avg_sq")
    if amsgrad:
        assert_close(vmax, state["max_exp_avg_sq"], dtype=torch.float32, msg="max_exp_avg_sq")
    assert not torch.equal(p, p0)


# ---------------------------------------------------------------------------- bad input
def _good_args(n=8, amsgrad=False):
    s = make_state(n, torch.bfloat16, amsgrad=amsgrad)
    kwargs = dict(HYPER, max_exp_avg_sq=s["max_exp_avg_sq"])
    return [s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"]], kwargs


def _non_contiguous(t):
    return torch.zeros(t.numel() * 2, dtype=t.dtype)[::2]  # zeros: NaN garbage would fail torch.equal


def _set_arg(i, make):
    def edit(args, kwargs):
        args[i] = make(args[i])

    return edit


def _set_kw(**values):
    def edit(args, kwargs):
        kwargs.update({k: (v(args, kwargs) if callable(v) else v) for k, v in values.items()})

    return edit


def _out1_overlapping_exp_avg(args, kwargs):
    buf = torch.zeros(12)
    args[2] = buf[:8]
    kwargs["out"] = (torch.empty(8), buf[4:12], torch.empty(8))


def _out2_aliasing_grad(args, kwargs):
    args[1] = args[1].float()
    kwargs["out"] = (torch.empty(8), torch.empty(8), args[1])


def _out(*makers):
    def make(args, kwargs):
        n = args[0].numel()
        return tuple(mk(args, kwargs) if callable(mk) else torch.empty(n, dtype=mk) for mk in makers)

    return make


F32, BF16 = torch.float32, torch.bfloat16
META = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
# (id, edit of a valid call, amsgrad, exception, message regex) -- each message names the argument
ADAM_ERROR_INPUTS = [
    ("param non-contiguous", _set_arg(0, _non_contiguous), False, ValueError, "param must be contiguous"),
    ("grad non-contiguous", _set_arg(1, _non_contiguous), False, ValueError, "grad must be contiguous"),
    ("exp_avg non-contiguous", _set_arg(2, _non_contiguous), False, ValueError, "exp_avg must be contiguous"),
    (
        "exp_avg_sq 2-d transposed",
        _set_arg(3, lambda t: torch.zeros(4, 2).t()),
        False,
        ValueError,
        "exp_avg_sq must be contiguous",
    ),
    ("param fp64", _set_arg(0, lambda t: t.double()), False, TypeError, "param must have dtype"),
    ("grad int32", _set_arg(1, lambda t: t.int()), False, TypeError, "grad must have dtype"),
    ("grad fp64", _set_arg(1, lambda t: t.double()), False, TypeError, "grad must have dtype"),
    ("exp_avg fp16", _set_arg(2, lambda t: t.half()), False, TypeError, "exp_avg must have dtype"),
    ("exp_avg_sq fp16", _set_arg(3, lambda t: t.half()), False, TypeError, "exp_avg_sq must have dtype"),
    # exp_avg_sq may differ from exp_avg; max_exp_avg_sq and the outputs follow their own input
    (
        "max_exp_avg_sq dtype differs",
        _set_kw(max_exp_avg_sq=lambda a, k: k["max_exp_avg_sq"].bfloat16()),
        True,
        TypeError,
        r"max_exp_avg_sq must have dtype in \['torch.float32'\]",
    ),
    (
        "max_exp_avg_sq fp32 beside a bf16 exp_avg_sq",
        _set_arg(3, lambda t: t.bfloat16()),
        True,
        TypeError,
        r"max_exp_avg_sq must have dtype in \['torch.bfloat16'\]",
    ),
    (
        "out[2] in exp_avg's dtype, not exp_avg_sq's",
        lambda a, k: (_set_arg(3, lambda t: t.bfloat16())(a, k), _set_kw(out=_out(F32, F32, F32))(a, k)),
        False,
        TypeError,
        r"out\[2\] \(exp_avg_sq_out\) must have dtype in \['torch.bfloat16'\]",
    ),
    (
        "out[1] in exp_avg_sq's dtype, not exp_avg's",
        lambda a, k: (_set_arg(3, lambda t: t.bfloat16())(a, k), _set_kw(out=_out(F32, BF16, BF16))(a, k)),
        False,
        TypeError,
        r"out\[1\] \(exp_avg_out\) must have dtype in \['torch.float32'\]",
    ),
    (
        "out[3] in exp_avg's dtype, not exp_avg_sq's",
        lambda a, k: (
            _set_arg(3, lambda t: t.bfloat16())(a, k),
            _set_kw(
                max_exp_avg_sq=lambda a, k: k["max_exp_avg_sq"].bfloat16(), out=_out(F32, F32, BF16, F32)
            )(a, k),
        ),
        True,
        TypeError,
        r"out\[3\] \(max_exp_avg_sq_out\) must have dtype in \['torch.bfloat16'\]",
    ),
    ("grad not a tensor", _set_arg(1, lambda t: t.tolist()), False, TypeError, "grad must be a torch.Tensor"),
    (
        "grad sparse",
        _set_arg(1, lambda t: t.float().to_sparse()),
        False,
        TypeError,
        "grad must be a dense strided tensor",
    ),
    (
        "grad size mismatch",
        _set_arg(1, lambda t: torch.zeros(9, dtype=t.dtype)),
        False,
        ValueError,
        "grad has 9 elements, expected 8",
    ),
    (
        "exp_avg_sq size mismatch",
        _set_arg(3, lambda t: torch.zeros(7)),
        False,
        ValueError,
        "exp_avg_sq has 7 elements",
    ),
    (
        "max_exp_avg_sq size mismatch",
        _set_kw(max_exp_avg_sq=torch.zeros(5)),
        True,
        ValueError,
        "max_exp_avg_sq has 5 elements",
    ),
    ("negative lr", _set_kw(lr=-1e-3), False, ValueError, "Invalid learning rate"),
    ("nan lr", _set_kw(lr=float("nan")), False, ValueError, "lr must be finite"),
    ("lr a string", _set_kw(lr="0.001"), False, TypeError, "lr must be a float"),
    ("beta1 1.0", _set_kw(beta1=1.0), False, ValueError, "beta parameter at index 0"),
    ("beta1 -0.1", _set_kw(beta1=-0.1), False, ValueError, "beta parameter at index 0"),
    ("beta2 1.0", _set_kw(beta2=1.0), False, ValueError, "beta parameter at index 1"),
    ("beta2 -0.1", _set_kw(beta2=-0.1), False, ValueError, "beta parameter at index 1"),
    ("negative eps", _set_kw(eps=-1e-8), False, ValueError, "epsilon"),
    ("negative weight_decay", _set_kw(weight_decay=-0.1), False, ValueError, "weight_decay"),
    ("inf grad_scale", _set_kw(grad_scale=float("inf")), False, ValueError, "grad_scale must be finite"),
    ("step 0", _set_kw(step=0), False, ValueError, "step must be an int >= 1"),
    ("step a float", _set_kw(step=1.0), False, ValueError, "step must be an int"),
    ("step a bool", _set_kw(step=True), False, ValueError, "step must be an int"),
    ("param on meta", _set_arg(0, META), False, ValueError, "param must be a CPU tensor"),
    ("grad on meta", _set_arg(1, META), False, ValueError, "grad must be a CPU tensor"),
    ("out of wrong length", _set_kw(out=_out(F32, F32)), False, ValueError, "out must be a tuple of 3"),
    ("amsgrad out of 3", _set_kw(out=_out(F32, F32, F32)), True, ValueError, "out must be a tuple of 4"),
    ("out a tensor", _set_kw(out=lambda a, k: torch.empty(8)), False, ValueError, "out must be a tuple"),
    ("out[0] wrong dtype", _set_kw(out=_out(BF16, F32, F32)), False, TypeError, r"out\[0\] \(param_out\)"),
    (
        "out[2] wrong size",
        _set_kw(out=_out(F32, F32, lambda a, k: torch.empty(9))),
        False,
        ValueError,
        r"out\[2\] \(exp_avg_sq_out\) has 9 elements",
    ),
    (
        "out[1] non-contiguous",
        _set_kw(out=_out(F32, lambda a, k: _non_contiguous(torch.empty(8)), F32)),
        False,
        ValueError,
        r"out\[1\] \(exp_avg_out\) must be contiguous",
    ),
    (
        "out[0] is param",
        _set_kw(out=lambda a, k: (a[0], torch.empty(8), torch.empty(8))),
        False,
        ValueError,
        r"out\[0\] \(param_out\) overlaps param",
    ),
    (
        "out[1] overlaps exp_avg",
        _out1_overlapping_exp_avg,
        False,
        ValueError,
        r"out\[1\] \(exp_avg_out\) overlaps exp_avg",
    ),
    ("out[2] is grad", _out2_aliasing_grad, False, ValueError, r"out\[2\] \(exp_avg_sq_out\) overlaps grad"),
    (
        "out[3] overlaps max_exp_avg_sq",
        _set_kw(out=lambda a, k: (torch.empty(8), torch.empty(8), torch.empty(8), k["max_exp_avg_sq"])),
        True,
        ValueError,
        r"out\[3\] \(max_exp_avg_sq_out\) overlaps max_exp_avg_sq",
    ),
    ("param_copy fp32", _set_kw(param_copy=torch.empty(8)), False, TypeError, "param_copy must have dtype"),
    (
        "param_copy size mismatch",
        _set_kw(param_copy=torch.empty(9, dtype=BF16)),
        False,
        ValueError,
        "param_copy has 9 elements",
    ),
    (
        "param_copy overlaps param",
        _set_kw(param_copy=lambda a, k: a[0].view(BF16)[:8]),
        False,
        ValueError,
        "param_copy overlaps param",
    ),
]


@pytest.mark.parametrize(
    "edit,amsgrad,exc,match", [c[1:] for c in ADAM_ERROR_INPUTS], ids=[c[0] for c in ADAM_ERROR_INPUTS]
)
def test_adam_step_rejects_bad_input_naming_the_argument(edit, amsgrad, exc, match):
    args, kwargs = _good_args(8, amsgrad)
    edit(args, kwargs)
    before = [
        t.clone() if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse else None
        for t in args
    ]
    with pytest.raises(exc, match=match):
        ck.adam_step_(*args, **kwargs)
    for t, b in zip(args, before):  # a rejected call writes nothing
        if b is not None:
            assert torch.equal(t, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_adam_step_rejects_a_cuda_tensor(which):
    args, kwargs = _good_args()
    args[which] = args[which].cuda()
    name = ("param", "grad", "exp_avg", "exp_avg_sq")[which]
    with pytest.raises(ValueError, match=f"{name} must be a CPU tensor"):
        ck.adam_step_(*args, **kwargs)


@pytest.mark.parametrize(
    "grad,exc,match",
    [
        (torch.zeros(16)[::2], ValueError, "grad must be contiguous"),
        (torch.zeros(8, dtype=torch.int64), TypeError, "grad must have dtype"),
        (torch.zeros(8, dtype=torch.float64), TypeError, "grad must have dtype"),
        (torch.zeros(8, device="meta"), ValueError, "grad must be a CPU tensor"),
        ([0.0, 1.0], TypeError, "grad must be a torch.Tensor"),
    ],
    ids=["non-contiguous", "int64", "fp64", "meta", "list"],
)
def test_grad_stats_rejects_bad_input_naming_the_argument(grad, exc, match):
    with pytest.raises(exc, match=match):
        ck.grad_stats(grad)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_set_num_threads_rejects_non_positive_or_non_int(n):
    with pytest.raises(ValueError, match="n must be a positive int"):
        ck.set_num_threads(n)


# --------------------------------------------------------------------------------- simd
# the architecture's levels, lowest first (x86-64: portable, avx2, avx512; AArch64: portable, neon, sve)
ARCH_LEVELS = {"x86_64": ("portable", "avx2", "avx512"), "aarch64": ("portable", "neon", "sve")}


def test_simd_level_is_one_of_the_architectures_three_and_available():
    import platform

    from cpu_kernels import _lib

    arch = ARCH_LEVELS.get(platform.machine(), ("portable",))
    assert _lib.LEVELS == arch, (platform.machine(), _lib.LEVELS)
    assert LEVELS[0] == "portable" and ck.simd_level() in LEVELS
    assert set(LEVELS) <= set(arch)


def test_set_simd_level_rejects_an_unknown_level():
    saved = ck.simd_level()
    with pytest.raises(ValueError, match="unknown SIMD level 'bogus'"):
        ck.set_simd_level("bogus")
    assert ck.simd_level() == saved


def _top_level():
    from cpu_kernels import _lib

    return _lib.LEVELS[-1]


@pytest.mark.skipif(LEVELS[-1] == _top_level(), reason="this CPU runs every level")
def test_set_simd_level_rejects_a_level_above_the_cpu():
    with pytest.raises(ValueError, match=f"this CPU cannot run SIMD level '{_top_level()}'"):
        ck.set_simd_level(_top_level())


def test_set_simd_level_switches_the_dispatcher(simd):
    assert ck.simd_level() == simd


def _simd_level_in_subprocess(value):
    env = dict(os.environ, HYBRID_OPT_SIMD=value)
    proc = subprocess.run(
        [sys.executable, "-c", "import cpu_kernels; print(cpu_kernels.simd_level())"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("value", ["portable", " AVX2 "])
def test_hybrid_opt_simd_env_forces_a_lower_level_at_import(value):
    want = value.strip().lower()
    if want not in LEVELS:
        pytest.skip(f"this CPU cannot run {want}")
    assert _simd_level_in_subprocess(value)[0] == want


def test_hybrid_opt_simd_env_with_an_unknown_level_warns_and_keeps_the_detected_one():
    level, stderr = _simd_level_in_subprocess("bogus")
    assert level == LEVELS[-1]
    assert "HYBRID_OPT_SIMD='bogus' is not one of" in stderr


def test_set_thread_cpus_moves_the_threads_a_region_runs_on_and_refuses_nonsense():
    """The worker moves its OpenMP threads between its own cores and every core (hybrid_opt's
    split): each thread of a team of `threads` is allowed on the named cores afterwards, as the OS
    reports; the caller's thread (the team's first) too."""
    from cpu_kernels import _lib

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or not hasattr(os, "sched_setaffinity"):
        pytest.skip("one core: nowhere to move a thread")
    before = ck.get_num_threads()
    threads = len(cores)
    try:
        assert _lib.set_thread_cpus([cores[-1]], threads) == 0
        p = torch.rand(1 << 20)
        ck.set_num_threads(threads)
        # a parallel region now runs on the moved pool: its threads stay on the one core
        ck.adam_step_(p, p.clone(), torch.zeros_like(p), torch.zeros_like(p), **HYPER)
        masks = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]
        assert sum(m == {cores[-1]} for m in masks) >= threads
        assert os.sched_getaffinity(0) == {cores[-1]}  # this thread took part
    finally:
        assert _lib.set_thread_cpus(cores, threads) == 0
        ck.set_num_threads(before)
    assert os.sched_getaffinity(0) == set(cores)
    for bad in (([], 1), ([0], 0), ([0], 1.5)):
        with pytest.raises(ValueError, match="set_thread_cpus"):
            _lib.set_thread_cpus(*bad)
