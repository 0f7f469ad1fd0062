"""Convergence of the state formats: the demo's TinyGPT on its bigram token stream, trained with
HybridAdamW under each moment format, several seeds, the final losses side by side (issue #38).

    python benchmarks/bench_convergence.py [--steps 300] [--seeds 3] [--formats fp32 bf16 q8]
        [--d-model 128] [--layers 4] [--json out.json] [--png out.png]

Each run: the model and its batches seeded by the seed, AdamW lr 3e-3, weight decay 0.1,
max_grad_norm 1.0, every subgroup on the device tier (offload 0: the format, not the placement,
is what is compared; every tier steps the same bits). The final loss is the mean of the last 20
steps' losses. Rows for bitsandbytes' and torchao's 8-bit AdamW run where those packages import
(torch's clip_grad_norm_ then clips, as HybridAdamW's max_grad_norm does); they are skipped, and
the table says so, where they do not.

Output: a markdown table (per format: each seed's final loss, their mean and spread, the mean's
difference from fp32 moments'), --json the rows, --png the mean loss curve of each format.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "q8": "q8"}
PEERS = ("bnb_adamw8bit", "torchao_adamw8bit")
VOCAB, CTX, BATCH = 256, 64, 16


def _peer(name: str, params):
    """bitsandbytes' or torchao's 8-bit AdamW over `params`, or None where it does not import."""
    try:
        if name == "bnb_adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=3e-3, weight_decay=0.1)
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=3e-3, weight_decay=0.1)
    except ImportError:
        return None


def train(fmt: str, seed: int, steps: int, d_model: int, layers: int) -> list | None:
    """The loss of every step of one run, or None where a peer does not import."""
    from hybrid_opt import HybridAdamW
    from hybrid_opt.demo import TinyGPT, bigram_batches

    torch.manual_seed(seed)
    model = TinyGPT(VOCAB, d_model, layers, 4, CTX)
    batches = bigram_batches(steps, BATCH, CTX, VOCAB, "cpu", seed=seed)
    if fmt in PEERS:
        opt = _peer(fmt, model.parameters())
        if opt is None:
            return None
        clip = True
    else:
        dt = FORMATS[fmt]
        opt = HybridAdamW(
            model.parameters(),
            lr=3e-3,
            weight_decay=0.1,
            max_grad_norm=1.0,
            offload_fraction=0.0,
            exp_avg_dtype=dt,
            exp_avg_sq_dtype=dt,
        )
        clip = False
    losses = []
    try:
        for seq in batches:
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return losses


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=[*FORMATS, *PEERS], choices=[*FORMATS, *PEERS])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    curves, rows = {}, []
    for fmt in args.formats:
        runs = [train(fmt, s, args.steps, args.d_model, args.layers) for s in range(args.seeds)]
        if any(r is None for r in runs):
            rows.append({"format": fmt, "skipped": "does not import here"})
            continue
        finals = [statistics.fmean(r[-20:]) for r in runs]
        curves[fmt] = [statistics.fmean(step) for step in zip(*runs)]
        rows.append(
            {
                "format": fmt,
                "finals": finals,
                "mean": statistics.fmean(finals),
                "spread": max(finals) - min(finals),
                "first": runs[0][0],
            }
        )
    base = next((r["mean"] for r in rows if r["format"] == "fp32" and "mean" in r), None)
    print(
        f"TinyGPT d_model {args.d_model}, {args.layers} layers, bigram tokens, {args.steps} steps, "
        f"seeds 0..{args.seeds - 1}; final loss = mean of the last 20 steps\n"
    )
    print("| moments | final loss per seed | mean | spread | vs fp32 moments |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['format']} | skipped: {r['skipped']} | | | |")
            continue
        vs = f"{100 * (r['mean'] - base) / base:+.3f} %" if base else "-"
        print(
            f"| {r['format']} | {', '.join(f'{x:.4f}' for x in r['finals'])} | {r['mean']:.4f} | "
            f"{r['spread']:.4f} | {vs} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.png and curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for fmt, curve in curves.items():
            ax.plot(curve, label=f"{fmt} moments" if fmt in FORMATS else fmt, lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(f"cross-entropy loss (mean of {args.seeds} seeds)")
        ax.set_yscale("log")
        ax.set_title(f"TinyGPT d={args.d_model}, {args.layers} layers: state formats")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
