"""Owns the q8 format of Adam's moments in pure torch: bitsandbytes' dynamic maps, blocks of 256 with
one fp32 absmax each, the reference and the fast quantizer, and the bit-exact reference of a q8
Adam step (issue 38).

Invariant: this is the ground truth every tier's q8 kernel matches bitwise; the maps are built in
exact arithmetic, so they do not depend on the machine. The format, the maps, the fast
quantizer's table and the step: docs/internals.md."""

from __future__ import annotations

import functools
import math
import struct
from fractions import Fraction
from typing import NamedTuple

import torch

from .reference import adam_step_bitwise_reference

BLOCK = 256  # elements per absmax
ZERO_CODE = {True: 127, False: 0}  # the index of 0.0 in the signed / unsigned map
KEY_FIRST = 0x3400  # bits >> 16 of 2**-23: smaller magnitudes all quantize to 0.0
KEYS = 0x3F80 - KEY_FIRST + 1  # up to the bucket of 1.0
STEP_BITS = 17  # an entry: rank << 17 | the low 16 bits where the rank steps (65536: it does not)
NO_STEP = 1 << 16


class Q8Blocks(NamedTuple):
    """A q8 moment: one uint8 code per element and one fp32 absmax per block of 256 (the last
    block may be partial). Which map it uses follows from the moment: signed for exp_avg,
    unsigned for exp_avg_sq and max_exp_avg_sq."""

    codes: torch.Tensor
    absmax: torch.Tensor


# ------------------------------------------------------------------------------------ the maps


def _bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _round32(q: Fraction) -> float:
    """The fp32 value nearest to the exact rational q, ties to even (correct rounding)."""
    guess = struct.unpack("<f", struct.pack("<f", float(q)))[0]
    candidates = [guess]
    for direction in (-math.inf, math.inf):
        candidates.append(_next32(guess, direction))
    return min(candidates, key=lambda y: (abs(Fraction(y) - q), _bits32(y) & 1))


def _next32(y: float, toward: float) -> float:
    """The fp32 neighbour of fp32 y toward +inf or -inf (y finite)."""
    if y == 0:
        return _from_bits32(1) if toward > 0 else -_from_bits32(1)
    u = _bits32(y)
    return _from_bits32(u + 1 if (toward > 0) == (y > 0) else u - 1)


def _linspace32(start: float, end: float, steps: int) -> list:
    """torch.linspace(start, end, steps) in fp32 as its vectorised CPU kernels compute it: step
    = (end - start) / (steps - 1), each rounded; the first half start + step·k and the second
    end - step·(steps - 1 - k), each one rounding (a fused multiply-add)."""
    start32, end32 = _round32(Fraction(start)), _round32(Fraction(end))
    step = _round32(Fraction(_round32(Fraction(end32) - Fraction(start32))) / (steps - 1))
    out = []
    for k in range(steps):
        if k < steps // 2:
            out.append(_round32(Fraction(start32) + Fraction(step) * k))
        else:
            out.append(_round32(Fraction(end32) - Fraction(step) * (steps - 1 - k)))
    return out


@functools.lru_cache(maxsize=None)
def _dynamic_map_values(signed: bool) -> tuple:
    values = [0.0, 1.0]
    for i in range(7):
        bounds = _linspace32(0.1, 1.0, 2 ** (i if signed else i + 1) + 1)
        # (a + b) / 2.0 on fp32 tensors; the Python scale 10**(i-6) is a double torch rounds to fp32
        means = [_round32(_round32(Fraction(a) + Fraction(b)) / 2) for a, b in zip(bounds, bounds[1:])]
        scale = _round32(Fraction(10.0 ** (i - 6)))
        for mean in means:
            values.append(_round32(Fraction(scale) * Fraction(mean)))
            if signed:
                values.append(_round32(Fraction(-scale) * Fraction(mean)))
    assert len(values) == 256 and len(set(values)) == 256
    return tuple(sorted(values))


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 fp32 values of bitsandbytes' `create_dynamic_map(signed)`, ascending (a new tensor)."""
    return torch.tensor(_dynamic_map_values(bool(signed)), dtype=torch.float32)


