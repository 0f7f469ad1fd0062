"""A non-editable install carries every subpackage: `pip install .` once listed only the
top-level packages and left hybrid_opt.tiers, .worker (and now .placement, .state,
.distributed) out, so the installed optimizer could not import its tiers."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _packages(root: pathlib.Path) -> set:
    return {
        str(p.parent.relative_to(root))
        for top in ("hybrid_opt", "gpu_kernels", "cpu_kernels")
        for p in (root / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_a_non_editable_install_has_every_subpackage(tmp_path):
    # built from a copy: setuptools reuses a checkout's build/ directory, which would hide a
    # package list that leaves subpackages out
    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "*.egg-info", "venv", ".venv", "__pycache__", "bench_out", ".pytest_cache"
        ),
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PIP_NO_INPUT="1"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    missing = _packages(ROOT) - _packages(target)
    assert not missing, f"left out of the install: {sorted(missing)}"
    assert {
        "hybrid_opt/tiers",
        "hybrid_opt/worker",
        "hybrid_opt/placement",
        "hybrid_opt/state",
        "hybrid_opt/distributed",
    } <= _packages(target)
