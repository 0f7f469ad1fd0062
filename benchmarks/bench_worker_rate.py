"""The worker's step that step() waits for, against the in-process kernel, by core arrangement.

    python benchmarks/bench_worker_rate.py [--numel 8Mi] [--subgroups 4] [--rounds 5] [--steps 3]
                                           [--device cpu|cuda] [--json out.json]

Issue #35 item 5: on the H200's 16-core host the worker stepped 2.75 G elements/s on its 8 cores,
the in-process kernel 4.96 on all 16 (torchao's CPUOffloadOptimizer steps in process). Rows, every
round in this order, on the same sizes, fp32 state (28 B an element, bank mode):

  in_process   cpu_kernels.adam_step_ out of place on every core, no tier alive: the rate to reach
  split_own    worker_share 0.5 with the worker's cores named (worker_cores=): the waited step on
               the worker's own cores only (how every split stepped before they widened)
  split        worker_share 0.5: the waited step on every core, the trainer's too (a GPU host's
               default; the trainer sleeps in step() meanwhile)
  shared       worker_share None: trainer and worker share every core (a CPU-only host's default)

A worker row's step is HostStepping.finish() over every subgroup, as step() waits for it: its grads
staged (CPU grads: the worker reads them from the trainer, process_vm_readv; CUDA grads: D2H copies
into the pinned slots), the kernel, the results committed. Each row reports the wall rate and the
worker's own (its task seconds, io.worker_seconds). Each tier is built for its row and closed after
it, so the trainer's cores are its whole affinity again for the next row. Median and p20-p80 over
rounds; the ratio to in_process is per round, then its median.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_description, markdown_table, parse_size, spread, write_json  # noqa: E402

import cpu_kernels  # noqa: E402
from hybrid_opt.tiers.host import AdamInputs, HostTier  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
ARRANGEMENTS = ("split_own", "split", "shared")


def _inputs(step: int) -> AdamInputs:
    return AdamInputs(step, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"])


def in_process_seconds(sizes, grads_cpu, steps: int) -> float:
    """The best of `steps` in-process steps over every subgroup, bank mode, on every core."""
    cpu_kernels.set_num_threads(len(os.sched_getaffinity(0)))
    state = [(torch.randn(n), torch.zeros(n), torch.zeros(n)) for n in sizes]
    out = [tuple(torch.empty(n) for _ in range(3)) for n in sizes]
    best = float("inf")
    for step in range(1, steps + 2):
        t0 = time.perf_counter()
        for (p, m, v), g, o in zip(state, grads_cpu, out):
            cpu_kernels.adam_step_(p, g, m, v, step=step, out=o, **HP)
        if step > 1:  # the first touches fresh pages
            best = min(best, time.perf_counter() - t0)
    return best


def worker_seconds(arrangement: str, sizes, grads, steps: int, pin) -> tuple[float, float]:
    """(wall, worker) seconds of the best of `steps` waited steps under `arrangement`."""
    cores = sorted(os.sched_getaffinity(0))
    kw: dict = {"worker_share": None} if arrangement == "shared" else {"worker_share": 0.5}
    if arrangement == "split_own" and len(cores) > 1:
        kw = {"worker_cores": cores[-max(1, len(cores) // 2) :]}
    tier = HostTier(list(sizes), spare_banks=2, slot_numel=min(sizes[0], 1 << 20), pin=pin, **kw)
    try:
        for sg, n in enumerate(sizes):
            tier.load_state(sg, torch.randn(n))
        best = (float("inf"), float("inf"))
        for step in range(1, steps + 2):
            before = sum(tier.io.worker_seconds.values())
            t0 = time.perf_counter()
            tier.stepping.finish({sg: (grads[sg], _inputs(step)) for sg in range(len(sizes))})
            wall = time.perf_counter() - t0
            spent = sum(tier.io.worker_seconds.values()) - before
            if step > 1 and wall < best[0]:
                best = (wall, spent)
        return best
    finally:
        tier.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="8Mi", help="elements in all, cut into --subgroups")
    ap.add_argument("--subgroups", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row and round (the best counts)")
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the grads live"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n = parse_size(args.numel)
    sizes = [n // args.subgroups] * args.subgroups
    n = sum(sizes)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    grads_cpu = [torch.randn(k, generator=gen) for k in sizes]
    grads = [g.to(device) for g in grads_cpu]
    pin = device if device.type == "cuda" else False
    samples: dict = {name: {"wall": [], "worker": [], "ratio": []} for name in ("in_process", *ARRANGEMENTS)}
    for _ in range(args.rounds):
        base = n / in_process_seconds(sizes, grads_cpu, args.steps) / 1e9
        samples["in_process"]["wall"].append(base)
        samples["in_process"]["ratio"].append(1.0)
        for name in ARRANGEMENTS:
            wall, spent = worker_seconds(name, sizes, grads, args.steps, pin)
            samples[name]["wall"].append(n / wall / 1e9)
            samples[name]["worker"].append(n / max(spent, 1e-9) / 1e9)
            samples[name]["ratio"].append(n / wall / 1e9 / base)
    records = []
    for name, s in samples.items():
        wall, wall_p20, wall_p80 = spread(s["wall"])
        rec = {
            "impl": name,
            "numel": n,
            "subgroups": args.subgroups,
            "grads_on": device.type,
            "cores": len(os.sched_getaffinity(0)),
            "simd": cpu_kernels.simd_level(),
            "gelems_per_s": wall,
            "gelems_per_s_p20": wall_p20,
            "gelems_per_s_p80": wall_p80,
            "vs_in_process": spread(s["ratio"])[0],
        }
        if s["worker"]:
            rec["worker_gelems_per_s"] = spread(s["worker"])[0]
        records.append(rec)
    print(
        f"{host_description()}; {len(os.sched_getaffinity(0))} cores, cpu_kernels at {cpu_kernels.simd_level()}; "
        f"{args.subgroups} subgroups of {sizes[0]:,} fp32 elements, grads on {device.type}; "
        f"median of {args.rounds} rounds (best of {args.steps} steps each)"
    )
    print(
        markdown_table(
            records,
            [
                ("impl", "row", "s"),
                ("gelems_per_s", "G elem/s (wall)", ".3f"),
                ("gelems_per_s_p20", "p20", ".3f"),
                ("gelems_per_s_p80", "p80", ".3f"),
                ("worker_gelems_per_s", "worker's own", ".3f"),
                ("vs_in_process", "vs in_process", ".2f"),
            ],
        )
    )
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
