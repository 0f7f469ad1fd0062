"""The q8 format of Adam's moments (issue 38, first slice): bitsandbytes' dynamic maps, blocks of
256 with one absmax each, the fast quantizer proven equal to the reference on every fp32 value,
the reference q8 Adam step, and the Triton kernel bitwise equal to it under Triton's interpreter.

References: `cpu_kernels.q8_reference` (the format and the step), `cpu_kernels.reference`
(the fp32 step it reuses, and the fp64 one), and the map values pinned below.
"""

import hashlib
import math

import pytest
import torch
from tolerances import assert_close

import gpu_kernels
from cpu_kernels import q8_reference as q8
from cpu_kernels.reference import adam_step_bitwise_reference, adam_step_reference, bf16_round_reference
from gpu_kernels import q8 as gpu_q8

needs_interpreter = pytest.mark.skipif(
    gpu_kernels.unavailable_reason("cpu") is not None,
    reason=f"Triton's interpreter: {gpu_kernels.unavailable_reason('cpu')}",
)
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

F32, BF16 = torch.float32, torch.bfloat16
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SIGNS = [pytest.param(True, id="signed"), pytest.param(False, id="unsigned")]


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def as_f32(u):
    """int64 bit patterns in [0, 2**32) -> fp32 tensor."""
    u = torch.as_tensor(u, dtype=torch.int64)
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


# ------------------------------------------------------------------------------------- maps

# sha256 of the 256 fp32 values' little-endian bytes, and single values, as bitsandbytes'
# create_dynamic_map builds them with torch 2.13 on this AVX2 host (its linspace fusing
# start + step·k). The last two per map are where torch's scalar (ATEN_CPU_CAPABILITY=default)
# build rounds twice and lands one ulp away: 0xbf3d6667, 0xbf363333, 0x381fe867, 0x397c5048.
MAP_SHA256 = {
    True: "e732639a65f497b4ad684bb166a4467708255edd5207757de8b8f0c7e1fda89c",
    False: "305f002cc11278fb769d13b25b9fd0c7c83c8402c40a878fe086f4039fde6398",
}
MAP_VALUES = {
    True: {
        0: 0xBF7E3333,
        1: 0xBF7A999A,
        126: 0xB513A3B7,
        127: 0x0,
        128: 0x3513A3B7,
        254: 0x3F7E3333,
        255: 0x3F800000,
        18: 0xBF3D6666,
        20: 0xBF363334,
    },
    False: {
        0: 0x0,
        1: 0x34AE7BAA,
        126: 0x3DCB5C29,
        127: 0x3DD40000,
        128: 0x3DE26666,
        254: 0x3F7F199A,
        255: 0x3F800000,
        9: 0x381FE868,
        17: 0x397C5049,
    },
}


@pytest.mark.parametrize("signed", SIGNS)
def test_dynamic_maps_are_bitsandbytes_maps_value_for_value(signed):
    qmap = q8.dynamic_map(signed)
    assert qmap.dtype == F32 and qmap.shape == (256,)
    assert hashlib.sha256(qmap.numpy().tobytes()).hexdigest() == MAP_SHA256[signed]
    for index, want in MAP_VALUES[signed].items():
        assert bits(qmap)[index].item() & 0xFFFFFFFF == want, index
    assert bool((qmap[1:] > qmap[:-1]).all()), "strictly ascending"
    assert qmap[q8.ZERO_CODE[signed]].item() == 0.0
    if signed:  # lopsided: +1.0 on top, -0.99296875 at the bottom
        assert qmap[255].item() == 1.0 and qmap[0].item() == -0.992968738079071
        assert torch.equal(qmap[1:127], -qmap[128:254].flip(0))


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="torch's scalar linspace rounds start + step*k twice; the maps are the fused ones",
)
@pytest.mark.parametrize("signed", SIGNS)
def test_dynamic_maps_equal_the_maps_torch_builds_from_linspace(signed):
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** (i if signed else i + 1) + 1)
        midpoints = (edges[:-1] + edges[1:]) / 2.0
        values += (10 ** (i - 6) * midpoints).tolist()
        if signed:
            values += (-(10 ** (i - 6)) * midpoints).tolist()
    assert torch.equal(bits(q8.dynamic_map(signed)), bits(torch.tensor(sorted(values), dtype=F32)))


