"""The nvme tier's step with 1,100 descriptors of the user's open before the optimizer is made
(its files and the worker's pipes then numbered past select()'s FD_SETSIZE, 1,024) against the
same step without them — in fresh processes, rounds alternating which goes first. The figure is
the median of per-round ratios (high / low), with its range: 1.0 when nothing waits longer there.

    python benchmarks/bench_nvme_fds.py [--subgroups 48] [--iters 40] [--rounds 8] [--dir bench_out] [--json out.json]

Before session 13 the worker waited on its request pipe with poll() up there (whole milliseconds:
its 0.5 ms waits between polls of nvme I/O took 1.1 ms); it now reads a duplicate numbered low.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, resource, sys, time, torch
from hybrid_opt import HybridAdamW
high, subgroups, iters, path = sys.argv[1] == "high", int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)] if high else []
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(subgroups * 65536))
opt = HybridAdamW([p], lr=1e-3, subgroup_numel=65536, offload_fraction=1.0, nvme_fraction=1.0, nvme_path=path)
times = []
for i in range(iters + 5):
    p.grad = torch.randn_like(p)
    t = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t)
opt.close()
print(json.dumps(sorted(times[5:])[len(times[5:]) // 2]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subgroups", type=int, default=48)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dir", help="where the nvme files go (a disk: O_DIRECT; default bench_out/)")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    ms = {"low": [], "high": []}
    base = args.dir or os.path.join(root, "bench_out")
    os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_nvme_fds_", dir=base) as path:
        for r in range(args.rounds):
            for mode in ("low", "high") if r % 2 == 0 else ("high", "low"):
                out = subprocess.run(
                    [sys.executable, "-c", _CHILD, mode, str(args.subgroups), str(args.iters), path],
                    env=env,
                    cwd=root,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=True,
                )
                ms[mode].append(json.loads(out.stdout.strip().splitlines()[-1]) * 1e3)
    ratios = [h / lo for h, lo in zip(ms["high"], ms["low"])]
    print("| descriptors | step ms (median of rounds, range) |\n|---|---|")
    for mode in ("low", "high"):
        print(f"| {mode} | {statistics.median(ms[mode]):.1f} ({min(ms[mode]):.1f}-{max(ms[mode]):.1f}) |")
    print(
        f"high / low: {statistics.median(ratios):.3f} (median of {args.rounds} rounds, "
        f"{min(ratios):.3f}-{max(ratios):.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": ms, "ratios": ratios, "subgroups": args.subgroups}, f, indent=1)


if __name__ == "__main__":
    main()
