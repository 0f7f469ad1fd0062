"""Shared benchmark plumbing: timing with median/p20/p80, markdown tables, JSON records."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time


def spread(xs) -> tuple[float, float, float]:
    """(median, p20, p80) of `xs` (a single sample is all three)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else xs * 9
    return statistics.median(xs), q[1], q[7]


def time_ms(fn, *, reps: int, warmup: int = 2) -> dict:
    """Median and p20/p80 of `reps` timed calls, in milliseconds (noisy machines: never a mean)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    median, p20, p80 = spread(samples)
    return {"median_ms": median, "p20_ms": p20, "p80_ms": p80}


def time_ms_interleaved(fns: dict, *, reps: int, warmup: int = 2) -> dict:
    """Like time_ms for several callables, timed in rounds (each once per round, in turn), so
    drift on a noisy machine hits them all alike; returns {name: median/p20/p80}."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, xs in samples.items():
        median, p20, p80 = spread(xs)
        out[name] = {"median_ms": median, "p20_ms": p20, "p80_ms": p80}
    return out


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); a missing value prints as '-'."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str | None, records: list[dict]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}")


def host_description() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus"


def parse_size(s: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * units[u])
    return int(s)


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding path (longest mount-point prefix)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mnt, typ = fields[1], fields[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind
