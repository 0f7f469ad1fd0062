"""The RAM a stretch of code costs as the OS counts it, sampled from a process of its own.

    with RamSampler([os.getpid(), worker_pid]) as ram:
        do_the_thing()
    ram.result  # {"anon_shmem_peak": bytes, "rss_shmem_peak": bytes, ...}

`RamSampler` starts `python ram_sampler.py PID...`: a separate process, not a thread, so the
measured code holding the GIL never delays a sample. Every 2 ms it reads /proc/<pid>/status of
each pid and /proc/meminfo, and on stop hands back the peak of two sums above their first
sample (taken before the `with` body starts):

- `anon_shmem`: RssAnon of the pids + the system's `Shmem` (meminfo). A shared page counts once
  however many processes map it, and whether or not any does (a tmpfs file counts too; so does
  any other process's shared memory that comes or goes meanwhile: run on a quiet machine).
- `rss_shmem`: RssAnon + RssShmem of the pids. The kernel counts a shared page once per process
  mapping it, so new pages of an arena that both the trainer and its worker touch count twice.

`wait_until_steady(pids)` (in process) returns once RssAnon + RssShmem of the pids hold still:
a baseline taken then does not count a background thread still populating shared memory.

A pid that has exited (or None) counts 0. The kernel syncs a process's RSS counters lazily (about
every 64 page faults), so a figure is good to a fraction of a MiB, and a peak shorter than the
2 ms period can be missed.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

PERIOD_S = 0.002
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 30.0


def _status_kib(pid: int, keys: tuple[str, ...]) -> list[int]:
    """The given fields of /proc/<pid>/status in KiB (0 each once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return [0] * len(keys)
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return [int(fields[k].split()[0]) if k in fields else 0 for k in keys]


def _system_shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key == "Shmem":  # not ShmemHugePages / ShmemPmdMapped
                return int(value.split()[0])
    raise RuntimeError("/proc/meminfo has no Shmem line: not a Linux kernel this sampler knows")


def sample(pids: list[int]) -> dict:
    """One reading, in bytes: each sum and its parts."""
    anon = rss_shmem = 0
    for pid in pids:
        a, s = _status_kib(pid, ("RssAnon", "RssShmem"))
        anon, rss_shmem = anon + a, rss_shmem + s
    system = _system_shmem_kib()
    return {
        "anon_shmem": (anon + system) << 10,
        "rss_shmem": (anon + rss_shmem) << 10,
        "anon": anon << 10,
        "system_shmem": system << 10,
    }


def sampler_main(pids: list[int]) -> None:
    """Samples until a line (or EOF) arrives on stdin, then prints the peaks above the first
    sample as one JSON line."""
    base = sample(pids)
    peak = dict(base)
    print("ready", flush=True)
    n = 1
    while True:
        stop = select.select([sys.stdin], [], [], PERIOD_S)[0]
        now = sample(pids)  # one more after the stop: the state the stretch ended in
        n += 1
        for key, value in now.items():
            peak[key] = max(peak[key], value)
        if stop:
            break
    result = {f"{key}_peak": peak[key] - base[key] for key in base}
    result.update({f"{key}_end": now[key] - base[key] for key in base}, samples=n)
    print(json.dumps(result), flush=True)


def wait_until_steady(
    pids: list[int | None], quiet_s: float = 0.5, tolerance: int = 1 << 20, timeout_s: float = 60.0
) -> bool:
    """Waits until RssAnon + RssShmem of the pids stayed within `tolerance` bytes for `quiet_s`
    (a background thread populating shared memory has finished, say); False past `timeout_s`.
    Per-process figures only: other processes' shared memory does not hold it up."""
    pids = [p for p in pids if p is not None]
    deadline = time.monotonic() + timeout_s
    low = high = sample(pids)["rss_shmem"]
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(PERIOD_S * 10)
        now = sample(pids)["rss_shmem"]
        low, high = min(low, now), max(high, now)
        if high - low > tolerance:
            low = high = now
            since = time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
    return False


class RamSampler:
    """A sampler process over `pids` (None entries dropped) for the span of a `with` block;
    `result` holds its peaks (bytes above the first sample) once the block ends."""

    def __init__(self, pids: list[int | None]):
        self.pids = [p for p in pids if p is not None]
        self.result: dict | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> RamSampler:
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *map(str, self.pids)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = select.select([self._proc.stdout], [], [], _START_TIMEOUT_S)[0]
        line = self._proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            self._proc.kill()
            raise RuntimeError(
                f"the RAM sampler did not start within {_START_TIMEOUT_S:.0f} s "
                f"(said {line!r}, exit {self._proc.poll()})"
            )
        return self

    def __exit__(self, *exc) -> None:
        try:
            out, _ = self._proc.communicate("stop\n", timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            raise RuntimeError(f"the RAM sampler did not stop within {_STOP_TIMEOUT_S:.0f} s") from None
        if self._proc.returncode != 0:
            raise RuntimeError(f"the RAM sampler failed (exit {self._proc.returncode})")
        self.result = json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sampler_main([int(p) for p in sys.argv[1:]])
