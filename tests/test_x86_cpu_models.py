"""cpu_kernels on x86-64 CPUs below this one's, emulated: qemu-x86_64 -cpu Haswell (AVX2 + FMA, no
AVX-512: most cloud hosts and desktops) and -cpu SandyBridge (AVX without AVX2 or FMA: the portable
level; numpy 2.4 itself needs more than Nehalem's SSE4.2) run
tests/x86_model_probe.py. The library must load there (nothing runs at load that the CPU lacks: a
table built by a constructor compiled for AVX-512 killed every AVX2-only host with SIGILL), pick
the level the CPU has, and step fp32 Adam and q8 ranges to the bits this host gives at that level
(HYBRID_OPT_SIMD). Skipped, saying why, where qemu-x86_64 (Debian's qemu-user) is missing; on
another architecture there is nothing to emulate."""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "x86_model_probe.py")
QEMU = shutil.which("qemu-x86_64")
MODELS = {"Haswell": "avx2", "SandyBridge": "portable"}  # qemu's CPU model -> the level it supports

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 CPU models are emulated on x86-64"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 is not installed (apt-get install qemu-user)"),
]


def _probe(prefix: list, env: dict) -> dict:
    run = subprocess.run(
        [*prefix, sys.executable, PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **env},
    )
    assert run.returncode == 0, (
        f"{prefix or 'native'}: exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_cpu_kernels_load_and_step_on_a_lower_cpu_bitwise(model):
    level = MODELS[model]
    native = _probe([], {"HYBRID_OPT_SIMD": level})
    assert native["level"] == native["q8_level"] == level, native
    emulated = _probe([QEMU, "-cpu", model], {"HYBRID_OPT_SIMD": ""})
    assert emulated["level"] == emulated["q8_level"] == level, (model, emulated)
    assert emulated == native, (model, emulated, native)
