"""Convergence of the state formats: the demo's TinyGPT on its bigram token stream, trained with
HybridAdamW under each moment format, several seeds, the final losses side by side (issue #38).

    python benchmarks/bench_convergence.py [--model tiny|bench] [--steps 300] [--seeds 3]
        [--formats fp32 bf16 q8] [--d-model 128] [--layers 4] [--json out.json] [--png out.png]

--model bench trains the peers' bench GPT instead (benchmarks/peers_model.py: 23.1M params, vocab
4096, 8 sequences of 64 tokens a step) on a bigram stream of its vocab, at lr 1e-3 (the bench's);
--d-model / --layers then size it (its defaults: 512, 6). The bench rows of bench_peers.py feed it
random tokens, which teach nothing; the bigram chain gives its loss somewhere to go.

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
import dataclasses
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers_model import GPT, ModelConfig, init_weights  # noqa: E402

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "q8": "q8"}
PEERS = ("bnb_adamw8bit", "torchao_adamw8bit")


@dataclasses.dataclass(frozen=True)
class Model:
    """What one run trains: the model's vocab, context and batch, and its learning rate."""

    kind: str  # "tiny" (the demo's TinyGPT) or "bench" (peers_model.GPT)
    d_model: int
    layers: int
    vocab: int
    ctx: int
    batch: int
    lr: float

    @classmethod
    def named(cls, kind: str, d_model: int | None, layers: int | None) -> Model:
        if kind == "tiny":
            return cls(kind, d_model or 128, layers or 4, 256, 64, 16, 3e-3)
        d = ModelConfig()
        return cls(kind, d_model or d.d_model, layers or d.layers, d.vocab, d.seq, d.batch, 1e-3)

    def build(self, seed: int) -> torch.nn.Module:
        from hybrid_opt.demo import TinyGPT

        torch.manual_seed(seed)
        if self.kind == "tiny":
            return TinyGPT(self.vocab, self.d_model, self.layers, 4, self.ctx)
        cfg = ModelConfig(d_model=self.d_model, layers=self.layers, vocab=self.vocab, seq=self.ctx)
        model = GPT(cfg)
        torch.manual_seed(seed)  # build_model's init, seeded per run
        init_weights(model, cfg)
        return model

    def describe(self, n_params: int) -> str:
        name = "TinyGPT" if self.kind == "tiny" else "bench GPT"
        return f"{name} d_model {self.d_model}, {self.layers} layers, {n_params / 1e6:.2f}M params, lr {self.lr:g}"


def _peer(name: str, params, lr: float):
    """bitsandbytes' or torchao's 8-bit AdamW over `params`, or None where it does not import."""
    try:
        if name == "bnb_adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.1)
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr, weight_decay=0.1)
    except ImportError:
        return None


def train(fmt: str, seed: int, steps: int, spec: Model) -> list | None:
    """The loss of every step of one run, or None where a peer does not import."""
    from hybrid_opt import HybridAdamW
    from hybrid_opt.demo import bigram_batches

    model = spec.build(seed)
    batches = bigram_batches(steps, spec.batch, spec.ctx, spec.vocab, "cpu", seed=seed)
    if fmt in PEERS:
        opt = _peer(fmt, model.parameters(), spec.lr)
        if opt is None:
            return None
        clip = True
    else:
        dt = FORMATS[fmt]
        opt = HybridAdamW(
            model.parameters(),
            lr=spec.lr,
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
            loss = F.cross_entropy(logits.reshape(-1, spec.vocab), seq[:, 1:].reshape(-1))
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
    ap.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=[*FORMATS, *PEERS], choices=[*FORMATS, *PEERS])
    ap.add_argument("--d-model", type=int, default=None, help="default: tiny 128, bench 512")
    ap.add_argument("--layers", type=int, default=None, help="default: tiny 4, bench 6")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    spec = Model.named(args.model, args.d_model, args.layers)
    n_params = sum(p.numel() for p in spec.build(0).parameters())
    curves, rows = {}, []
    for fmt in args.formats:
        runs = [train(fmt, s, args.steps, spec) for s in range(args.seeds)]
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
        f"{spec.describe(n_params)}, bigram tokens, {args.steps} steps, "
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
        ax.set_title(f"{spec.describe(n_params)}: state formats")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
