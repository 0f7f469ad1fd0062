"""On a host without a GPU: the bench GPT's iteration with HybridAdamW against torch's AdamW, under
each arrangement of the trainer's and the worker's cores (issue #37).

    python benchmarks/bench_cpu_host.py [--cores 2 1] [--arrangements split shared] [--rounds 3]
        [--steps 12] [--json out.json] [--subgroup-numel N] [--io-banks K]

The model: benchmarks/peers_model.py's GPT (23M params at its defaults; its --d-model, --layers,
... flags), AdamW lr 1e-3, weight decay 0.01, in one process on the CPU. Rows, each with and without clipping at 1.0:
- torch.optim.AdamW(fused=True) (+ torch.nn.utils.clip_grad_norm_(1.0)): the baseline;
- HybridAdamW offload_fraction=1.0 (max_grad_norm=1.0), and with nvme_fraction=1.0 too, under
  each arrangement: `split` (worker_share=0.5: the worker gets half of the cores, the trainer the
  rest: a GPU host's default) and `shared` (worker_share=None: a CPU-only host's default: the
  trainer keeps every core, the worker runs beside it in sleeping threads).
Each row runs in a fresh process pinned to its first `--cores` CPUs (before torch starts its
threads), `--steps` iterations of forward, backward and step; the figure is the median of all but
the first two. Rounds alternate the order of the rows. The ratio is the row's median over torch's
(same cores, same clipping), with the spread of per-round ratios.

Output: a markdown table on stdout; --json, a list of rows: cores, optimizer, arrangement, clip,
median_ms (per round), ratio (median and range), loss (the last step's, against torch's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers_model as M  # noqa: E402

_CHILD = r"""
import json, os, statistics, sys, tempfile, time
cores, opt_kind, arrangement, clip, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])  # before torch starts its threads
sys.path.insert(0, sys.argv[6])
import torch
import peers_model as M
from hybrid_opt import HybridAdamW
cfg = M.ModelConfig(**json.loads(sys.argv[8]))
torch.manual_seed(0)
model = M.build_model(cfg)
nvme = tempfile.mkdtemp(dir=sys.argv[7])
if opt_kind == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
else:
    share = {"split": 0.5, "shared": None}[arrangement]
    kw = dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme) if opt_kind == "nvme" else dict(offload_fraction=1.0)
    kw.update(json.loads(sys.argv[9]))  # --subgroup-numel, --io-banks
    opt = HybridAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, worker_share=share,
                      max_grad_norm=1.0 if clip else None, **kw)
times = []
for step in range(steps):
    x, y = M.batch(cfg, step, 0, 1)
    t = time.perf_counter()
    loss = M.loss_fn(model(x), y)
    loss.backward()
    if clip and opt_kind == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t)
if hasattr(opt, "close"):
    opt.close()
print(json.dumps({"median_ms": 1000 * statistics.median(times[2:]), "loss": float(loss),
                  "threads": torch.get_num_threads()}))
"""


def _run(
    cores: int,
    kind: str,
    arrangement: str,
    clip: bool,
    steps: int,
    work: str,
    timeout: float,
    cfg: dict,
    hybrid: dict,
) -> dict:
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(cores),
            kind,
            arrangement,
            "1" if clip else "0",
            str(steps),
            HERE,
            work,
            json.dumps(cfg),
            json.dumps(hybrid),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if res.returncode != 0:
        raise RuntimeError(f"{kind} {arrangement} clip={clip} on {cores} cores failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def rows_for(args) -> list:
    """(cores, optimizer, arrangement, clip) of every row."""
    out = []
    for cores in args.cores:
        for clip in (False, True):
            out.append((cores, "torch", "-", clip))
            for kind in args.optimizers:
                out += [(cores, kind, a, clip) for a in args.arrangements]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, nargs="+", default=[len(os.sched_getaffinity(0)), 1])
    ap.add_argument("--arrangements", nargs="+", default=["split", "shared"], choices=["split", "shared"])
    ap.add_argument("--optimizers", nargs="+", default=["host", "nvme"], choices=["host", "nvme"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=600, help="seconds each fresh process may take")
    ap.add_argument("--json")
    ap.add_argument("--subgroup-numel", type=int, help="HybridAdamW's subgroup_numel (default: its own)")
    ap.add_argument("--io-banks", type=int, help="HybridAdamW's io_banks (default: its own)")
    M.add_model_args(ap)
    args = ap.parse_args(argv)
    cfg = dataclasses.asdict(M.config_from_args(args))
    hybrid = {
        k: v
        for k, v in (("subgroup_numel", args.subgroup_numel), ("io_banks", args.io_banks))
        if v is not None
    }
    rows = rows_for(args)
    got: dict = {r: [] for r in rows}
    os.makedirs(os.path.join(os.path.dirname(HERE), "bench_out"), exist_ok=True)
    with tempfile.TemporaryDirectory(
        prefix="bench_cpu_host_", dir=os.path.join(os.path.dirname(HERE), "bench_out")
    ) as work:
        for k in range(args.rounds):
            for r in rows if k % 2 == 0 else rows[::-1]:
                print(f"round {k + 1}/{args.rounds}: {r}", file=sys.stderr, flush=True)
                got[r].append(_run(*r, args.steps, work, args.timeout, cfg, hybrid))
    out = []
    for cores, kind, arrangement, clip in rows:
        runs = got[(cores, kind, arrangement, clip)]
        base = got[(cores, "torch", "-", clip)]
        ratios = [a["median_ms"] / b["median_ms"] for a, b in zip(runs, base)]
        out.append(
            dict(
                cores=cores,
                optimizer=kind,
                arrangement=arrangement,
                clip=clip,
                median_ms=[r["median_ms"] for r in runs],
                ms=statistics.median(r["median_ms"] for r in runs),
                ratio=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                loss=runs[-1]["loss"],
                torch_loss=base[-1]["loss"],
                threads=runs[-1]["threads"],
            )
        )
    label = {
        "torch": "torch AdamW(fused=True)",
        "host": "HybridAdamW offload 1",
        "nvme": "HybridAdamW offload 1, nvme 1",
    }
    print(
        f"bench GPT ({M.n_params(M.ModelConfig(**cfg)):,} params), one process, {args.steps} steps (median of the last "
        f"{args.steps - 2}), {args.rounds} rounds of fresh processes alternating"
        + "".join(f", {k}={v}" for k, v in hybrid.items())
    )
    print(
        "\n| cores | optimizer | arrangement | clip 1.0 | iteration, ms (median) | vs torch (median, range) | loss - torch's |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['cores']} | {label[r['optimizer']]} | {r['arrangement']} | {'yes' if r['clip'] else 'no'} | "
            f"{r['ms']:,.0f} | {r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
            f"{r['loss'] - r['torch_loss']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
