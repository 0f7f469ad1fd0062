"""The q8 Adam step's C entry point through ctypes, with no torch import (the worker process uses
this alone). The struct mirrors `q8_args_t` in cpu_kernels/csrc/q8.h."""

from __future__ import annotations

import ctypes

from ._lib import lib

DT_Q8 = 3  # a q8 moment's dtype code beside _lib's DT_F32 / DT_BF16 (q8.h)
BLOCK = 256  # elements per absmax


class Q8AdamArgs(ctypes.Structure):
    _fields_ = (
        [("n", ctypes.c_int64)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "param",
                "grad",
                "exp_avg",
                "exp_avg_absmax",
                "exp_avg_sq",
                "exp_avg_sq_absmax",
                "max_exp_avg_sq",
                "max_exp_avg_sq_absmax",
                "param_out",
                "exp_avg_out",
                "exp_avg_absmax_out",
                "exp_avg_sq_out",
                "exp_avg_sq_absmax_out",
                "max_exp_avg_sq_out",
                "max_exp_avg_sq_absmax_out",
                "param_copy",
                "remainder",
                "remainder_out",
            )
        ]
        + [
            (name, ctypes.c_int32)
            for name in (
                "grad_dtype",
                "exp_avg_dtype",
                "exp_avg_sq_dtype",
                "copy_dtype",
                "decoupled",
                "reserved",
            )
        ]
        + [("step", ctypes.c_int64)]
        + [(name, ctypes.c_double) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")]
    )

    def __init__(self, **fields):
        # an unscaled grad unless told: a zeroed grad_scale would step every grad as 0
        fields.setdefault("grad_scale", 1.0)
        super().__init__(**fields)


lib.hybrid_q8_adam_step.argtypes = [ctypes.POINTER(Q8AdamArgs)]
lib.hybrid_q8_adam_step.restype = ctypes.c_int
lib.hybrid_q8_level.argtypes = []
lib.hybrid_q8_level.restype = ctypes.c_char_p
for _name in ("hybrid_q8_map", "hybrid_q8_buckets"):
    getattr(lib, _name).argtypes = [ctypes.c_int]
    getattr(lib, _name).restype = ctypes.POINTER(ctypes.c_uint32)
lib.hybrid_q8_keys.argtypes = []
lib.hybrid_q8_keys.restype = ctypes.c_int


def q8_simd_level() -> str:
    """The level the q8 step runs at now: the Adam dispatcher's ("avx512", "avx2", "portable" on
    x86-64; "sve", "neon", "portable" on AArch64), each with a q8 kernel of its own."""
    return lib.hybrid_q8_level().decode()


def q8_codebook(signed: bool) -> tuple[list[int], list[int]]:
    """The C library's codebook for one map: its 256 fp32 bit patterns and its bucket table
    (two rows of keys entries, x >= +0 then x <= -0), as loaded."""
    keys = lib.hybrid_q8_keys()
    qmap = lib.hybrid_q8_map(1 if signed else 0)
    table = lib.hybrid_q8_buckets(1 if signed else 0)
    return [qmap[k] for k in range(256)], [table[k] for k in range(2 * keys)]


def q8_adam_step_raw(args: Q8AdamArgs) -> None:
    """One call on raw addresses (the worker's path): the caller vouches for every pointer."""
    if lib.hybrid_q8_adam_step(ctypes.byref(args)) != 0:
        raise ValueError(
            "hybrid_q8_adam_step refused its arguments: a dtype code out of range or "
            "a missing pointer (a q8 moment needs its absmax and absmax_out)"
        )
