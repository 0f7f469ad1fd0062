"""The program a GPU compiles, checked without one: every fused_adam_ and grad_stats
specialization the launchers can produce (tests/kernel_specializations.py), through the launch
path, compiled by Triton to PTX and a cubin for sm_80 and sm_90.

Triton's interpreter (the value tests) runs programs the compiler rejects; this test fails
on any kernel whose constexprs are lost on the way to the compiler, on a variable whose type
differs between the branches of a runtime `if`, and on shapes from runtime values. The two
architectures compile in parallel, each in a fresh interpreter (the interpreter patches
triton.language in a process that has interpreted) with an empty Triton cache.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "kernel_specializations.py")
DEADLINE_S = 600


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_specialization_compiles_for_sm80_and_sm90_through_the_launch_path():
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        for arch in ("80", "90"):
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["TRITON_CACHE_DIR"] = os.path.join(cache, arch)
            env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
            runs[arch] = subprocess.Popen(
                [sys.executable, SCRIPT, "--arch", arch],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        outputs = {}
        try:
            for arch, proc in runs.items():
                outputs[arch] = proc.communicate(timeout=DEADLINE_S)[0]
        finally:
            for proc in runs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    for arch, proc in runs.items():
        assert proc.returncode == 0 and "OK" in outputs[arch], f"sm_{arch}:\n{outputs[arch][-6000:]}"
        print(outputs[arch].strip().splitlines()[-2])


def test_compile_for_refuses_an_unknown_architecture_and_nesting():
    from gpu_kernels import offline

    with pytest.raises(ValueError, match="compute capability"):
        offline.parse_arch("hopper")
    assert offline.parse_arch("sm_90") == offline.parse_arch(90) == offline.parse_arch("sm90") == 90


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_an_architecture_s_own_launch_configuration_overrides_the_gpu_default():
    from gpu_kernels import _runtime, offline

    configs = {"cuda": {"BLOCK": 1}, "sm_90": {"BLOCK": 2}, "cpu": {"BLOCK": 3}}
    with offline.compile_for("sm_90"):
        assert _runtime.launch_config(configs, "cpu") == {"BLOCK": 2}
    with offline.compile_for("sm_80"):
        assert _runtime.launch_config(configs, "cpu") == {"BLOCK": 1}
    assert _runtime.launch_config(configs, "cpu") == {"BLOCK": 3}
