"""Construction time: HybridAdamW(model.parameters(), offload_fraction=...) until it returns,
and how long the arena's background population runs after that.

The model is GPT-2 124M-shaped (an embedding of 50257 x 768 and 12 blocks of plain Linear
layers, fp32, no transformers needed). torch.optim's one-time lazy imports (~3 s on a cold
process, paid by torch.optim.AdamW too) are done before timing: a torch.optim.AdamW is
constructed first. Each run builds a fresh model (untimed), times the constructor, waits for
the background population (timed separately), and closes. Beside it, the same process times
allocating and touching the state's 12 B/param (`torch.zeros`): the ratio is the figure.

    python benchmarks/bench_construct.py [--runs 3] [--offload 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_description, markdown_table, spread, write_json  # noqa: E402

from hybrid_opt.testing import debug_view


def gpt2_shaped(width: int = 768, layers: int = 12, vocab: int = 50257) -> nn.Module:
    mods = [nn.Embedding(vocab, width)]
    for _ in range(layers):
        mods += [
            nn.Linear(width, 3 * width),
            nn.Linear(width, width),
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
        ]
    return nn.Sequential(*mods)


def _quantiles(xs: list) -> dict:
    median, p20, p80 = spread(xs)
    return {"median_s": median, "p20_s": p20, "p80_s": p80}


def materialise_s(params: int, runs: int) -> float:
    """Median time to allocate and touch the state's 12 B/param (torch.zeros: fp32 master and
    two moments) in this process: the floor a constructor of that state cannot beat."""
    times = []
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        state = torch.zeros(3 * params)
        times.append(time.perf_counter() - t0)
        del state
    return statistics.median(times)


def run(offload: float, runs: int, **kw) -> dict:
    from hybrid_opt import HybridAdamW

    times, background, arena_gb, params = [], [], 0.0, 0
    for _ in range(runs):
        torch.manual_seed(0)
        model = gpt2_shaped()
        params = sum(p.numel() for p in model.parameters())
        gc.collect()
        t0 = time.perf_counter()
        opt = HybridAdamW(model.parameters(), offload_fraction=offload, **kw)
        times.append(time.perf_counter() - t0)
        if debug_view(opt).host is not None:
            t1 = time.perf_counter()
            debug_view(opt).host.arena.wait_populated(timeout_s=600)
            background.append(time.perf_counter() - t1)
            arena_gb = debug_view(opt).host.arena.nbytes / 1e9
        opt.close()
        del opt, model
        gc.collect()
    row = dict(
        impl="HybridAdamW",
        model="gpt2-124M-shaped fp32",
        params=params,
        offload=offload,
        **{k: v for k, v in kw.items()},
        **_quantiles(times),
        arena_gb=arena_gb,
        background_s=statistics.median(background) if background else 0.0,
    )
    row["gb_per_s"] = arena_gb / row["median_s"] if row["median_s"] else None
    row["materialise_s"] = materialise_s(params, runs)
    row["vs_materialise"] = row["median_s"] / row["materialise_s"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offload", type=float, nargs="+", default=[1.0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch.optim's one-time imports
    rows = []
    for off in args.offload:
        r = run(off, args.runs)
        r.update(device=host_description(), torch=torch.__version__, timestamp=time.time())
        rows.append(r)
    print(
        markdown_table(
            rows,
            [
                ("model", "model", "s"),
                ("params", "params", ",d"),
                ("offload", "offload", ".2f"),
                ("median_s", "construct s (median)", ".2f"),
                ("p20_s", "p20", ".2f"),
                ("p80_s", "p80", ".2f"),
                ("arena_gb", "arena GB", ".2f"),
                ("gb_per_s", "arena GB/s", ".2f"),
                ("background_s", "background population after, s", ".2f"),
                ("materialise_s", "zeros(12 B/param) s", ".2f"),
                ("vs_materialise", "construct / zeros", ".2f"),
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
