"""Owns the bf16 encodings of fp32 optimizer state in pure torch, bit for bit what `adam.py`'s kernel
stores: `round_to_bf16` (a bf16 moment) and the remainder encoding of an fp32 master (a bf16 param
plus an int16 remainder, 2 bytes instead of a 4-byte master).

Invariant: decode(encode(x)) is x for every one of the 2**32 fp32 bit patterns. The encoding and
where the param differs from `master.to(torch.bfloat16)`: docs/internals.md."""

import torch


def _int16(x):
    """int32/int64 values in [0, 2**16) as the int16 with those bits (no wrapping cast)."""
    return ((x ^ 0x8000) - 0x8000).to(torch.int16)


def round_to_bf16(x):
    """fp32 -> bf16 rounded to nearest even, every NaN -> 0x7FC0 (the kernel's bits; torch's
    vectorised cast may write another NaN)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return _int16(torch.where(torch.isnan(x), 0x7FC0, rounded)).view(torch.bfloat16)


def encode_remainder(master):
    """fp32 master -> (bf16 param, int16 remainder); any shape, any device."""
    if master.dtype != torch.float32:
        raise TypeError(f"encode_remainder takes an fp32 master, got {master.dtype}")
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits & 0xFFFF
    hi = ((bits >> 16) + (lo >> 15)) & 0xFFFF
    return _int16(hi).view(torch.bfloat16), _int16(lo)


def decode_remainder(param, remainder):
    """(bf16 param, int16 remainder) -> the fp32 master, bitwise."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(
            f"decode_remainder takes a bf16 param and an int16 remainder, got "
            f"{param.dtype} and {remainder.dtype}"
        )
    if param.shape != remainder.shape:
        raise ValueError(f"param has shape {tuple(param.shape)} but remainder has {tuple(remainder.shape)}")
    hi = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    lo = remainder.to(torch.int64) & 0xFFFF
    bits = (((hi - (lo >> 15)) & 0xFFFF) << 16) | lo
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
