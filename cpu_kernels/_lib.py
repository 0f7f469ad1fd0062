"""The C library through ctypes, with no torch import: the worker process uses this alone.

Struct layouts mirror cpu_kernels/csrc/kernels.h.
"""

from __future__ import annotations

import array
import ctypes
import importlib.util
import itertools
import os
import struct
import warnings

DT_F32, DT_BF16, DT_F16 = 0, 1, 2  # dtype codes of kernels.h


class AdamArgs(ctypes.Structure):
    _fields_ = (
        [("n", ctypes.c_int64)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "param",
                "grad",
                "exp_avg",
                "exp_avg_sq",
                "max_exp_avg_sq",
                "param_out",
                "exp_avg_out",
                "exp_avg_sq_out",
                "max_exp_avg_sq_out",
                "param_copy",
            )
        ]
        + [
            ("grad_dtype", ctypes.c_int32),
            ("moment_dtype", ctypes.c_int32),
            ("copy_dtype", ctypes.c_int32),
            ("decoupled", ctypes.c_int32),
            ("step", ctypes.c_int64),
        ]
        + [(name, ctypes.c_double) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")]
        + [
            ("remainder", ctypes.c_void_p),
            ("remainder_out", ctypes.c_void_p),
            ("exp_avg_sq_dtype", ctypes.c_int32),
        ]
    )  # exp_avg_sq's (and max's); moment_dtype: exp_avg's


