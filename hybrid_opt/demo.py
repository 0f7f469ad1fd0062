"""The main job: a small GPT-style language model trained with HybridAdamW over all three
tiers, next to torch.optim.AdamW on the same run.

    python -m hybrid_opt demo [--steps 300] [--out bench_out/demo] [--nvme-path DIR]
                              [--dtype bf16] [--exp-avg-dtype bf16] [--exp-avg-sq-dtype bf16]
                              [--store-param-remainders]

Synthetic token data from a fixed sparse bigram chain (each token has a few likely
successors), so the loss falls from ln(vocab) towards the chain's entropy. The model, the
data and the seed are the same for both optimizers; the PNG overlays the two loss curves.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_opt.state import state_format


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def bigram_batches(steps: int, batch: int, ctx: int, vocab: int, device, seed: int = 0):
    """Sequences from a fixed random chain where each token has 4 likely successors."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.12, 0.08])
    out = []
    for _ in range(steps):
        seq = torch.empty(batch, ctx + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        choice = torch.multinomial(probs, batch * ctx, replacement=True, generator=g).view(batch, ctx)
        for t in range(ctx):
            seq[:, t + 1] = succ[seq[:, t], choice[:, t]]
        out.append(seq.to(device))
    return out


def train(model, opt, batches, desc: str, *, progress: bool = True, after_step=None, phases=None):
    """Trains on `batches`; returns (losses, iteration seconds). `phases`, a list, gets each
    iteration's (forward with zero_grad, backward, step()) seconds (on a GPU, the launches'
    time only: the device is synchronized once per iteration, at its end)."""
    from tqdm import tqdm

    losses, step_times = [], []
    bar = tqdm(batches, desc=desc, unit="step", disable=not progress, dynamic_ncols=True)
    for seq in bar:
        t0 = time.perf_counter()
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if after_step is not None:
            after_step()
        if seq.is_cuda:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", ms=f"{step_times[-1] * 1e3:.0f}")
    return losses, step_times


_DTYPES = state_format.DTYPE_NAMES
MODEL_DTYPES = ("fp32", "bf16")  # the model's; "q8" is a moment format only


def tier_state_bytes(subgroups, tiers, state_format, amsgrad: bool = False) -> dict:
    """Bytes of optimizer state each tier holds for `subgroups` (dtype, numel, index) placed
    as `tiers` (plan.tiers), from the state format (hybrid_opt/state/state_format.py): the device
    tier's state (an fp32 param is its own master), a committed host bank (with the bf16 copy it
    keeps, but under q8 moments), the nvme file (one slot; the high half of a remainder is the
    model's param)."""
    from hybrid_opt.placement.plan import DEVICE, HOST, NVME

    out = {t: {"elements": 0, "state_bytes": 0} for t in (DEVICE, HOST, NVME)}
    for sg in subgroups:
        tier = tiers[sg.index]
        fmt = state_format.for_subgroup(sg.quantized)  # small params keep fp32 moments for q8
        if tier == DEVICE:
            per = fmt.state_bytes(sg.dtype, amsgrad, own_master=True)
        elif tier == HOST and state_format.quantized_moments:
            # a q8 tier's committed bank keeps no model-dtype copy (its high half is the model's
            # param; a step's new copy borrows a pooled slot): the state alone
            per = fmt.state_bytes(sg.dtype, amsgrad)
        elif tier == HOST:
            per = fmt.bank_bytes(sg.dtype, amsgrad)
        else:
            per = fmt.state_bytes(sg.dtype, amsgrad)
        out[tier]["elements"] += sg.numel
        out[tier]["state_bytes"] += sg.numel * per
    return out


def tier_table(totals: dict, steps: int) -> str:
    from hybrid_opt.placement.plan import DEVICE, HOST, NVME

    lines = [
        "| tier | subgroups | state MB | state B/param | host steps ms/step | step() waited ms/step "
        "| during backward ms/step | committed | redone | stepped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in (DEVICE, HOST, NVME):
        t = totals[name]
        per = f"{t['state_bytes'] / t['elements']:.1f}" if t["elements"] else "-"
        if name == DEVICE:
            work, waited, during = "-", f"{t['trainer_s'] / steps * 1e3:.2f} (in trainer)", "-"
        else:
            work = f"{t['worker_s'] / steps * 1e3:.2f}"
            waited = f"{t['trainer_wait_s'] / steps * 1e3:.2f}"
            during = f"{max(0.0, t['worker_s'] - t['trainer_wait_s']) / steps * 1e3:.2f}"
        lines.append(
            f"| {name} | {t['subgroups']} | {t['state_bytes'] / 1e6:.1f} | {per} | {work} | {waited} | "
            f"{during} | {t['committed']} | {t['redone']} | {t['stepped']} |"
        )
    return "\n".join(lines)


def _median_ms(times: list) -> float:
    return sorted(times)[len(times) // 2] * 1e3


PHASES = ("forward", "backward", "step()")


def phase_medians(phases: list) -> tuple:
    """Median ms of each of train()'s phases (forward with zero_grad, backward, step())."""
    return tuple(_median_ms([p[k] for p in phases]) for k in range(len(PHASES)))


def process_cpu_s(pid) -> float | None:
    """User + system CPU seconds of every thread of process `pid` so far (Linux /proc), or
    None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def time_summary(
    totals: dict,
    steps: int,
    times: list,
    wall_s: float,
    base_times,
    base_s,
    cores: str | None,
    clipped: int,
    *,
    phases: tuple | None = None,
    base_phases: tuple | None = None,
    worker_cpu_s: float | None = None,
    trainer_steps: bool = False,
) -> str:
    """Where the time went: both runs' wall time and median iteration, each phase of the
    iteration in both runs (`phases`, `base_phases`: phase_medians()), what the host tiers'
    steps cost the worker (its tasks' time, and `worker_cpu_s`: its CPU time over the run), how
    much of it step() waited for, the device tier's step in the trainer, and the arrangement of
    the cores that explains it. trainer_steps: the trainer ran the host steps step() waited for
    itself (HostTier.inline), so their time is its own."""
    from hybrid_opt.placement.plan import DEVICE, HOST, NVME

    host = [totals[t] for t in (HOST, NVME) if totals.get(t, {}).get("subgroups")]
    worker = sum(t["worker_s"] for t in host) / steps * 1e3
    waited = sum(t["trainer_wait_s"] for t in host) / steps * 1e3
    device = totals.get(DEVICE, {}).get("trainer_s", 0.0) / steps * 1e3
    med = _median_ms(times)
    lines = ["Where the time goes (per step):"]
    if base_times is not None:
        base = _median_ms(base_times)
        lines.append(
            f"  wall time: HybridAdamW {wall_s:.1f} s, torch AdamW {base_s:.1f} s "
            f"({wall_s / base_s:.2f}x); median iteration {med:.1f} ms against {base:.1f} ms "
            f"({med - base:+.1f} ms)"
        )
    else:
        lines.append(f"  wall time: HybridAdamW {wall_s:.1f} s; median iteration {med:.1f} ms")
    if phases is not None:
        if base_phases is not None:
            each = [
                f"{name} {a:.1f} against {b:.1f} ({a - b:+.1f})"
                for name, a, b in zip(PHASES, phases, base_phases)
            ]
        else:
            each = [f"{name} {a:.1f}" for name, a in zip(PHASES, phases)]
        lines.append("  median ms: " + "; ".join(each))
    lines.append(f"  device tier: {device:.2f} ms stepped by the trainer after backward")
    if host:
        whose = (
            "steps in the trainer (speculated ones, and nvme's reads and writes, at the worker)"
            if trainer_steps
            else "the worker's time"
        )
        lines.append(
            f"  host and nvme tiers: {worker:.2f} ms of {whose}; step() waited "
            f"{waited:.2f} ms for it, the rest ran during backward"
        )
        lines.append(
            "    (a task's time from its start to its result: an nvme swap's counts its read or "
            "write in flight, when the worker's threads sleep)"
        )
        if worker_cpu_s is not None:
            lines.append(
                f"  the worker's CPU: {worker_cpu_s / steps * 1e3:.2f} ms per step, all its threads "
                f"(the Adam steps, the grads it reads, the nvme tier's system calls and checksums)"
            )
    if cores is not None:
        lines.append(f"  cores: {cores}")
        if cores.startswith("shared"):
            grew = ""
            if phases is not None and base_phases is not None:
                grew = f" (here backward {phases[1] - base_phases[1]:+.1f} ms against torch's)"
            lines.append(
                "    so work during backward would take cores the backward needs and hide nothing "
                "(a core taken from one of torch's threads stalls its other thread too): "
                'speculative="auto" steps the host and nvme tiers in step() on this host'
                f"{grew}; on a GPU host the worker has cores of its own and the same work hides "
                "under backward"
            )
    if clipped and not (cores is not None and cores.startswith("shared")):
        lines.append(f"  clipping bit in {clipped} of {steps} steps: a speculated step is redone then")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="hybrid-opt demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--offload-fraction", type=float, default=0.75)
    ap.add_argument("--nvme-fraction", type=float, default=0.25)
    ap.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    ap.add_argument("--subgroup-numel", type=int, default=1 << 16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--spare-banks",
        type=int,
        default=None,
        help="spare state banks: how many host subgroups can be speculated at once "
        "(default: one per host subgroup, as memory allows)",
    )
    ap.add_argument("--out", default=os.path.join("bench_out", "demo"), help="where the PNG goes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch.optim.AdamW run")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default="fp32",
        help="the model's params (bf16: HybridAdamW keeps fp32 masters; torch's AdamW "
        "baseline steps the bf16 params themselves)",
    )
    state_format.add_arguments(ap, " (with --dtype bf16)")
    args = ap.parse_args(argv)
    fmt = state_format.from_arguments(args)
    state_options = dict(
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        store_param_remainders=fmt.store_param_remainders,
    )

    from hybrid_opt import HybridAdamW

    device = torch.device(args.device)
    ctx, vocab = 64, 256
    batches = bigram_batches(args.steps, args.batch, ctx, vocab, device)

    def fresh():
        torch.manual_seed(0)
        return TinyGPT(vocab, args.d_model, args.layers, 4, ctx).to(device, _DTYPES[args.dtype])

    model = fresh()
    n_params = sum(p.numel() for p in model.parameters())
    tmp = None
    nvme_path = args.nvme_path
    if args.nvme_fraction > 0 and nvme_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="hybrid_opt_demo_")
        nvme_path = tmp.name
    print(
        f"TinyGPT: {n_params / 1e6:.2f}M {args.dtype} parameters on {device}; HybridAdamW with "
        f"offload {args.offload_fraction}, nvme {args.nvme_fraction} ({nvme_path}), exp_avg "
        f"{args.exp_avg_dtype}, exp_avg_sq {args.exp_avg_sq_dtype}, remainders "
        f"{args.store_param_remainders}, {args.steps} steps"
    )
    totals: dict[str, dict] | None = None
    try:
        with HybridAdamW(
            model.parameters(),
            lr=args.lr,
            weight_decay=0.1,
            max_grad_norm=1.0,
            offload_fraction=args.offload_fraction,
            nvme_fraction=args.nvme_fraction,
            nvme_path=nvme_path,
            subgroup_numel=args.subgroup_numel,
            spare_banks=args.spare_banks,
            **state_options,
        ) as opt:
            print(opt.plan)
            host_tier = opt.parts.placement.host
            cores = host_tier.describe() if host_tier is not None else None
            trainer_steps = host_tier is not None and host_tier.inline is not None
            held = tier_state_bytes(opt.parts.layout.subgroups, opt.plan.tiers, opt.state_format)
            hooks_stats: list = []
            phases: list = []
            worker_cpu0 = process_cpu_s(opt.worker_pid) if opt.worker_pid else None
            t0 = time.perf_counter()
            losses, times = train(
                model,
                opt,
                batches,
                "HybridAdamW",
                progress=not args.no_progress,
                after_step=lambda: hooks_stats.append(opt.stats),
                phases=phases,
            )
            hybrid_s = time.perf_counter() - t0
            worker_cpu1 = process_cpu_s(opt.worker_pid) if worker_cpu0 is not None else None
            worker_cpu_s = (
                worker_cpu1 - worker_cpu0 if worker_cpu0 is not None and worker_cpu1 is not None else None
            )
        totals = {}
        for st in hooks_stats:
            for name, t in st["tiers"].items():
                acc = totals.setdefault(name, {k: 0 for k in t})
                for k, v in t.items():
                    if k in ("subgroups", "elements", "state_bytes"):
                        acc[k] = v
                    else:
                        acc[k] += v
        for name, t in totals.items():
            t.update(held[name])  # the format's bytes (the step's stats count fp32 state)
    finally:
        if tmp is not None:
            tmp.cleanup()

    base_losses = base_times = base_s = None
    base_phases: list = []
    if not args.no_baseline:
        model = fresh()
        ref = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

        class _Clipped:  # torch's AdamW with the same clipping the hybrid run fuses
            def zero_grad(self, set_to_none=True):
                ref.zero_grad(set_to_none)

            def step(self):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                ref.step()

        t0 = time.perf_counter()
        base_losses, base_times = train(
            model, _Clipped(), batches, "torch AdamW", progress=not args.no_progress, phases=base_phases
        )
        base_s = time.perf_counter() - t0

    med = sorted(times)[len(times) // 2] * 1e3
    print(
        f"\nHybridAdamW: final loss {losses[-1]:.3f} (start {losses[0]:.3f}, ln(vocab) "
        f"{math.log(vocab):.3f}); {hybrid_s:.1f} s, median step {med:.1f} ms"
    )
    if base_losses is not None:
        diff = max(abs(a - b) for a, b in zip(losses, base_losses))
        print(
            f"torch AdamW: final loss {base_losses[-1]:.3f}; {base_s:.1f} s; largest loss "
            f"difference along the run {diff:.2e}"
        )
    print("\nPer tier (totals over the run, per-step averages):")
    print(tier_table(totals, len(losses)))
    clipped = sum(1 for st in hooks_stats if (st.get("clip_coef") or 1.0) < 1.0)
    summary = time_summary(
        totals,
        len(losses),
        times,
        hybrid_s,
        base_times,
        base_s,
        cores,
        clipped,
        phases=phase_medians(phases),
        base_phases=phase_medians(base_phases) if base_phases else None,
        worker_cpu_s=worker_cpu_s,
        trainer_steps=trainer_steps,
    )
    print("\n" + summary)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "demo_loss.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, label="HybridAdamW (device + host + nvme)", lw=1.5)
    if base_losses is not None:
        ax.plot(base_losses, label="torch.optim.AdamW", lw=1, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"TinyGPT {n_params / 1e6:.2f}M params, synthetic bigram tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"\nloss curve: {os.path.abspath(png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
