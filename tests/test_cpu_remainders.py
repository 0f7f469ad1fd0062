"""cpu_kernels' compressed state: bf16 moments and 16-bit master remainders, bit for bit.

exp_avg and exp_avg_sq each have their own dtype (fp32 or bf16, max_exp_avg_sq exp_avg_sq's):
the matrix runs all four pairs.

Every SIMD level is compared with the pure-torch bit-exact reference
(`adam_step_bitwise_reference`: the kernels' fp32 arithmetic op for op, fused multiply-adds
emulated exactly) with torch.equal on the bits — never a tolerance. The remainder encoding
is checked on every low half over a spread of high halves, and a bf16 param + remainder is
stepped 50 times beside an fp32 master: the masters stay bitwise equal.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import _id

import cpu_kernels as ck
from cpu_kernels.reference import (
    FUSED_MULTIPLY_ADD_LEVELS,
    adam_step_bitwise_reference,
    bf16_round_reference,
    decode_remainder_reference,
    encode_remainder_reference,
)

LEVELS = ck.available_simd_levels()
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRAD_SCALE = 0.7 / 1024
HYPER = dict(step=7, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BIG = 1_000_003  # many 16384-element chunks: every thread takes some
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE_NAMES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder")
F32, BF16 = torch.float32, torch.bfloat16
# (exp_avg dtype, exp_avg_sq dtype): the same-dtype pairs and both mixed ones
MOMENT_PAIRS = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)]


def _pair_id(pair):
    return "m_" + _id(pair[0]) + "-v_" + _id(pair[1])


# the `simd` fixture (every SIMD level this CPU offers) is in conftest.py
pytestmark = pytest.mark.usefixtures("restore_kernel_threads")


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bitwise_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    if not torch.equal(bits(a), bits(b)):
        bad = (bits(a) != bits(b)).nonzero().flatten()
        raise AssertionError(
            f"{what}: {bad.numel()} elements differ, first at {bad[:5].tolist()}: "
            f"{a[bad[:5]].tolist()} vs {b[bad[:5]].tolist()}"
        )


def make_state(
    n, grad_dtype, *, amsgrad, remainders, moment_dtype=None, seed=0, exp_avg_sq_dtype=None, moments=None
):
    """A mid-training state (non-zero moments, loss-scaled grads, max_exp_avg_sq above v
    for about half the elements); with remainders the master is held as (bf16, int16).
    moment_dtype is exp_avg's, exp_avg_sq_dtype (default: the same) exp_avg_sq's and the max's;
    moments, a MOMENT_PAIRS entry, gives both."""
    if moments is not None:
        moment_dtype, exp_avg_sq_dtype = moments
    vdt = moment_dtype if exp_avg_sq_dtype is None else exp_avg_sq_dtype
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1024).to(grad_dtype)
    exp_avg = (torch.randn(n, generator=gen) * 0.1).to(moment_dtype)
    v = torch.rand(n, generator=gen) * 1e-2
    vmax = (v * 2 * torch.rand(n, generator=gen)).to(vdt) if amsgrad else None
    state = dict(
        param=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=v.to(vdt), max_exp_avg_sq=vmax, remainder=None
    )
    if remainders:
        state["param"], state["remainder"] = ck.encode_remainder(master)
    return state


def _clone_keeping_offset(t):
    """A copy of t that starts as many elements into its storage as t does (so a view at an
    unaligned offset stays unaligned)."""
    off = t.storage_offset()
    buf = torch.empty(t.numel() + off, dtype=t.dtype)
    return buf[off:].copy_(t)


def _clone(state):
    return {k: (_clone_keeping_offset(t) if t is not None else None) for k, t in state.items()}


def shift_inputs(state, offset):
    """The same state with every tensor a view `offset` elements into a fresh buffer (not
    64-byte aligned when offset > 0)."""

    def shifted(t):
        buf = torch.empty(t.numel() + offset, dtype=t.dtype)
        return buf[offset:].copy_(t)

    return {k: (shifted(t) if t is not None else None) for k, t in state.items()}


def _poisoned(like, offset=0):
    """An output buffer of NaN / 0x7FFF bits (an unwritten element shows) starting `offset`
    elements into its storage (not 64-byte aligned when offset > 0)."""
    buf = torch.empty(like.numel() + offset, dtype=like.dtype)
    bits(buf).fill_(0x7FFF if like.element_size() == 2 else 0x7FC00001)
    return buf[offset:]


def run_kernel(state, *, bank, out_offset=0, **hyper):
    """One adam_step_ on a clone; returns (new state tuple in STATE_NAMES order, inputs after)."""
    s = _clone(state)
    ams, rem = s["max_exp_avg_sq"] is not None, s["remainder"] is not None
    kw = dict(max_exp_avg_sq=s["max_exp_avg_sq"], remainder=s["remainder"])
    if bank:
        out = tuple(
            _poisoned(s[k], out_offset)
            for k in ("param", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())
        )
        kw.update(out=out, remainder_out=_poisoned(s["remainder"], out_offset) if rem else None)
        ret = ck.adam_step_(s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"], **kw, **hyper)
        assert ret is out[0]
        new = out + (None,) * (4 - len(out)) + (kw["remainder_out"],)
    else:
        ret = ck.adam_step_(s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"], **kw, **hyper)
        assert ret is s["param"]
        new = tuple(s[k] for k in STATE_NAMES)
    return new, s


def reference(state, level, **hyper):
    return adam_step_bitwise_reference(
        state["param"],
        state["grad"],
        state["exp_avg"],
        state["exp_avg_sq"],
        max_exp_avg_sq=state["max_exp_avg_sq"],
        remainder=state["remainder"],
        fma=level in FUSED_MULTIPLY_ADD_LEVELS,
        **hyper,
    )


def check_matches_reference(state, level, *, bank, out_offset=0, **hyper):
    new, inputs_after = run_kernel(state, bank=bank, out_offset=out_offset, **hyper)
    want = reference(state, level, **hyper)
    for name, got, exp in zip(STATE_NAMES, new, want):
        assert (got is None) == (exp is None), name
        if exp is not None:
            assert_bitwise_equal(got, exp, f"{name} at {level} vs the bitwise reference")
    if bank:
        for name, t in state.items():
            if t is not None:
                assert_bitwise_equal(inputs_after[name], t, f"bank mode changed input {name}")


# ------------------------------------------------------------- the kernel matrix, bitwise
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_master", "remainders"])
@pytest.mark.parametrize("moments", MOMENT_PAIRS, ids=_pair_id)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_id)
def test_adam_step_is_bitwise_the_reference(simd, grad_dtype, decoupled, bank, amsgrad, moments, remainders):
    # 4099 = vector body + a 3-element tail at every level
    state = make_state(4099, grad_dtype, amsgrad=amsgrad, moments=moments, remainders=remainders, seed=4099)
    hyper = dict(HYPER, decoupled=decoupled, grad_scale=GRAD_SCALE if decoupled else -GRAD_SCALE)
    check_matches_reference(state, simd, bank=bank, **hyper)


@pytest.mark.parametrize("n", [1, 15, 17, 33, 95])
@pytest.mark.parametrize("moments", MOMENT_PAIRS, ids=_pair_id)
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_master", "remainders"])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
def test_adam_step_short_tails_every_moment_pair(simd, bank, remainders, moments, n):
    """Lengths around the vector widths (8, 16) and the register loops' 32-element step."""
    state = make_state(n, torch.bfloat16, amsgrad=True, moments=moments, remainders=remainders, seed=n)
    check_matches_reference(state, simd, bank=bank, **dict(HYPER, grad_scale=GRAD_SCALE))


