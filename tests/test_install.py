"""A non-editable install carries every subpackage: `pip install .` once listed only the
top-level packages and left hybrid_opt.tiers, .worker (and now .placement, .state,
.distributed) out, so the installed optimizer could not import its tiers. And .ci/setup.sh keeps the torch it finds: the
test extra's frameworks once upgraded a GPU CI column's torch 2.5.1 to the newest."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _packages(root: pathlib.Path) -> set:
    return {
        str(p.parent.relative_to(root))
        for top in ("hybrid_opt", "gpu_kernels", "cpu_kernels")
        for p in (root / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def _reuse_the_built_kernels(src: pathlib.Path) -> None:
    """The checkout's built cpu_kernels/_native*.so, alone, where setuptools' build_ext puts its
    output (build/lib.<platform>-<tag>/): newer than the sources, it is taken as up to date, and the
    install skips 20 s of compiling that .ci/setup.sh's install has checked. No .py file goes
    there, so the package list is still the one setuptools finds now (where the naming differs, the
    install compiles them again)."""
    built = sorted((ROOT / "cpu_kernels").glob("_native*.so"))
    lib = src / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "cpu_kernels"
    lib.mkdir(parents=True)
    for so in built:
        shutil.copy(so, lib / so.name)  # a fresh mtime: newer than every source


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_a_non_editable_install_has_every_subpackage(tmp_path):
    # --no-build-isolation builds with this environment's setuptools: a wheel needs bdist_wheel,
    # setuptools' own from 70.1, else the wheel package's (a Python 3.11 venv has neither)
    if (
        importlib.util.find_spec("wheel") is None
        and importlib.util.find_spec("setuptools.command.bdist_wheel") is None
    ):
        pytest.skip(
            "no bdist_wheel here (setuptools < 70.1 without the wheel package): pip install -U setuptools"
        )
    # built from a copy: setuptools reuses a checkout's build/ directory, which would hide a
    # package list that leaves subpackages out
    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            "build",
            "*.egg-info",
            "venv",
            ".venv",
            "__pycache__",
            "bench_out",
            ".pytest_cache",
            ".mypy_cache",  # written meanwhile by the suite's type check (tests/test_types.py)
        ),
    )
    _reuse_the_built_kernels(src)
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
    assert sorted(p.name for p in (target / "cpu_kernels").glob("_native*.so")), "no built kernels installed"


def _setup_script_pin_program() -> str:
    """The Python program .ci/setup.sh runs to write its torch constraint (its `<<'PIN'` block)."""
    text = (ROOT / ".ci" / "setup.sh").read_text()
    start = text.index("<<'PIN'\n") + len("<<'PIN'\n")
    return text[start : text.index("\nPIN\n", start)]


def test_setup_installs_the_test_extra_under_a_constraint_that_holds_the_installed_torch(tmp_path):
    import importlib.metadata

    text = (ROOT / ".ci" / "setup.sh").read_text()
    extra = [line for line in text.splitlines() if '".[test]"' in line and "pip install" in line]
    assert extra and all('-c "$TORCH_PIN"' in line for line in extra), extra
    pin = tmp_path / "pin.txt"
    pin.write_text(
        subprocess.run(
            [sys.executable, "-c", _setup_script_pin_program()], check=True, capture_output=True, text=True
        ).stdout
    )
    installed = importlib.metadata.version("torch")
    assert pin.read_text().split() == [f"torch=={installed}"]

    # pip reads it so: a later torch cannot be had under it, the installed one stays (no index asked)
    def dry_run(requirement):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--no-index",
                "--no-deps",
                "-c",
                str(pin),
                requirement,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    later = dry_run(f"torch>{installed.split('+')[0]}")
    assert later.returncode != 0 and "ResolutionImpossible" in later.stdout + later.stderr, later
    kept = dry_run("torch>=2.4")
    assert kept.returncode == 0 and "already satisfied" in kept.stdout, kept
