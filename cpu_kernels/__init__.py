"""cpu_kernels: the host tier's SIMD kernels (Adam/AdamW step, grad statistics, inverse step, q8),
built by `pip install` without torch headers and loaded through ctypes.

The SIMD level (avx512 / avx2 / portable on x86-64, sve / neon / portable on AArch64) is picked at
run time; `HYBRID_OPT_SIMD` or `set_simd_level()` forces a lower one. Invariant: results are
bitwise the same for any thread count. The step is torch.optim.AdamW / Adam's with bias correction;
the formulas: docs/internals.md."""

from __future__ import annotations

from ._lib import available_simd_levels, get_num_threads, set_num_threads, set_simd_level, simd_level

__all__ = [
    "simd_level",
    "available_simd_levels",
    "set_simd_level",
    "set_num_threads",
    "get_num_threads",
    "adam_step_",
    "adam_call",
    "adam_steps_",
    "grad_stats",
    "grad_stats_many",
    "adam_inverse_",
    "bandwidth_probe_",
    "bandwidth_probe_bank_",
    "bandwidth_probe_pattern_",
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
    "adam_call",
    "adam_steps_",
    "grad_stats",
    "grad_stats_many",
    "adam_inverse_",
    "bandwidth_probe_",
    "bandwidth_probe_bank_",
    "bandwidth_probe_pattern_",
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
    # library through cpu_kernels._lib on raw shared memory) starts without torch. A name found
    # is kept in the module: later lookups skip this function (0.75 us each, per kernel call).
    if name in _API:
        from . import _api

        value = getattr(_api, name)
    elif name in _Q8:
        import importlib

        value = getattr(importlib.import_module(f".{_Q8[name]}", __name__), name)
    elif name in _REFERENCES:
        from . import reference

        value = getattr(reference, name)
    else:
        raise AttributeError(f"module 'cpu_kernels' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | _API | _REFERENCES | set(_Q8))
