"""bench_peers.py's rows, and how each trains on a rank: the configurations (HybridAdamW,
DeepSpeed, torch) with their keys and groups, DeepSpeed's config, HybridAdamW's arguments,
and `rank_main`, the body of every launch (`bench_peers.py --rank-main`). No hybrid_opt or
DeepSpeed import at module level: the peer interpreter (DeepSpeed's own venv, which has no
hybrid_opt) imports this module too, and each row imports what it runs."""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peers_model as M  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 1.0
OFFLOAD = 1.0
BF16_MOMENTS = "bf16 moments"


def _row(key, impl, config, mode, **kw):
    return dict(key=key, impl=impl, config=config, mode=mode, **kw)


ROWS = [
    _row("plain", "HybridAdamW", "plain", "plain"),
    _row("plain-bf16", "HybridAdamW", f"plain, {BF16_MOMENTS}", "plain", compressed=True),
    _row("fsdp2", "HybridAdamW", "FSDP2", "fsdp2"),
    _row("fsdp2-bf16", "HybridAdamW", f"FSDP2, {BF16_MOMENTS}", "fsdp2", compressed=True),
    _row("pg", "HybridAdamW", "process_group", "pg"),
    _row("pg-bf16", "HybridAdamW", f"process_group, {BF16_MOMENTS}", "pg", compressed=True),
    _row("pg-inverse", "HybridAdamW", 'process_group, rollback="inverse"', "pg", rollback="inverse"),
    _row(
        "pg-inverse-release",
        "HybridAdamW",
        'process_group, rollback="inverse", release_grads=True',
        "pg",
        rollback="inverse",
        release_grads=True,
    ),
    _row("plain-nvme0.5", "HybridAdamW", "plain, nvme_fraction 0.5", "plain", nvme=0.5),
    _row("plain-nvme1", "HybridAdamW", "plain, nvme_fraction 1.0", "plain", nvme=1.0),
    _row("fsdp2-nvme0.5", "HybridAdamW", "FSDP2, nvme_fraction 0.5", "fsdp2", nvme=0.5),
    _row("fsdp2-nvme1", "HybridAdamW", "FSDP2, nvme_fraction 1.0", "fsdp2", nvme=1.0),
    _row("pg-nvme0.5", "HybridAdamW", "process_group, nvme_fraction 0.5", "pg", nvme=0.5),
    _row("pg-nvme1", "HybridAdamW", "process_group, nvme_fraction 1.0", "pg", nvme=1.0),
    _row("ds-zero2-cpu", "DeepSpeed", "ZeRO-2 + CPU optimizer offload", "ds", stage=2, offload="cpu"),
    _row("ds-zero3-cpu", "DeepSpeed", "ZeRO-3 + CPU optimizer offload", "ds", stage=3, offload="cpu"),
    _row(
        "ds-zero3-nvme",
        "DeepSpeed",
        "ZeRO-3 + nvme optimizer offload",
        "ds",
        stage=3,
        offload="nvme",
        nvme=1.0,
    ),
    _row("ddp-fused", "torch", "DDP + AdamW(fused=True)", "ddp"),
    _row("fsdp2-torch", "torch", "FSDP2 + AdamW", "fsdp2-torch"),
]
BY_KEY = {r["key"]: r for r in ROWS}
REFERENCE = "ddp-fused"
GROUPS = {
    "all": [r["key"] for r in ROWS],
    "no-peers": [r["key"] for r in ROWS if r["mode"] != "ds"],
    "hybrid": [r["key"] for r in ROWS if r["impl"] == "HybridAdamW"],
    "deepspeed": [r["key"] for r in ROWS if r["mode"] == "ds"],
    "torch": [r["key"] for r in ROWS if r["impl"] == "torch"],
}