def test_the_device_codebook_is_the_reference_maps_and_tables():
    book = gpu_q8.codebook("cpu")
    want = torch.cat(
        [
            bits(q8.dynamic_map(True)),
            bits(q8.dynamic_map(False)),
            q8.bucket_table(True).flatten(),
            q8.bucket_table(False).flatten(),
        ]
    )
    assert torch.equal(book, want)


# ---------------------------------------------------------------------------- the quantizers


def nearest_code_oracle(x, signed):
    """Brute force: argmin over all 256 |x - map| in fp64, exact ties to the even code."""
    qmap = q8.dynamic_map(signed).double()
    dist = (x.double().view(-1, 1) - qmap.view(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = torch.where(dist == best, torch.arange(256), 1 << 20)
    even = torch.where(candidates % 2 == 0, candidates, 1 << 20).min(dim=1).values
    return torch.where(even < 1 << 20, even, candidates.min(dim=1).values).to(torch.uint8)


def boundary_points(signed):
    """Each map value, each midpoint between neighbours (rounded to fp32) and the fp32 values on
    either side of it, 0, -0, +-1."""
    qmap = q8.dynamic_map(signed)
    mids = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()
    around = [
        torch.nextafter(mids, torch.full_like(mids, -math.inf)),
        mids,
        torch.nextafter(mids, torch.full_like(mids, math.inf)),
    ]
    return torch.cat([qmap, *around, torch.tensor([0.0, -0.0, 1.0, -1.0])])


@pytest.mark.parametrize("signed", SIGNS)
def test_fast_quantizer_equals_reference_at_every_code_boundary(signed):
    x = boundary_points(signed)
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.exp(torch.empty(100_000).uniform_(math.log(1e-9), 0.0, generator=gen))
    signs = torch.where(torch.rand(100_000, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.cat([x, magnitudes * signs])
    reference = q8.quantize_reference(x, signed)
    assert torch.equal(q8.quantize_fast(x, signed), reference)
    in_range = x if signed else x.clamp_min(0.0)
    assert torch.equal(reference, nearest_code_oracle(in_range, signed))
    # the map values quantize to themselves
    assert torch.equal(q8.quantize_fast(q8.dynamic_map(signed), signed).long(), torch.arange(256))


@pytest.mark.parametrize("signed", SIGNS)
def test_exact_ties_go_to_the_even_code(signed):
    qmap = q8.dynamic_map(signed).double()
    mids = (qmap[:-1] + qmap[1:]) / 2
    exact = mids.float().double() == mids
    assert int(exact.sum()) > 100  # representable midpoints, so the rule is exercised
    lower = torch.arange(255)[exact]
    codes = q8.quantize_fast(mids[exact].float(), signed).long()
    assert bool(((codes == lower) | (codes == lower + 1)).all())
    assert bool((codes % 2 == 0).all())
    assert torch.equal(codes, q8.quantize_reference(mids[exact].float(), signed).long())


def piece_ends(signed):
    """For each sign, the first and last fp32 bit pattern of every piece on which the fast
    quantizer is constant: buckets split at their step, the magnitudes below 2**-23 (bucket 0),
    those from 1.0 to inf (the last bucket), and the NaNs."""
    table = q8.bucket_table(signed).to(torch.int64)
    points = []
    for sign in (0, 1):
        top = sign << 31
        points += [
            top,
            top | ((q8.KEY_FIRST + 1) << 16) - 1,  # clamped to bucket 0
            top | 0x3F800000,
            top | 0x7F800000,
            top | 0x7F800001,
            top | 0x7FFFFFFF,
        ]
        for key in range(q8.KEYS - 1):
            lo = (q8.KEY_FIRST + key) << 16
            step = int(table[sign, key]) & ((1 << q8.STEP_BITS) - 1)
            if step == q8.NO_STEP:
                points += [top | lo, top | lo + 0xFFFF]
            else:
                points += [top | lo, top | lo + step - 1, top | lo + step, top | lo + 0xFFFF]
    return torch.tensor([p for p in points if 0 <= p < 1 << 32], dtype=torch.int64)


@pytest.mark.parametrize("signed", SIGNS)
def test_fast_quantizer_equals_reference_for_every_float32(signed):
    # The fast code is constant on each piece (it depends on the bucket and on one compare of
    # the low bits). The reference is monotone in x (a binary search over sorted midpoints,
    # ties to a neighbour), so equal at both ends of a piece means equal on all of it; NaNs are
    # one piece per sign by definition. Hence equal on all 2**32 bit patterns.
    ends = piece_ends(signed)
    x = as_f32(ends)
    assert torch.equal(q8.quantize_fast(x, signed), q8.quantize_reference(x, signed))
    for sign in (0, 1):
        ordered = ends[(ends >> 31) == sign]
        ordered = ordered[(ordered & 0x7FFFFFFF) <= 0x7F800000].sort().values
        codes = q8.quantize_reference(as_f32(ordered), signed).long()
        steps = codes[1:] - codes[:-1]
        assert bool((steps >= 0).all() if sign == 0 else (steps <= 0).all()), "reference not monotone"
    assert len(ends) > 4 * q8.KEYS


# ---------------------------------------------------------------------------- blocks of 256


def test_blocks_have_one_absmax_each_and_a_partial_last_block():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(700, generator=gen) * torch.logspace(-3, 1, 700)
    values[256:512] = 0.0  # an all-zero block
    q = q8.quantize_blocks(values, signed=True)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (700,)
    assert q.absmax.dtype == F32 and q.absmax.shape == (3,)
    for b, block in enumerate(values.split(256)):
        assert q.absmax[b].item() == block.abs().max().item()
    assert q.absmax[1].item() == 0.0 and bool((q.codes[256:512] == 127).all())
    back = q8.dequantize_blocks(q, signed=True)
    assert bool((back[256:512] == 0).all())
    # within half the widest gap of the map (the bottom: -1 to -0.99297) of each block's absmax
    error = (back - values).abs() / q.absmax.repeat_interleave(256)[:700].clamp_min(1e-30)
    assert float(error.max()) <= 0.0071
    assert torch.equal(q8.quantize_blocks(values, True, fast=False).codes, q.codes)


def test_a_non_finite_value_makes_its_block_non_finite_and_no_other():
    values = torch.randn(600)
    values[300] = math.nan
    values[10] = math.inf
    q = q8.quantize_blocks(values, signed=True)
    back = q8.dequantize_blocks(q, signed=True)
    assert math.isnan(q.absmax[1].item()) and bool(back[256:512].isnan().all())
    assert math.isinf(q.absmax[0].item()) and not bool(back[:256].isfinite().any())
    assert bool(back[512:].isfinite().all())


def test_requantizing_a_dequantized_exp_avg_changes_it_so_state_keeps_codes_and_scales():
    # the signed map's bottom is -0.99297, not -1: a block whose largest magnitude is negative
    # shrinks its absmax when dequantized and quantized again (issue 38: banks hold the codes)
    values = torch.linspace(-1.0, 0.5, 256)
    once = q8.quantize_blocks(values, signed=True)
    twice = q8.quantize_blocks(q8.dequantize_blocks(once, signed=True), signed=True)
    assert twice.absmax.item() < once.absmax.item()
    assert not torch.equal(q8.dequantize_blocks(twice, signed=True), q8.dequantize_blocks(once, signed=True))


def test_dequantize_refuses_an_absmax_count_that_does_not_fit():
    with pytest.raises(ValueError, match="300 codes need 2 absmax values"):
        q8.dequantize_blocks(q8.Q8Blocks(torch.zeros(300, dtype=torch.uint8), torch.ones(3)), signed=True)


# ------------------------------------------------------------------------------ the Adam step

MOMENT_FORMATS = [("q8", "q8"), ("q8", F32), ("q8", BF16), (F32, "q8"), (BF16, "q8")]


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
        state["param"], state["remainder"] = gpu_kernels.encode_remainder(master)
    return state


def widen(moment, signed):
    return moment.float() if isinstance(moment, torch.Tensor) else q8.dequantize_blocks(moment, signed)


def same_bits(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(bits(a), bits(b))
    return torch.equal(a.codes, b.codes) and torch.equal(bits(a.absmax), bits(b.absmax))


@pytest.mark.parametrize("formats", MOMENT_FORMATS, ids=lambda f: "-".join(map(str, f)))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
def test_step_reference_updates_the_param_from_the_fresh_fp32_moments(formats, amsgrad):
    state = make_state(1000, formats, amsgrad=amsgrad)
    p, m, v, vmax, _ = q8.q8_adam_step_reference(**state, step=4, **HYPER)
    # the fp32 step on the dequantized moments, fused multiply-adds off, is the param's and
    # each moment's value before it is stored
    fp32 = adam_step_bitwise_reference(
        state["param"],
        state["grad"],
        widen(state["exp_avg"], True),
        widen(state["exp_avg_sq"], False),
        step=4,
        max_exp_avg_sq=widen(state["max_exp_avg_sq"], False) if amsgrad else None,
        fma=False,
        **HYPER,
    )
    assert torch.equal(bits(p), bits(fp32[0]))
    for new, old, value, signed in (
        (m, state["exp_avg"], fp32[1], True),
        (v, state["exp_avg_sq"], fp32[2], False),
    ):
        if isinstance(old, torch.Tensor):
            want = bf16_round_reference(value) if old.dtype == BF16 else value
            assert new.dtype == old.dtype and torch.equal(bits(new), bits(want))
        else:
            assert same_bits(new, q8.quantize_blocks(value, signed))
    if amsgrad:
        assert same_bits(
            vmax,
            q8.quantize_blocks(fp32[3], False)
            if formats[1] == "q8"
            else bf16_round_reference(fp32[3])
            if formats[1] == BF16
            else fp32[3],
        )
    # the quantized moments differ from the fresh ones, so the param's bits tell them apart
    for new, value, signed in ((m, fp32[1], True), (v, fp32[2], False)):
        if not isinstance(new, torch.Tensor):
            assert not torch.equal(q8.dequantize_blocks(new, signed), value)


def test_step_reference_is_adam_within_the_quantization_error():
    state = make_state(3000, ("q8", "q8"), seed=3)
    p, m, v, _, _ = q8.q8_adam_step_reference(**state, step=2, **HYPER)
    p64, m64, v64, _ = adam_step_reference(
        state["param"],
        state["grad"],
        widen(state["exp_avg"], True),
        widen(state["exp_avg_sq"], False),
        step=2,
        **HYPER,
    )
    assert_close(p, p64, F32)
    for q, exact, signed, gap in ((m, m64, True, 0.0071), (v, v64, False, 0.0036)):
        scale = q.absmax.repeat_interleave(256)[: exact.numel()].double()
        assert float(((q8.dequantize_blocks(q, signed) - exact).abs() / scale).max()) <= gap


# -------------------------------------------------------------------------- the Triton kernel

SIZES = [1, 255, 256, 257, 4096 + 300]  # partial blocks, one block, several programs


def kernel_args(states):
    keys = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder")
    lists = {k: [s[k] for s in states] for k in keys if k in states[0]}
    return dict(
        params=lists["param"],
        grads=lists["grad"],
        exp_avgs=lists["exp_avg"],
        exp_avg_sqs=lists["exp_avg_sq"],
        max_exp_avg_sqs=lists.get("max_exp_avg_sq"),
        remainders=lists.get("remainder"),
    )


def to_device_format(state):
    out = {}
    for key, value in state.items():
        out[key] = (
            value.clone()
            if isinstance(value, torch.Tensor)
            else gpu_q8.Q8Blocks(value.codes.clone(), value.absmax.clone())
        )
    return out


def assert_state_equals(kernel_state, reference, what=""):
    names = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder")
    for name, want in zip(names, reference):
        if want is not None:
            assert same_bits(kernel_state[name], want), f"{what} {name}"


def reference_step(state, **kwargs):
    return q8.q8_adam_step_reference(**state, **kwargs)


def with_result(state, result):
    names = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder")
    return {**state, **{k: v for k, v in zip(names, result) if v is not None}}


@needs_interpreter
@pytest.mark.parametrize("formats", MOMENT_FORMATS, ids=lambda f: "-".join(map(str, f)))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
def test_kernel_equals_reference_bitwise_over_three_steps(formats, amsgrad):
    states = [make_state(n, formats, amsgrad=amsgrad, seed=i) for i, n in enumerate(SIZES)]
    device_states = [to_device_format(s) for s in states]
    for step in (1, 2, 3):
        gpu_q8.q8_adam_(**kernel_args(device_states), step=step, **HYPER)
        states = [with_result(s, reference_step(s, step=step, **HYPER)) for s in states]
        for i, (got, want) in enumerate(zip(device_states, states)):
            assert_state_equals(
                got,
                [want.get(k) for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder")],
                f"step {step} tensor {i} ({SIZES[i]} elements)",
            )


def boundary_grads(absmax):
    """Blocks of 256 whose values divided by `absmax` land on and around every code boundary of
    both maps (each block's first value is `absmax` itself, so it is the block's absmax)."""
    points = torch.cat([boundary_points(True), boundary_points(False).abs().sqrt()]).abs()
    points = points[points <= 1.0]
    scaled = (points.double() * absmax).float()
    scaled = torch.cat(
        [
            torch.nextafter(scaled, torch.zeros_like(scaled)),
            scaled,
            torch.nextafter(scaled, torch.full_like(scaled, 2 * absmax)),
        ]
    ).clamp_max(absmax)
    signs = torch.where(torch.arange(scaled.numel()) % 2 == 0, 1.0, -1.0)
    blocks = (scaled * signs).split(255)
    return torch.cat([torch.cat([torch.tensor([absmax]), b]) for b in blocks])


@needs_interpreter
def test_kernel_quantizes_values_at_every_code_boundary_as_the_reference():
    # beta1 = beta2 = 0 and zero moments make the new moments g and g·g exactly, so the
    # quantizer sees x = g / absmax on and beside every boundary (absmax 3: the division is
    # inexact, so dividing by a reciprocal instead would move codes)
    grad = boundary_grads(3.0)
    n = grad.numel()
    zero_m = q8.Q8Blocks(torch.full((n,), 127, dtype=torch.uint8), torch.zeros(-(-n // 256)))
    zero_v = q8.Q8Blocks(torch.zeros(n, dtype=torch.uint8), torch.zeros(-(-n // 256)))
    state = dict(param=torch.randn(n), grad=grad, exp_avg=zero_m, exp_avg_sq=zero_v)
    hyper = {**HYPER, "beta1": 0.0, "beta2": 0.0}
    device_state = to_device_format(state)
    gpu_q8.q8_adam_(**kernel_args([device_state]), step=1, **hyper)
    want = reference_step(state, step=1, **hyper)
    assert torch.equal(q8.dequantize_blocks(want[1], True).abs().max(), torch.tensor(3.0))
    assert_state_equals(device_state, want, "boundary values")


VARIANTS = {
    "adam-l2": dict(decoupled=False),
    "no-decay": dict(weight_decay=0.0),
    "scale-float": dict(grad_scale=0.25),
    "scale-tensor-found-inf-0": dict(grad_scale=torch.tensor([0.5]), found_inf=torch.zeros(1)),
    "remainders-bf16-grads": dict(remainders=True, grad_dtype=BF16),
    "fp16-grads-bf16-copy": dict(grad_dtype=torch.float16, copy=BF16),
}


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_equals_reference_bitwise_for_each_input_kind(variant):
    options = dict(VARIANTS[variant])
    remainders, grad_dtype, copy = (
        options.pop("remainders", False),
        options.pop("grad_dtype", F32),
        options.pop("copy", None),
    )
    states = [
        make_state(n, ("q8", "q8"), remainders=remainders, grad_dtype=grad_dtype, seed=i)
        for i, n in enumerate(SIZES)
    ]
    device_states = [to_device_format(s) for s in states]
    copies = [torch.empty(s["param"].numel(), dtype=copy) for s in states] if copy else None
    hyper = {**HYPER, **options}
    gpu_q8.q8_adam_(**kernel_args(device_states), step=5, param_copies=copies, **hyper)
    ref_hyper = {k: v for k, v in hyper.items() if k != "found_inf"}
    if isinstance(ref_hyper.get("grad_scale"), torch.Tensor):
        ref_hyper["grad_scale"] = float(ref_hyper["grad_scale"])
    for i, state in enumerate(states):
        want = reference_step(state, step=5, **ref_hyper)
        assert_state_equals(device_states[i], want, f"{variant} tensor {i}")
        if copies:
            assert torch.equal(bits(copies[i]), bits(bf16_round_reference(want[0])))


@needs_interpreter
def test_kernel_writes_nothing_when_found_inf_is_set():
    states = [make_state(n, ("q8", "q8"), amsgrad=True, seed=i) for i, n in enumerate(SIZES)]
    device_states = [to_device_format(s) for s in states]
    gpu_q8.q8_adam_(**kernel_args(device_states), step=1, found_inf=torch.ones(1), **HYPER)
    for got, before in zip(device_states, states):
        for name in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert same_bits(got[name], before[name]), name


@needs_interpreter
def test_kernel_equals_reference_on_zero_and_non_finite_blocks():
    state = make_state(1024, ("q8", "q8"), seed=7)
    state["grad"][:256] = 0.0  # with zero moments: all-zero blocks, absmax 0
    state["exp_avg"].codes[:256] = 127
    state["exp_avg_sq"].codes[:256] = 0
    state["grad"][600] = math.inf
    state["grad"][900] = math.nan
    device_state = to_device_format(state)
    gpu_q8.q8_adam_(**kernel_args([device_state]), step=2, **HYPER)
    want = reference_step(state, step=2, **HYPER)
    assert float(want[1].absmax[0]) == 0.0 and math.isnan(float(want[1].absmax[3]))
    assert_state_equals(device_state, want, "zero and non-finite blocks")


@needs_interpreter
@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (
            lambda s: s.update(exp_avg=gpu_q8.Q8Blocks(s["exp_avg"].codes, s["exp_avg"].absmax[:-1])),
            ValueError,
            r"exp_avgs\[0\]\.absmax has 2 elements; params\[0\]'s 600 elements need 3 \(one per block",
        ),
        (
            lambda s: s.update(
                exp_avg_sq=gpu_q8.Q8Blocks(s["exp_avg_sq"].codes.to(torch.int8), s["exp_avg_sq"].absmax)
            ),
            TypeError,
            r"exp_avg_sqs\[0\]\.codes must be a torch\.uint8 tensor, got torch\.int8",
        ),
        (
            lambda s: s.update(max_exp_avg_sq=torch.zeros(600)),
            TypeError,
            r"max_exp_avg_sqs\[0\] must have exp_avg_sqs\[0\]'s format",
        ),
        (
            lambda s: s.update(exp_avg=torch.zeros(600, dtype=torch.float16)),
            TypeError,
            r"exp_avgs\[0\] has dtype torch\.float16",
        ),
    ],
)
def test_kernel_refuses_bad_moments_naming_them(mutate, error, message):
    state = to_device_format(make_state(600, ("q8", "q8"), amsgrad=True))
    mutate(state)
    with pytest.raises(error, match=message):
        gpu_q8.q8_adam_(**kernel_args([state]), step=1, **HYPER)


def test_kernel_refuses_an_lr_it_cannot_read_on_the_host():
    state = to_device_format(make_state(10, ("q8", "q8")))
    with pytest.raises(ValueError, match="lr as a float or a 1-element CPU tensor"):
        gpu_q8.q8_adam_(**kernel_args([state]), step=1, **{**HYPER, "lr": torch.tensor([1e-2, 1e-3])})
