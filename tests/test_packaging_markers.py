"""The dependency markers in pyproject.toml, evaluated offline with packaging.markers: triton
(the device tier's kernels) is declared wherever it publishes wheels — Linux x86_64 and
aarch64 (GH200, Grace Hopper) — and nowhere else; the other runtime dependencies everywhere."""

import os
import sys

import pytest

packaging = pytest.importorskip("packaging", reason="packaging (pip's own marker library) is not installed")
from packaging.requirements import Requirement  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 without tomli cannot read pyproject.toml")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _environment(system, machine):
    """A marker environment of CPython 3.11 on `system`/`machine` (PEP 508 variables)."""
    return {
        "implementation_name": "cpython",
        "implementation_version": "3.11.7",
        "os_name": "nt" if system == "Windows" else "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": system,
        "platform_version": "",
        "python_full_version": "3.11.7",
        "python_version": "3.11",
        "sys_platform": {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system],
    }


def _requirements():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return {Requirement(r).name: Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]}


@pytest.mark.parametrize(
    "system,machine,wanted",
    [
        ("Linux", "x86_64", True),
        ("Linux", "aarch64", True),
        ("Linux", "ppc64le", False),
        ("Linux", "armv7l", False),
        ("Darwin", "arm64", False),
        ("Darwin", "x86_64", False),
        ("Windows", "AMD64", False),
    ],
)
def test_triton_is_declared_exactly_where_it_ships_wheels(system, machine, wanted):
    triton = _requirements()["triton"]
    assert triton.marker is not None
    assert triton.marker.evaluate(_environment(system, machine)) is wanted


def test_the_other_dependencies_apply_on_linux_aarch64_too():
    reqs = _requirements()
    assert {"torch", "numpy", "psutil", "tqdm", "matplotlib", "triton"} <= set(reqs)
    for name, req in reqs.items():
        if name != "triton":
            assert req.marker is None or req.marker.evaluate(_environment("Linux", "aarch64")), name