# ------------------------------------------------------------------------------- the quantizers


def _midpoints64(signed: bool) -> torch.Tensor:
    """The exact midpoints between adjacent map values (fp64 holds them exactly: adjacent fp32
    values are within a factor of 2.3 of each other, so their sum needs at most 26 bits)."""
    qmap = dynamic_map(signed).double()
    return (qmap[:-1] + qmap[1:]) / 2


def quantize_reference(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 x (already divided by its absmax) -> uint8 codes: the nearest map value, ties to
    the even code, by binary search over the exact midpoints. NaN saturates at its sign's end
    (code 0 or 255), as the fast quantizer does."""
    x = x.float()
    mids = _midpoints64(signed)
    x64 = x.double()
    below = torch.searchsorted(mids, x64.nan_to_num(0.0).contiguous(), side="left")  # midpoints < x
    tie = mids[below.clamp(max=254)] == x64
    code = below + (tie & (below % 2 == 1)).long()
    negative = x.contiguous().view(torch.int32) < 0
    code = torch.where(torch.isnan(x), torch.where(negative, 0, 255), code)
    if not signed:
        code = torch.where(x <= 0, 0, code)  # every x <= 0 is nearest to 0.0
    return code.to(torch.uint8)


def _first_of_each_rank(signed: bool) -> dict:
    """{sign: ascending magnitude bits at which |x|'s rank (codes away from zero_code) steps
    up}: for each code boundary, the smallest fp32 magnitude on the far side of it, its exact
    tie resolved to the even code."""
    qmap, zero = _dynamic_map_values(signed), ZERO_CODE[signed]
    firsts = {0: [], 1: []}
    for c in range(1, 256):
        lo, hi = qmap[c - 1], qmap[c]
        mid = (Fraction(lo) + Fraction(hi)) / 2
        magnitude = abs(mid)
        exact = _round32(magnitude) == magnitude
        if c > zero:  # positive side: x >= mid moves from c - 1 to c; at the tie x gets the even one
            far_code = c
            side = 0
        else:  # negative side: |x| >= |mid| moves from c to c - 1
            far_code = c - 1
            side = 1
        if exact and far_code % 2 == 0:
            first = _bits32(float(magnitude))
        else:
            below = _round32(magnitude)
            if Fraction(below) > magnitude:
                below = _next32(below, -math.inf)
            first = _bits32(below) + 1
        firsts[side].append(first)
    return {side: sorted(values) for side, values in firsts.items()}


@functools.lru_cache(maxsize=None)
def _bucket_table_values(signed: bool) -> tuple:
    tables = []
    for side, firsts in _first_of_each_rank(signed).items():
        # magnitudes below the first bucket and above the last share those buckets' entries
        assert not firsts or firsts[0] >= (KEY_FIRST + 1) << 16, "a code boundary below 2**-23"
        assert not firsts or firsts[-1] < (KEY_FIRST + KEYS - 1) << 16, "a code boundary in 1.0's bucket"
        entries, rank = [], 0
        for key in range(KEYS):
            lo = (KEY_FIRST + key) << 16
            while rank < len(firsts) and firsts[rank] <= lo:
                rank += 1
            inside = [f - lo for f in firsts[rank:] if f < lo + (1 << 16)]
            assert len(inside) <= 1, f"two code boundaries in bucket {key:#x}"
            entries.append((rank << STEP_BITS) | (inside[0] if inside else NO_STEP))
        tables.append(entries)
    return tuple(tables[0]), tuple(tables[1])


def bucket_table(signed: bool) -> torch.Tensor:
    """int32 [2, KEYS]: the fast quantizer's entries for x >= +0 (row 0) and x <= -0 (row 1),
    each rank << 17 | the low 16 bits of |x| at which the rank steps once in the bucket (65536:
    it does not). See the module doc."""
    return torch.tensor(_bucket_table_values(bool(signed)), dtype=torch.int32)


def quantize_fast(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 x -> uint8 codes from x's bits and one table entry per element (the kernels'
    formula, see the module doc); bitwise `quantize_reference` for every fp32 x."""
    table = bucket_table(signed).to(torch.int64).flatten()
    u = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    neg, mag = u >> 31, u & 0x7FFFFFFF
    key = ((mag >> 16) - KEY_FIRST).clamp(0, KEYS - 1)
    entry = table[neg * KEYS + key]
    rank = (entry >> STEP_BITS) + ((mag & 0xFFFF) >= (entry & ((1 << STEP_BITS) - 1))).long()
    zero = ZERO_CODE[bool(signed)]
    return torch.where(neg == 1, zero - rank, zero + rank).to(torch.uint8)


# ------------------------------------------------------------------------------ blocks of 256


def _padded_blocks(values: torch.Tensor) -> torch.Tensor:
    flat = values.float().flatten()
    pad = -flat.numel() % BLOCK
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, BLOCK)


