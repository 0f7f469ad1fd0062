"""HybridAdamW under torch.distributed: sharded state vs replicated, 2 gloo ranks.

Configurations (each rank builds all of them, then times them interleaved: every round runs
each configuration for a few iterations, in an order rotated per round, so drift hits all):

- fsdp2: FSDP2 `fully_shard` per block, HybridAdamW over the DTensor params (state sharded);
- process_group: plain params, HybridAdamW(process_group=WORLD) (ZeRO-2 style: state sharded,
  grads reduce-scattered, params all-gathered) — skipped with a note where it raises
  NotImplementedError (not built);
- ddp: DDP + HybridAdamW over the plain params (every rank holds and steps all the state);
- process_group[KIND] (with --zero-collectives KIND,...): process_group over other collectives
  than the backend's default (hybrid_opt.distributed.zero.COLLECTIVES: all_to_all, reduce_scatter,
  all_reduce), interleaved with the rest.

Per configuration: median / p20 / p80 of the iteration (forward + backward + step) and of
step() alone, the max over ranks; host state bytes per rank (host + nvme tiers' state, and the
shared-memory arena with its spare banks and staging slots); speculation's commit rate over
the timed steps (committed / host steps) and the share of the worker's time hidden under
backward. Writes JSON and a markdown table.

    python benchmarks/bench_dist.py [--params 50e6] [--rounds 3] [--iters 2] [--json F] [--md F]
                                    [--overlap-param-gather] [--zero-collectives reduce_scatter,...]

The launcher runs `torchrun --nproc-per-node 2` on this script; each launch is bounded
(--timeout), killing every rank and worker on overrun.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from hybrid_opt.testing import debug_view

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

HIDDEN = 2048
CONFIGS = ("fsdp2", "process_group", "ddp")


def build_model(n_params: float):
    import torch

    layers = max(1, round(n_params / (HIDDEN * HIDDEN + HIDDEN)))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def make(config: str, args, rank: int, world: int):
    """(model, optimizer) for one configuration, or (None, note) when it cannot run."""
    import torch
    import torch.distributed as dist

    from hybrid_opt import HybridAdamW

    model = build_model(args.params)
    # clipping on (so the one decision all_reduce runs) but never biting: a clip that bites
    # redoes every speculated step in any mode, which is not what is compared here
    kw = dict(lr=1e-4, weight_decay=0.01, max_grad_norm=1e4, offload_fraction=1.0)
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, HybridAdamW(model.parameters(), **kw)
    if config.startswith("process_group"):
        from hybrid_opt.distributed import zero

        zero.COLLECTIVES = config[len("process_group[") : -1] if "[" in config else None
        try:
            return model, HybridAdamW(
                model.parameters(),
                process_group=dist.group.WORLD,
                overlap_param_gather=args.overlap_param_gather,
                **kw,
            )
        except NotImplementedError as e:
            return None, f"process_group not built: {e}"
        except Exception as e:  # a partial build: the row is skipped, the others still run
            return None, f"process_group raised {type(e).__name__}: {e}"
        finally:
            zero.COLLECTIVES = None
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replicated-params warning: replication is the point
        opt = HybridAdamW(model.parameters(), **kw)
    return DDP(model), opt


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from hybrid_opt.placement.plan import HOST, NVME

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, HIDDEN, generator=gen)
    runs, notes = {}, {}
    for config in configs(args):
        model, opt = make(config, args, rank, world)
        if model is None:
            notes[config] = opt
            continue
        runs[config] = dict(model=model, opt=opt, iter_ms=[], step_ms=[], spec=[], worker_s=0.0, hidden_s=0.0)

    def iteration(run, timed: bool) -> None:
        model, opt = run["model"], run["opt"]
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if timed:
            run["iter_ms"].append((t2 - t0) * 1e3)
            run["step_ms"].append((t2 - t1) * 1e3)
            run["spec"].append(dict(opt.stats.get("speculation") or {}))
            run["worker_s"] += opt.stats.get("worker_s", 0.0)
            run["hidden_s"] += opt.stats.get("hidden_s", 0.0)

    names = list(runs)
    for name in names:  # warmup: first-touch of the state, worker start-up, FSDP lazy init
        for _ in range(args.warmup):
            iteration(runs[name], False)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            for _ in range(args.iters):
                iteration(runs[name], True)
    records = []
    for name in names:
        run, opt = runs[name], runs[name]["opt"]
        tiers = opt.stats["tiers"]
        spec = {
            k: sum(s.get(k, 0) for s in run["spec"]) for k in ("committed", "redone", "stepped", "dropped")
        }
        host_steps = sum(spec.values())
        rec = dict(
            config=name,
            rank=rank,
            world=world,
            params=sum(p.numel() for p in build_model(args.params).parameters()) if rank == 0 else None,
            iter_ms=run["iter_ms"],
            step_ms=run["step_ms"],
            host_state_bytes=tiers[HOST]["state_bytes"] + tiers[NVME]["state_bytes"],
            host_arena_bytes=debug_view(opt).host.arena.nbytes if debug_view(opt).host is not None else 0,
            comm_buffer_bytes=debug_view(opt).sharding.stats["buffer_bytes"]
            if debug_view(opt).sharding.active
            else 0,
            **spec,
            commit_rate=spec["committed"] / host_steps if host_steps else None,
            hidden_share=run["hidden_s"] / run["worker_s"] if run["worker_s"] else None,
        )
        records.append(rec)
        opt.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(records=records, notes=notes))
    if rank == 0:
        with open(os.path.join(os.environ["BENCH_OUT"], "ranks.json"), "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def _q(xs: list, k: int) -> float:
    xs = sorted(xs)
    return statistics.quantiles(xs, n=10, method="inclusive")[k] if len(xs) > 1 else xs[0]


def configs(args) -> list:
    extra = [f"process_group[{k}]" for k in (args.zero_collectives or "").split(",") if k]
    return list(CONFIGS[:2]) + extra + list(CONFIGS[2:])


def summarise(gathered: list, names: list) -> tuple[list, dict]:
    notes = {}
    for g in gathered:
        notes.update(g["notes"])
    by_config: dict = {}
    for g in gathered:
        for rec in g["records"]:
            by_config.setdefault(rec["config"], []).append(rec)
    rows = []
    for config in names:
        if config not in by_config:
            rows.append(dict(config=config, note=notes.get(config, "not run")))
            continue
        recs = by_config[config]
        # per timed iteration the slowest rank (the ranks wait for each other anyway)
        it = [max(v) for v in zip(*(r["iter_ms"] for r in recs))]
        st = [max(v) for v in zip(*(r["step_ms"] for r in recs))]
        rates = [r["commit_rate"] for r in recs if r["commit_rate"] is not None]
        hidden = [r["hidden_share"] for r in recs if r["hidden_share"] is not None]
        rows.append(
            dict(
                config=config,
                world=recs[0]["world"],
                params=recs[0]["params"],
                iter_median_ms=statistics.median(it),
                iter_p20_ms=_q(it, 1),
                iter_p80_ms=_q(it, 7),
                step_median_ms=statistics.median(st),
                step_p20_ms=_q(st, 1),
                step_p80_ms=_q(st, 7),
                host_state_mb_per_rank=max(r["host_state_bytes"] for r in recs) / 1e6,
                host_state_mb_total=sum(r["host_state_bytes"] for r in recs) / 1e6,
                host_arena_mb_per_rank=max(r["host_arena_bytes"] for r in recs) / 1e6,
                comm_buffer_mb_per_rank=max(r.get("comm_buffer_bytes", 0) for r in recs) / 1e6,
                committed=sum(r["committed"] for r in recs),
                redone=sum(r["redone"] for r in recs),
                commit_rate=min(rates) if rates else None,
                hidden_share=statistics.mean(hidden) if hidden else None,
                timed_iterations=len(it),
            )
        )
    ddp = next((r for r in rows if r["config"] == "ddp" and "step_median_ms" in r), None)
    for r in rows:
        if ddp and "step_median_ms" in r:
            r["step_vs_ddp"] = r["step_median_ms"] / ddp["step_median_ms"]
            r["iter_vs_ddp"] = r["iter_median_ms"] / ddp["iter_median_ms"]
    return rows, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6, help="model size (>= 50e6 for the table)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2, help="timed iterations per configuration per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900, help="seconds before every rank is killed")
    ap.add_argument("--json", default="bench_dist.json")
    ap.add_argument("--md", default="bench_dist.md")
    ap.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="process_group row with overlap_param_gather=True (its all-gathers land in the next forward)",
    )
    ap.add_argument(
        "--zero-collectives",
        default="",
        help="comma-separated extra process_group rows over other collectives "
        "(all_to_all, reduce_scatter, all_reduce)",
    )
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import tempfile

    from dist_launch import _kill_tree

    out = tempfile.mkdtemp(prefix="bench_dist-")
    # --standalone: the store binds a free port itself (a port picked beforehand can be taken)
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--log-dir={os.path.join(out, 'torchelastic')}",  # not a /tmp/torchelastic_* per launch
            "--standalone",
            os.path.abspath(__file__),
            "--rank-main",
            f"--params={args.params}",
            f"--batch={args.batch}",
            f"--rounds={args.rounds}",
            f"--iters={args.iters}",
            f"--warmup={args.warmup}",
        ]
        + (["--overlap-param-gather"] if args.overlap_param_gather else [])
        + ([f"--zero-collectives={args.zero_collectives}"] if args.zero_collectives else [])
    )
    env = dict(
        os.environ,
        BENCH_OUT=out,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"note: 2 gloo ranks and their HybridAdamW workers share this machine's {cores} cores "
        f"(torchrun's LOCAL_WORLD_SIZE 2: each rank gets {max(1, cores // 2)} core(s) for its "
        f"trainer and worker); figures are for this machine only",
        flush=True,
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        sys.exit(f"bench_dist: no result within {args.timeout:.0f} s; every rank and worker killed")
    if proc.returncode != 0:
        sys.exit(f"bench_dist: torchrun failed (exit {proc.returncode})")
    with open(os.path.join(out, "ranks.json")) as f:
        gathered = json.load(f)
    rows, notes = summarise(gathered, configs(args))
    import torch

    meta = dict(
        world=2,
        backend="gloo",
        cores=cores,
        torch=torch.__version__,
        params=args.params,
        overlap_param_gather=args.overlap_param_gather,
        zero_collectives=args.zero_collectives,
        batch=args.batch,
        rounds=args.rounds,
        iters=args.iters,
        seconds=time.monotonic() - t0,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        notes=notes,
    )
    from _common import markdown_table

    table = markdown_table(
        [r for r in rows if "step_median_ms" in r],
        [
            ("config", "config", "s"),
            ("iter_median_ms", "iter ms (median)", ".0f"),
            ("iter_p20_ms", "p20", ".0f"),
            ("iter_p80_ms", "p80", ".0f"),
            ("step_median_ms", "step() ms (median)", ".0f"),
            ("step_vs_ddp", "step / ddp", ".2f"),
            ("host_state_mb_per_rank", "host state MB / rank", ".0f"),
            ("host_state_mb_total", "host state MB, all ranks", ".0f"),
            ("host_arena_mb_per_rank", "host arena MB / rank", ".0f"),
            ("comm_buffer_mb_per_rank", "comm buffers MB / rank", ".0f"),
            ("commit_rate", "spec. committed", ".0%"),
            ("hidden_share", "worker time hidden", ".0%"),
        ],
    )
    skipped = "".join(f"\n- {r['config']}: {r['note']}" for r in rows if "note" in r)
    text = (
        f"{table}\n\n{meta['world']} gloo ranks and their workers on {cores} cores; "
        f"{rows[0].get('params') or int(args.params)} params, batch {args.batch}, "
        f"{args.rounds} rounds x {args.iters} iterations (interleaved), torch {torch.__version__}"
        + (f"\nSkipped:{skipped}" if skipped else "")
    )
    print(text)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(args.md, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
