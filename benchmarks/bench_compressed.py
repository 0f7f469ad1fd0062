"""Compressed optimizer state at the optimizer level (#16): HybridAdamW.step() of a bf16 model
with fp32 state vs bf16 moments + remainders, at every placement — what a user sees.

    python benchmarks/bench_compressed.py [--params 33.6e6] [--layers 8] [--rounds 3] [--iters 10]
                                          [--placements device host nvme mixed] [--grads assign]
                                          [--dir DIR] [--json out.json] [--md out.md]

The model is --layers x Linear(w, w) in bf16, w picked so it has about --params parameters
(default 8 x Linear(2048): 33.6M). Placements: "device" (offload_fraction=0: the device tier,
on a CPU-only host the in-process CPU kernel), "host" (offload 1: the host tier, stepped by
the worker), "nvme" (offload 1, nvme 1: swap files under --dir, which must be on a disk, not
tmpfs), "mixed" (offload 0.5, nvme 0.25: all three tiers in one optimizer). Formats: "fp32
state" (fp32 master + moments) and "bf16 moments + remainders" (exp_avg_dtype =
exp_avg_sq_dtype = torch.bfloat16, store_param_remainders=True). Speculation is on
(speculative=True, where a CPU-only host's "auto" would step the host tier in step()).

Grads come from a fixed stream of --grad-sets bf16 grad sets generated once and shared by
every configuration (step k of a run uses set k mod --grad-sets), so every configuration
steps the same inputs. `--grads assign` (default) sets `p.grad` before each step and times
step() alone: no forward/backward, so no grad hook fires and the host/nvme subgroups are
stepped inside step() (worker-sequential: the whole worker time is in the figure).
`--grads backward` drives a real backward of a cheap loss, sum((p * g).sum()), whose grads are
the same stream's: the hooks fire and speculation starts host steps during that (short)
backward; the iteration (zero_grad + forward/backward + step) is timed besides step().

Interleaved: each round builds every configuration in turn (a fresh model copy and optimizer,
--warmup untimed steps, --iters timed steps, closed), the order rotated by one each round and
reversed every other round, so drift on a noisy machine hits every configuration alike (a
worker takes cores from the trainer, so configurations are not alive at once). Reported per
configuration: median and p20/p80 of step() ms over all rounds; per placement the ratio
compressed / fp32 state (median of the per-round ratios of the round medians, and its range;
targets: in-process CPU step >= 1.45x faster, i.e. ratio <= 0.69; nvme step ratio <= 0.6);
state bytes per param per tier (opt.stats["tiers"]: state_bytes / elements; on nvme the
file's bytes) and the host tier's arena: bytes per element of any bank (committed, spare or
I/O: state + the bf16 copy), the committed banks per host-resident param, the spare/I/O pool
per offloaded param, and each nvme file slot per param; the host/nvme subgroup steps over the
timed steps that were speculated and committed, and those stepped inside step().

JSON records (--json): one per configuration {"impl", "kind": "config", "placement", "format",
"median_ms", "p20_ms", "p80_ms", "iter_median_ms", "round_medians_ms", per-tier bytes, ...}
and one per placement {"impl", "kind": "ratio", "ratio_median", "ratio_min", "ratio_max",
"speedup", "target", "met"}, each with the run's "params", "layers", "width", "grads",
"rounds", "iters", "simd", "host", "torch", "timestamp".
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read once, when torch is imported (bench_step.py)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import fs_type, host_description, markdown_table, write_json  # noqa: E402

import cpu_kernels  # noqa: E402
from hybrid_opt import HybridAdamW  # noqa: E402
from hybrid_opt.testing import debug_view

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "host": dict(offload_fraction=1.0),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0),
    "mixed": dict(offload_fraction=0.5, nvme_fraction=0.25),
}
FP32, COMPRESSED = "fp32 state", "bf16 moments + remainders"
FORMATS = {
    FP32: dict(),
    COMPRESSED: dict(
        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True
    ),
}
# #16's targets on compressed / fp32-state step time (interleaved medians)
TARGETS = {"device": 1 / 1.45, "nvme": 0.6}


def model_shape(params: float, layers: int) -> tuple[int, int]:
    """(layers, width) of layers x Linear(width, width) with about `params` parameters (width a
    multiple of 8: 33.6e6 over 8 layers gives 2048)."""
    width = max(8, int(round((params / layers) ** 0.5 / 8)) * 8)
    return layers, width


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(torch.bfloat16)


def grad_stream(model, sets: int) -> list[list[torch.Tensor]]:
    """`sets` grad sets (one bf16 tensor per param), made once: every configuration steps them."""
    gen = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16) for p in model.parameters()]
        for _ in range(sets)
    ]


def _quantiles(xs: list) -> dict:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]  # noqa: E731
    return {"median_ms": statistics.median(xs), "p20_ms": pick(0.2), "p80_ms": pick(0.8)}


def _bytes_info(opt, numel: int) -> dict:
    """Bytes per param of each tier's state (opt.stats) and of the host tier's arena."""
    info = {}
    tiers = opt.stats.get("tiers", {})
    for name, t in tiers.items():
        if t.get("elements"):
            info[f"{name}_state_B"] = t["state_bytes"] / t["elements"]
            info[f"{name}_elements"] = t["elements"]
    host = debug_view(opt).host
    if host is not None:
        resident = sum(n for sg, n in host.numels.items() if not host.nvme[sg])
        offloaded = sum(host.numels.values())
        on_nvme = offloaded - resident
        info["bank_B_per_elem"] = host.banks.bank_stride / host.capacity
        info["banks_B_per_host_param"] = host.bank_bytes / resident if resident else None
        info["spare_pool_B_per_offloaded_param"] = host.spare_bytes / offloaded
        info["spare_banks"] = host.pool.n_banks - sum(1 for x in host.nvme.values() if not x)
        info["nvme_slot_B_per_param"] = host.nvme_bytes / 2 / on_nvme if on_nvme else None
        info["arena_B_per_param"] = host.arena.nbytes / numel
    return info


def run_config(args, base, grads, placement: str, fmt: str, workdir: str) -> tuple[dict, dict]:
    """One configuration: a fresh copy of the model and a HybridAdamW, --warmup steps, then
    --iters timed ones. Returns ({"step": [ms], "iter": [ms]}, bytes info)."""
    model = copy.deepcopy(base)
    params = list(model.parameters())
    kw = dict(PLACEMENTS[placement], **FORMATS[fmt])
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = workdir
    step_ms, iter_ms = [], []
    outcomes = {}  # host/nvme subgroups committed (speculated), redone, stepped (in step()), dropped
    # speculative=True: the --grads backward mode shows host steps during backward, which
    # "auto" turns off on a CPU-only host (the worker shares the backward's cores)
    with HybridAdamW(params, lr=1e-4, subgroup_numel=args.subgroup_numel, speculative=True, **kw) as opt:
        for k in range(args.warmup + args.iters):
            g = grads[k % len(grads)]
            t0 = time.perf_counter()
            if args.grads == "backward":
                opt.zero_grad(set_to_none=True)
                # d/dp sum(p * g) = g exactly: the stream's grads, through real grad hooks
                sum((p * gp).sum() for p, gp in zip(params, g)).backward()
            else:
                for p, gp in zip(params, g):
                    p.grad = gp
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if k >= args.warmup:
                step_ms.append((t2 - t1) * 1e3)
                iter_ms.append((t2 - t0) * 1e3)
                for key, v in (opt.stats.get("speculation") or {}).items():
                    outcomes[key] = outcomes.get(key, 0) + v
        info = _bytes_info(opt, sum(p.numel() for p in params))
        info["plan"] = repr(opt.plan)
        info.update({f"subgroups_{key}": v for key, v in outcomes.items()})
    del model, params
    gc.collect()
    return {"step": step_ms, "iter": iter_ms}, info


def study(args, workdir: str) -> tuple[list, list]:
    layers, width = model_shape(args.params, args.layers)
    base = make_model(layers, width)
    n = sum(p.numel() for p in base.parameters())
    grads = grad_stream(base, args.grad_sets)
    configs = [(pl, fmt) for pl in args.placements for fmt in FORMATS]
    samples = {c: {"step": [], "iter": []} for c in configs}
    round_med = {c: [] for c in configs}
    infos = {}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order[::-1] if r % 2 else order:
            s, infos[c] = run_config(args, base, grads, *c, workdir)
            for key in s:
                samples[c][key] += s[key]
            round_med[c].append(statistics.median(s["step"]))
            print(
                f"  round {r + 1}/{args.rounds}: {c[0]}, {c[1]}: step {round_med[c][-1]:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    common = dict(
        params=n,
        layers=layers,
        width=width,
        grads=args.grads,
        rounds=args.rounds,
        iters=args.iters,
        subgroup_numel=args.subgroup_numel,
        simd=cpu_kernels.simd_level(),
        host=host_description(),
        torch=torch.__version__,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    rows = []
    for c in configs:
        q = _quantiles(samples[c]["step"])
        rows.append(
            {
                "impl": f"{c[0]}, {c[1]}",
                "kind": "config",
                "placement": c[0],
                "format": c[1],
                **q,
                "iter_median_ms": _quantiles(samples[c]["iter"])["median_ms"],
                "round_medians_ms": round_med[c],
                **infos[c],
                **common,
            }
        )
    ratios = []
    for pl in args.placements:
        per_round = sorted(a / b for a, b in zip(round_med[(pl, COMPRESSED)], round_med[(pl, FP32)]))
        med = statistics.median(per_round)
        target = TARGETS.get(pl)
        ratios.append(
            {
                "impl": f"{pl}: {COMPRESSED} / {FP32}",
                "kind": "ratio",
                "placement": pl,
                "ratio_median": med,
                "ratio_min": per_round[0],
                "ratio_max": per_round[-1],
                "speedup": 1 / med,
                "target": target,
                "met": None if target is None else med <= target,
                **common,
            }
        )
    return rows, ratios


def report(rows: list, ratios: list, args) -> str:
    r0 = rows[0]
    head = (
        f"# HybridAdamW.step() of a bf16 model, {r0['layers']} x Linear({r0['width']}) = "
        f"{r0['params'] / 1e6:.1f}M params, fp32 state vs bf16 moments + remainders; "
        f"{args.rounds} rounds x {args.iters} steps, grads: {args.grads}; cpu_kernels "
        f"{r0['simd']}; {r0['host']}; torch {r0['torch']}"
    )
    if args.grads == "assign":
        head += (
            "\n\nGrads set before each step (no backward): no grad hook fires, so host/nvme "
            "subgroups are stepped inside step(), not speculatively during backward."
        )
    cols = [
        ("impl", "configuration", "s"),
        ("median_ms", "step ms", ".1f"),
        ("p20_ms", "p20", ".1f"),
        ("p80_ms", "p80", ".1f"),
    ]
    if args.grads == "backward":
        cols.append(("iter_median_ms", "iteration ms", ".1f"))
    cols += [
        ("device_state_B", "device B/param", ".2f"),
        ("host_state_B", "host B/param", ".2f"),
        ("nvme_state_B", "nvme file B/param", ".2f"),
        ("bank_B_per_elem", "bank B/elem", ".2f"),
        ("banks_B_per_host_param", "banks B/host param", ".2f"),
        ("spare_pool_B_per_offloaded_param", "spare+io pool B/offloaded param", ".2f"),
        ("spare_banks", "spare+io banks", "d"),
        ("subgroups_committed", "speculated", "d"),
        ("subgroups_stepped", "stepped in step()", "d"),
    ]
    table = markdown_table(rows, cols)
    shown = [
        dict(
            r,
            _range=f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}",
            _target="-" if r["target"] is None else f"<= {r['target']:.2f}",
            _met="-" if r["met"] is None else ("yes" if r["met"] else "no"),
        )
        for r in ratios
    ]
    ratio_table = markdown_table(
        shown,
        [
            ("impl", "placement: compressed / fp32 state step", "s"),
            ("ratio_median", "median of per-round ratios", ".3f"),
            ("_range", "range", "s"),
            ("speedup", "speedup", ".2f"),
            ("_target", "target", "s"),
            ("_met", "met", "s"),
        ],
    )
    return f"{head}\n\n{table}\n\n{ratio_table}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--params", type=float, default=33.6e6, help="about this many parameters (default 33.6e6)"
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration per round")
    ap.add_argument("--grad-sets", type=int, default=4, help="grad sets in the fixed stream")
    ap.add_argument("--grads", choices=("assign", "backward"), default="assign")
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument(
        "--subgroup-numel",
        type=int,
        default=None,
        help="default 2Mi, or params/8 for a model under 16Mi params (several subgroups)",
    )
    ap.add_argument(
        "--dir",
        default=os.path.join(REPO, "bench_out", "compressed"),
        help="nvme placements: a directory on a local disk (not tmpfs)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown tables to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0 or args.grad_sets < 1:
        ap.error("--rounds, --iters and --grad-sets must be >= 1, --warmup >= 0")
    if args.subgroup_numel is None:
        args.subgroup_numel = min(1 << 21, max(4096, int(args.params) // 8))
    workdir = None
    if any(PLACEMENTS[p].get("nvme_fraction") for p in args.placements):
        os.makedirs(args.dir, exist_ok=True)
        kind = fs_type(args.dir)
        if kind in ("tmpfs", "ramfs"):
            sys.exit(
                f"--dir {args.dir} is on {kind}: the nvme placements would measure memory, not "
                f"a disk; pass a directory on the disk (see `df`), or leave out nvme/mixed"
            )
        workdir = tempfile.mkdtemp(prefix="bench_compressed_", dir=args.dir)
    try:
        rows, ratios = study(args, workdir)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    text = report(rows, ratios, args)
    print(text)
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        with open(args.md, "w") as f:
            f.write(text)
        print(f"wrote {args.md}")
    write_json(args.json, rows + ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