# ---------------------------------------------------------------------------------- DeepSpeed
def ds_config(row: dict, cfg: M.ModelConfig, world: int, nvme_path: str | None, cuda: bool) -> dict:
    """The DeepSpeed config of a row: the same optimizer, hyperparameters, clipping and batch
    as every other row; DeepSpeed's own defaults for everything else (bucket sizes, overlap).
    Keys from deepspeed/runtime/zero/config.py, offload_config.py, swap_tensor/constants.py."""
    offload = {"device": row["offload"], "pin_memory": cuda}  # page-locking buys nothing without a GPU
    if row["offload"] == "nvme":
        offload.update(nvme_path=nvme_path, buffer_count=4)
    conf = {
        "train_batch_size": cfg.batch,
        "train_micro_batch_size_per_gpu": cfg.batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": HYPER["lr"],
                "betas": list(HYPER["betas"]),
                "eps": HYPER["eps"],
                "weight_decay": HYPER["weight_decay"],
            },
        },
        "zero_optimization": {"stage": row["stage"], "offload_optimizer": offload},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if row["offload"] == "nvme":  # DeepSpeed's documented defaults, spelled out
        conf["aio"] = {
            "block_size": 1048576,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    return conf


# ---------------------------------------------------------------------------------- one rank
def has_release_grads() -> bool:
    import inspect

    from hybrid_opt import HybridAdamW

    return any(
        "release_grads" in inspect.signature(c.__init__).parameters
        for c in HybridAdamW.__mro__
        if "__init__" in c.__dict__
    )


def _hybrid_kwargs(row: dict, nvme_path: str | None, param_dtype) -> dict:
    import torch
    import torch.distributed as dist

    kw = dict(HYPER, max_grad_norm=CLIP, offload_fraction=OFFLOAD)
    if row.get("compressed"):
        kw.update(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        if param_dtype == torch.bfloat16:  # remainders need bf16 params (docs/usage.md)
            kw.update(store_param_remainders=True)
    if row.get("nvme"):
        kw.update(nvme_fraction=row["nvme"], nvme_path=nvme_path)
    if row.get("rollback"):
        kw.update(rollback=row["rollback"])
    if row.get("release_grads"):
        kw.update(release_grads=True)
    if row["mode"] == "pg":
        kw.update(process_group=dist.group.WORLD)
    return kw


def _shard(model, world: int, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.split(":")[0], (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full_params(net, row: dict) -> dict:
    """{name: full fp32 CPU tensor} on every rank (collectives where the params are sharded)."""
    from hybrid_opt.distributed.local_shards import is_dtensor

    if row["mode"] == "ds" and row["stage"] == 3:
        import deepspeed

        params = list(net.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().float().cpu().clone() for n, p in net.named_parameters()}
    out = {}
    for n, p in net.named_parameters():
        t = p.full_tensor() if is_dtensor(p) else p
        out[n] = t.detach().float().cpu().clone()
    return out


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    row = BY_KEY[args.row]
    cfg = M.config_from_args(args)
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if row["mode"] == "ds":
        import deepspeed

        deepspeed.init_distributed(backend)
    else:
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    nvme_path = None
    if row.get("nvme"):
        nvme_path = os.path.join(args.nvme_root, f"rank{rank}")
        os.makedirs(nvme_path, exist_ok=True)

    net = M.build_model(cfg, device)
    model, opt, engine = net, None, None
    mode = row["mode"]
    if mode == "ds":
        import deepspeed

        conf = ds_config(row, cfg, world, nvme_path, cuda)
        engine, opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=conf)
        model = engine
    elif mode in ("fsdp2", "fsdp2-torch"):
        _shard(net, world, device)
    if mode in ("plain", "fsdp2", "pg"):
        import warnings

        from hybrid_opt import HybridAdamW

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            opt = HybridAdamW(
                net.parameters(), **_hybrid_kwargs(row, nvme_path, next(net.parameters()).dtype)
            )
        for w in said:  # into the launch's log (plain at 2 ranks: replicated, the row's point, is said too)
            print(f"bench_peers {row['key']} rank {rank}: {w.category.__name__}: {w.message}", flush=True)
        if mode == "plain" and world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(net)
    elif mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        opt = torch.optim.AdamW(net.parameters(), fused=True, **HYPER)
        model = DDP(net, device_ids=[local] if cuda else None)
    elif mode == "fsdp2-torch":
        opt = torch.optim.AdamW(net.parameters(), **HYPER)

    def iteration(step: int) -> None:
        x, y = M.batch(cfg, step, rank, world, device)
        if engine is not None:
            loss = M.loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()  # clipping inside (gradient_clipping), grads zeroed by the engine
            return
        opt.zero_grad(set_to_none=True)
        M.loss_fn(model(x), y).backward()
        if mode in ("ddp", "fsdp2-torch"):
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()

    if rank == 0:
        inner = getattr(opt, "optimizer", None)
        print(
            f"bench_peers {row['key']} @{world}: optimizer {type(opt).__module__}.{type(opt).__name__}"
            + (f" over {type(inner).__module__}.{type(inner).__name__}" if inner is not None else ""),
            flush=True,
        )
    times, spec = [], {}
    for step in range(args.steps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        iteration(step)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            # HybridAdamW: how its host steps went (committed = speculated during backward, kept)
            stats = getattr(opt, "stats", None)
            for k, v in ((stats or {}).get("speculation") or {}).items():
                spec[k] = spec.get(k, 0) + v
    dist.barrier()
    # after the last step, before close: the state is all there, the nvme files too
    nvme_bytes = M.tree_bytes(nvme_path)
    allocated = getattr(opt, "allocated_bytes", None)
    allocated = {k: int(v) for k, v in allocated.items()} if isinstance(allocated, dict) else None
    pss = M.pss_bytes()
    params = _full_params(net, row)
    if rank == 0:
        torch.save(params, os.path.join(args.out, "params.pt"))
    plan = getattr(opt, "plan", None)
    rec = dict(
        rank=rank,
        world=world,
        times_ms=times,
        pss=pss,
        allocated=allocated,
        nvme_bytes=nvme_bytes,
        subgroups=len(plan.tiers) if hasattr(plan, "tiers") else None,
        speculation=spec or None,
        python=sys.version.split()[0],
        torch=torch.__version__,
    )
    if mode == "ds":
        import deepspeed

        rec["deepspeed"] = deepspeed.__version__
    else:  # not imported in the torch rows: their memory was sampled without it, keep it so
        from importlib.metadata import PackageNotFoundError, version

        try:
            rec["hybrid_opt"] = version("hybrid_opt")
        except PackageNotFoundError:
            rec["hybrid_opt"] = None
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    if hasattr(opt, "close"):
        opt.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- driver
