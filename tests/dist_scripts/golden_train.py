"""Rank script of the golden harness (tests/golden.py) at 2 gloo ranks: the golden model under
FSDP2 (each param's holder sharded) or as plain params with process_group=WORLD, each rank
feeding its own exact grads (the reduction averages them exactly), clipping on and an
overflow on rank 1 only at golden.OVERFLOW_STEP; saves {name: per-step records of this rank}
(its shards' params and state)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import golden as G  # noqa: E402

# name: (sharding, hybrid kwargs, model dtype)
CONFIGS = {
    "fsdp2_mixed": ("fsdp2", dict(offload_fraction=0.5, nvme_fraction=0.25), torch.float32),
    "zero_mixed": ("zero", dict(offload_fraction=0.5, nvme_fraction=0.25), torch.float32),
    "zero_compressed_host": (
        "zero",
        dict(
            offload_fraction=1.0,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
            store_param_remainders=True,
        ),
        torch.bfloat16,
    ),
}


class _Holder(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, g):
        return (self.p * g).sum()


class Golden(torch.nn.Module):
    """golden.build_params as a module: one holder per param, so FSDP2 shards each on its own
    and unshards it in its forward."""

    def __init__(self, dtype):
        super().__init__()
        self.holders = torch.nn.ModuleList(_Holder(p) for p in G.build_params(dtype))

    def forward(self, gs):
        return sum(h(g) for h, g in zip(self.holders, gs))


def run(name: str, rank: int, world: int, tmp: str) -> list:
    from hybrid_opt import HybridAdamW

    sharding, hybrid, dtype = CONFIGS[name]
    model = Golden(dtype)
    hybrid = dict(hybrid)
    if hybrid.get("nvme_fraction"):
        hybrid["nvme_path"] = os.path.join(tmp, f"{name}-rank{rank}")
        os.makedirs(hybrid["nvme_path"])
    if sharding == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for h in model.holders:
            fully_shard(h, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        hybrid["process_group"] = dist.group.WORLD
    params = list(model.parameters())
    records = []
    with HybridAdamW(
        G.param_groups(params), max_grad_norm=0.05, subgroup_numel=G.SUBGROUP_NUMEL, **hybrid
    ) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        opt.attach_grad_scaler(scaler)
        for step in range(G.STEPS):
            opt.zero_grad()
            loss = model(G.grads(step, rank, dtype, overflow=rank == 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if sharding == "zero":
                opt.wait_params()
            records.append(G.snapshot(opt, params))
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    C.rank_main(run)