def block_absmax(values: torch.Tensor) -> torch.Tensor:
    """fp32 [ceil(n / 256)]: each block's largest magnitude, on the bits (see the module doc)."""
    blocks = _padded_blocks(values)
    magnitude = blocks.view(torch.int32) & 0x7FFFFFFF
    return magnitude.amax(dim=1).view(torch.float32)


def quantize_blocks(values: torch.Tensor, signed: bool, *, fast: bool = True) -> Q8Blocks:
    """Any float tensor -> Q8Blocks over its flat index (`fast=False`: the reference quantizer)."""
    n = values.numel()
    blocks = _padded_blocks(values)
    absmax = block_absmax(values)
    scale = absmax.view(-1, 1)
    x = torch.where(scale == 0, torch.zeros_like(blocks), blocks / torch.where(scale == 0, 1.0, scale))
    codes = (quantize_fast if fast else quantize_reference)(x, signed)
    return Q8Blocks(codes.flatten()[:n].contiguous(), absmax)


def dequantize_blocks(q: Q8Blocks, signed: bool) -> torch.Tensor:
    """Q8Blocks -> fp32 [n]: map[code] · absmax of its block, one fp32 multiply."""
    codes, absmax = q
    n = codes.numel()
    if absmax.numel() != -(-n // BLOCK):
        raise ValueError(
            f"{n} codes need {-(-n // BLOCK)} absmax values (one per block of {BLOCK}), got {absmax.numel()}"
        )
    values = dynamic_map(signed)[codes.flatten().long()]
    return values * absmax.float().repeat_interleave(BLOCK)[:n]


# ------------------------------------------------------------------------------- the Adam step


def q8_adam_step_reference(
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
):
    """One Adam/AdamW step over flat tensors whose moments may be q8: each of exp_avg,
    exp_avg_sq is a Q8Blocks or an fp32/bf16 tensor (max_exp_avg_sq in exp_avg_sq's format).
    Returns the new (param, exp_avg, exp_avg_sq, max_exp_avg_sq, remainder), each in its input's
    format (None where absent); inputs untouched. The arithmetic is
    `adam_step_bitwise_reference(..., fma=False)` on the dequantized moments; the param update
    uses the fp32 moments before they are quantized again, each block with a fresh absmax."""

    def widened(moment, signed):
        if isinstance(moment, torch.Tensor):
            return moment  # fp32 or bf16: adam_step_bitwise_reference rounds it back to its dtype
        return dequantize_blocks(moment, signed)

    def narrowed(new, old, signed):
        if isinstance(old, torch.Tensor):
            return new
        return quantize_blocks(new, signed)

    vmax_in = widened(max_exp_avg_sq, False) if max_exp_avg_sq is not None else None
    p, m, v, vmax, rem = adam_step_bitwise_reference(
        param,
        grad,
        widened(exp_avg, True),
        widened(exp_avg_sq, False),
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale=grad_scale,
        max_exp_avg_sq=vmax_in,
        remainder=remainder,
        fma=False,
    )
    return (
        p,
        narrowed(m, exp_avg, True),
        narrowed(v, exp_avg_sq, False),
        narrowed(vmax, max_exp_avg_sq, False) if vmax is not None else None,
        rem,
    )
