"""The host tier's q8 Adam step (issue 38): cpu_kernels' C kernels at every SIMD level this CPU runs,
bitwise `q8_reference.q8_adam_step_reference` over the moment formats, sizes around a block and a
parallel one, 1 and 2 threads, remainders, amsgrad, bank mode, zero / subnormal / non-finite blocks
and every code boundary; the C library's codebook is the reference's; bad arguments are refused
with a message naming them.
"""

import functools
import json
import math
import os

import background_jobs
import pytest
import q8_proof
import torch
from test_q8 import boundary_grads

import cpu_kernels
from cpu_kernels import _q8_lib, q8_adam_step_, q8_codegen
from cpu_kernels import q8_reference as q8
from cpu_kernels.reference import bf16_round_reference, encode_remainder_reference

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SIZES = [1, 255, 256, 257, 4396, 1 << 20]  # partial, one, two blocks; many; parallel (>= 65536)
MOMENT_FORMATS = [("q8", "q8"), ("q8", F32), ("q8", BF16), (F32, "q8"), (BF16, "q8")]
NAMES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder")
LEVELS = cpu_kernels.available_simd_levels()


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    return torch.equal(a.codes, b.codes) and torch.equal(bits(a.absmax), bits(b.absmax))


def clone(value):
    if value is None or isinstance(value, torch.Tensor):
        return None if value is None else value.clone()
    return q8.Q8Blocks(value.codes.clone(), value.absmax.clone())


def garbage_like(value):
    """An output buffer of value's format, filled with bits the step must overwrite."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(bits(value), 0x55).view(value.dtype)
    return q8.Q8Blocks(torch.full_like(value.codes, 0x55), torch.full_like(value.absmax, math.nan))


def use_vbmi(on: int) -> int:
    """The AVX-512 kernel's VBMI map lookup: on < 0 asks whether it is in use, 0 / 1 turn it off
    / on (-1: this CPU lacks VBMI). Without it the kernel takes the path of CPUs that lack it."""
    import ctypes

    fn = _q8_lib.lib.q8_avx512_use_vbmi
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn(on)


# each kernel path this CPU runs: every level; at avx512 both map lookups where it has VBMI, and the
# fused pass's other arrangement of its codes than the CPU's vendor chose (pipelined into the next
# block's loop on Intel, after each block's own loop elsewhere: cpu_kernels._lib._q8_pipeline)
_PIPELINE = cpu_kernels._lib._q8_pipeline() if "avx512" in LEVELS else False
PATHS = (
    [(lv, True, _PIPELINE) for lv in LEVELS]
    + ([("avx512", False, _PIPELINE)] if "avx512" in LEVELS and use_vbmi(-1) else [])
    + ([("avx512", True, not _PIPELINE)] if "avx512" in LEVELS else [])
)


def _path_id(path):
    name, vbmi, pipeline = path
    return (
        name
        + ("" if vbmi else "-novbmi")
        + ("" if pipeline == _PIPELINE else "-pipeline" if pipeline else "-apart")
    )


@pytest.fixture(params=PATHS, ids=_path_id)
def level(request):
    name, vbmi, pipeline = request.param
    before = cpu_kernels.simd_level()
    cpu_kernels.set_simd_level(name)
    if not vbmi:
        assert use_vbmi(0) == 0
    cpu_kernels._lib._set_q8_pipeline(pipeline)
    yield name
    cpu_kernels._lib._set_q8_pipeline(_PIPELINE)
    if not vbmi:
        assert use_vbmi(1) == 1
    cpu_kernels.set_simd_level(before)


@pytest.mark.skipif(
    not os.path.exists("/proc/cpuinfo") or "avx512" not in LEVELS, reason="x86-64 Linux, AVX-512"
)
def test_the_fused_pass_pipelines_its_codes_on_intel_cpus_only():
    """kernels.h, hybrid_get_q8_pipeline: the vendor's choice, and a set the next step obeys."""
    with open("/proc/cpuinfo") as f:
        vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    assert _PIPELINE == (vendor == "GenuineIntel"), vendor
    cpu_kernels._lib._set_q8_pipeline(not _PIPELINE)
    try:
        assert cpu_kernels._lib._q8_pipeline() == (not _PIPELINE)
    finally:
        cpu_kernels._lib._set_q8_pipeline(_PIPELINE)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = cpu_kernels.get_num_threads()
    cpu_kernels.set_num_threads(request.param)
    yield request.param
    cpu_kernels.set_num_threads(before)


