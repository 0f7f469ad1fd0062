"""gpu_kernels.fused_adam_ with compressed state: bf16 moments and fp32 masters stored as a bf16
param plus an int16 remainder (Transformer Engine's encoding), against the pure-torch
references beside the kernel (`fused_adam_reference_`, `encode_remainder` / `decode_remainder`).

Under Triton's interpreter (CPU tensors, TRITON_INTERPRET=1) the kernel's arithmetic is numpy
fp32, one rounding per operation, so it must equal the reference's `arithmetic="fp32"` mode bit
for bit; so must the compiled kernel on a GPU (built without multiply-add contraction). Against
the fp64 reference a bf16 result is within one bf16 ulp. The remainder path is checked to be the fp32-master path
exactly: same arithmetic, only the storage differs.
"""

import importlib

import pytest
import torch
from helpers import needs_kernels, run_compile_check
from tolerances import assert_bf16_within_ulps, assert_close

import gpu_kernels
from gpu_kernels import decode_remainder, encode_remainder, fused_adam_, fused_adam_reference_

adam_module = importlib.import_module("gpu_kernels.adam")

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]
# bitwise equality with the fp32 reference holds for the interpreter's numpy arithmetic only
needs_interpreter = pytest.mark.skipif(
    gpu_kernels.unavailable_reason("cpu") is not None,
    reason=f"Triton's interpreter: {gpu_kernels.unavailable_reason('cpu')}",
)
# the interpreter computes in numpy, which warns where the non-finite inputs that tests give it
# overflow or make NaNs
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
SIZES = [1, 15, 17, 4099, 8192]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
F32, BF16 = torch.float32, torch.bfloat16
MOMENT_DTYPES = [(F32, F32), (BF16, F32), (F32, BF16), (BF16, BF16)]
STATE_KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs")


