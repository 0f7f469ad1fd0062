"""A/B of HybridAdamW.step() between two checkouts of this repo (a refactor must not slow it).

Each checkout runs in fresh interpreters (PYTHONPATH=<checkout>), the same script and model,
rounds alternating which goes first; a round is one process per checkout that trains a few
warm-up iterations and then times step() alone over `--iters` iterations of
forward/backward/step. The figure is the ratio of medians (B / A) per offload fraction,
with the spread of per-round medians.

    git worktree add /tmp/ab_old <commit>; cp cpu_kernels/_native*.so /tmp/ab_old/cpu_kernels/
    python benchmarks/bench_ab.py --a /tmp/ab_old --b . --offload 0 1 --json bench_out/ab.json
    python benchmarks/bench_ab.py --a /tmp/ab_old --b . --calls    # the work itself, noise-free

`--calls` counts instead of timing: the Python function calls and the C calls (sys.setprofile's
"call" and "c_call" events) that one backward's hooks and one step() make after warm-up, in one
process per checkout. step()'s counts are the same from run to run, so they show what a refactor
added to or took from step() where the VM's ±10-20 % timing noise hides a 3 % difference; with
host subgroups backward's move by about 0.5 % (how often a hook finds the worker's banks still
busy and retries a deferred subgroup depends on the worker's speed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time, torch
from hybrid_opt import HybridAdamW
import hybrid_opt.optimizer as o
torch.manual_seed(0)
off, iters, width, layers = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
x = torch.randn(16, width)
opt = HybridAdamW(model.parameters(), lr=1e-4, offload_fraction=off, subgroup_numel=1 << 20)
times = []
for i in range(iters + 3):
    model(x).square().mean().backward()
    t = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t)
    opt.zero_grad()
opt.close()
print(json.dumps({"file": o.__file__, "step_s": times[3:]}))
"""

_CALLS_CHILD = r"""
import json, sys, torch
from hybrid_opt import HybridAdamW
import hybrid_opt.optimizer as o
torch.manual_seed(0)
off, width, layers = float(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
x = torch.randn(16, width)
opt = HybridAdamW(model.parameters(), lr=1e-4, offload_fraction=off, subgroup_numel=1 << 16)
phase, counts = None, {p: {"call": 0, "c_call": 0} for p in ("backward", "step")}
def count(frame, event, arg):
    if event in ("call", "c_call"):
        counts[phase][event] += 1
for i in range(6):
    loss = model(x).square().mean()
    if i == 5:
        phase = "backward"; sys.setprofile(count)
    loss.backward()
    if i == 5:
        phase = "step"
    opt.step()
    sys.setprofile(None)
    opt.zero_grad()
opt.close()
print(json.dumps({"file": o.__file__, "counts": counts}))
"""


def _run(root: str, off: float, iters: int, width: int, layers: int, child: str = _CHILD):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    out = subprocess.run(
        [sys.executable, "-c", child, str(off), str(iters), str(width), str(layers)],
        env=env,
        cwd=os.path.abspath(root),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["file"].startswith(os.path.abspath(root)):
        raise RuntimeError(f"{root}: imported {res['file']} instead (PYTHONPATH did not win)")
    return res["step_s"] if child is _CHILD else res["counts"]


def calls(args) -> list:
    """--calls: per offload, each checkout's Python / C calls in one backward's hooks and one step()."""
    rows = []
    print(
        "| offload | backward: A Python / C calls | B | step(): A Python / C calls | B | B / A, all calls |"
    )
    print("|---|---|---|---|---|---|")
    for off in args.offload:
        c = {k: _run(getattr(args, k), off, 0, args.width, args.layers, _CALLS_CHILD) for k in ("a", "b")}
        total = {k: sum(n for ph in c[k].values() for n in ph.values()) for k in c}
        cell = {
            (k, ph): f"{c[k][ph]['call']:,} / {c[k][ph]['c_call']:,}"
            for k in c
            for ph in ("backward", "step")
        }
        print(
            f"| {off:g} | {cell['a', 'backward']} | {cell['b', 'backward']} | {cell['a', 'step']} "
            f"| {cell['b', 'step']} | {total['b'] / total['a']:.3f} |",
            flush=True,
        )
        rows.append({"offload": off, "a": c["a"], "b": c["b"]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", required=True, help="checkout B")
    ap.add_argument("--offload", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--calls", action="store_true", help="count calls instead of timing (module docstring)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.calls:
        _save(args, calls(args))
        return
    rows = []
    print(
        "| offload | A step ms (median, p20-p80 of rounds) | B step ms | B / A (median of per-round ratios) | ratio range |"
    )
    print("|---|---|---|---|---|")
    for off in args.offload:
        med = {"a": [], "b": []}
        for r in range(args.rounds):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for k in order:
                med[k].append(
                    statistics.median(_run(getattr(args, k), off, args.iters, args.width, args.layers))
                )
        ratios = [b / a for a, b in zip(med["a"], med["b"])]

        def q(xs, p):
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))]

        row = {
            "offload": off,
            "a_ms": [1e3 * x for x in med["a"]],
            "b_ms": [1e3 * x for x in med["b"]],
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        rows.append(row)
        print(
            f"| {off:g} | {1e3 * statistics.median(med['a']):.1f} ({1e3 * q(med['a'], 0.2):.1f}-{1e3 * q(med['a'], 0.8):.1f}) "
            f"| {1e3 * statistics.median(med['b']):.1f} ({1e3 * q(med['b'], 0.2):.1f}-{1e3 * q(med['b'], 0.8):.1f}) "
            f"| {row['ratio_median']:.3f} | {row['ratio_min']:.3f}-{row['ratio_max']:.3f} |",
            flush=True,
        )
    _save(args, rows)


def _save(args, rows: list) -> None:
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"a": args.a, "b": args.b, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