def make_state(n, formats, *, amsgrad=False, remainders=False, grad_dtype=F32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1 * torch.logspace(-4, 0, n)
    v = torch.rand(n, generator=gen) * 0.01 * torch.logspace(-6, 0, n)

    def moment(values, fmt, signed):
        return q8.quantize_blocks(values, signed) if fmt == "q8" else values.to(fmt)

    state = dict(
        param=master,
        grad=torch.randn(n, generator=gen).to(grad_dtype),
        exp_avg=moment(m, formats[0], True),
        exp_avg_sq=moment(v, formats[1], False),
    )
    if amsgrad:
        state["max_exp_avg_sq"] = moment(v * 1.5, formats[1], False)
    if remainders:
        state["param"], state["remainder"] = encode_remainder_reference(master)
    return state


def kernel_step(state, **kwargs):
    """q8_adam_step_ in place on a copy of state; returns the copy."""
    got = {k: clone(v) for k, v in state.items()}
    q8_adam_step_(
        got["param"],
        got["grad"],
        got["exp_avg"],
        got["exp_avg_sq"],
        max_exp_avg_sq=got.get("max_exp_avg_sq"),
        remainder=got.get("remainder"),
        **kwargs,
    )
    return got


def assert_state_equals(got, want, what):
    for name, value in zip(NAMES, want):
        if value is not None:
            assert same_bits(got[name], value), f"{what}: {name}"


@functools.lru_cache(maxsize=None)
def case(n, formats, amsgrad, remainders=False, grad_dtype=F32, step=3, seed=0, **hyper):
    """(state, the reference's new state) for one tensor, computed once per session."""
    state = make_state(n, formats, amsgrad=amsgrad, remainders=remainders, grad_dtype=grad_dtype, seed=seed)
    return state, q8.q8_adam_step_reference(**state, step=step, **{**HYPER, **hyper})


# ------------------------------------------------------------------------------- the codebook


def test_generated_tables_file_is_what_the_generator_writes_now():
    assert q8_codegen.PATH.read_text() == q8_codegen.source(), (
        "cpu_kernels/csrc/q8_tables.c is stale: run `python -m cpu_kernels.q8_codegen` and rebuild"
    )


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_libraries_codebook_is_the_reference_maps_and_tables(signed):
    qmap, table = _q8_lib.q8_codebook(signed)
    assert torch.equal(
        torch.tensor(qmap, dtype=torch.int64), bits(q8.dynamic_map(signed)).to(torch.int64) & 0xFFFFFFFF
    )
    assert torch.equal(
        torch.tensor(table, dtype=torch.int64), q8.bucket_table(signed).flatten().to(torch.int64)
    )


def test_the_q8_step_runs_at_the_adam_dispatchers_level(level):
    # every level has a q8 kernel of its own (the NEON and SVE ones: tests/test_aarch64_emulation.py)
    assert cpu_kernels.q8_simd_level() == level


# ------------------------------------------------------------------------------- the Adam step


@pytest.mark.parametrize("formats", MOMENT_FORMATS, ids=lambda f: "-".join(map(str, f)))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
def test_step_equals_reference_bitwise_at_every_size(level, threads, formats, amsgrad):
    for i, n in enumerate(SIZES):
        state, want = case(n, formats, amsgrad, seed=i)
        assert_state_equals(kernel_step(state, step=3, **HYPER), want, f"{level} {threads}T n={n}")


VARIANTS = {
    "adam-l2": dict(decoupled=False),
    "adam-l2-no-decay": dict(decoupled=False, weight_decay=0.0),
    "adamw-no-decay": dict(weight_decay=0.0),
    "grad-scale": dict(grad_scale=0.25),
    "bf16-grads": dict(grad_dtype=BF16),
    "fp16-grads": dict(grad_dtype=F16),
    "remainders-bf16-grads": dict(remainders=True, grad_dtype=BF16),
    "remainders-amsgrad-l2": dict(remainders=True, amsgrad=True, decoupled=False),
    "first-step": dict(step=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_equals_reference_bitwise_for_each_input_kind(level, threads, variant):
    options = dict(VARIANTS[variant])
    kinds = {k: options.pop(k) for k in ("remainders", "grad_dtype", "amsgrad", "step") if k in options}
    step = kinds.get("step", 3)
    for i, n in enumerate(SIZES):
        state, want = case(
            n,
            ("q8", "q8"),
            kinds.get("amsgrad", False),
            kinds.get("remainders", False),
            kinds.get("grad_dtype", F32),
            step,
            i,
            **options,
        )
        got = kernel_step(state, step=step, **{**HYPER, **options})
        assert_state_equals(got, want, f"{variant} {level} {threads}T n={n}")


@pytest.mark.parametrize("copy_dtype", [BF16, F16], ids=["bf16-copy", "fp16-copy"])
def test_param_copy_is_the_new_param_rounded_as_torch_casts(level, copy_dtype):
    for i, n in enumerate(SIZES[:5]):
        state, want = case(n, ("q8", BF16), False, seed=i)
        copy = torch.empty(n, dtype=copy_dtype)
        got = {k: clone(v) for k, v in state.items()}
        q8_adam_step_(
            got["param"], got["grad"], got["exp_avg"], got["exp_avg_sq"], param_copy=copy, step=3, **HYPER
        )
        assert_state_equals(got, want, f"n={n}")
        expected = bf16_round_reference(want[0]) if copy_dtype == BF16 else want[0].to(F16)
        assert torch.equal(bits(copy), bits(expected)), f"n={n}"


@pytest.mark.parametrize(
    "formats", [("q8", "q8"), ("q8", BF16), (F32, "q8")], ids=lambda f: "-".join(map(str, f))
)
def test_three_steps_in_place_equal_three_reference_steps(level, formats):
    states = [
        make_state(n, formats, amsgrad=True, remainders=True, grad_dtype=BF16, seed=i)
        for i, n in enumerate(SIZES[:5])
    ]
    got = [{k: clone(v) for k, v in s.items()} for s in states]
    for step in (1, 2, 3):
        for i, (g, s) in enumerate(zip(got, states)):
            q8_adam_step_(
                g["param"],
                g["grad"],
                g["exp_avg"],
                g["exp_avg_sq"],
                max_exp_avg_sq=g["max_exp_avg_sq"],
                remainder=g["remainder"],
                step=step,
                **HYPER,
            )
            want = q8.q8_adam_step_reference(**s, step=step, **HYPER)
            states[i] = {**s, **{k: v for k, v in zip(NAMES, want) if v is not None}}
            assert_state_equals(g, want, f"step {step} n={SIZES[i]}")


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-master", "remainders"])
def test_bank_mode_writes_the_outputs_and_leaves_the_inputs_untouched(level, threads, remainders):
    for i, n in enumerate(SIZES):
        state, want = case(n, ("q8", "q8"), True, remainders, BF16 if remainders else F32, seed=i)
        before = {k: clone(v) for k, v in state.items()}
        out = tuple(garbage_like(state[k]) for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        remainder_out = garbage_like(state["remainder"]) if remainders else None
        result = q8_adam_step_(
            state["param"],
            state["grad"],
            state["exp_avg"],
            state["exp_avg_sq"],
            max_exp_avg_sq=state["max_exp_avg_sq"],
            remainder=state.get("remainder"),
            out=out,
            remainder_out=remainder_out,
            step=3,
            **HYPER,
        )
        assert result is out[0]
        for name in before:
            assert same_bits(state[name], before[name]), f"input {name} changed, n={n}"
        got = dict(zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), out), remainder=remainder_out)
        assert_state_equals(got, want, f"bank mode n={n}")


@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
def test_zero_subnormal_and_non_finite_blocks_equal_the_reference(level, amsgrad):
    # without amsgrad x86's fused loop steps these blocks, with it the generic one
    state = make_state(2048, ("q8", "q8"), amsgrad=amsgrad, seed=7)
    zero_m = q8.Q8Blocks(torch.full((2048,), 127, dtype=torch.uint8), torch.zeros(8))
    zero_v = q8.Q8Blocks(torch.zeros(2048, dtype=torch.uint8), torch.zeros(8))
    state.update(exp_avg=zero_m, exp_avg_sq=zero_v)
    if amsgrad:
        state["max_exp_avg_sq"] = clone(zero_v)
    state["grad"][:256] = 0.0  # with zero moments: all-zero blocks, absmax 0
    state["grad"][256:512] = torch.linspace(-1e-40, 1e-40, 256)  # subnormal moments and absmax
    state["grad"][600] = math.inf
    state["grad"][900] = math.nan
    state["grad"][1100] = -math.inf
    state["param"][1500] = math.nan
    hyper = {**HYPER, "beta1": 0.0}
    got = kernel_step(state, step=2, **hyper)
    want = q8.q8_adam_step_reference(**state, step=2, **hyper)
    assert float(want[1].absmax[0]) == 0.0 and 0.0 < float(want[1].absmax[1]) < 1.2e-38
    assert math.isinf(float(want[1].absmax[2])) and math.isnan(float(want[1].absmax[3]))
    assert_state_equals(got, want, f"{level} zero, subnormal and non-finite blocks")


@pytest.mark.parametrize("variant", ["fp32", "remainders", "bf16_grad"])
def test_blocks_without_a_reciprocal_between_blocks_with_one_equal_the_reference(level, threads, variant):
    # AVX-512 writes a block's codes in the next block's loop where both absmaxes take the reciprocal,
    # and at once where one does not: zero blocks (absmax 0) and subnormal ones at the start, between
    # others and at each end of the threads' runs (blocks 0-127 and 128-255 at two threads), so the
    # pipeline starts, stops and restarts; the last block takes the reciprocal (written after the loop)
    state = make_state(
        256 * 256,
        ("q8", "q8"),
        remainders=variant == "remainders",
        grad_dtype=BF16 if variant == "bf16_grad" else F32,
    )
    codes_m, codes_v = state["exp_avg"].codes.clone(), state["exp_avg_sq"].codes.clone()
    absmax_m, absmax_v = state["exp_avg"].absmax.clone(), state["exp_avg_sq"].absmax.clone()
    grad = state["grad"]
    dead = (
        (0, "zero"),
        (3, "zero"),
        (4, "subnormal"),
        (7, "zero"),
        (8, "zero"),
        (127, "zero"),
        (128, "subnormal"),
    )
    for blk, kind in dead:
        lanes = slice(256 * blk, 256 * (blk + 1))
        codes_m[lanes], codes_v[lanes], absmax_m[blk], absmax_v[blk] = 127, 0, 0.0, 0.0
        if kind == "zero":
            grad[lanes] = 0.0
        else:
            grad[lanes] = torch.linspace(-1e-40, 1e-40, 256).to(grad.dtype)
    state.update(exp_avg=q8.Q8Blocks(codes_m, absmax_m), exp_avg_sq=q8.Q8Blocks(codes_v, absmax_v))
    hyper = {**HYPER, "beta1": 0.0}
    want = q8.q8_adam_step_reference(**state, step=2, **hyper)
    assert float(want[1].absmax[3]) == 0.0 and float(want[1].absmax[2]) > 1e-30
    assert_state_equals(
        kernel_step(state, step=2, **hyper), want, f"{level} {variant} blocks without a reciprocal"
    )


@pytest.mark.parametrize("absmax", [3.0, 1.0, 2.0**-100])
def test_every_code_boundary_quantizes_as_the_reference(level, absmax):
    # beta1 = beta2 = 0 and zero moments make the new moments g and g·g exactly, so the
    # quantizer sees x = g / absmax on and beside every boundary of both maps (absmax 3: the
    # division is inexact, so a reciprocal multiply would move codes); then random magnitudes
    grad = boundary_grads(absmax)
    gen = torch.Generator().manual_seed(0)
    random = torch.exp(torch.empty(255 * 64).uniform_(math.log(1e-12), 0.0, generator=gen))
    random = random * torch.where(torch.rand(random.numel(), generator=gen) < 0.5, -1.0, 1.0) * absmax
    random = torch.cat([torch.cat([torch.tensor([absmax]), b]) for b in random.split(255)])
    grad = torch.cat([grad, random])
    n = grad.numel()
    blocks = -(-n // 256)
    state = dict(
        param=torch.randn(n),
        grad=grad,
        exp_avg=q8.Q8Blocks(torch.full((n,), 127, dtype=torch.uint8), torch.zeros(blocks)),
        exp_avg_sq=q8.Q8Blocks(torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)),
    )
    hyper = {**HYPER, "beta1": 0.0, "beta2": 0.0}
    want = q8.q8_adam_step_reference(**state, step=1, **hyper)
    assert torch.equal(want[1].absmax[:8], torch.full((8,), absmax))
    assert_state_equals(kernel_step(state, step=1, **hyper), want, f"{level} boundaries at absmax {absmax}")


def test_an_empty_tensor_is_a_no_op():
    state = make_state(0, ("q8", "q8"))
    assert kernel_step(state, step=1, **HYPER)["param"].numel() == 0


# ------------------------------------------------------------------------------ bad arguments


def _q8(n, fill=0):
    return q8.Q8Blocks(torch.full((n,), fill, dtype=torch.uint8), torch.zeros(-(-n // 256)))


def q8_with(name, codes=None, absmax=None):
    """A mutation: the call's q8 moment `name` with its codes or absmax replaced (a function of it)."""

    def mutate(call):
        old = call[name]
        call[name] = q8.Q8Blocks(
            codes(old.codes) if codes else old.codes, absmax(old.absmax) if absmax else old.absmax
        )

    return mutate


def set_args(**values):
    """A mutation: the call's arguments set, each a value or a function of the call."""

    def mutate(call):
        call.update({k: v(call) if callable(v) else v for k, v in values.items()})

    return mutate


BAD_ARGUMENTS = {
    "absmax-count": (
        q8_with("exp_avg", absmax=lambda a: a[:-1]),
        ValueError,
        r"exp_avg\.absmax has 2 elements; param's 600 elements need 3 \(one per block of 256\)",
    ),
    "codes-dtype": (
        q8_with("exp_avg_sq", codes=lambda c: c.to(torch.int8)),
        TypeError,
        r"exp_avg_sq\.codes must have dtype in \['torch\.uint8'\], got torch\.int8",
    ),
    "codes-count": (
        q8_with("exp_avg", codes=lambda c: c[:599]),
        ValueError,
        r"exp_avg\.codes has 599 elements, expected 600",
    ),
    "absmax-dtype": (
        q8_with("exp_avg", absmax=lambda a: a.double()),
        TypeError,
        r"exp_avg\.absmax must have dtype in \['torch\.float32'\], got torch\.float64",
    ),
    "codes-strided": (
        q8_with("exp_avg", codes=lambda c: torch.zeros(1200, dtype=torch.uint8)[::2]),
        ValueError,
        r"exp_avg\.codes must be contiguous",
    ),
    "max-format": (
        set_args(max_exp_avg_sq=torch.zeros(600)),
        TypeError,
        r"max_exp_avg_sq must have exp_avg_sq's format, Q8Blocks \(codes, absmax\); "
        r"got a torch\.float32 tensor",
    ),
    "moment-fp16": (
        set_args(exp_avg=torch.zeros(600, dtype=F16)),
        TypeError,
        r"exp_avg must have dtype in \['torch\.float32', 'torch\.bfloat16'\], got torch\.float16",
    ),
    "moment-list": (
        set_args(exp_avg=[0.0] * 600),
        TypeError,
        r"exp_avg must be a torch\.Tensor \(fp32 or bf16\) or Q8Blocks \(codes, absmax\), got list",
    ),
    "out-format": (
        set_args(out=(torch.zeros(600), torch.zeros(600), _q8(600), _q8(600))),
        TypeError,
        r"out\[1\] \(exp_avg_out\) must have exp_avg's format, Q8Blocks",
    ),
    "out-count": (
        set_args(out=(torch.zeros(600), _q8(600, 127), _q8(600))),
        ValueError,
        r"out must be a tuple of 4 \(param_out, exp_avg_out, exp_avg_sq_out, max_exp_avg_sq_out\)",
    ),
    "out-overlaps-input": (
        set_args(
            out=lambda s: (
                torch.zeros(600),
                q8.Q8Blocks(s["exp_avg"].codes, torch.zeros(3)),
                _q8(600),
                _q8(600),
            )
        ),
        ValueError,
        r"out\[1\] \(exp_avg_out\)\.codes overlaps exp_avg\.codes: bank mode",
    ),
    "outs-overlap": (
        set_args(out=lambda s: (torch.zeros(600), _q8(600, 127), *(2 * [_q8(600)]))),
        ValueError,
        r"out\[2\] \(exp_avg_sq_out\)\.codes overlaps out\[3\] \(max_exp_avg_sq_out\)\.codes",
    ),
    "remainder-out-alone": (
        set_args(remainder_out=torch.zeros(600, dtype=torch.int16)),
        ValueError,
        r"remainder_out needs remainder=",
    ),
    "bf16-param-no-remainder": (
        set_args(param=lambda s: s["param"].to(BF16)),
        TypeError,
        r"a bf16 param needs remainder=",
    ),
    "grad-count": (
        set_args(grad=lambda s: s["grad"][:500]),
        ValueError,
        r"grad has 500 elements, expected 600",
    ),
    "lr": (set_args(lr=-1.0), ValueError, r"Invalid learning rate: -1\.0"),
    "step": (set_args(step=0), ValueError, r"step must be an int >= 1"),
}


@pytest.mark.parametrize("bad", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_naming_them(bad):
    mutate, error, message = BAD_ARGUMENTS[bad]
    state = make_state(600, ("q8", "q8"), amsgrad=True)
    call = dict(state, step=1, **HYPER)
    mutate(call)
    before = {k: clone(v) for k, v in state.items()}
    with pytest.raises(error, match=message):
        q8_adam_step_(**call)
    for name in before:
        assert same_bits(state[name], before[name]), f"{bad}: {name} written before the refusal"


def test_the_raw_entry_point_refuses_a_q8_moment_without_its_absmax():
    state = make_state(300, ("q8", "q8"))
    args = _q8_lib.Q8AdamArgs(
        n=300,
        param=state["param"].data_ptr(),
        grad=state["grad"].data_ptr(),
        param_out=state["param"].data_ptr(),
        exp_avg=state["exp_avg"].codes.data_ptr(),
        exp_avg_out=state["exp_avg"].codes.data_ptr(),
        exp_avg_sq=state["exp_avg_sq"].codes.data_ptr(),
        exp_avg_sq_out=state["exp_avg_sq"].codes.data_ptr(),
        exp_avg_dtype=_q8_lib.DT_Q8,
        exp_avg_sq_dtype=_q8_lib.DT_Q8,
        step=1,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
    )
    before = state["param"].clone()
    with pytest.raises(ValueError, match="a q8 moment needs its absmax and absmax_out"):
        _q8_lib.q8_adam_step_raw(args)
    assert torch.equal(state["param"], before)


# ------------------------------------------------ the AVX-512 quantizer's lines against q8_code


def _check_quant(level, signed, first, count, bounded=False):
    return q8_proof.check_quant(level, signed, first, count, bounded)


def _check_quant_avx512(signed, first, count, bounded=False):
    return _check_quant("avx512", signed, first, count, bounded)


BOUNDED_LAST = q8_proof.BOUNDED_LAST


needs_avx512 = pytest.mark.skipif("avx512" not in LEVELS, reason="no AVX-512 on this CPU")


@needs_avx512
@pytest.mark.parametrize("signed", [True, False])
def test_avx512_quantizer_equals_q8_code_around_every_code_boundary(signed):
    # 2^16 bit patterns either side of every boundary's first magnitude, both signs, plus the
    # octave of 1.0 and the patterns above it (inf, NaN): the lines' minimum is floored only away
    # from an integer, the lanes near one take q8_code
    for side in (0, 1 << 31):
        for u in q8._first_of_each_rank(signed)[0]:
            bad, _ = _check_quant_avx512(signed, side | (u - (1 << 16)), 1 << 17)
            assert bad == 0, f"signed={signed} side={side:#x} boundary {u:#x}"
            bad, _ = _check_quant_avx512(
                signed, side | (u - (1 << 16)), min(1 << 17, BOUNDED_LAST + 1 - (u - (1 << 16))), True
            )
            assert bad == 0, f"signed={signed} side={side:#x} boundary {u:#x} bounded"
        for first, count in ((0x3F000000, (1 << 23) + 64), (0x7F7FFFF0, 64), (0x7FFFFFC0, 64)):
            bad, _ = _check_quant_avx512(signed, side | first, count)
            assert bad == 0, f"signed={signed} side={side:#x} from {first:#x}"
        bad, _ = _check_quant_avx512(signed, side | 0x3F000000, BOUNDED_LAST + 1 - 0x3F000000, bounded=True)
        assert bad == 0, f"signed={signed} side={side:#x} bounded, the top octave"


def test_a_raw_q8_args_struct_steps_unscaled_grads_unless_told():
    """The raw entry's argument struct (the worker fills it field by field) defaults grad_scale
    to 1.0, not ctypes' zero, which would step every grad as 0; any field can still be given."""
    from cpu_kernels._q8_lib import Q8AdamArgs

    assert Q8AdamArgs().grad_scale == 1.0
    assert Q8AdamArgs(grad_scale=0.5, n=7).grad_scale == 0.5
    assert Q8AdamArgs(n=7).n == 7 and Q8AdamArgs().lr == 0.0


# ------------------------------------------------ the AVX2 quantizer's bucket table against q8_code


def _check_quant_avx2(signed, first, count, bounded=False):
    return _check_quant("avx2", signed, first, count, bounded)


needs_avx2 = pytest.mark.skipif("avx2" not in LEVELS, reason="no AVX2 on this CPU")


@needs_avx2
@pytest.mark.parametrize("signed", [True, False])
def test_avx2_quantizer_equals_q8_code_around_every_code_boundary(signed):
    # the AVX2 level quantizes x·(1/absmax): a lane whose pattern lies within Q8_SLACK of its
    # bucket's step or edge takes q8_code, every other must give q8_code's code for every pattern
    # within Q8_SLACK of it. 2^16 patterns either side of every boundary, both signs, plus the
    # octave of 1.0 and the patterns above it (inf, NaN)
    for side in (0, 1 << 31):
        for u in q8._first_of_each_rank(signed)[0]:
            bad, near = _check_quant_avx2(signed, side | (u - (1 << 16)), 1 << 17)
            assert bad == 0, f"signed={signed} side={side:#x} boundary {u:#x}"
            assert near < 1 << 8  # the lanes near this boundary and the edges of its buckets
        for first, count in ((0x3F000000, (1 << 23) + 64), (0x7F7FFFF0, 64), (0x7FFFFFC0, 64)):
            bad, _ = _check_quant_avx2(signed, side | first, count)
            assert bad == 0, f"signed={signed} side={side:#x} from {first:#x}"
        # the bounded form (the fused pass's, by its own table): every boundary, the top octave,
        # and the smallest magnitudes (clamped to one bucket)
        for u in q8._first_of_each_rank(signed)[0]:
            bad, near = _check_quant_avx2(signed, side | (u - (1 << 16)), 1 << 17, bounded=True)
            assert bad == 0, f"signed={signed} side={side:#x} boundary {u:#x} bounded"
            assert near < 1 << 6
        for first, count in ((0x3F000000, BOUNDED_LAST + 1 - 0x3F000000), (0, 1 << 20)):
            bad, _ = _check_quant_avx2(signed, side | first, count, bounded=True)
            assert bad == 0, f"signed={signed} side={side:#x} from {first:#x} bounded"


# from when the test starts waiting: conftest.py runs it last, when its job has the machine
DEADLINE_S = 600


@pytest.mark.slow
@pytest.mark.parametrize(
    "level, bounded_near",
    [pytest.param("avx512", 1 << 20, marks=needs_avx512), pytest.param("avx2", 1 << 13, marks=needs_avx2)],
)
@pytest.mark.parametrize("signed", [True, False])
def test_quantizer_equals_q8_code_for_every_fp32_pattern(level, bounded_near, signed):
    # all 2^32 patterns (about 10 s per map at AVX-512, 24 at AVX2), and the bounded form's 2^31
    # (the fused pass's): the proof that AVX-512's generated lines and near band (Q8_NEAR), and
    # AVX2's near band whatever the 3 ulps between x·(1/absmax) and x / absmax, give q8_code's
    # code for every x. It runs as a background job (tests/q8_proof.py, tests/background_jobs.py)
    code, out = background_jobs.result(background_jobs.q8_job(level, signed), DEADLINE_S)
    assert code == 0, (
        f"q8_proof.py {level} signed={signed} (exit {code}, None: past {DEADLINE_S} s):\n{out[-3000:]}"
    )
    checks = json.loads(out.strip().splitlines()[-1])["checks"]
    assert len(checks) == 4
    for c in checks:
        assert c["bad"] == 0, (signed, c)
        assert c["near"] < (bounded_near if c["bounded"] else 1 << 20), (
            signed,
            c,
        )  # the scalar path stays rare
