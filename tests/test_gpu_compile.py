"""The program a GPU compiles, checked without one: every fused_adam_ and grad_stats
specialization the launchers can produce (tests/kernel_specializations.py), through the launch
path, compiled by Triton to PTX and a cubin for sm_80 and sm_90.

Triton's interpreter (the value tests) runs programs the compiler rejects; this test fails
on any kernel whose constexprs are lost on the way to the compiler, on a variable whose type
differs between the branches of a runtime `if`, and on shapes from runtime values. The two
architectures compile in parallel, each in a fresh interpreter (the interpreter patches
triton.language in a process that has interpreted) with an empty Triton cache, started in the
background as the session begins and collected last (tests/background_jobs.py).
"""

import importlib.util

import background_jobs
import pytest

# from when the test starts waiting: by then the suite's other tests are done (conftest.py runs this
# one last), and the compiles have the machine
DEADLINE_S = 600


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_specialization_compiles_for_sm80_and_sm90_through_the_launch_path():
    results = {arch: background_jobs.result(f"sm_{arch}", DEADLINE_S) for arch in background_jobs.ARCHS}
    for arch, (code, output) in results.items():
        assert code == 0 and "OK" in output, (
            f"sm_{arch} (exit {code}, None: past {DEADLINE_S} s):\n{output[-6000:]}"
        )
        print(output.strip().splitlines()[-2])


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
