"""Rank script: a launcher that sets no LOCAL_WORLD_SIZE (Lightning's DDP launcher sets only
LOCAL_RANK; mp.spawn neither), simulated under torchrun by removing what it set — the
configuration names which: "no_local_world_size" keeps LOCAL_RANK, "no_local_env" removes
both. Saves what hybrid_opt.distributed.node derived and the cores this rank's worker got."""

import os

import common as C
import torch
import torch.distributed as dist

from hybrid_opt import HybridAdamW
from hybrid_opt.distributed import node
from hybrid_opt.testing import debug_view


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if name == "no_local_env":
        os.environ.pop("LOCAL_RANK", None)
    model = C.build_model()
    with HybridAdamW(
        model.parameters(), lr=C.LR, subgroup_numel=32, offload_fraction=1.0, process_group=dist.group.WORLD
    ) as opt:
        C.loss_fn(model, C.local_batch(C.batches(1)[0], rank, world)).backward()
        opt.step()
        info = node.info()
        return dict(
            local_rank=info.local_rank,
            local_world_size=info.local_world_size,
            worker_cores=sorted(os.sched_getaffinity(opt.worker_pid)),
            trainer_cores=sorted(os.sched_getaffinity(0)),
            steps=debug_view(opt).steps_taken,
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    C.rank_main(run)