# the mixed pairs: one 4-byte and one 2-byte moment stream, each split at its own alignment
@pytest.mark.parametrize("moments", MOMENT_PAIRS[2:], ids=_pair_id)
def test_adam_step_with_remainders_on_a_million_elements_any_thread_count(simd, moments):
    state = make_state(BIG, torch.bfloat16, amsgrad=False, moments=moments, remainders=True, seed=1)
    hyper = dict(HYPER, grad_scale=GRAD_SCALE)
    want = reference(state, simd, **hyper)
    for threads in (1, 2, 3):
        ck.set_num_threads(threads)
        for bank in (False, True):
            new, _ = run_kernel(state, bank=bank, **hyper)
            for name, got, exp in zip(STATE_NAMES, new, want):
                if exp is not None:
                    assert_bitwise_equal(got, exp, f"{name}, {threads} threads, bank={bank}")


@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=_id)
def test_bf16_moments_with_param_copy_are_the_reference_and_the_copy_its_cast(simd, copy_dtype, bank):
    """fp32 master + bf16 moments + the model copy (the register loops' copy stores)."""
    state = make_state(
        4099, torch.bfloat16, amsgrad=bank, moment_dtype=torch.bfloat16, remainders=False, seed=11
    )
    state["param"][::97] *= 1e5  # past fp16's range: the copy must be inf
    s = _clone(state)
    out = (
        tuple(_poisoned(s[k], 1) for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        if bank
        else None
    )
    copy = _poisoned(torch.empty(4099, dtype=copy_dtype))
    ck.adam_step_(
        s["param"],
        s["grad"],
        s["exp_avg"],
        s["exp_avg_sq"],
        max_exp_avg_sq=s["max_exp_avg_sq"],
        param_copy=copy,
        out=out,
        **dict(HYPER, grad_scale=GRAD_SCALE),
    )
    new = out if bank else (s["param"], s["exp_avg"], s["exp_avg_sq"])
    want = reference(state, simd, **dict(HYPER, grad_scale=GRAD_SCALE))
    for name, got, exp in zip(STATE_NAMES, new, want):
        assert_bitwise_equal(got, exp, f"{name} at {simd}")
    cast = bf16_round_reference(want[0]) if copy_dtype == torch.bfloat16 else want[0].to(torch.float16)
    assert torch.isinf(cast.float()).any() == (copy_dtype == torch.float16)
    assert_bitwise_equal(copy, cast, "param_copy vs the new param rounded to nearest even")


# The AVX-512 compressed loop rounds to bf16 with vcvtne2ps2bf16 where the CPU has AVX-512
# BF16, and with integer arithmetic where it has not (or a 32-element step holds a NaN or a
# subnormal, which the instruction gets wrong): both must give the reference's bits.
_HAS_BF16_INSN = "avx512" in LEVELS and ck._lib._avx512_bf16()
ROUNDINGS = [(level, True) for level in LEVELS] + ([("avx512", False)] if _HAS_BF16_INSN else [])


@pytest.fixture(params=ROUNDINGS, ids=lambda r: r[0] + ("" if r[1] else "-integer_bf16"))
def rounding(request):
    level, insn = request.param
    saved_level, saved_insn = ck.simd_level(), ck._lib._avx512_bf16()
    ck.set_simd_level(level)
    if _HAS_BF16_INSN:
        ck._lib._set_avx512_bf16(insn)
    yield level
    ck.set_simd_level(saved_level)
    if _HAS_BF16_INSN:
        ck._lib._set_avx512_bf16(saved_insn)


def _nans(dtype, bits32: list) -> torch.Tensor:
    """NaNs of the given fp32 bit patterns, in `dtype` (bf16/fp16: the same NaN's high bits)."""
    f = torch.tensor(bits32, dtype=torch.int64).to(torch.int32).view(torch.float32)
    if dtype == torch.float32:
        return f
    hi = torch.tensor(bits32, dtype=torch.int64) >> 16
    hi = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16)
    return hi.view(torch.bfloat16) if dtype == torch.bfloat16 else f.to(dtype)


