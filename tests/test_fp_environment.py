"""The host kernels' bits do not depend on the process's floating-point environment.

A shared library built with -ffast-math (gcc links crtfastmath.o into it) turns on flush-to-zero and
denormals-are-zero in the thread that loads it, for the rest of the process: torch 2.4's inductor
does so with every CPU kernel it compiles (measured: `torch.compile` of a one-line function, then
1e-40 * 1.0 == 0 in that process; not in torch 2.13). The worker process loads nothing of the
kind, the trainer may: without a guard an offload-0 step there would round subnormals otherwise
than the host tier's. Each kernel clears those modes for its work (kernels.h, ieee_enter).

A fresh interpreter loads a real -ffast-math library (built here with gcc) before its first kernel
call, so every OpenMP thread starts flushed; it steps the same inputs, full of subnormals, that
this process steps, and every output must be bit for bit this process's.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import cpu_kernels as ck
from cpu_kernels.q8_reference import Q8Blocks, quantize_blocks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES = (1000, 3 * 65536 + 17)  # one thread, and the parallel regions (PARALLEL_MIN 65536)
HYPER = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _tiny(n: int, seed: int) -> torch.Tensor:
    """Values around the fp32 subnormal range (2^-149 to 2^-126) and a few normal ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 2.0**-130
    x[::7] *= 2.0**100  # normal values beside them
    return x.float()


def make_inputs() -> dict:
    """{n: named inputs}, every conversion made here: in a flushed process torch's own ops would
    flush them before any kernel saw them."""
    out = {}
    for n in SIZES:
        t = dict(p=_tiny(n, 1), g=_tiny(n, 2), m=_tiny(n, 3), v=_tiny(n, 4).abs())
        t.update(
            g16=_tiny(n, 5).to(torch.bfloat16), m16=t["m"].to(torch.bfloat16), v16=t["v"].to(torch.bfloat16)
        )
        t["param"], t["rem"] = ck.encode_remainder(t["p"])
        m8, v8 = quantize_blocks(t["m"] * 2.0**100, signed=True), quantize_blocks(t["v"], signed=False)
        t.update(m8=m8.codes, m8_absmax=m8.absmax, v8=v8.codes, v8_absmax=v8.absmax)
        out[n] = t
    return out


def run_cases(inputs: dict) -> dict:
    """Every host kernel on the subnormal-laden inputs: {case: output tensors}. Clones and
    kernels only: no torch arithmetic."""
    out = {}
    for n, t in inputs.items():
        t = {k: v.clone() for k, v in t.items()}
        p, m, v = t["p"].clone(), t["m"].clone(), t["v"].clone()
        ck.adam_step_(p, t["g"], m, v, **HYPER)
        out[f"adam {n}"] = (p, m, v)
        p, m, v = t["p"].clone(), t["m"].clone(), t["v"].clone()
        ck.adam_step_(p, t["g16"], m, v, decoupled=False, grad_scale=0.5, **HYPER)
        out[f"adam L2 bf16 grads {n}"] = (p, m, v)
        param, rem = ck.encode_remainder(t["p"])
        out[f"encode {n}"] = (param, rem)
        param, rem, m16, v16 = t["param"], t["rem"], t["m16"], t["v16"]
        ck.adam_step_(param, t["g"], m16, v16, remainder=rem, **HYPER)
        out[f"remainders {n}"] = (ck.decode_remainder(param, rem), param, rem, m16, v16)
        p, m, v = t["p"].clone(), t["m"].clone(), t["v"].clone()
        ck.adam_inverse_(p, t["g"], m, v, **HYPER)
        out[f"inverse {n}"] = (p, m, v)
        out[f"grad_stats {n}"] = (torch.tensor([ck.grad_stats(t["g"])[0]], dtype=torch.float64),)
        p = t["p"].clone()
        m8, v8 = Q8Blocks(t["m8"], t["m8_absmax"]), Q8Blocks(t["v8"], t["v8_absmax"])
        ck.q8_adam_step_(p, t["g"], m8, v8, **HYPER)
        out[f"q8 {n}"] = (p, m8.codes, m8.absmax, v8.codes, v8.absmax)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[t.element_size()])


@pytest.fixture(scope="module")
def fast_math_library(tmp_path_factory):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build a -ffast-math library with")
    d = tmp_path_factory.mktemp("fastmath")
    src, lib = d / "fastmath.c", d / "libfastmath.so"
    src.write_text("float hybrid_fast_math_probe(float x) { return x * 2.0f; }\n")
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-ffast-math", str(src), "-o", str(lib)], check=True)
    return str(lib)


SCRIPT = r"""
import ctypes, sys
sys.path.insert(0, {tests!r})
import torch
tiny = torch.full((4,), 1e-40)
assert float((tiny * 1.0)[0]) != 0.0, "flushed before the library was loaded"
ctypes.CDLL({lib!r})
if float((tiny * 1.0)[0]) != 0.0:
    print("SKIP this compiler's -ffast-math library sets no flush-to-zero on load")
    sys.exit(0)
import test_fp_environment as T
torch.save(T.run_cases(torch.load({inputs!r}, weights_only=True)), {out!r})
print("OK")
"""


def test_kernels_step_the_same_bits_where_a_fast_math_library_set_flush_to_zero(fast_math_library, tmp_path):
    assert float((torch.full((4,), 1e-40) * 1.0)[0]) != 0.0, "this process flushes subnormals itself"
    inputs, out = make_inputs(), tmp_path / "flushed.pt"
    torch.save(inputs, tmp_path / "inputs.pt")
    script = SCRIPT.format(
        tests=HERE, lib=fast_math_library, inputs=str(tmp_path / "inputs.pt"), out=str(out)
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    if res.stdout.startswith("SKIP"):
        pytest.skip(res.stdout[5:].strip())
    flushed = torch.load(out, weights_only=True)
    clean = run_cases(inputs)
    assert set(flushed) == set(clean)
    subnormal = 0
    for case, tensors in clean.items():
        for i, (a, b) in enumerate(zip(tensors, flushed[case])):
            assert torch.equal(_bits(a), _bits(b)), f"{case}: output {i} differs where flush-to-zero was on"
        if tensors[0].is_floating_point():
            subnormal += int(((tensors[0] != 0) & (tensors[0].abs() < 2.0**-126)).sum())
    assert subnormal > 0, "no subnormal output: the inputs test nothing"
