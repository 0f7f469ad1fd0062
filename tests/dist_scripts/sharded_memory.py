"""Rank script: what each rank's tiers hold under process_group= and FSDP2, read from the OS
(tests/test_sharded_memory.py compares the ranks' sum with one process's). For each
configuration named on the command line: build memory.model(), shard it, take one step at
offload 1.0 with the configuration's nvme_fraction, and save opt.allocated_bytes (host: the
arena's fstat, nvme: the files' sizes) and the arena's fixed parts (staging slots, io banks)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import sharded_memory_model as M  # noqa: E402

from hybrid_opt import HybridAdamW  # noqa: E402


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    sharding, nvme = name.rsplit("_", 1)
    model = M.model()
    kw = {}
    if sharding == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        kw["process_group"] = dist.group.WORLD
    path = os.path.join(tmp, f"{name}-rank{rank}")
    os.makedirs(path, exist_ok=True)
    opt = HybridAdamW(
        model.parameters(),
        offload_fraction=1.0,
        nvme_fraction=float(nvme),
        nvme_path=path if float(nvme) else None,
        **kw,
    )
    try:
        M.loss(model, torch.randn(8, M.WIDTH, generator=torch.Generator().manual_seed(rank))).backward()
        opt.step()
        opt.wait_params()
        return M.figures(opt)
    finally:
        opt.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    C.rank_main(run)