def bits(t):
    """A tensor's bits, so that torch.equal compares NaN payloads and the sign of zero."""
    return t.contiguous().view(
        {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def make_state(sizes, device, *, grad_dtype=F32, moments=(F32, F32), remainders=False, amsgrad=False, seed=0):
    """Random state; with `remainders` the params are the bf16 high halves of fp32 masters."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n, scale=1.0):
        return torch.randn(n, generator=gen) * scale

    masters = [rand(n) for n in sizes]
    state = dict(
        params=[m.clone() for m in masters],
        grads=[rand(n).to(grad_dtype) for n in sizes],
        exp_avgs=[rand(n, 0.1).to(moments[0]) for n in sizes],
        exp_avg_sqs=[rand(n, 0.01).abs().to(moments[1]) for n in sizes],
    )
    if amsgrad:
        state["max_exp_avg_sqs"] = [(v.float() * 1.5).to(moments[1]) for v in state["exp_avg_sqs"]]
    if remainders:
        halves = [encode_remainder(m) for m in masters]
        state["params"] = [hi for hi, _ in halves]
        state["remainders"] = [lo for _, lo in halves]
    return {k: [t.to(device) for t in v] for k, v in state.items()}


def clone_state(state):
    return {k: [t.clone() for t in v] for k, v in state.items()}


def run(fn, state, **kwargs):
    fn(*(state[k] for k in STATE_KEYS), **{k: v for k, v in state.items() if k not in STATE_KEYS}, **kwargs)


def master_of(state, i):
    if "remainders" in state:
        return decode_remainder(state["params"][i], state["remainders"][i])
    return state["params"][i]


def assert_state_bitwise(actual, expected):
    for key in actual:
        for i, (a, e) in enumerate(zip(actual[key], expected[key])):
            assert torch.equal(bits(a), bits(e)), f"{key}[{i}] differs from the reference's bits"


def assert_state_within_rounding(actual, expected):
    """fp32 results within fp32 rounding, bf16 ones within one bf16 ulp; masters decoded."""
    for i in range(len(actual["params"])):
        assert_close(master_of(actual, i), master_of(expected, i), dtype=F32, msg=f"master[{i}]")
    for key in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        for i, (a, e) in enumerate(zip(actual.get(key, []), expected.get(key, []))):
            if a.dtype == BF16:
                assert_bf16_within_ulps(a, e, msg=f"{key}[{i}]")
            elif key != "params":
                assert_close(a, e, msg=f"{key}[{i}]")


# --------------------------------------------------------------------------------------------
# the remainder encoding
# --------------------------------------------------------------------------------------------

# ±0, subnormals, the smallest normal, 1.0, the largest finite, ±inf, NaNs (incl. the high
# halves whose carry wraps), and a few ordinary values
HIGH_HALVES = [
    0x0000,
    0x0001,
    0x007F,
    0x0080,
    0x3F80,
    0x4049,
    0x7F7F,
    0x7F80,
    0x7FC0,
    0x7FFF,
    0x8000,
    0x8001,
    0x807F,
    0xBF80,
    0xFF7F,
    0xFF80,
    0xFFC0,
    0xFFFF,
]


def every_low_half(high_halves):
    """fp32 tensor of every pattern `hi << 16 | lo`, lo over all 2**16 values, for each hi."""
    hi = torch.tensor(high_halves, dtype=torch.int64).repeat_interleave(1 << 16)
    lo = torch.arange(1 << 16, dtype=torch.int64).repeat(len(high_halves))
    pattern = (hi << 16) | lo
    return (pattern - ((pattern >> 31) << 32)).to(torch.int32).view(torch.float32)


def test_remainder_decode_of_encode_is_every_bit_pattern():
    masters = every_low_half(HIGH_HALVES)
    param, remainder = encode_remainder(masters)
    assert param.dtype == BF16 and remainder.dtype == torch.int16
    assert torch.equal(bits(decode_remainder(param, remainder)), bits(masters))
    low_half = bits(masters).to(torch.int64) & 0xFFFF
    assert torch.equal(remainder.to(torch.int64) & 0xFFFF, low_half), "the remainder is the low half"


def test_remainder_param_is_the_round_to_nearest_ties_away_high_half():
    masters = every_low_half(HIGH_HALVES)
    param, remainder = encode_remainder(masters)
    finite = torch.isfinite(masters)
    cast = masters.to(BF16)
    differs = bits(param) != bits(cast)
    m_bits = bits(masters).to(torch.int64) & 0xFFFFFFFF
    # an exact tie (low half 0x8000) whose high half is even: ties to even keeps the high half,
    # ties away adds one ulp; every other finite master rounds the same both ways
    ties = (remainder == -0x8000) & ((m_bits >> 16) & 1 == 0)
    assert int((ties & finite).sum()) > 0
    assert torch.equal(differs & finite, ties & finite)
    assert torch.equal(param[finite & ~ties].float(), cast[finite & ~ties].float())
    tie_params = param[ties & finite].float()
    tie_cast = cast[ties & finite].float()
    assert bool((tie_params.abs() > tie_cast.abs()).all())
    # ±inf masters stay ±inf; NaN masters: NaN params unless the payload is in the low 15 bits
    # only (±inf) or the carry wraps 0x7FFF / 0xFFFF (to -0 / +0) — the master still decodes
    inf = torch.isinf(masters)
    assert torch.equal(param[inf].float(), masters[inf])
    nan = torch.isnan(masters)
    payload_low_only = (m_bits & 0x007F8000) == 0
    wraps = ((m_bits >> 16) & 0x7FFF) == 0x7FFF
    wraps &= (m_bits & 0x8000) != 0
    assert bool(torch.isnan(param[nan & ~payload_low_only & ~wraps].float()).all())
    assert bool(torch.isinf(param[nan & payload_low_only].float()).all())
    assert bool((param[nan & wraps].float() == 0).all())


def test_remainder_reference_rejects_wrong_dtypes():
    with pytest.raises(TypeError, match="fp32 master"):
        encode_remainder(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="bf16 param and an int16 remainder"):
        decode_remainder(torch.zeros(3), torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match="shape"):
        decode_remainder(torch.zeros(3, dtype=BF16), torch.zeros(4, dtype=torch.int16))


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_remainder_round_trip_is_bitwise_for_every_non_nan_pattern(device):
    """With lr = 0 and no decay the update is p - 0: the kernel decodes and re-encodes every
    pattern, and must store exactly encode_remainder's halves. NaNs are left out: arithmetic on
    a NaN may change its payload (a GPU returns the canonical NaN)."""
    masters = every_low_half(HIGH_HALVES)
    masters = masters[~torch.isnan(masters)]
    param, remainder = encode_remainder(masters)
    state = dict(
        params=[param.to(device)],
        grads=[torch.zeros_like(masters, device=device)],
        exp_avgs=[torch.zeros_like(masters, device=device)],
        exp_avg_sqs=[torch.zeros_like(masters, device=device)],
        remainders=[remainder.to(device)],
    )
    run(fused_adam_, state, step=1, **{**HYPER, "lr": 0.0, "weight_decay": 0.0})
    assert torch.equal(bits(state["params"][0].cpu()), bits(param))
    assert torch.equal(state["remainders"][0].cpu(), remainder)


# --------------------------------------------------------------------------------------------
# the kernel against the reference
# --------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moments", MOMENT_DTYPES, ids=lambda m: "m%s_v%s" % tuple(str(d)[6:] for d in m))
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_params", "remainders"])
@pytest.mark.parametrize(
    "amsgrad, decoupled", [(False, True), (True, False)], ids=["adamw", "adam_l2_amsgrad"]
)
def test_interpreted_kernel_equals_fp32_reference_bitwise(
    grad_dtype, moments, remainders, amsgrad, decoupled
):
    state = make_state(
        SIZES, "cpu", grad_dtype=grad_dtype, moments=moments, remainders=remainders, amsgrad=amsgrad
    )
    exact, rounded = clone_state(state), clone_state(state)
    kwargs = dict(step=3, decoupled=decoupled, grad_scale=torch.tensor([0.5]), **HYPER)
    run(fused_adam_, state, **kwargs)
    run(fused_adam_reference_, exact, arithmetic="fp32", **kwargs)
    run(fused_adam_reference_, rounded, **kwargs)
    assert_state_bitwise(state, exact)
    assert_state_within_rounding(state, rounded)


@needs_interpreter
@pytest.mark.parametrize("lr_on_device", [False, True], ids=["lr_float", "lr_tensor"])
def test_interpreted_kernel_equals_fp32_reference_with_float_scale_and_lr_tensor(lr_on_device):
    state = make_state(SIZES, "cpu", grad_dtype=BF16, moments=(BF16, BF16), remainders=True)
    expected = clone_state(state)
    lr = torch.tensor(3e-3) if lr_on_device else 3e-3
    kwargs = dict(step=11, grad_scale=0.25, **{**HYPER, "lr": lr})
    run(fused_adam_, state, **kwargs)
    run(fused_adam_reference_, expected, arithmetic="fp32", **kwargs)
    assert_state_bitwise(state, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moments", [(F32, F32), (BF16, BF16)], ids=["fp32_moments", "bf16_moments"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_params", "remainders"])
@pytest.mark.parametrize(
    "amsgrad, decoupled", [(False, True), (True, False)], ids=["adamw", "adam_l2_amsgrad"]
)
def test_compiled_kernel_equals_fp32_reference_bitwise(grad_dtype, moments, remainders, amsgrad, decoupled):
    """Compiled without multiply-add contraction, the kernel on the GPU rounds every operation
    once, as the reference's fp32 arithmetic does (computed on the CPU): the same bits, and so
    the same bits in every specialization (the fp32-master and remainder programs agree)."""
    state = make_state(
        SIZES + [1 << 20],
        "cuda",
        grad_dtype=grad_dtype,
        moments=moments,
        remainders=remainders,
        amsgrad=amsgrad,
    )
    exact = {k: [t.cpu() for t in v] for k, v in state.items()}
    run(
        fused_adam_,
        state,
        step=3,
        decoupled=decoupled,
        grad_scale=torch.tensor([0.5], device="cuda"),
        **HYPER,
    )
    run(
        fused_adam_reference_,
        exact,
        arithmetic="fp32",
        step=3,
        decoupled=decoupled,
        grad_scale=torch.tensor([0.5]),
        **HYPER,
    )
    assert_state_bitwise({k: [t.cpu() for t in v] for k, v in state.items()}, exact)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_grads_store_bf16_moments_as_the_quiet_nan(device):
    """Without found_inf the kernel steps whatever it is given: a NaN grad makes NaN moments,
    stored as 0x7FC0 (round_to_bf16's NaN), an inf grad inf moments (0x7F80), as the reference
    stores them; the master is NaN at both (inf / inf)."""
    state = make_state([4099], device, grad_dtype=BF16, moments=(BF16, BF16), remainders=True, amsgrad=True)
    state["grads"][0][[5, 700]] = torch.tensor([float("nan"), float("inf")], dtype=BF16, device=device)
    expected = clone_state(state)
    run(fused_adam_, state, step=2, **HYPER)
    run(fused_adam_reference_, expected, step=2, **HYPER)
    for key in ("exp_avgs", "exp_avg_sqs"):
        assert bits(state[key][0])[[5, 700]].tolist() == [0x7FC0, 0x7F80], key
        assert torch.equal(bits(state[key][0]), bits(expected[key][0])), key
    # (tl.maximum returns the number where v is NaN, torch.maximum the NaN: not compared)
    assert bits(state["max_exp_avg_sqs"][0])[700].item() == 0x7F80
    master = decode_remainder(state["params"][0], state["remainders"][0])
    assert torch.isnan(master[[5, 700]]).all()
    finite = torch.ones(4099, dtype=torch.bool, device=device)
    finite[[5, 700]] = False
    assert_close(master[finite], decode_remainder(expected["params"][0], expected["remainders"][0])[finite])


@needs_interpreter
def test_moment_dtypes_are_per_tensor_one_launch_per_combination():
    state = make_state([17, 4099, 33], "cpu", grad_dtype=BF16, amsgrad=True)
    for key in ("exp_avg_sqs", "max_exp_avg_sqs"):  # tensor 1: a bf16 exp_avg_sq (and its max)
        state[key][1] = state[key][1].to(BF16)
    state["exp_avgs"][2] = state["exp_avgs"][2].to(BF16)
    expected = clone_state(state)
    before = adam_module._fused_adam_kernel.launches
    run(fused_adam_, state, step=2, **HYPER)
    assert adam_module._fused_adam_kernel.launches - before == 3
    run(fused_adam_reference_, expected, arithmetic="fp32", step=2, **HYPER)
    assert_state_bitwise(state, expected)


def _twenty_steps(device, *, moments, amsgrad, decoupled, grad_dtype, steps=20):
    """The fp32-master run and the remainder run of the same kernel from the same master, with
    the same grads (a fixed stream): after every step the decoded master, the moments and the
    bf16 params must be what the fp32 run has."""
    master_run = make_state(SIZES, device, grad_dtype=grad_dtype, moments=moments, amsgrad=amsgrad)
    remainder_run = clone_state(master_run)
    halves = [encode_remainder(p) for p in master_run["params"]]
    remainder_run["params"] = [hi for hi, _ in halves]
    remainder_run["remainders"] = [lo for _, lo in halves]
    gen = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        grads = [
            (torch.randn(n, generator=gen) * 10.0 ** (step % 3 - 1)).to(grad_dtype).to(device) for n in SIZES
        ]
        master_run["grads"], remainder_run["grads"] = grads, grads
        kwargs = dict(step=step, decoupled=decoupled, grad_scale=0.5, **HYPER)
        run(fused_adam_, master_run, **kwargs)
        run(fused_adam_, remainder_run, **kwargs)
        for i, master in enumerate(master_run["params"]):
            decoded = decode_remainder(remainder_run["params"][i], remainder_run["remainders"][i])
            assert torch.equal(bits(decoded), bits(master)), f"step {step}: master[{i}] differs"
            hi = remainder_run["params"][i]
            assert torch.equal(bits(hi), bits(encode_remainder(master)[0]))
            # the param is the master's cast but for exact ties (ties away, not to even)
            tie = remainder_run["remainders"][i] == -0x8000
            assert torch.equal(bits(hi)[~tie], bits(master.to(BF16))[~tie])
        for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            for i, (a, b) in enumerate(zip(master_run.get(key, []), remainder_run.get(key, []))):
                assert torch.equal(bits(a), bits(b)), f"step {step}: {key}[{i}] differs"


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moments", [(F32, F32), (BF16, BF16)], ids=["fp32_moments", "bf16_moments"])
@pytest.mark.parametrize(
    "amsgrad, decoupled", [(False, True), (True, False)], ids=["adamw", "adam_l2_amsgrad"]
)
def test_remainders_equal_the_fp32_master_run_over_20_steps(device, moments, amsgrad, decoupled):
    _twenty_steps(device, moments=moments, amsgrad=amsgrad, decoupled=decoupled, grad_dtype=BF16)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "moments, amsgrad, decoupled",
    [((F32, BF16), True, False), ((BF16, F32), False, True)],
    ids=["m_fp32-v_bf16-adam_l2_amsgrad", "m_bf16-v_fp32-adamw"],
)
def test_remainders_equal_the_fp32_master_run_with_mixed_moment_dtypes(device, moments, amsgrad, decoupled):
    """exp_avg and exp_avg_sq of different dtypes (max_exp_avg_sq in exp_avg_sq's): the
    remainder run is still the fp32-master run bit for bit (8 steps: the mixed pairs' loads
    and stores are what this adds to the test above)."""
    _twenty_steps(device, moments=moments, amsgrad=amsgrad, decoupled=decoupled, grad_dtype=F32, steps=8)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [1.0, float("inf"), float("nan")])
def test_found_inf_writes_no_compressed_state(device, flag):
    state = make_state(SIZES, device, grad_dtype=BF16, moments=(BF16, BF16), remainders=True, amsgrad=True)
    before = clone_state(state)
    run(
        fused_adam_,
        state,
        step=4,
        found_inf=torch.tensor([flag], device=device),
        grad_scale=torch.tensor([2.0], device=device),
        **{**HYPER, "lr": torch.tensor(1e-2, device=device)},
    )
    assert_state_bitwise(state, before)
    run(fused_adam_, state, step=4, found_inf=torch.zeros(1, device=device), **HYPER)
    for key in ("params", "remainders", "exp_avgs", "exp_avg_sqs"):
        assert not torch.equal(bits(state[key][3]), bits(before[key][3])), (
            f"{key} not stepped with found_inf = 0"
        )


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------


def _bad_inputs():
    """(description, mutate(state, kwargs), exception, message regex)."""

    def t(n, dtype):
        return torch.zeros(n, dtype=dtype, device=DEVICES[0])

    def with_remainders(state, kwargs):
        state["params"] = [t(4, BF16), t(4, BF16)]
        kwargs["remainders"] = [t(4, torch.int16), t(4, torch.int16)]

    def chain(*fns):
        def mutate(state, kwargs):
            for fn in fns:
                fn(state, kwargs)

        return mutate

    return [
        (
            "remainders with param_copies",
            chain(with_remainders, lambda s, k: k.update(param_copies=[t(4, BF16), None])),
            ValueError,
            r"param_copies must be None when remainders are given",
        ),
        (
            "fp32 param with remainders",
            chain(with_remainders, lambda s, k: s["params"].__setitem__(1, t(4, F32))),
            TypeError,
            r"params\[1\] has dtype torch.float32; expected one of: bfloat16 \(with remainders",
        ),
        (
            "bf16 param without remainders",
            lambda s, k: s["params"].__setitem__(0, t(4, BF16)),
            TypeError,
            r"params\[0\] has dtype torch.bfloat16; expected one of: float32 \(bf16 params need remainders=",
        ),
        (
            "int32 remainder",
            chain(with_remainders, lambda s, k: k["remainders"].__setitem__(0, t(4, torch.int32))),
            TypeError,
            r"remainders\[0\] has dtype torch.int32; expected one of: int16",
        ),
        (
            "short remainders",
            chain(with_remainders, lambda s, k: k["remainders"].pop()),
            ValueError,
            r"remainders has 1 tensors but params has 2",
        ),
        (
            "remainder numel",
            chain(with_remainders, lambda s, k: k["remainders"].__setitem__(1, t(5, torch.int16))),
            ValueError,
            r"remainders\[1\] has 5 elements but params\[1\] has 4",
        ),
        (
            "remainders not a list",
            chain(with_remainders, lambda s, k: k.update(remainders=t(4, torch.int16))),
            TypeError,
            r"remainders must be a list or tuple of tensors",
        ),
        (
            "fp16 exp_avg",
            lambda s, k: s["exp_avgs"].__setitem__(0, t(4, torch.float16)),
            TypeError,
            r"exp_avgs\[0\] has dtype torch.float16; expected one of: float32, bfloat16",
        ),
        (
            "max_exp_avg_sq dtype differs",
            lambda s, k: k.update(max_exp_avg_sqs=[t(4, BF16), t(4, F32)]),
            TypeError,
            r"max_exp_avg_sqs\[0\] has dtype torch.bfloat16; expected one of: float32 \(exp_avg_sqs\[0\]'s dtype\)",
        ),
    ]


@pytest.mark.parametrize(
    "case", range(len(_bad_inputs())), ids=[c[0].replace(" ", "_") for c in _bad_inputs()]
)
def test_compressed_state_rejects_bad_inputs(case):
    description, mutate, error, message = _bad_inputs()[case]
    state = make_state([4, 4], DEVICES[0])
    kwargs = dict(step=1, **HYPER)
    mutate(state, kwargs)
    with pytest.raises(error, match=message):
        run(fused_adam_, state, **kwargs)


# --------------------------------------------------------------------------------------------
# compiled code (no GPU needed: Triton compiles for a named target on the CPU)
# --------------------------------------------------------------------------------------------

_COMPILE_CHECK = r"""
import re, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
adam = importlib.import_module("gpu_kernels.adam")
from gpu_kernels import _runtime
import inspect
if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
    print(f"SKIP triton {triton.__version__}: this check uses the ahead-of-time API of triton >= 3.3 "
          f"(the launch-path compile covers every release: .ci/compile_matrix.sh)")
    sys.exit(0)
fn = _runtime._namespace(adam._fused_adam_kernel.fn.__globals__, "compile")["_fused_adam_kernel"]
names = fn.arg_names
floats = ["step_size", "decay", "bias_correction1", "grad_scale", "one_minus_beta1", "beta2",
          "one_minus_beta2", "eps", "weight_decay", "bias_correction2_sqrt"]
signature = dict(meta_ptr="*i64", chunk_ptr="*i64", lr_ptr="*fp32", grad_scale_ptr="*fp32",
                 found_inf_ptr="*fp32", **{n: "fp32" for n in floats})
cfg = adam.LAUNCH_CONFIG["cuda"]
# (exp_avg, exp_avg_sq, remainder, amsgrad) -> 16-byte loads / stores per thread per iteration:
# fp32 p, m, v: 2 each; bf16 p, remainder, m, v, grad: 1 each
for m_code, v_code, remainder, amsgrad, loads, stores in [(2, 2, True, False, 5, 4), (2, 2, False, True, 6, 5),
                                                          (1, 2, True, True, 7, 6)]:
    constexprs = dict(META=adam._META, GRAD_CODE=2, COPY_CODE=0, LR_ON_DEVICE=True, SCALE_MODE=2,
                      HAS_FOUND_INF=True, WEIGHT_DECAY=True, DECOUPLED=True, AMSGRAD=amsgrad,
                      EXP_AVG_CODE=m_code, EXP_AVG_SQ_CODE=v_code, REMAINDER=remainder, ALIGNED=True,
                      BLOCK=cfg["BLOCK"], ITERS=cfg["ITERS"])
    src = ASTSource(fn, {n: "constexpr" if n in constexprs else signature[n] for n in names},
                    constexprs=constexprs,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ("meta_ptr", "chunk_ptr")})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"])).asm["ptx"]
    ld = len(re.findall(r"ld\.global[.\w]*\.v4", ptx))
    st = len(re.findall(r"st\.global[.\w]*\.v4", ptx))
    print("adam", m_code, v_code, remainder, amsgrad, "ld.v4", ld, "st.v4", st)
    # BLOCK elements over 32 * num_warps threads: 8 per thread, 16 B = 8 bf16 or 4 fp32
    per_thread = cfg["BLOCK"] // (32 * cfg["num_warps"]) // 8
    assert ld >= loads * per_thread * cfg["ITERS"] and st >= stores * per_thread * cfg["ITERS"], (ld, st)
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_compressed_kernels_compile_for_sm90_with_vector_accesses():
    """The interpreter does not run the compiler: compile the bf16-moment and remainder
    variants for sm_90 (bitcasts, uint16 pointers, shifts) and check they keep 16-byte vector
    accesses. In a subprocess: the interpreter patches triton.language in this one."""
    run_compile_check(_COMPILE_CHECK)


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_compressed_state_on_cuda_within_bf16_rounding_of_the_reference():
    """The compiled kernel (it may contract multiply-adds) against the fp64 reference: masters
    within fp32 rounding, bf16 params and moments within one bf16 ulp; then the remainder run
    is the fp32-master run exactly over 20 steps, the kernel's decode/encode round trip is
    bitwise, and an overflow step writes nothing."""
    for grad_dtype, moments, remainders, amsgrad, decoupled in [
        (BF16, (BF16, BF16), True, False, True),
        (torch.float16, (BF16, F32), False, True, False),
        (F32, (F32, BF16), True, True, True),
    ]:
        state = make_state(
            SIZES + [1 << 20],
            "cuda",
            grad_dtype=grad_dtype,
            moments=moments,
            remainders=remainders,
            amsgrad=amsgrad,
        )
        expected = clone_state(state)
        kwargs = dict(step=5, decoupled=decoupled, grad_scale=torch.tensor([0.5], device="cuda"), **HYPER)
        run(fused_adam_, state, **kwargs)
        run(fused_adam_reference_, expected, **kwargs)
        assert_state_within_rounding(state, expected)
    _twenty_steps("cuda", moments=(BF16, BF16), amsgrad=False, decoupled=True, grad_dtype=BF16)
    _twenty_steps("cuda", moments=(F32, BF16), amsgrad=True, decoupled=False, grad_dtype=F32, steps=8)
    test_kernel_remainder_round_trip_is_bitwise_for_every_non_nan_pattern("cuda")
    test_found_inf_writes_no_compressed_state("cuda", float("inf"))
