"""Adam / AdamW over 8-bit blockwise moments ("q8", issue 38): the Triton kernel and its launcher
(`q8_adam_`).

The format and the step are `cpu_kernels.q8_reference`'s; the kernel packages do not import each
other, so this module builds the same codebook itself and the tests hold it to the reference.
Invariant: every multiply and add rounds on its own (`enable_fp_fusion=False`, no `tl.fma`), so
the bits are the reference's. The formula: docs/internals.md."""

import functools
import math
import struct
from fractions import Fraction
from typing import NamedTuple

import torch

from . import _runtime
from ._runtime import lazy_jit
from .adam import _check_hyperparameters, _check_tensor, _seven_lists

tl = _runtime.language()

BLOCK = 256  # elements per absmax
# the kernel's dtype codes, one table per argument (they coincide)
_GRAD_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_COPY_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_MOMENT_DTYPES = {torch.float32: 1, torch.bfloat16: 2}
Q8 = 3  # a moment's code when it is Q8Blocks
_SCALE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_FOUND_INF_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)

# one int64 row per tensor: numel, then the addresses of param, grad, exp_avg, its absmax,
# exp_avg_sq, its absmax, max_exp_avg_sq, its absmax, param_copy, remainder (0 when absent)
_META = 11

# The codebook, one int32 tensor per device: the signed and the unsigned map's fp32 bits, then
# each map's bucket table (rows x >= +0 and x <= -0), as cpu_kernels.q8_reference builds them.
_KEY_FIRST = 0x3400  # (bits of 2**-23) >> 16: smaller magnitudes quantize to 0.0
_KEYS = 0x3F80 - _KEY_FIRST + 1  # up to the bucket of 1.0
_SIGNED_MAP, _UNSIGNED_MAP = 0, 256
_SIGNED_TABLE, _UNSIGNED_TABLE = 512, 512 + 2 * _KEYS
_CODEBOOK_SIZE = 512 + 4 * _KEYS

# QBLOCKS blocks of 256 per program. The interpreter costs ~0.7 ms per program whatever its size.
LAUNCH_CONFIG = {
    "cuda": dict(QBLOCKS=4, num_warps=4),
    "cpu": dict(QBLOCKS=16, num_warps=4),
}

_tables = _runtime.TableCache()


class Q8Blocks(NamedTuple):
    """A q8 moment: `codes` uint8 [n], `absmax` fp32 [ceil(n / 256)] (cpu_kernels' Q8Blocks
    has the same fields)."""

    codes: torch.Tensor
    absmax: torch.Tensor


# ---------------------------------------------------------------------------------- codebook