class InverseArgs(ctypes.Structure):
    _fields_ = (
        [("n", ctypes.c_int64)]
        + [(name, ctypes.c_void_p) for name in ("param", "grad", "exp_avg", "exp_avg_sq")]
        + [("grad_dtype", ctypes.c_int32), ("decoupled", ctypes.c_int32), ("step", ctypes.c_int64)]
        + [(name, ctypes.c_double) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")]
    )


def _load_library():
    spec = importlib.util.find_spec("cpu_kernels._native")
    if spec is None or spec.origin is None:
        raise ImportError(
            "cpu_kernels' C library is not built: install the package with "
            "`pip install -e .` (or `python setup.py build_ext --inplace`)"
        )
    lib = ctypes.CDLL(spec.origin)
    lib.hybrid_adam_step.argtypes = [ctypes.POINTER(AdamArgs)]
    lib.hybrid_adam_step.restype = None
    lib.hybrid_adam_step_many.argtypes = [ctypes.POINTER(AdamArgs), ctypes.c_int64]
    lib.hybrid_adam_step_many.restype = ctypes.c_int
    lib.hybrid_adam_expand_runs.argtypes = [
        ctypes.POINTER(AdamArgs),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.POINTER(AdamArgs),
    ]
    lib.hybrid_adam_expand_runs.restype = None
    lib.hybrid_adam_inverse.argtypes = [ctypes.POINTER(InverseArgs)]
    lib.hybrid_adam_inverse.restype = None
    lib.hybrid_grad_stats.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_double),
    ]
    lib.hybrid_grad_stats.restype = ctypes.c_int
    lib.hybrid_grad_stats_many.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_double),
    ]
    lib.hybrid_grad_stats_many.restype = ctypes.c_int
    lib.hybrid_bw_inplace.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int]
    lib.hybrid_bw_inplace.restype = None
    lib.hybrid_bw_bank.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64]
    lib.hybrid_bw_bank.restype = None
    lib.hybrid_bw_pattern.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int64,
    ]
    lib.hybrid_bw_pattern.restype = ctypes.c_int64
    for name in ("hybrid_remainder_encode", "hybrid_remainder_decode"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
        getattr(lib, name).restype = None
    for name in (
        "hybrid_max_level",
        "hybrid_get_level",
        "hybrid_get_num_threads",
        "hybrid_level_count",
        "hybrid_get_arm_streaming_stores",
        "hybrid_get_avx2_bank_nt",
        "hybrid_get_block_prefetch",
        "hybrid_get_q8_pipeline",
    ):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    lib.hybrid_set_level.argtypes = [ctypes.c_int]
    lib.hybrid_set_level.restype = ctypes.c_int
    lib.hybrid_set_num_threads.argtypes = [ctypes.c_int]
    lib.hybrid_set_num_threads.restype = None
    lib.hybrid_set_thread_cpus.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.hybrid_set_thread_cpus.restype = ctypes.c_int
    lib.hybrid_set_avx512_bf16.argtypes = [ctypes.c_int]
    lib.hybrid_set_avx512_bf16.restype = ctypes.c_int
    lib.hybrid_get_avx512_bf16.argtypes = []
    lib.hybrid_get_avx512_bf16.restype = ctypes.c_int
    lib.hybrid_level_name.argtypes = [ctypes.c_int]
    lib.hybrid_level_name.restype = ctypes.c_char_p
    lib.hybrid_set_arm_streaming_stores.argtypes = [ctypes.c_int]
    lib.hybrid_set_arm_streaming_stores.restype = ctypes.c_int
    lib.hybrid_set_avx2_bank_nt.argtypes = [ctypes.c_int]
    lib.hybrid_set_avx2_bank_nt.restype = ctypes.c_int
    lib.hybrid_set_block_prefetch.argtypes = [ctypes.c_int]
    lib.hybrid_set_block_prefetch.restype = ctypes.c_int
    lib.hybrid_set_q8_pipeline.argtypes = [ctypes.c_int]
    lib.hybrid_set_q8_pipeline.restype = ctypes.c_int
    return lib


lib = _load_library()
# this architecture's levels, lowest first (the C library's table): ("portable", "avx2",
# "avx512") on x86-64, ("portable", "neon", "sve") on AArch64, ("portable",) elsewhere
LEVELS = tuple(lib.hybrid_level_name(k).decode() for k in range(lib.hybrid_level_count()))


def available_simd_levels() -> list[str]:
    """Every level this CPU can run, lowest first."""
    return list(LEVELS[: lib.hybrid_max_level() + 1])


def simd_level() -> str:
    """The level the dispatcher uses now: "avx512", "avx2" or "portable" on x86-64; "sve",
    "neon" or "portable" on AArch64."""
    return LEVELS[lib.hybrid_get_level()]


def set_simd_level(level: str) -> None:
    """Use `level` (at most what the CPU supports) for every following call."""
    if level not in LEVELS:
        raise ValueError(f"unknown SIMD level {level!r}; expected one of {LEVELS}")
    if lib.hybrid_set_level(LEVELS.index(level)) != 0:
        raise ValueError(f"this CPU cannot run SIMD level {level!r}; it supports {available_simd_levels()}")


def _avx512_bf16() -> bool:
    """Whether the AVX-512 level's compressed-state loop rounds to bf16 with vcvtne2ps2bf16
    (CPUs with AVX-512 BF16; NaN and subnormal inputs still take the integer rounding, so the
    bits are the same either way)."""
    return bool(lib.hybrid_get_avx512_bf16())


def _set_avx512_bf16(on: bool) -> None:
    """Tests: turn the bf16 instruction off (the integer rounding alone) or back on."""
    if lib.hybrid_set_avx512_bf16(1 if on else 0) != 0:
        raise ValueError("this CPU has no AVX-512 BF16 (vcvtne2ps2bf16)")


def _arm_streaming_stores() -> bool:
    """Whether the Arm vector levels write bank-mode state and the param copy with streaming
    (non-temporal) stores: STNP on NEON, STNT1 on SVE. Off unless HYBRID_OPT_ARM_STREAMING_STORES=1
    or `_set_arm_streaming_stores(True)`: whether they help has not been measured on Arm
    hardware (benchmarks/bench_cpu_adam.py times both where the level has them). Same bits."""
    return bool(lib.hybrid_get_arm_streaming_stores())


def _set_arm_streaming_stores(on: bool) -> None:
    if lib.hybrid_set_arm_streaming_stores(1 if on else 0) != 0:
        raise ValueError("streaming stores are an option of the Arm levels (neon, sve) only")


def _avx2_bank_nt() -> bool:
    """Whether the AVX2 level writes bank mode's outputs with non-temporal stores: on where the CPU
    is an Intel one, off on AMD and others (kernels.h says what each measured). Same bits."""
    return bool(lib.hybrid_get_avx2_bank_nt())


def _set_avx2_bank_nt(on: bool) -> None:
    """Tests and benchmarks: the other store kind than the CPU's vendor chose."""
    if lib.hybrid_set_avx2_bank_nt(1 if on else 0) != 0:
        raise ValueError("non-temporal bank stores are an option of the AVX2 level (x86-64) only")


def _block_prefetch() -> bool:
    """Whether the x86 levels' in-place blocks prefetch their streams: on where the CPU is an Intel
    one, off on AMD and others (kernels.h says what each measured). Same bits."""
    return bool(lib.hybrid_get_block_prefetch())


def _set_block_prefetch(on: bool) -> None:
    """Benchmarks: the other choice than the CPU's vendor made."""
    if lib.hybrid_set_block_prefetch(1 if on else 0) != 0:
        raise ValueError("the blocks' prefetch is an option of the x86 levels only")


def _q8_pipeline() -> bool:
    """Whether the AVX-512 q8 pass writes each block's codes inside the next block's loop: on where
    the CPU is an Intel one, off on AMD and others (kernels.h says what each measured). Same bits."""
    return bool(lib.hybrid_get_q8_pipeline())


def _set_q8_pipeline(on: bool) -> None:
    """Tests and benchmarks: the other choice than the CPU's vendor made."""
    if lib.hybrid_set_q8_pipeline(1 if on else 0) != 0:
        raise ValueError("the q8 pipeline is an option of the x86 levels only")


_STRUCT_CODES = {ctypes.c_int64: "q", ctypes.c_void_p: "Q", ctypes.c_int32: "i", ctypes.c_double: "d"}
_packers: dict = {}


def packer(cls) -> tuple:
    """(pack_into, size) of the ctypes structure `cls` as a `struct` format (native byte order, its
    padding spelled out from the fields' offsets), made once per class: `pack_into(buf, offset,
    *fields)` writes one struct, fields in `cls._fields_`' order (a NULL pointer as 0). A
    caller that makes many structs a step packs them into one buffer and takes the array
    `(cls * count).from_buffer(buf)`: a fraction of the time of ctypes' constructor per struct."""
    if cls not in _packers:
        fmt, pos = "=", 0
        for name, ty in cls._fields_:
            offset = getattr(cls, name).offset
            fmt += f"{offset - pos}x" if offset > pos else ""
            fmt += _STRUCT_CODES[ty]
            pos = offset + ctypes.sizeof(ty)
        fmt += f"{ctypes.sizeof(cls) - pos}x" if ctypes.sizeof(cls) > pos else ""
        packed = struct.Struct(fmt)
        assert packed.size == ctypes.sizeof(cls), (fmt, ctypes.sizeof(cls))
        _packers[cls] = packed.pack_into, packed.size
    return _packers[cls]


# AdamArgs' pointer fields that hybrid_adam_expand_runs moves by a run's first element, in its order
# (the struct's own; the grads' address comes from each run)
EXPAND_FIELDS = tuple(name for name, ty in AdamArgs._fields_ if ty is ctypes.c_void_p and name != "grad")


def expand_runs(base, strides: dict, runs: list):
    """An AdamArgs array of one call per run: `base` with each run's n and grad, its pointer fields
    moved by the run's first element times their stride (`strides`: {field: bytes an element}, the
    fields of EXPAND_FIELDS that move). `runs`: (grads' address, first element, elements) each.
    Built in C (hybrid_adam_expand_runs): bit for bit what packing each run's fields gives."""
    flat = array.array("q", itertools.chain.from_iterable(runs))
    steps = array.array("q", (strides.get(name, 0) for name in EXPAND_FIELDS))
    out = (AdamArgs * len(runs))()
    if runs:
        lib.hybrid_adam_expand_runs(base, steps.buffer_info()[0], flat.buffer_info()[0], len(runs), out)
    return out


def adam_steps(calls) -> None:
    """Runs a list (or a ctypes array) of AdamArgs in one call of hybrid_adam_step_many (raw
    addresses, unchecked): the torch-free half of cpu_kernels.adam_steps_, which the worker's steps
    call too."""
    if not len(calls):
        return
    argv = calls if isinstance(calls, ctypes.Array) else (AdamArgs * len(calls))(*calls)
    if lib.hybrid_adam_step_many(argv, len(calls)) != 0:
        raise MemoryError("hybrid_adam_step_many could not allocate its per-call constants")


def grad_sums(grads: list) -> list:
    """The sum of squares of each of `grads`, (address, dtype code, elements), in one call of
    hybrid_grad_stats_many (raw addresses, unchecked): the torch-free half of
    cpu_kernels.grad_stats_many, which the worker's steps call too."""
    count = len(grads)
    if not count:
        return []
    ptrs = (ctypes.c_void_p * count)(*(addr for addr, _, _ in grads))
    dts = (ctypes.c_int32 * count)(*(dt for _, dt, _ in grads))
    ns = (ctypes.c_int64 * count)(*(n for _, _, n in grads))
    out = (ctypes.c_double * count)()
    if lib.hybrid_grad_stats_many(ptrs, dts, ns, count, out) != 0:
        raise MemoryError("hybrid_grad_stats_many could not allocate the per-chunk partial sums")
    return list(out)


def set_num_threads(n: int) -> None:
    """OpenMP threads used by every kernel call from now on (results do not depend on it)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"set_num_threads: n must be a positive int, got {n!r}")
    lib.hybrid_set_num_threads(n)


def get_num_threads() -> int:
    return lib.hybrid_get_num_threads()


def set_thread_cpus(cpus, threads: int) -> int:
    """Allows the first `threads` OpenMP threads (the caller's and the pool's that every region
    of up to that many threads runs on) on the cores `cpus` from now on. Returns how many threads
    the OS refused to move (0: all moved), or -1 where threads have no affinity (not Linux)."""
    cpus = sorted({int(c) for c in cpus})
    if not cpus or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"set_thread_cpus: needs cores and threads >= 1, got {cpus!r}, {threads!r}")
    return lib.hybrid_set_thread_cpus((ctypes.c_int * len(cpus))(*cpus), len(cpus), threads)


def _apply_env_level():
    forced = os.environ.get("HYBRID_OPT_SIMD")
    if not forced:
        return
    forced = forced.strip().lower()
    if forced not in LEVELS:
        warnings.warn(f"HYBRID_OPT_SIMD={forced!r} is not one of {LEVELS}; ignored")
    elif LEVELS.index(forced) > lib.hybrid_max_level():
        warnings.warn(f"HYBRID_OPT_SIMD={forced!r} is above what this CPU supports; using {simd_level()!r}")
    else:
        set_simd_level(forced)


def _apply_env_streaming_stores():
    value = os.environ.get("HYBRID_OPT_ARM_STREAMING_STORES", "").strip()
    if value in ("", "0"):
        return
    if value != "1":
        warnings.warn(f"HYBRID_OPT_ARM_STREAMING_STORES={value!r} is not 0 or 1; ignored")
    elif lib.hybrid_set_arm_streaming_stores(1) != 0:
        warnings.warn(
            "HYBRID_OPT_ARM_STREAMING_STORES=1 has no effect here: streaming stores "
            "are an option of the Arm levels (neon, sve) only"
        )


_apply_env_level()
_apply_env_streaming_stores()
