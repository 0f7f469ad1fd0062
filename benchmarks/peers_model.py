"""The model, the batch stream and the measurements every row of bench_peers.py shares.

Imported by the project's interpreter (HybridAdamW and torch rows) and by the peer's
(DeepSpeed, whose venv has torch but not hybrid_opt): so nothing here imports hybrid_opt,
and everything a row's figures depend on besides its optimizer is defined once, here.

- `GPT(cfg)`: `cfg.layers` blocks of LayerNorm, qkv / proj / fc / out Linear layers with biases
  (causal attention, a 4x MLP), an Embedding in front and a bias-free head. The default
  (`ModelConfig()`: d_model 512, 6 layers, vocab 4096) has 23,108,608 params.
- `batch(cfg, step, rank, world)`: the global batch of step `step` (`cfg.batch` sequences of
  `cfg.seq` tokens, the same on every rank and in every interpreter: a CPU generator seeded
  by the step), and this rank's rows of it (`batch / world` each, in rank order), so the
  mean loss averaged over ranks is the global batch's and every row follows one trajectory.
- `pss_bytes()`: the proportional set size of this process and every descendant (the
  HybridAdamW worker; DeepSpeed's aio threads are threads), from psutil's
  `memory_full_info().pss`.
- `tree_bytes(path)`: the apparent sizes of the files under `path` (nvme bytes on disk).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 512
    layers: int = 6
    vocab: int = 4096
    heads: int = 8
    seq: int = 64
    batch: int = 8  # the global batch, in sequences

    def as_args(self) -> list[str]:
        return [
            f"--d-model={self.d_model}",
            f"--layers={self.layers}",
            f"--vocab={self.vocab}",
            f"--heads={self.heads}",
            f"--seq={self.seq}",
            f"--batch={self.batch}",
        ]


def add_model_args(ap) -> None:
    d = ModelConfig()
    ap.add_argument("--d-model", type=int, default=d.d_model)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    ap.add_argument(
        "--batch", type=int, default=d.batch, help="global batch, sequences (divided among the ranks)"
    )


def config_from_args(args) -> ModelConfig:
    return ModelConfig(
        d_model=args.d_model,
        layers=args.layers,
        vocab=args.vocab,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
    )


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def build_model(cfg: ModelConfig, device="cpu") -> GPT:
    """The same initial params in every row and interpreter (same torch: same CPU generator)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    init_weights(model, cfg)
    return model.to(device)


def init_weights(model: GPT, cfg: ModelConfig) -> None:
    """Small init, GPT-2 style (so 16 steps at lr 1e-3 stay well-behaved), from torch's generator."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(
                    0.0,
                    0.02 / (math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 1),
                )
            elif name.endswith("bias"):
                p.zero_()


def n_params(cfg: ModelConfig) -> int:
    d, v = cfg.d_model, cfg.vocab
    return cfg.layers * (12 * d * d + 13 * d) + 2 * v * d


def batch(cfg: ModelConfig, step: int, rank: int, world: int, device="cpu"):
    """(inputs, targets) of this rank's share of step `step`'s global batch."""
    if cfg.batch % world:
        raise ValueError(f"global batch {cfg.batch} does not divide among {world} ranks")
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    per = cfg.batch // world
    mine = tokens[rank * per : (rank + 1) * per]
    return mine[:, :-1].to(device), mine[:, 1:].to(device)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def pss_bytes(pid: int | None = None) -> int:
    """PSS of the process and all its descendants, in bytes (a vanished child counts 0)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def tree_bytes(path: str | None) -> int:
    """Sum of the apparent sizes (st_size) of the regular files under path; 0 without one."""
    if not path or not os.path.isdir(path):
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except FileNotFoundError:
                continue
            if not os.path.islink(os.path.join(root, f)):
                total += st.st_size
    return total
