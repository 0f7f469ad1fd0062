"""The host tier's worker: does speculation hide the host step under backward?

    python benchmarks/bench_worker.py [--numel 32Mi] [--subgroups 16] [--iters 7] [--json out.json]

The trainer runs a fixed CPU workload standing in for backward on its core (matmuls,
sized to take about as long as the host step), cut into one segment per subgroup; after
each segment that subgroup's grads are "ready". Three ways to step, same state, same grads:
  (a) in_process_sequential: backward, then cpu_kernels.adam_step_ in the trainer (all cores)
  (b) worker_sequential:     backward, then the worker steps every subgroup (finish)
  (c) worker_speculative:    each subgroup submitted to the worker as soon as it is ready
Also: the empty-task round trip, and memory per host-tier parameter (PSS of trainer +
worker, inverse and exact mode). Both cores share one memory system, so (c) cannot reach
max(backward, step): the Adam stream slows the matmuls on the other core.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, parse_size, time_ms, write_json  # noqa: E402

import cpu_kernels  # noqa: E402
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.host import AdamInputs, HostTier  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line")


class Backward:
    """A fixed matmul workload cut into segments, standing in for backward."""

    def __init__(self, seconds: float, segments: int):
        self.a = torch.randn(256, 256)
        self.b = torch.randn(256, 256)
        self.segments = segments
        t = time_ms(lambda: self.unit(20), reps=5)["median_ms"] / 20 / 1e3
        self.units = max(1, round(seconds / t / segments))
        for _ in range(3):  # the whole run is what must match: correct the unit estimate
            took = time_ms(self.run, reps=3, warmup=1)["median_ms"] / 1e3
            self.units = max(1, round(self.units * seconds / took))

    def unit(self, k: int) -> None:
        for _ in range(k):
            torch.mm(self.a, self.b)

    def run(self, on_segment=None) -> None:
        for s in range(self.segments):
            self.unit(self.units)
            if on_segment is not None:
                on_segment(s)


def memory_child(what: str, n: int) -> dict:
    """Bytes the host tier (or HybridAdamW over it) adds per parameter: PSS of this process
    and the worker after two steps, minus this process's PSS before (model and grads
    already allocated). fp32 state: master + m + v = 12 bytes are what must be held."""
    torch.set_num_threads(1)
    S = 16
    hp = {k: HP[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    mode = what.split("_")[1]
    if what.startswith("tier"):
        g = torch.zeros(n // S)
        gc.collect()
        base = pss_bytes(os.getpid())
        tier = HostTier(
            [n // S] * S,
            rollback=mode,
            spare_banks=2 if mode == "exact" else None,
            staging_slots=2,
            slot_numel=1 << 18,
        )
        for step in (1, 2):
            tier.stepping.finish({sg: (g, AdamInputs(step, **hp)) for sg in range(S)})
        tier.arena.wait_populated()  # the spare banks are populated in the background
        total = pss_bytes(os.getpid()) - base + pss_bytes(tier.client.pid)
        spare = tier.spare_bytes
        tier.close()
    else:
        from hybrid_opt import HybridAdamW

        # torch.optim's first construction costs a fixed ~100-150 MB of lazy imports, not per
        # parameter: pay it before the baseline, as any training script already has
        warm = torch.nn.Parameter(torch.zeros(1))
        warm.grad = torch.zeros(1)
        torch.optim.AdamW([warm]).step()
        params = [torch.nn.Parameter(torch.zeros(n // S)) for _ in range(S)]
        for p in params:
            p.grad = torch.zeros_like(p)
        gc.collect()
        base = pss_bytes(os.getpid())
        opt = HybridAdamW(params, lr=HP["lr"], offload_fraction=1.0, rollback=mode, subgroup_numel=n // S)
        for _ in range(2):
            opt.step()
        gc.collect()
        debug_view(opt).host.arena.wait_populated()  # the spare banks are populated in the background
        total = pss_bytes(os.getpid()) - base + pss_bytes(opt.worker_pid)
        spare = debug_view(opt).host.spare_bytes
        opt.close()
    return {
        "impl": f"memory_{what}",
        "numel": n,
        "bytes_per_param": total / n,
        "state_bytes_per_param": 12,
        "spare_bytes_per_param": spare / n,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="32Mi")
    ap.add_argument("--subgroups", type=int, default=16)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--memory-numel", default="64Mi", help="parameters for the memory figure")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory-child", nargs=2, metavar=("WHAT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child[0], int(args.memory_child[1]))))
        return 0
    all_cores = len(os.sched_getaffinity(0))
    # the stand-in backward runs on the trainer's one core in every variant; only the
    # in-process step uses all cores, as an in-process optimizer would
    torch.set_num_threads(1)
    cpu_kernels.set_num_threads(all_cores)
    n_total = parse_size(args.numel)
    S = args.subgroups
    sizes = [n_total // S] * S
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(k)) for k, n in enumerate(sizes)]
    init = [torch.randn(n) for n in sizes]
    records, rows = [], []

    def record(name, t, **extra):
        rec = {"impl": name, "numel": n_total, "subgroups": S, **t, **extra}
        records.append(rec)
        rows.append(rec)

    # (a) in process, all cores
    state = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in init]
    counter = [0]

    def in_process_step():
        counter[0] += 1
        for (p, m, v), g in zip(state, grads):
            cpu_kernels.adam_step_(p, g, m, v, step=counter[0], **HP)

    # the stand-in backward is sized to the worker's step (the case the target names): time
    # that step first, with the cores split as they will be
    tier = HostTier(sizes, spare_banks=S, staging_slots=4, slot_numel=min(sizes[0], 1 << 20))
    torch.set_num_threads(1)
    it = [0]

    def inputs():
        return AdamInputs(it[0], HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"])

    def worker_step_alone():
        it[0] += 1
        tier.stepping.finish({sg: (grads[sg], inputs()) for sg in range(S)})

    try:
        for sg, p in enumerate(init):
            tier.load_state(sg, p)
        worker_alone = time_ms(worker_step_alone, reps=args.iters)
        backward = Backward(worker_alone["median_ms"] / 1e3, S)
    finally:
        tier.close()
    torch.set_num_threads(1)

    step_only = time_ms(in_process_step, reps=args.iters)
    record("backward_alone", time_ms(backward.run, reps=args.iters))
    record("in_process_step_alone", step_only)
    record("in_process_sequential", time_ms(lambda: (backward.run(), in_process_step()), reps=args.iters))
    state.clear()

    tier = HostTier(sizes, spare_banks=S, staging_slots=4, slot_numel=min(sizes[0], 1 << 20))
    torch.set_num_threads(1)
    try:
        for sg, p in enumerate(init):
            tier.load_state(sg, p)

        def worker_sequential():
            it[0] += 1
            backward.run()
            tier.stepping.finish({sg: (grads[sg], inputs()) for sg in range(S)})

        def worker_speculative():
            it[0] += 1
            # grads become ready in reverse order during backward: the last layer's first
            backward.run(lambda s: tier.stepping.speculate(S - 1 - s, grads[S - 1 - s], inputs()))
            out = tier.stepping.finish({sg: (grads[sg], inputs()) for sg in range(S)})
            assert all(v == "committed" for v in out.values()), out

        record("worker_step_alone", time_ms(worker_step_alone, reps=args.iters))
        seq = time_ms(worker_sequential, reps=args.iters)
        spec = time_ms(worker_speculative, reps=args.iters)
        record("worker_sequential", seq)
        record("worker_speculative", spec, ratio_to_worker_sequential=spec["median_ms"] / seq["median_ms"])
        pings = sorted(tier.client.ping() * 1e6 for _ in range(500))
        rt = {
            "impl": "round_trip_us",
            "median_us": statistics.median(pings),
            "p20_us": pings[len(pings) // 5],
            "p80_us": pings[4 * len(pings) // 5],
        }
        records.append(rt)
        trainer_cores, worker_cores = tier.cores.trainer, tier.cores.worker
    finally:
        tier.close()

    # memory per host-tier parameter: trainer + worker PSS, each measured in a fresh process
    n_mem = parse_size(args.memory_numel)
    mem_rows = []
    for what in ("tier_inverse", "tier_exact", "optimizer_inverse", "optimizer_exact"):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--memory-child", what, str(n_mem)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError(f"memory measurement {what} failed:\n{out.stderr[-2000:]}")
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        records.append(rec)
        mem_rows.append(rec)

    print(
        f"trainer cores {trainer_cores}, worker cores {worker_cores}; {S} subgroups of "
        f"{sizes[0]} elements; torch {torch.__version__}"
    )
    print(
        markdown_table(
            rows,
            [
                ("impl", "impl", "s"),
                ("median_ms", "median ms", ".1f"),
                ("p20_ms", "p20 ms", ".1f"),
                ("p80_ms", "p80 ms", ".1f"),
                ("ratio_to_worker_sequential", "vs worker sequential", ".3f"),
            ],
        )
    )
    print(
        f"\nempty-task round trip: median {rt['median_us']:.0f} us (p20 {rt['p20_us']:.0f}, "
        f"p80 {rt['p80_us']:.0f})\n"
    )
    print(
        markdown_table(
            mem_rows,
            [
                ("impl", "what", "s"),
                ("numel", "params", "d"),
                ("bytes_per_param", "bytes/param added (trainer+worker PSS)", ".2f"),
                ("state_bytes_per_param", "state it must hold", ".0f"),
                ("spare_bytes_per_param", "of which spare pool", ".2f"),
            ],
        )
    )
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