def make_special_state(n, moments, *, remainders, amsgrad, seed):
    """make_state plus the inputs vcvtne2ps2bf16 rounds differently, in a few 32-element steps
    (the others ordinary): subnormal moments with zero grads (the new moments stay subnormal),
    NaN and +-inf grads (NaN and inf moments and masters), a moment rounding up to inf."""
    s = make_state(n, torch.bfloat16, amsgrad=amsgrad, moments=moments, remainders=False, seed=seed)
    sub, nan, inf, ninf, big = [33, 34, 63, 300, n - 2], [64, 65, 500], [128, 900], [129], [1500]
    s["grad"][sub] = 0
    s["exp_avg"][sub] = torch.tensor([3e-39, -5e-39, 1e-45, 2e-40, -1e-40]).to(s["exp_avg"].dtype)
    s["exp_avg_sq"][sub] = torch.tensor([1e-39, 4e-40, 1e-45, 3e-39, 9e-41]).to(s["exp_avg_sq"].dtype)
    s["grad"][nan] = float("nan")
    s["grad"][inf] = float("inf")
    s["grad"][ninf] = float("-inf")
    # NaNs other than torch's default 0x7FC00000: negative (x86's inf - inf), with payload bits,
    # signalling — every one must still round to 0x7FC0 in a bf16 moment
    odd_nans = [96, 97, 98, 700]
    s["grad"][odd_nans] = _nans(s["grad"].dtype, [0xFFC00000, 0x7FC12345, 0xFFC00001, 0x7F800001])
    s["exp_avg"][big] = 3.3e38 if s["exp_avg"].dtype == torch.float32 else 3.38e38
    s["grad"][big] = 3.3e38
    if remainders:
        s["param"], s["remainder"] = ck.encode_remainder(s["param"])
    return s


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_master", "remainders"])
@pytest.mark.parametrize("moments", MOMENT_PAIRS, ids=_pair_id)
def test_nan_inf_and_subnormal_moments_round_as_the_reference(rounding, moments, remainders, bank, amsgrad):
    state = make_special_state(4099, moments, remainders=remainders, amsgrad=amsgrad, seed=17)
    want = reference(state, rounding, **dict(HYPER, grad_scale=GRAD_SCALE))
    # the data does reach the cases: NaN, inf and subnormal fp32 moments before rounding
    for got_dtype, new in ((moments[0], want[1]), (moments[1], want[2])):
        vals = new.float()
        assert torch.isnan(vals).any() and torch.isinf(vals).any()
        assert ((vals != 0) & (vals.abs() < 1.1754944e-38)).any(), "no subnormal moment left"
    check_matches_reference(state, rounding, bank=bank, **dict(HYPER, grad_scale=GRAD_SCALE))


