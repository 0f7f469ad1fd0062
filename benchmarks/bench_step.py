"""End to end: full training iterations (forward + backward + step) with HybridAdamW,
speculation on and off, against torch's fused AdamW in process.

    python benchmarks/bench_step.py [--layers 8] [--width 2048] [--batch 16] [--iters 10]
                                    [--offload 1.0] [--json out.json] [--png out.png]

The model (8 x Linear(2048, 2048) at batch 16 by default, 33.6M parameters) is one where
backward takes about as long as the host step on this machine, the case speculation is
for: each host subgroup is stepped by the worker as soon as its grads are complete, while
backward goes on. Reports iteration time (median, p20, p80), the worker's time and how
much of it was hidden under backward, and the committed/redone counts.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, time_ms, write_json  # noqa: E402

from hybrid_opt import HybridAdamW  # noqa: E402


def make_model(layers: int, width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--offload", type=float, default=1.0)
    ap.add_argument("--subgroup-numel", type=int, default=1 << 21)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    x = torch.randn(args.batch, args.width)
    rows, records = [], []

    def iteration(model, opt):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    # torch fused AdamW, in process, all cores
    model = make_model(args.layers, args.width)
    n_params = sum(p.numel() for p in model.parameters())
    ref = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    t = time_ms(lambda: iteration(model, ref), reps=args.iters)
    fwd_bwd = time_ms(lambda: (model.zero_grad(), model(x).square().mean().backward()), reps=args.iters)
    rows.append({"impl": "torch AdamW(fused=True), in process", **t})
    rows.append({"impl": "forward+backward alone, all cores", **fwd_bwd})

    for speculative in (False, True):
        model = make_model(args.layers, args.width)
        with HybridAdamW(model.parameters(), lr=1e-4, offload_fraction=args.offload,
                         subgroup_numel=args.subgroup_numel, speculative=speculative,
                         spare_banks=64) as opt:
            stats = []

            def it():
                iteration(model, opt)
                stats.append(opt.stats)

            t = time_ms(it, reps=args.iters)
            tail = stats[-args.iters:]
            worker = sorted(s["worker_s"] for s in tail)[len(tail) // 2] * 1e3
            hidden = sorted(s["hidden_s"] for s in tail)[len(tail) // 2] * 1e3
            spec = tail[-1]["speculation"] or {}
            rows.append({"impl": f"HybridAdamW offload {args.offload}, speculative={speculative}", **t,
                         "worker_ms": worker, "hidden_ms": hidden, "hidden_pct": 100 * hidden / worker if worker else 0,
                         "committed": spec.get("committed", 0), "redone": spec.get("redone", 0),
                         "stepped": spec.get("stepped", 0), "plan": repr(opt.plan)})
    seq = next(r for r in rows if "speculative=False" in r["impl"])
    specr = next(r for r in rows if "speculative=True" in r["impl"])
    specr["vs_sequential"] = specr["median_ms"] / seq["median_ms"]
    print(f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch}: "
          f"{n_params / 1e6:.1f}M parameters; torch {torch.__version__}")
    print(markdown_table(rows, [("impl", "impl", "s"), ("median_ms", "iteration ms", ".1f"),
                                ("p20_ms", "p20", ".1f"), ("p80_ms", "p80", ".1f"),
                                ("worker_ms", "worker ms", ".1f"), ("hidden_pct", "% hidden", ".0f"),
                                ("committed", "committed", "d"), ("redone", "redone", "d"),
                                ("stepped", "stepped", "d"), ("vs_sequential", "vs sequential", ".3f")]))
    for r in rows:
        records.append(dict(r, numel=n_params, layers=args.layers, width=args.width, batch=args.batch))
    write_json(args.json, records)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = [r["impl"] for r in rows]
        ax.barh(names, [r["median_ms"] for r in rows],
                xerr=[[r["median_ms"] - r["p20_ms"] for r in rows], [r["p80_ms"] - r["median_ms"] for r in rows]])
        ax.set_xlabel("ms per iteration (median, p20-p80)")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
