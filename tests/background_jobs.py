"""The suite's long CPU-bound checks as background jobs, started as the test session begins and
collected by their tests, which run last: the launch-path compile of every kernel specialization
(tests/kernel_specializations.py, one job per GPU architecture: four CPU-minutes of Triton and
ptxas), the exhaustive proofs of the q8 quantizers (tests/q8_proof.py, one job per SIMD level
and map: 2^32 fp32 patterns each, about 24 s of both cores at AVX2), and mypy's type check of
hybrid_opt/ (about 50 s of one core without its cache: it reads torch's types).

The rest of the suite leaves much of the machine idle while it waits on processes, pipes and
disks. So conftest.py starts the jobs of the tests a session runs, at the lowest CPU priority
(SCHED_IDLE, or nice 19 where that is refused): they take only the cycles that no test wants,
and a timing or a deadline elsewhere sees no difference. Each job stays in pytest's session (its
own process group, not its own session: Linux's autogroups would give a new session half of the
CPU whatever its priority), writes to a file, not a pipe (nobody reads a pipe while other tests
run), and is killed with its group when its test gives up or the session ends. A test run
without the session's start (a job not started) starts its job in the foreground.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("80", "90")
COMPILE_TEST = (
    "test_gpu_compile.py::test_every_specialization_compiles_for_sm80_and_sm90_through_the_launch_path"
)
Q8_TEST = "test_q8_cpu.py::test_quantizer_equals_q8_code_for_every_fp32_pattern"
MYPY_TEST = "test_types.py::test_hybrid_opt_passes_mypy"


@dataclass(frozen=True)
class JobSpec:
    name: str
    test: str  # the node id (its end) of the test that collects it, parameters excluded
    args: tuple  # after the interpreter
    env: dict = field(default_factory=dict)  # set (None: removed) in the test session's environment
    params: str = ""  # the test's parameter id ("[...]") where one job serves one parametrization


def specs() -> list[JobSpec]:
    compile_env = {
        "TRITON_INTERPRET": None,
        "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"),
    }
    out = [
        JobSpec(f"sm_{arch}", COMPILE_TEST, ("tests/kernel_specializations.py", "--arch", arch), compile_env)
        for arch in ARCHS
    ]
    out += [
        JobSpec(
            q8_job(level, signed),
            Q8_TEST,
            ("tests/q8_proof.py", "--level", level, *(["--signed"] if signed else [])),
            params=f"[{signed}-{level}-",
        )
        for level in ("avx512", "avx2")
        for signed in (True, False)
    ]
    if mypy_skip_reason() is None:
        out.append(JobSpec("mypy", MYPY_TEST, ("-m", "mypy")))  # [tool.mypy] in pyproject.toml
    return out


def mypy_skip_reason() -> str | None:
    """Why mypy's check does not apply here, or None: hybrid_opt/ is typed against the torch that
    CI installs (.ci/setup.sh's pin), whose stubs differ from other releases' (a module that an
    older torch lacks is an error there, a `type: ignore` it does not need is one too)."""
    import re

    import torch

    with open(os.path.join(ROOT, ".ci", "setup.sh")) as f:
        pin = re.search(r"torch==([0-9.]+)", f.read())
    assert pin, ".ci/setup.sh names no torch==X pin"
    ours = torch.__version__.split("+")[0]
    if ours.rsplit(".", 1)[0] != pin.group(1).rsplit(".", 1)[0]:
        return f"hybrid_opt/ is typed against torch {pin.group(1)} (.ci/setup.sh), not this torch {ours}"
    return None


def q8_job(level: str, signed: bool) -> str:
    return f"q8_{level}_{'signed' if signed else 'unsigned'}"


def _own_group() -> None:
    """In the child before exec: its own process group (killed as one), and killed with pytest
    if pytest is killed first (PR_SET_PDEATHSIG), so no job outlives the session."""
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


class Job:
    """One running job: its process (group) and its log file, in a directory of its own (the
    compile's Triton cache goes there too)."""

    def __init__(self, spec: JobSpec, background: bool):
        self.spec = spec
        self.workdir = tempfile.mkdtemp(prefix=f"hybrid_opt-{spec.name}-")
        env = dict(os.environ)
        for k, v in spec.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env["TRITON_CACHE_DIR"] = os.path.join(self.workdir, "triton-cache")
        self.log = os.path.join(self.workdir, "out.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *spec.args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_lowest_priority if background else _own_group,
            )

    def collect(self, deadline_s: float) -> tuple[int | None, str]:
        """(return code, output), waiting at most deadline_s from now; a job still running then is
        killed with its group and reports None. Its directory is removed."""
        try:
            self.proc.wait(timeout=max(0.0, deadline_s))
        except subprocess.TimeoutExpired:
            pass
        code = self.proc.poll()
        self.kill()
        with open(self.log) as log:
            out = log.read()
        self.close()
        return code, out

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


_jobs: dict[str, Job] = {}


def tests_with_jobs(items) -> list:
    """The session's items that collect a job (conftest.py runs them last)."""
    return [item for item in items if any(_serves(s, item.nodeid) for s in specs())]


def _serves(spec: JobSpec, nodeid: str) -> bool:
    base, _, params = nodeid.partition("[")
    return base.endswith(spec.test) and ("[" + params).startswith(spec.params)


def start_in_background(items) -> None:
    """conftest.py, as the session starts: the jobs of the tests among `items` that will run
    (not skipped by a mark)."""
    for spec in specs():
        if spec.name in _jobs:
            continue
        if any(
            _serves(spec, item.nodeid) and not item.get_closest_marker("skip") and not _skipped(item)
            for item in items
        ):
            _jobs[spec.name] = Job(spec, background=True)


def _skipped(item) -> bool:
    """A skipif mark whose condition holds (the q8 levels this CPU lacks)."""
    return any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))


def result(name: str, deadline_s: float) -> tuple[int | None, str]:
    """The test: its job's (return code, output), the background job's, or (run without one) a
    job started now."""
    job = _jobs.pop(name, None)
    if job is None:
        job = Job(next(s for s in specs() if s.name == name), background=False)
    return job.collect(deadline_s)


def groups() -> set[int]:
    """The process groups of the jobs running in the background (each job leads its own): tests
    that count this process's children leave them out, as they come and go (ptxas) meanwhile."""
    return {job.proc.pid for job in _jobs.values()}


def stop() -> None:
    """conftest.py, as the session ends: nothing outlives it."""
    for job in _jobs.values():
        job.close()
    _jobs.clear()