@pytest.mark.skipif(
    not _HAS_BF16_INSN, reason="no AVX-512 BF16 on this CPU: the integer rounding is the only one"
)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("bank", [False, True], ids=["in_place", "bank"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_master", "remainders"])
@pytest.mark.parametrize("moments", MOMENT_PAIRS, ids=_pair_id)
def test_avx512_integer_bf16_rounding_is_bitwise_the_reference(moments, remainders, bank, amsgrad):
    """The matrix runs the bf16 instruction where this CPU has it; this runs the same
    AVX-512 loop with the integer rounding only (what a CPU without AVX-512 BF16 runs)."""
    saved_level = ck.simd_level()
    ck.set_simd_level("avx512")
    ck._lib._set_avx512_bf16(False)
    try:
        state = make_state(
            4099, torch.bfloat16, amsgrad=amsgrad, moments=moments, remainders=remainders, seed=99
        )
        check_matches_reference(state, "avx512", bank=bank, **dict(HYPER, grad_scale=GRAD_SCALE))
        copy = _poisoned(torch.empty(4099, dtype=torch.bfloat16))
        if not remainders:  # the bf16 model copy takes the same rounding
            s = _clone(state)
            ck.adam_step_(
                s["param"],
                s["grad"],
                s["exp_avg"],
                s["exp_avg_sq"],
                max_exp_avg_sq=s["max_exp_avg_sq"],
                param_copy=copy,
                **dict(HYPER, grad_scale=GRAD_SCALE),
            )
            assert_bitwise_equal(copy, bf16_round_reference(s["param"]), "param_copy, integer rounding")
    finally:
        ck._lib._set_avx512_bf16(True)
        ck.set_simd_level(saved_level)


# The AVX2 register loop writes bank mode's outputs with non-temporal stores on Intel CPUs and with
# plain ones elsewhere (kernels.h, hybrid_get_avx2_bank_nt), and fp32 state in bank mode goes through
# the loop on Intel CPUs, through the blocks elsewhere: every way must give the reference's bits,
# with the outputs line-aligned (where the stores stream) and not.
@pytest.mark.skipif("avx2" not in LEVELS, reason="this CPU has no AVX2")
@pytest.mark.parametrize("non_temporal", [False, True], ids=["plain", "non_temporal"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_master", "remainders"])
@pytest.mark.parametrize("moments", MOMENT_PAIRS, ids=_pair_id)
def test_avx2_bank_mode_is_the_reference_with_either_store_kind(
    moments, remainders, amsgrad, grad_dtype, non_temporal
):
    saved_level, saved_nt = ck.simd_level(), ck._lib._avx2_bank_nt()
    ck.set_simd_level("avx2")
    ck._lib._set_avx2_bank_nt(non_temporal)
    try:
        for off in (0, 3, 16):
            state = make_state(
                4099, grad_dtype, amsgrad=amsgrad, moments=moments, remainders=remainders, seed=off
            )
            check_matches_reference(
                state, "avx2", bank=True, out_offset=off, **dict(HYPER, grad_scale=GRAD_SCALE)
            )
    finally:
        ck.set_simd_level(saved_level)
        ck._lib._set_avx2_bank_nt(saved_nt)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or "avx2" not in LEVELS, reason="x86-64 Linux")
def test_avx2_bank_stores_are_non_temporal_and_in_place_blocks_prefetch_on_intel_cpus_only():
    with open("/proc/cpuinfo") as f:
        vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    assert ck._lib._avx2_bank_nt() == (vendor == "GenuineIntel"), vendor
    assert ck._lib._block_prefetch() == (vendor == "GenuineIntel"), vendor


def test_the_reference_tells_fused_from_unfused_multiply_adds():
    """The matrix can tell the levels' arithmetic apart: on its data, fused and unfused
    multiply-adds give different params (so a level rounding the other way would fail)."""
    state = make_state(
        4099, torch.float32, amsgrad=False, moment_dtype=torch.float32, remainders=False, seed=4099
    )
    args = (state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"])
    fused = adam_step_bitwise_reference(*args, **HYPER, fma=True)
    unfused = adam_step_bitwise_reference(*args, **HYPER, fma=False)
    assert not torch.equal(bits(fused[0]), bits(unfused[0]))


def test_misaligned_inputs_and_bank_outputs_match_the_reference():
    """Inputs and bank-mode outputs at odd element offsets (non-temporal stores peel to
    alignment or fall back; a stream's alignment differs by dtype), every moment pair, with
    and without remainders. In a child process: a crash there fails this test instead of
    the run."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "import torch, cpu_kernels as ck, test_cpu_remainders as t\n"
        f"for level in {LEVELS!r}:\n"
        "    ck.set_simd_level(level)\n"
        "    for n in (17, 4099):\n"
        "        for md, vd in t.MOMENT_PAIRS:\n"
        "            for rem in (False, True):\n"
        "                for off in (1, 3, 8, 15):\n"
        "                    s = t.make_state(n, torch.bfloat16, amsgrad=off % 2 == 1, moment_dtype=md,\n"
        "                                     exp_avg_sq_dtype=vd, remainders=rem, seed=off)\n"
        "                    t.check_matches_reference(s, level, bank=True, out_offset=off, **t.HYPER)\n"
        "                    s = t.shift_inputs(s, off + 1)\n"
        "                    for bank in (False, True):\n"
        "                        t.check_matches_reference(s, level, bank=bank, out_offset=off, **t.HYPER)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"


# ------------------------------------------------------------------ the remainder encoding
HIGH_HALVES = [
    0x0000,
    0x0001,
    0x0002,
    0x007F,
    0x0080,
    0x0081,
    0x3F7F,
    0x3F80,
    0x3F81,
    0x4049,
    0x7F7E,
    0x7F7F,  # largest finite: its carry makes the param inf
    0x7F80,  # +inf (low 0) or a NaN whose payload is in the low half
    0x7F81,
    0x7FBF,
    0x7FC0,
    0x7FC1,
    0x7FFE,
    0x7FFF,  # NaNs; 0x7FFF's carry wraps
    0x1234,
    0x5555,
    0x2AAA,
]
HIGH_HALVES += [h | 0x8000 for h in HIGH_HALVES]  # the same with the sign bit: -0, -inf, ...


def every_low_half():
    """fp32 values: each of HIGH_HALVES joined with each of the 65536 low halves."""
    high = torch.tensor(HIGH_HALVES, dtype=torch.int64)[:, None] << 16
    u = (high | torch.arange(65536, dtype=torch.int64)[None, :]).flatten()
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def test_encode_decode_round_trips_every_low_half_at_every_level(simd):
    x = every_low_half()
    p_ref, r_ref = encode_remainder_reference(x)
    p, r = ck.encode_remainder(x)
    assert p.dtype == torch.bfloat16 and r.dtype == torch.int16
    assert_bitwise_equal(p, p_ref, "encode_remainder param vs the reference")
    assert_bitwise_equal(r, r_ref, "encode_remainder remainder vs the reference")
    # lossless for every pattern: +-0, subnormals, the largest finite, inf, and NaN payloads
    assert_bitwise_equal(ck.decode_remainder(p, r), x, "decode(encode(x)) vs x")
    assert_bitwise_equal(decode_remainder_reference(p_ref, r_ref), x, "reference decode(encode(x))")
    # decode of arbitrary (param, remainder) pairs agrees with the reference as well
    pr = torch.randint(
        -(2**15), 2**15, (2, 1 << 16), generator=torch.Generator().manual_seed(3), dtype=torch.int16
    )
    assert_bitwise_equal(
        ck.decode_remainder(pr[0].view(torch.bfloat16), pr[1]),
        decode_remainder_reference(pr[0].view(torch.bfloat16), pr[1]),
        "decode",
    )


def test_encoded_param_is_the_high_half_rounded_ties_away_and_differs_from_rne_only_on_ties():
    x = every_low_half()
    u = bits(x).to(torch.int64) & 0xFFFFFFFF
    p, r = ck.encode_remainder(x)
    p_bits = bits(p).to(torch.int64) & 0xFFFF
    assert torch.equal(p_bits, ((u >> 16) + ((u >> 15) & 1)) & 0xFFFF)
    assert torch.equal(r.to(torch.int64) & 0xFFFF, u & 0xFFFF)
    not_nan = ~torch.isnan(x)
    rne = bits(bf16_round_reference(x)).to(torch.int64) & 0xFFFF
    tie = (u & 0xFFFF) == 0x8000
    assert torch.equal(p_bits[not_nan & ~tie], rne[not_nan & ~tie])
    # on a tie the two agree exactly when the high half is odd (RNE then rounds up too)
    odd = (u >> 16) & 1 == 1
    assert torch.equal(p_bits[not_nan & tie] == rne[not_nan & tie], odd[not_nan & tie])
    # and torch's own cast agrees wherever RNE does (finite, non-NaN values)
    finite = torch.isfinite(x) & ~tie
    assert torch.equal(bits(x[finite].to(torch.bfloat16)), bits(p[finite]))


@pytest.mark.parametrize(
    "master,param",
    [
        (0x7F7F8000, 0x7F80),
        (0xFF7FFFFF, 0xFF80),  # largest finite magnitudes -> +-inf
        (0x7F7F7FFF, 0x7F7F),  # just below: the param stays finite
        (0x7F800000, 0x7F80),
        (0x7F800001, 0x7F80),  # inf; a NaN with a low payload -> inf
        (0x7F808000, 0x7F81),  # ... whose carry keeps it a NaN
        (0x7FFF8000, 0x8000),
        (0xFFFF8000, 0x0000),  # the carry wraps: a NaN master, a +-0 param
        (0x7FC00000, 0x7FC0),
        (0x00008000, 0x0001),  # the default NaN; a subnormal tie -> away
        (0x80000000, 0x8000),
        (0x00000001, 0x0000),  # -0; the smallest subnormal
    ],
    ids=lambda v: f"{v:08x}",
)
def test_documented_carry_cases(master, param):
    x = torch.tensor([master - 2**32 if master >= 2**31 else master], dtype=torch.int32).view(torch.float32)
    p, r = ck.encode_remainder(x)
    assert bits(p).item() & 0xFFFF == param
    assert bits(ck.decode_remainder(p, r)).item() & 0xFFFFFFFF == master


def test_encode_decode_keep_shape_and_handle_empty_tensors():
    x = torch.randn(3, 5)
    p, r = ck.encode_remainder(x)
    assert p.shape == r.shape == (3, 5)
    assert ck.decode_remainder(p, r).shape == (3, 5)
    p0, r0 = ck.encode_remainder(torch.empty(0))
    assert p0.numel() == r0.numel() == ck.decode_remainder(p0, r0).numel() == 0


# --------------------------------------------- remainders are the fp32 master, step after step
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("mode", ["in_place", "bank-amsgrad-l2"])
def test_fifty_steps_with_remainders_keep_the_fp32_masters_bits(simd, moment_dtype, mode):
    """The same kernel steps an fp32 master and a (bf16 param, remainder) pair with grads from
    one fixed random stream: after every step the decoded master is bitwise the fp32 one and
    the param is its high half rounded ties-away (torch's cast of it but for ties)."""
    n, bank = 4099, mode != "in_place"
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=not bank)
    gen = torch.Generator().manual_seed(50)
    master = torch.randn(n, generator=gen)
    param, rem = ck.encode_remainder(master)
    m32, v32 = torch.zeros(n, dtype=moment_dtype), torch.zeros(n, dtype=moment_dtype)
    m16, v16 = m32.clone(), v32.clone()
    x32 = torch.zeros(n, dtype=moment_dtype) if bank else None
    x16 = x32.clone() if bank else None
    for t in range(1, 51):
        grad = (torch.randn(n, generator=gen) * (1 + t % 3)).bfloat16()
        kw = dict(hyper, step=t, grad_scale=0.5)
        if bank:
            o32 = (torch.empty(n), torch.empty_like(m32), torch.empty_like(v32), torch.empty_like(x32))
            o16 = (torch.empty_like(param),) + tuple(torch.empty_like(b) for b in o32[1:])
            r_out = torch.empty_like(rem)
            ck.adam_step_(master, grad, m32, v32, max_exp_avg_sq=x32, out=o32, **kw)
            ck.adam_step_(
                param, grad, m16, v16, max_exp_avg_sq=x16, out=o16, remainder=rem, remainder_out=r_out, **kw
            )
            master, m32, v32, x32 = o32
            param, m16, v16, x16 = o16
            rem = r_out
        else:
            ck.adam_step_(master, grad, m32, v32, **kw)
            ck.adam_step_(param, grad, m16, v16, remainder=rem, **kw)
        assert_bitwise_equal(ck.decode_remainder(param, rem), master, f"master after step {t}")
        for name, a, b in (("exp_avg", m16, m32), ("exp_avg_sq", v16, v32), ("max_exp_avg_sq", x16, x32)):
            if b is not None:
                assert_bitwise_equal(a, b, f"{name} after step {t}")
    assert_bitwise_equal(param, encode_remainder_reference(master)[0], "param vs the master rounded away")
    not_tie = (bits(master) & 0xFFFF) != 0x8000
    assert_bitwise_equal(param[not_tie], master[not_tie].to(torch.bfloat16), "param vs torch's cast")
    assert not torch.equal(master, torch.randn(n, generator=torch.Generator().manual_seed(50)))


# ---------------------------------------------------------------------------- bad input
def _args(n=8, *, remainders=True, amsgrad=False):
    s = make_state(n, torch.bfloat16, amsgrad=amsgrad, moment_dtype=torch.bfloat16, remainders=remainders)
    kw = dict(HYPER, max_exp_avg_sq=s["max_exp_avg_sq"], remainder=s["remainder"])
    return [s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"]], kw


def _bank(args, kw, **over):
    n = args[0].numel()
    out = (
        torch.empty(n, dtype=torch.bfloat16),
        torch.empty(n, dtype=torch.bfloat16),
        torch.empty(n, dtype=torch.bfloat16),
    )
    kw.update(out=out, remainder_out=torch.empty(n, dtype=torch.int16))
    kw.update({k: (v(args, kw) if callable(v) else v) for k, v in over.items()})


I16, BF16 = torch.int16, torch.bfloat16
# (id, edit of a valid remainder call, exception, message regex)
REMAINDER_ERROR_INPUTS = [
    (
        "remainder fp32",
        lambda a, k: k.update(remainder=torch.zeros(8)),
        TypeError,
        "remainder must have dtype",
    ),
    (
        "remainder uint16-sized int32",
        lambda a, k: k.update(remainder=torch.zeros(8, dtype=torch.int32)),
        TypeError,
        "remainder must have dtype",
    ),
    (
        "remainder size",
        lambda a, k: k.update(remainder=torch.zeros(9, dtype=I16)),
        ValueError,
        "remainder has 9 elements, expected 8",
    ),
    (
        "remainder non-contiguous",
        lambda a, k: k.update(remainder=torch.zeros(16, dtype=I16)[::2]),
        ValueError,
        "remainder must be contiguous",
    ),
    (
        "remainder a list",
        lambda a, k: k.update(remainder=[0] * 8),
        TypeError,
        "remainder must be a torch.Tensor",
    ),
    (
        "fp32 param with remainder",
        lambda a, k: a.__setitem__(0, torch.zeros(8)),
        TypeError,
        "param must have dtype",
    ),
    (
        "bf16 param without remainder",
        lambda a, k: k.update(remainder=None),
        TypeError,
        "a bf16 param needs remainder=",
    ),
    (
        "param_copy with remainder",
        lambda a, k: k.update(param_copy=torch.empty(8, dtype=BF16)),
        ValueError,
        "param_copy cannot be combined with remainder",
    ),
    (
        "remainder overlaps param",
        lambda a, k: k.update(remainder=a[0].view(I16)),
        ValueError,
        "remainder overlaps param",
    ),
    (
        "remainder overlaps exp_avg",
        lambda a, k: k.update(remainder=a[2].view(I16)),
        ValueError,
        "remainder overlaps exp_avg",
    ),
    (
        "remainder_out without out",
        lambda a, k: k.update(remainder_out=torch.empty(8, dtype=I16)),
        ValueError,
        "remainder_out is for bank mode only",
    ),
    (
        "out without remainder_out",
        lambda a, k: (_bank(a, k), k.update(remainder_out=None)),
        ValueError,
        "bank mode with remainders needs remainder_out=",
    ),
    (
        "remainder_out without remainder",
        lambda a, k: (
            a.__setitem__(0, torch.zeros(8)),
            _bank(a, k, remainder=None, out=lambda a, k: (torch.empty(8),) + k["out"][1:]),
        ),
        ValueError,
        "remainder_out needs remainder=",
    ),
    (
        "out[0] fp32 with remainders",
        lambda a, k: _bank(a, k, out=lambda a, k: (torch.empty(8),) + k["out"][1:]),
        TypeError,
        r"out\[0\] \(param_out\) must have dtype",
    ),
    (
        "remainder_out fp32",
        lambda a, k: _bank(a, k, remainder_out=torch.empty(8)),
        TypeError,
        "remainder_out must have dtype",
    ),
    (
        "remainder_out size",
        lambda a, k: _bank(a, k, remainder_out=torch.empty(7, dtype=I16)),
        ValueError,
        "remainder_out has 7 elements",
    ),
    (
        "remainder_out is remainder",
        lambda a, k: _bank(a, k, remainder_out=lambda a, k: k["remainder"]),
        ValueError,
        "remainder_out overlaps remainder",
    ),
    (
        "remainder_out overlaps out[0]",
        lambda a, k: _bank(a, k, remainder_out=lambda a, k: k["out"][0].view(I16)),
        ValueError,
        r"remainder_out overlaps out\[0\]",
    ),
    (
        "remainder_out overlaps grad",
        lambda a, k: _bank(a, k, remainder_out=lambda a, k: a[1].view(I16)),
        ValueError,
        "remainder_out overlaps grad",
    ),
]


@pytest.mark.parametrize(
    "edit,exc,match", [c[1:] for c in REMAINDER_ERROR_INPUTS], ids=[c[0] for c in REMAINDER_ERROR_INPUTS]
)
def test_adam_step_rejects_bad_remainder_input_naming_the_argument(edit, exc, match):
    args, kw = _args()
    edit(args, kw)
    before = [t.clone() for t in args] + (
        [kw["remainder"].clone()] if isinstance(kw.get("remainder"), torch.Tensor) else []
    )
    with pytest.raises(exc, match=match):
        ck.adam_step_(*args, **kw)
    after = args + ([kw["remainder"]] if isinstance(kw.get("remainder"), torch.Tensor) else [])
    for t, b in zip(after, before):  # a rejected call writes nothing
        assert torch.equal(bits(t), bits(b))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: ck.encode_remainder(torch.zeros(4, dtype=BF16)), TypeError, "master must have dtype"),
        (lambda: ck.encode_remainder(torch.zeros(8)[::2]), ValueError, "master must be contiguous"),
        (
            lambda: ck.decode_remainder(torch.zeros(4), torch.zeros(4, dtype=I16)),
            TypeError,
            "param must have dtype",
        ),
        (
            lambda: ck.decode_remainder(torch.zeros(4, dtype=BF16), torch.zeros(4)),
            TypeError,
            "remainder must have dtype",
        ),
        (
            lambda: ck.decode_remainder(torch.zeros(4, dtype=BF16), torch.zeros(5, dtype=I16)),
            ValueError,
            "remainder has 5 elements, expected 4",
        ),
    ],
    ids=["encode bf16", "encode strided", "decode fp32 param", "decode fp32 remainder", "decode size"],
)
def test_encode_and_decode_reject_bad_input_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
