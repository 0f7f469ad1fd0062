"""Probe run by tests/test_x86_cpu_models.py, natively and under qemu-x86_64 -cpu MODEL: loads
cpu_kernels without torch (as the worker does), steps one fp32 Adam range and one q8 range on numpy
buffers through the raw C entry points, and prints one JSON line: the SIMD levels the library
picked and a digest of every output buffer. A library that runs an instruction the CPU lacks
dies here with SIGILL (a constructor compiled for a higher level, run at load, is the trap)."""

import ctypes
import hashlib
import json

import numpy as np

import cpu_kernels
from cpu_kernels._lib import DT_F32, AdamArgs, lib
from cpu_kernels._q8_lib import DT_Q8, Q8AdamArgs, q8_adam_step_raw, q8_simd_level

N = 4 * 256 + 37  # whole q8 blocks and a partial one; vector loops and their tails


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def adam(rng: np.random.Generator) -> str:
    """Two fp32 AdamW steps in place (fp32 grads and moments)."""
    p = rng.standard_normal(N, dtype=np.float32)
    m = np.zeros(N, np.float32)
    v = np.zeros(N, np.float32)
    for step in (1, 2):
        g = rng.standard_normal(N, dtype=np.float32)
        a = AdamArgs(n=N, param=_ptr(p), grad=_ptr(g), exp_avg=_ptr(m), exp_avg_sq=_ptr(v))
        a.param_out, a.exp_avg_out, a.exp_avg_sq_out = _ptr(p), _ptr(m), _ptr(v)
        a.grad_dtype = a.moment_dtype = a.exp_avg_sq_dtype = DT_F32
        a.decoupled, a.step = 1, step
        a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale = 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0
        lib.hybrid_adam_step(ctypes.byref(a))
    return _digest(p, m, v)


def q8(rng: np.random.Generator) -> str:
    """Three q8 AdamW steps in place (fp32 param and grads, both moments q8)."""
    blocks = (N + 255) // 256
    p = rng.standard_normal(N, dtype=np.float32)
    m, v = np.full(N, 127, np.uint8), np.zeros(N, np.uint8)
    ma, va = np.zeros(blocks, np.float32), np.zeros(blocks, np.float32)
    for step in (1, 2, 3):
        g = rng.standard_normal(N, dtype=np.float32)
        a = Q8AdamArgs(n=N, param=_ptr(p), grad=_ptr(g), param_out=_ptr(p), step=step)
        a.exp_avg, a.exp_avg_absmax, a.exp_avg_out, a.exp_avg_absmax_out = (
            _ptr(m),
            _ptr(ma),
            _ptr(m),
            _ptr(ma),
        )
        a.exp_avg_sq, a.exp_avg_sq_absmax = _ptr(v), _ptr(va)
        a.exp_avg_sq_out, a.exp_avg_sq_absmax_out = _ptr(v), _ptr(va)
        a.grad_dtype, a.exp_avg_dtype, a.exp_avg_sq_dtype, a.decoupled = DT_F32, DT_Q8, DT_Q8, 1
        a.lr, a.beta1, a.beta2, a.eps, a.weight_decay = 1e-3, 0.9, 0.999, 1e-8, 0.01
        q8_adam_step_raw(a)
    return _digest(p, m, ma, v, va)


def main() -> None:
    rng = np.random.default_rng(0)
    out = dict(level=cpu_kernels.simd_level(), q8_level=q8_simd_level(), adam=adam(rng), q8=q8(rng))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
