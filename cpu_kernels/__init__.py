"""cpu_kernels: the host tier's SIMD kernels (Adam/AdamW step, grad statistics, inverse step).

The C library is built by `pip install` (a plain compiler call, no torch headers) and
loaded through ctypes. The SIMD level (x86-64: avx512 / avx2 / portable; AArch64: sve / neon /
portable) is picked at run time; `HYBRID_OPT_SIMD=avx2|neon|portable|...` or `set_simd_level()`
forces a lower one. Threads are
OpenMP's, sized by `set_num_threads()`; results are bitwise the same for any thread count.
Moments may be bf16, and a bf16 param may carry its fp32 master's low halves
(`remainder=`, `encode_remainder` / `decode_remainder`): 2 + 2 bytes instead of 4 + 4.

Formulas (torch.optim.AdamW / Adam, with bias correction, t = step):
    g  = grad * grad_scale            (+ weight_decay * p for Adam's L2 decay)
    m  = m + (1 - beta1) * (g - m)
    v  = beta2 * v + (1 - beta2) * g^2
    p  = p * (1 - lr * weight_decay)  (AdamW only)
    p  = p - lr / (1 - beta1^t) * m / (sqrt(max(v) if amsgrad else v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

from ._lib import available_simd_levels, get_num_threads, set_num_threads, set_simd_level, simd_level

__all__ = [
    "simd_level",
    "available_simd_levels",
    "set_simd_level",
    "set_num_threads",
    "get_num_threads",
    "adam_step_",
    "grad_stats",
    "adam_inverse_",
    "bandwidth_probe_",
    "bandwidth_probe_bank_",
    "encode_remainder",
    "decode_remainder",
    "adam_step_reference",
    "grad_stats_reference",
    "adam_inverse_reference",
    "adam_step_bitwise_reference",
    "encode_remainder_reference",
    "decode_remainder_reference",
    "bf16_round_reference",
    "q8_adam_step_",
    "q8_simd_level",
]

_API = {
    "adam_step_",
    "grad_stats",
    "adam_inverse_",
    "bandwidth_probe_",
    "bandwidth_probe_bank_",
    "encode_remainder",
    "decode_remainder",
}
_REFERENCES = {
    "adam_step_reference",
    "grad_stats_reference",
    "adam_inverse_reference",
    "adam_step_bitwise_reference",
    "encode_remainder_reference",
    "decode_remainder_reference",
    "bf16_round_reference",
}
_Q8 = {"q8_adam_step_": "_q8_api", "q8_simd_level": "_q8_lib"}  # issue 38's q8 step, not yet in the tiers


def __getattr__(name):
    # The tensor API imports torch on first use, so the worker process (which calls the C
    # library through cpu_kernels._lib on raw shared memory) starts without torch.
    if name in _API:
        from . import _api

        return getattr(_api, name)
    if name in _Q8:
        import importlib

        return getattr(importlib.import_module(f".{_Q8[name]}", __name__), name)
    if name in _REFERENCES:
        from . import reference

        return getattr(reference, name)
    raise AttributeError(f"module 'cpu_kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _API | _REFERENCES | set(_Q8))
