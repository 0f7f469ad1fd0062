"""A checkpoint of the host and nvme tiers: `opt.save_state_dict(path)` against
`torch.save(opt.state_dict(), path)` — the trainer's peak resident memory above what was
resident before the call (the kernel's VmHWM, reset through /proc/self/clear_refs), the
seconds and the file's size, in fresh processes, rounds alternating which goes first.

    python benchmarks/bench_save.py [--params 16] [--width 2048] [--rounds 3] [--dir bench_out] [--json out.json]

Each param is Linear(width, width) (fp32: 2 x 16 MiB of moments at width 2048), one subgroup
each. "glibc" rows run with the default malloc, which keeps freed blocks below its dynamic mmap
threshold (up to 32 MiB) for reuse (the save hands them back after each param: malloc_trim);
"fixed" rows with MALLOC_MMAP_THRESHOLD_=65536, where malloc keeps none.
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
import json, os, sys, time, torch
from hybrid_opt import HybridAdamW

def hwm_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024

how, tier, n, width, path, nvme = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n)])
kw = dict(offload_fraction=1.0) if tier == "host" else dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme)
with HybridAdamW(model.parameters(), lr=1e-3, subgroup_numel=width * width, **kw) as opt:
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = hwm_mib()
    t = time.perf_counter()
    if how == "stream":
        opt.save_state_dict(path)
    else:
        torch.save(opt.state_dict(), path)
    s = time.perf_counter() - t
    print(json.dumps({"peak_mib": hwm_mib() - base, "s": s, "bytes": os.path.getsize(path)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiers", nargs="+", default=["host", "nvme"])
    ap.add_argument("--dir", help="where the nvme files and checkpoints go (default bench_out/)")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = args.dir or os.path.join(root, "bench_out")
    os.makedirs(base, exist_ok=True)
    moments_mib = args.params * args.width * args.width * 8 / 2**20
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_save_", dir=base) as tmp:
        for tier in args.tiers:
            for malloc in ("glibc", "fixed"):
                env = dict(os.environ, PYTHONPATH=root)
                if malloc == "fixed":
                    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
                got = {"full": [], "stream": []}
                for r in range(args.rounds):
                    for how in (("full", "stream") if r % 2 == 0 else ("stream", "full")):
                        nvme = tempfile.mkdtemp(dir=tmp)
                        path = os.path.join(tmp, f"{how}.pt")
                        out = subprocess.run([sys.executable, "-c", _CHILD, how, tier, str(args.params),
                                              str(args.width), path, nvme], env=env, cwd=root,
                                             capture_output=True, text=True, timeout=900, check=True)
                        got[how].append(json.loads(out.stdout.strip().splitlines()[-1]))
                        os.unlink(path)
                rows[f"{tier} {malloc}"] = got
    print(f"{args.params} params of {args.width}^2 fp32: {moments_mib:.0f} MiB of moments\n")
    print("| tier, malloc | how | peak MiB above before (median, range) | seconds (median, range) | file MiB |")
    print("|---|---|---|---|---|")
    for name, got in rows.items():
        for how, label in (("full", "torch.save(state_dict())"), ("stream", "save_state_dict")):
            peaks, secs = [g["peak_mib"] for g in got[how]], [g["s"] for g in got[how]]
            print(f"| {name} | {label} | {statistics.median(peaks):.1f} ({min(peaks):.1f}-{max(peaks):.1f}) | "
                  f"{statistics.median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f}) | "
                  f"{got[how][0]['bytes'] / 2**20:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "moments_mib": moments_mib}, f, indent=1)


if __name__ == "__main__":
    main()
