"""The launch-path compile of every kernel specialization (tests/kernel_specializations.py), one
job per GPU architecture, started in the background as the test session begins.

The compile is four CPU-minutes of Triton and ptxas, and the rest of the suite leaves much of the
machine idle while it waits on processes, pipes and disks. So conftest.py starts these jobs when
the session runs test_gpu_compile.py's test, at the lowest CPU priority (SCHED_IDLE, or nice 19
where that is refused): they take only the cycles that no test wants, and a timing or a deadline
elsewhere sees no difference. The test runs last and collects them. Each job stays in pytest's
session (its own process group, not its own session: Linux's autogroups would give a new session
half of the CPU whatever its priority), writes to a file, not a pipe (nobody reads a pipe while
other tests run), and is killed with its group when the test gives up or the session ends.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "kernel_specializations.py")
ARCHS = ("80", "90")
TEST_ID = "test_gpu_compile.py::test_every_specialization_compiles_for_sm80_and_sm90_through_the_launch_path"


def _own_group() -> None:
    """In the child before exec: its own process group (killed as one), and killed with pytest
    if pytest is killed first (PR_SET_PDEATHSIG), so no compile outlives the session."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass


def _lowest_priority() -> None:
    """_own_group, and the idle CPU class."""
    _own_group()
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


class CompileJobs:
    """The running compiles, one per architecture; `collect` waits for them and kills what is late."""

    def __init__(self, background: bool):
        self.workdir = tempfile.mkdtemp(prefix="hybrid_opt-gpu-compile-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}
        for arch in ARCHS:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["TRITON_CACHE_DIR"] = os.path.join(self.workdir, f"cache-{arch}")
            env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
            self.logs[arch] = os.path.join(self.workdir, f"sm_{arch}.log")
            with open(self.logs[arch], "w") as log:
                self.procs[arch] = subprocess.Popen(
                    [sys.executable, SCRIPT, "--arch", arch],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_lowest_priority if background else _own_group,
                )

    def collect(self, deadline_s: float) -> dict[str, tuple[int | None, str]]:
        """(return code, output) per architecture, waiting at most deadline_s from now; a job still
        running then is killed with its group and reports None."""
        end = time.monotonic() + deadline_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = {arch: proc.poll() for arch, proc in self.procs.items()}
        self.kill()
        results = {}
        for arch in self.procs:
            with open(self.logs[arch]) as log:
                results[arch] = (codes[arch], log.read())
        self.close()
        return results

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def close(self) -> None:
        """Every job killed, and its logs and Triton caches removed."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


_jobs: CompileJobs | None = None


def start_in_background() -> None:
    """conftest.py, as the session starts a run that includes the test."""
    global _jobs
    if _jobs is None:
        _jobs = CompileJobs(background=True)


def take() -> CompileJobs:
    """The test: the jobs started in the background, or (run without them) jobs started now."""
    global _jobs
    jobs, _jobs = _jobs, None
    return jobs if jobs is not None else CompileJobs(background=False)


def groups() -> set[int]:
    """The process groups of the jobs running in the background (each job leads its own): tests
    that count this process's children leave them out, as they come and go (ptxas) meanwhile."""
    return {proc.pid for proc in _jobs.procs.values()} if _jobs is not None else set()


def stop() -> None:
    """conftest.py, as the session ends: nothing outlives it."""
    global _jobs
    if _jobs is not None:
        _jobs.close()
        _jobs = None
