"""Pure-torch fp64 references of the cpu_kernels entry points (the tests' ground truth)."""

from __future__ import annotations

import math

import torch


def adam_step_reference(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=1.0,
    max_exp_avg_sq=None,
):
    """Returns the new (param, exp_avg, exp_avg_sq, max_exp_avg_sq) in fp64; inputs untouched."""
    p = param.double()
    g = grad.double() * grad_scale
    m, v = exp_avg.double(), exp_avg_sq.double()
    if decoupled:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    vmax = None
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(max_exp_avg_sq.double(), v)
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (vmax if vmax is not None else v).sqrt() / bc2_sqrt + eps
    p = p - (lr / bc1) * m / denom
    return p, m, v, vmax


def grad_stats_reference(grad):
    """(sum of squares in fp64, all finite)."""
    g = grad.double()
    return float((g * g).sum()), bool(torch.isfinite(grad).all())


def adam_inverse_reference(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=1.0,
):
    """The state before the step that produced (param, exp_avg, exp_avg_sq), in fp64."""
    p1, m1, v1 = param.double(), exp_avg.double(), exp_avg_sq.double()
    g = grad.double() * grad_scale
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    p0 = p1 + (lr / bc1) * m1 / (v1.sqrt() / bc2_sqrt + eps)
    if decoupled:
        p0 = p0 / (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p0
    m0 = (m1 - (1.0 - beta1) * g) / beta1
    v0 = ((v1 - (1.0 - beta2) * g * g) / beta2).clamp_min(0.0)
    return p0, m0, v0


# ------------------------------------------------------------------ bit-exact references
# The kernels' fp32 arithmetic, operation for operation, in torch: every SIMD level gives
# these bits. Each fp32 operation is done in fp64 and rounded once to fp32, which is the
# correctly rounded fp32 result for +, -, *, / and sqrt (fp64 has more than 2 x 24 + 2 bits);
# a fused multiply-add is emulated exactly (fp64 product, TwoSum, round to odd, round).

FUSED_MULTIPLY_ADD_LEVELS = ("avx2", "avx512", "neon", "sve")  # the portable level multiplies, then adds


def _f32(x: float) -> float:
    """A Python float rounded to fp32, as the C code's (float) casts round it."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def _fma(a, b, c):
    """fp32 fma(a, b, c) = a * b + c rounded once, for fp32 tensors (or fp32-valued floats)."""
    s = a.double() * b  # exact: 24 + 24 bits
    c = c.double() if isinstance(c, torch.Tensor) else torch.tensor(c, dtype=torch.float64)
    hi = s + c
    bb = hi - s
    lo = (s - (hi - bb)) + (c - bb)  # hi + lo == s + c exactly
    odd = (hi.view(torch.int64) & 1) == 1
    toward = torch.where(
        lo > 0, torch.tensor(math.inf, dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64)
    )
    # round to odd: an inexact hi is replaced by its odd neighbour on lo's side, so the
    # second rounding (to fp32, 29 fewer bits) cannot land on a false tie
    rto = torch.where((lo != 0) & ~odd & torch.isfinite(hi), torch.nextafter(hi, toward), hi)
    return rto.float()


def _mul_add(a, b, c, fma):
    if fma:
        return _fma(a, b, c)
    prod = (a.double() * b).float()
    return (prod.double() + (c.double() if isinstance(c, torch.Tensor) else c)).float()


def _u32(x):
    """fp32 tensor -> its bits as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_u32(u):
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def _as_int16(u):
    """int64 in [0, 2**16) -> int16 with those bits."""
    return torch.where(u >= 2**15, u - 2**16, u).to(torch.int16)


def bf16_round_reference(x):
    """fp32 -> bf16 as the kernels round: to nearest even, every NaN -> 0x7FC0 (c10's scalar
    rule; torch's vectorised tensor cast writes 0xFFFF for a NaN). Integer arithmetic only."""
    u = _u32(x)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC0), r)
    return _as_int16(r).view(torch.bfloat16)


def encode_remainder_reference(master):
    """fp32 -> (bf16 param, int16 remainder): see cpu_kernels.encode_remainder."""
    u = _u32(master)
    high = ((u >> 16) + ((u >> 15) & 1)) & 0xFFFF  # 16-bit wrap-around, as the kernels
    return _as_int16(high).view(torch.bfloat16), _as_int16(u & 0xFFFF)


def decode_remainder_reference(param, remainder):
    """(bf16 param, int16 remainder) -> fp32 master: see cpu_kernels.decode_remainder."""
    p = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    r = remainder.to(torch.int64) & 0xFFFF
    return _from_u32((((p - (r >> 15)) & 0xFFFF) << 16) | r)


def adam_step_bitwise_reference(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=1.0,
    max_exp_avg_sq=None,
    remainder=None,
    fma=True,
):
    """adam_step_'s exact bits: returns the new (param, exp_avg, exp_avg_sq, max_exp_avg_sq,
    remainder) in the inputs' dtypes (None where absent); inputs untouched. `fma`: whether
    the level fuses multiply-adds (see FUSED_MULTIPLY_ADD_LEVELS). With `remainder`, `param`
    is the bf16 high half and the master is decoded, stepped and encoded again. exp_avg and
    exp_avg_sq may differ in dtype (fp32 / bf16 each, max_exp_avg_sq in exp_avg_sq's): each
    output is narrowed to its own input's dtype, the fp32 values before rounding feed the
    update."""
    bc1 = 1.0 - math.pow(beta1, float(step))
    bc2 = 1.0 - math.pow(beta2, float(step))
    nss, ib = _f32(-(lr / bc1)), _f32(1.0 / math.sqrt(bc2))
    decay = _f32(1.0 - lr * weight_decay) if decoupled else 1.0
    w1, b2, w2 = _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2)
    p = decode_remainder_reference(param, remainder) if remainder is not None else param.float()
    g = (grad.double() * _f32(grad_scale)).float()
    if not decoupled and weight_decay != 0.0:
        g = _mul_add(p, _f32(weight_decay), g, fma)
    m0, v0 = exp_avg.float(), exp_avg_sq.float()
    m = _mul_add((g.double() - m0.double()).float(), w1, m0, fma)
    v = _mul_add((g.double() * g.double()).float(), w2, (v0.double() * b2).float(), fma)
    vmax = None
    if max_exp_avg_sq is not None:
        x0 = max_exp_avg_sq.float()
        vmax = torch.where(x0 > v, x0, v)
    vv = vmax if vmax is not None else v
    denom = _mul_add(vv.double().sqrt().float(), ib, _f32(eps), fma)
    upd = ((m.double() / denom.double()).float().double() * nss).float()
    p = _mul_add(p, decay, upd, fma)

    def narrow(x, like):
        return bf16_round_reference(x) if like.dtype == torch.bfloat16 else x

    new_rem = None
    if remainder is not None:
        p, new_rem = encode_remainder_reference(p)
    return (
        p,
        narrow(m, exp_avg),
        narrow(v, exp_avg_sq),
        narrow(vmax, max_exp_avg_sq) if vmax is not None else None,
        new_rem,
    )