def _bits32(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits32(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _round32(q):
    """The fp32 value nearest to the exact rational q, ties to even."""
    guess = struct.unpack("<f", struct.pack("<f", float(q)))[0]
    u = _bits32(guess)
    neighbours = [guess] + [_from_bits32(w) for w in (u - 1, u + 1) if 0 <= w < 1 << 32]
    return min(neighbours, key=lambda y: (abs(Fraction(y) - q), _bits32(y) & 1))


def _dynamic_map(signed):
    """bitsandbytes' create_dynamic_map(signed) in exact arithmetic (see cpu_kernels.q8_reference:
    torch.linspace's fused start + step·k, means of neighbours, times 10**(i-6) rounded to fp32)."""
    values = [0.0, 1.0]
    start, end = _round32(Fraction(0.1)), 1.0
    for i in range(7):
        n = 2 ** (i if signed else i + 1) + 1
        step = _round32(Fraction(_round32(Fraction(end) - Fraction(start))) / (n - 1))
        bounds = [
            _round32(Fraction(start) + Fraction(step) * k)
            if k < n // 2
            else _round32(Fraction(end) - Fraction(step) * (n - 1 - k))
            for k in range(n)
        ]
        scale = _round32(Fraction(10.0 ** (i - 6)))
        for a, b in zip(bounds, bounds[1:]):
            mean = _round32(_round32(Fraction(a) + Fraction(b)) / 2)
            values += [_round32(Fraction(scale) * Fraction(mean))]
            if signed:
                values += [_round32(Fraction(-scale) * Fraction(mean))]
    return sorted(values)


def _bucket_table(qmap, zero_code):
    """Two rows of _KEYS entries (x >= +0, x <= -0): rank << 17 | the low 16 bits where the
    rank steps (65536: nowhere in the bucket)."""
    firsts = ([], [])
    for c in range(1, 256):
        mid = abs((Fraction(qmap[c - 1]) + Fraction(qmap[c])) / 2)
        far = c if c > zero_code else c - 1
        if _round32(mid) == mid and far % 2 == 0:
            first = _bits32(float(mid))  # the tie goes to the far (even) code
        else:
            below = _round32(mid)
            first = _bits32(below) + (1 if Fraction(below) <= mid else 0)
        firsts[0 if c > zero_code else 1].append(first)
    rows = []
    for side in firsts:
        side.sort()
        row, rank = [], 0
        for key in range(_KEYS):
            lo = (_KEY_FIRST + key) << 16
            while rank < len(side) and side[rank] <= lo:
                rank += 1
            inside = [f - lo for f in side[rank:] if f < lo + (1 << 16)]
            assert (
                len(inside) <= 1 and (key > 0 or rank == 0 and not inside) and (key < _KEYS - 1 or not inside)
            )
            row.append((rank << 17) | (inside[0] if inside else 1 << 16))
        rows += row
    return rows


@functools.lru_cache(maxsize=None)
def _codebook_values():
    signed, unsigned = _dynamic_map(True), _dynamic_map(False)
    words = [_bits32(x) for x in signed + unsigned]
    words += _bucket_table(signed, 127) + _bucket_table(unsigned, 0)
    assert len(words) == _CODEBOOK_SIZE
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


_codebooks = {}


def codebook(device) -> torch.Tensor:
    """int32 [512 + 4·2945] on `device`: the two maps' bits, then their bucket tables (made once
    per device)."""
    device = torch.device(device)
    book = _codebooks.get(device)
    if book is None:
        with _runtime.device_guard(device):
            book = torch.tensor(_codebook_values(), dtype=torch.int32).to(device)
        _codebooks[device] = book
    return book


# ------------------------------------------------------------------------------------ kernel


@lazy_jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (uint32 holding 16), round to nearest even; NaN -> 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return tl.where(x != x, 0x7FC0, bits)


@lazy_jit
def _quantize(x, book_ptr, TABLE: tl.constexpr, ZERO_CODE: tl.constexpr):
    """x = value / absmax -> its code (int32), from x's bits and one bucket-table entry."""
    u = x.to(tl.int32, bitcast=True)
    neg = (u < 0).to(tl.int32)
    mag = u & 0x7FFFFFFF
    key = tl.minimum(tl.maximum((mag >> 16) - 0x3400, 0), 0x3F80 - 0x3400)  # _KEY_FIRST, _KEYS - 1
    entry = tl.load(book_ptr + TABLE + neg * (0x3F80 - 0x3400 + 1) + key)
    rank = (entry >> 17) + ((mag & 0xFFFF) >= (entry & 0x1FFFF)).to(tl.int32)
    return tl.where(neg != 0, ZERO_CODE - rank, ZERO_CODE + rank)


@lazy_jit
def _load_moment(
    ptr, absmax_ptr, book_ptr, offs, blocks, mask, block_mask, CODE: tl.constexpr, MAP: tl.constexpr
):
    """A moment as fp32: q8 dequantized (CODE 3), bf16 widened (2), fp32 (1)."""
    if CODE == 3:
        codes = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        absmax = tl.load(absmax_ptr + blocks, mask=block_mask, other=0.0)
        value = tl.load(book_ptr + MAP + codes).to(tl.float32, bitcast=True)
        return value * absmax[:, None]
    elif CODE == 2:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@lazy_jit
def _store_moment(
    ptr,
    absmax_ptr,
    book_ptr,
    x,
    offs,
    blocks,
    mask,
    block_mask,
    CODE: tl.constexpr,
    TABLE: tl.constexpr,
    ZERO_CODE: tl.constexpr,
):
    """Stores an fp32 moment: q8 with a fresh absmax per block (CODE 3), bf16 (2), fp32 (1)."""
    if CODE == 3:
        # the largest magnitude on the bits: exact, and a NaN in the block becomes its absmax
        magnitude = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        absmax = tl.max(tl.where(mask, magnitude, 0), axis=1).to(tl.float32, bitcast=True)
        tl.store(absmax_ptr + blocks, absmax, mask=block_mask)
        scale = absmax[:, None]
        unit = tl.where(scale == 0.0, 0.0, tl.div_rn(x, tl.where(scale == 0.0, 1.0, scale)))
        tl.store(ptr + offs, _quantize(unit, book_ptr, TABLE, ZERO_CODE).to(tl.uint8), mask=mask)
    elif CODE == 2:
        tl.store(ptr + offs, _bf16_bits(x).to(tl.uint16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@lazy_jit
def _moment_ptr(address, CODE: tl.constexpr):
    if CODE == 3:
        return address.to(tl.pointer_type(tl.uint8))
    elif CODE == 2:
        return address.to(tl.pointer_type(tl.uint16))
    else:
        return address.to(tl.pointer_type(tl.float32))


@lazy_jit
def _q8_adam_kernel(
    meta_ptr,
    chunk_ptr,
    book_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    grad_scale,
    neg_step_size,
    decay,
    weight_decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    inv_bias_correction2_sqrt,
    eps,
    META: tl.constexpr,
    GRAD_CODE: tl.constexpr,
    COPY_CODE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    EXP_AVG_CODE: tl.constexpr,
    EXP_AVG_SQ_CODE: tl.constexpr,
    REMAINDER: tl.constexpr,
    ALIGNED: tl.constexpr,
    QBLOCKS: tl.constexpr,
):
    # program_id is int32: widen before it scales anything
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(chunk_ptr + 2 * pid)
    chunk = tl.load(chunk_ptr + 2 * pid + 1)
    row = meta_ptr + tensor * META
    numel = tl.load(row)
    if REMAINDER:  # the bf16 param and its remainder are read and written as bits
        p_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint16))
        r_ptr = tl.load(row + 10).to(tl.pointer_type(tl.uint16))
    else:
        p_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        r_ptr = p_ptr  # unused
    if GRAD_CODE == 1:
        g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    elif GRAD_CODE == 2:
        g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float16))
    m_ptr = _moment_ptr(tl.load(row + 3), EXP_AVG_CODE)
    m_absmax_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))  # unused unless q8
    v_ptr = _moment_ptr(tl.load(row + 5), EXP_AVG_SQ_CODE)
    v_absmax_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    vmax_ptr = v_ptr  # unused unless AMSGRAD; max_exp_avg_sq has exp_avg_sq's format
    vmax_absmax_ptr = v_absmax_ptr
    if AMSGRAD:
        vmax_ptr = _moment_ptr(tl.load(row + 7), EXP_AVG_SQ_CODE)
        vmax_absmax_ptr = tl.load(row + 8).to(tl.pointer_type(tl.float32))
    c_ptr = p_ptr  # unused unless COPY_CODE
    if COPY_CODE == 1:
        c_ptr = tl.load(row + 9).to(tl.pointer_type(tl.float32))
    elif COPY_CODE == 2:  # bf16, written as its bits
        c_ptr = tl.load(row + 9).to(tl.pointer_type(tl.uint16))
    elif COPY_CODE == 3:
        c_ptr = tl.load(row + 9).to(tl.pointer_type(tl.float16))
    if ALIGNED:
        # addresses loaded from memory carry no alignment facts: without these the compiler
        # emits one scalar access per element instead of 16-byte vectors
        p_ptr = tl.multiple_of(p_ptr, 16)
        r_ptr = tl.multiple_of(r_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        vmax_ptr = tl.multiple_of(vmax_ptr, 16)
        c_ptr = tl.multiple_of(c_ptr, 16)

    limit = numel
    if HAS_FOUND_INF:
        # read on the device, no host sync; an overflow step masks every access off
        limit = numel * (tl.load(found_inf_ptr) == 0).to(tl.int64)
    scale = grad_scale
    if SCALE_MODE == 2:
        scale = tl.load(grad_scale_ptr).to(tl.float32)

    start = chunk * (QBLOCKS * 256)
    rows = tl.arange(0, QBLOCKS)
    offs = start + rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    blocks = chunk * QBLOCKS + rows
    mask = offs < limit
    block_mask = (start + rows * 256) < limit

    if REMAINDER:
        # decode: undo the encoder's carry (mod 2**16) and join the halves (gpu_kernels.remainders)
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.uint32)
        lo = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.uint32)
        p = (((hi - (lo >> 15)) << 16) | lo).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = _load_moment(m_ptr, m_absmax_ptr, book_ptr, offs, blocks, mask, block_mask, EXP_AVG_CODE, 0)
    v = _load_moment(v_ptr, v_absmax_ptr, book_ptr, offs, blocks, mask, block_mask, EXP_AVG_SQ_CODE, 256)
    if SCALE_MODE != 0:
        g = g * scale
    if WEIGHT_DECAY:
        if not DECOUPLED:
            g = p * weight_decay + g
    m = (g - m) * one_minus_beta1 + m
    v = (g * g) * one_minus_beta2 + v * beta2
    if AMSGRAD:
        x0 = _load_moment(
            vmax_ptr, vmax_absmax_ptr, book_ptr, offs, blocks, mask, block_mask, EXP_AVG_SQ_CODE, 256
        )
        v_hat = tl.where(x0 > v, x0, v)  # NaN in v stays (torch.where's rule in the reference)
        _store_moment(
            vmax_ptr,
            vmax_absmax_ptr,
            book_ptr,
            v_hat,
            offs,
            blocks,
            mask,
            block_mask,
            EXP_AVG_SQ_CODE,
            512 + 2 * (0x3F80 - 0x3400 + 1),
            0,
        )
    else:
        v_hat = v
    # IEEE sqrt and division (Triton's defaults are approximate)
    update = tl.div_rn(m, tl.sqrt_rn(v_hat) * inv_bias_correction2_sqrt + eps) * neg_step_size
    if WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay + update
        else:
            p = p + update
    else:
        p = p + update
    if REMAINDER:
        # encode: the low half as it is; the high half rounded to nearest, ties away
        bits = p.to(tl.uint32, bitcast=True)
        lo = bits & 0xFFFF
        tl.store(p_ptr + offs, (((bits >> 16) + (lo >> 15)) & 0xFFFF).to(tl.uint16), mask=mask)
        tl.store(r_ptr + offs, lo.to(tl.uint16), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
    _store_moment(m_ptr, m_absmax_ptr, book_ptr, m, offs, blocks, mask, block_mask, EXP_AVG_CODE, 512, 127)
    _store_moment(
        v_ptr,
        v_absmax_ptr,
        book_ptr,
        v,
        offs,
        blocks,
        mask,
        block_mask,
        EXP_AVG_SQ_CODE,
        512 + 2 * (0x3F80 - 0x3400 + 1),
        0,
    )
    if COPY_CODE == 2:
        tl.store(c_ptr + offs, _bf16_bits(p).to(tl.uint16), mask=mask)
    elif COPY_CODE != 0:
        tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------- launcher


def q8_adam_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=None,
    found_inf=None,
    max_exp_avg_sqs=None,
    param_copies=None,
    remainders=None,
):
    """`fused_adam_`'s step (same arguments and meanings) where each exp_avgs[i] and
    exp_avg_sqs[i] is a `Q8Blocks` or an fp32/bf16 tensor; max_exp_avg_sqs[i] in exp_avg_sqs[i]'s
    format. Everything is written in place, codes and absmax included. `lr` is a float (or a CPU
    1-element tensor): the step's scalars are computed on the host in fp64, as the host tier's
    are. Bitwise `cpu_kernels.q8_reference.q8_adam_step_reference` on each tensor."""
    _check_hyperparameters(step, lr, beta1, beta2, eps, weight_decay)
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.device.type != "cpu":
            raise ValueError(
                "q8_adam_ takes lr as a float or a 1-element CPU tensor (its scalars are "
                f"computed on the host), got shape {tuple(lr.shape)} on {lr.device}"
            )
        lr = float(lr)
    lists = _checked_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders)
    if not lists[0]:
        return
    device = lists[0][0].device
    _runtime.require_runtime(device)
    scale_mode, scale_value, scale_tensor = 0, 1.0, None
    if isinstance(grad_scale, torch.Tensor):
        scale_tensor = _runtime.scalar_tensor_arg(grad_scale, "grad_scale", device, _SCALE_DTYPES)
        scale_mode = 2
    elif grad_scale is not None:
        scale_value = float(grad_scale)
        scale_mode = 0 if scale_value == 1.0 else 1
    if found_inf is not None:
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError(
                "found_inf must be a 1-element tensor on the device (or None), "
                f"got {type(found_inf).__name__}"
            )
        _runtime.scalar_tensor_arg(found_inf, "found_inf", device, _FOUND_INF_DTYPES)
    scalars = step_scalars(
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale=scale_value,
    )
    config = _runtime.launch_config(LAUNCH_CONFIG, device)
    chunk = config["QBLOCKS"] * BLOCK
    book = codebook(device)
    with _runtime.device_guard(device):
        for (codes, aligned), group in _groups(lists).items():
            grad_code, copy_code, exp_avg_code, exp_avg_sq_code = codes
            n_chunks = sum(-(-row[0] // chunk) for row in group)
            if n_chunks == 0:
                continue
            table = _tables.get(
                (device, chunk, tuple(group)), lambda: _build_table(group, chunk), device
            ).get()
            n_meta = len(group) * _META
            _q8_adam_kernel.launch(
                device,
                (n_chunks,),
                table[:n_meta],
                table[n_meta:],
                book,
                scale_tensor if scale_tensor is not None else table,
                found_inf if found_inf is not None else table,
                *scalars,
                META=_META,
                GRAD_CODE=grad_code,
                COPY_CODE=copy_code,
                SCALE_MODE=scale_mode,
                HAS_FOUND_INF=found_inf is not None,
                WEIGHT_DECAY=weight_decay != 0,
                DECOUPLED=bool(decoupled),
                AMSGRAD=lists[4] is not None,
                EXP_AVG_CODE=exp_avg_code,
                EXP_AVG_SQ_CODE=exp_avg_sq_code,
                REMAINDER=lists[6] is not None,
                ALIGNED=aligned,
                QBLOCKS=config["QBLOCKS"],
                num_warps=config["num_warps"],
                enable_fp_fusion=False,
            )


def _f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def step_scalars(*, step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale):
    """The kernel's fp32 scalars, computed in fp64 and rounded once, as
    cpu_kernels.reference.adam_step_bitwise_reference computes them: (grad_scale, −lr/bc1,
    1 − lr·wd (1 for Adam), wd, 1 − β1, β2, 1 − β2, 1/√bc2, ε)."""
    bias_correction1 = 1.0 - math.pow(beta1, float(step))
    bias_correction2 = 1.0 - math.pow(beta2, float(step))
    decay = _f32(1.0 - lr * weight_decay) if decoupled else 1.0
    return (
        _f32(grad_scale),
        _f32(-(lr / bias_correction1)),
        decay,
        _f32(weight_decay),
        _f32(1.0 - beta1),
        _f32(beta2),
        _f32(1.0 - beta2),
        _f32(1.0 / math.sqrt(bias_correction2)),
        _f32(eps),
    )


def _moment_parts(moment, name, i, device, numel):
    """(code, values tensor, absmax tensor or None), each checked."""
    if isinstance(moment, torch.Tensor):
        _check_tensor(moment, name, i, device, _MOMENT_DTYPES, numel, " (or Q8Blocks)")
        return _MOMENT_DTYPES[moment.dtype], moment, None
    if not (isinstance(moment, tuple) and len(moment) == 2):
        raise TypeError(
            f"{name}[{i}] must be a tensor or Q8Blocks(codes, absmax), got {type(moment).__name__}"
        )
    codes, absmax = moment
    blocks = -(-numel // BLOCK)
    for part, t, dtype, count in (
        ("codes", codes, torch.uint8, numel),
        ("absmax", absmax, torch.float32, blocks),
    ):
        where = f"{name}[{i}].{part}"
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{where} must be a {dtype} tensor, got {got}")
        if t.numel() != count:
            raise ValueError(
                f"{where} has {t.numel()} elements; params[{i}]'s {numel} elements need "
                f"{count} ({'one per element' if part == 'codes' else f'one per block of {BLOCK}'})"
            )
        if t.device != device:
            raise ValueError(f"{where} is on {t.device} but params[0] is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{where} is not contiguous")
    return Q8, codes, absmax


def _checked_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders):
    """fused_adam_'s list checks (adam._seven_lists), then each tensor's, q8 moments as their
    (code, codes, absmax) parts."""
    lists = _seven_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders = lists
    n = len(params)
    if n == 0:
        return (params, grads, [], [], None, None, None)
    if not isinstance(params[0], torch.Tensor):
        raise TypeError(f"params[0] must be a tensor, got {type(params[0]).__name__}")
    device = params[0].device
    param_dtypes = (torch.float32,) if remainders is None else (torch.bfloat16,)
    m_parts, v_parts, vmax_parts = [], [], []
    for i in range(n):
        _check_tensor(params[i], "params", i, device, param_dtypes, None)
        numel = params[i].numel()
        _check_tensor(grads[i], "grads", i, device, _GRAD_DTYPES, numel)
        m_parts.append(_moment_parts(exp_avgs[i], "exp_avgs", i, device, numel))
        v_parts.append(_moment_parts(exp_avg_sqs[i], "exp_avg_sqs", i, device, numel))
        if max_exp_avg_sqs is not None:
            vmax_parts.append(_moment_parts(max_exp_avg_sqs[i], "max_exp_avg_sqs", i, device, numel))
            if vmax_parts[-1][0] != v_parts[-1][0] or vmax_parts[-1][1].dtype != v_parts[-1][1].dtype:
                raise TypeError(f"max_exp_avg_sqs[{i}] must have exp_avg_sqs[{i}]'s format")
        if remainders is not None:
            _check_tensor(remainders[i], "remainders", i, device, (torch.int16,), numel)
        if param_copies is not None and param_copies[i] is not None:
            _check_tensor(param_copies[i], "param_copies", i, device, _COPY_DTYPES, numel)
    return (
        params,
        grads,
        m_parts,
        v_parts,
        vmax_parts if max_exp_avg_sqs is not None else None,
        param_copies,
        remainders,
    )


def _groups(lists) -> dict:
    """{((grad, copy, exp_avg, exp_avg_sq codes), 16-byte aligned): [table row]}."""
    params, grads, m_parts, v_parts, vmax_parts, param_copies, remainders = lists
    groups = {}
    for i, p in enumerate(params):
        c = param_copies[i] if param_copies is not None else None
        (m_code, m, m_absmax), (v_code, v, v_absmax) = m_parts[i], v_parts[i]
        vmax = vmax_absmax = None
        if vmax_parts is not None:
            _, vmax, vmax_absmax = vmax_parts[i]

        def address(t):
            return t.data_ptr() if t is not None else 0

        ptrs = (
            p.data_ptr(),
            grads[i].data_ptr(),
            m.data_ptr(),
            address(m_absmax),
            v.data_ptr(),
            address(v_absmax),
            address(vmax),
            address(vmax_absmax),
            address(c),
            remainders[i].data_ptr() if remainders is not None else 0,
        )
        codes = (_GRAD_DTYPES[grads[i].dtype], _COPY_DTYPES[c.dtype] if c is not None else 0, m_code, v_code)
        aligned = all(_runtime.is_aligned(ptr) for ptr in ptrs)
        groups.setdefault((codes, aligned), []).append((p.numel(), *ptrs))
    return groups


def _build_table(group, chunk):
    meta = torch.tensor(group, dtype=torch.int64)
    chunks = _runtime.chunk_rows([r[0] for r in group], chunk)
    return torch.cat([meta.flatten(), chunks.flatten()])
