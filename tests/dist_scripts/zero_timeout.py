"""Rank script: process_group mode keeps the timeout the user gave its process group
(hybrid_opt/distributed/zero_group.py). argv[1]: the default group's timeout in seconds
(init_process_group(timeout=)).

- "long": an optimizer over a group of every rank made with a 2 h timeout — the bound of its
  own group and of each of its waits (saved: the seconds of each), and one step taken.
- "short": over the default group; rank 0 pauses 3 timeouts before its second backward, so
  rank 1's reduction waits for it: saved, the timeouts as above, and per rank the seconds from
  the start of that backward to the error (rank 1: the reduction's wait, at the timeout) and
  its message. Last: the groups have failed.
"""

import datetime
import sys
import time

import common as C
import torch
import torch.distributed as dist

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view

LONG = datetime.timedelta(hours=2)


def _timeouts(opt) -> dict:
    zero = debug_view(opt).sharding
    backend = zero.group._get_backend(torch.device("cpu"))
    wait = getattr(zero.comm, "timeout", None)  # None: no bound of the group's (a fixed one, before)
    return dict(
        group_s=backend.options._timeout.total_seconds(),
        wait_s=None if wait is None else wait.total_seconds(),
    )


def run(name: str, rank: int, world: int, timeout_s: float) -> dict:
    model = C.build_model()
    group = dist.new_group(ranks=list(range(world)), timeout=LONG) if name == "long" else dist.group.WORLD
    opt = HybridAdamW(model.parameters(), lr=C.LR, offload_fraction=0.0, process_group=group)
    out = dict(_timeouts(opt), error=None, message=None, seconds=None, steps=0)
    for i, x in enumerate(C.batches(2)):
        if name == "short" and i == 1 and rank == 0:
            time.sleep(3 * timeout_s)
        t0 = time.monotonic()
        try:
            C.loss_fn(model, C.local_batch(x, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            out["steps"] += 1
        except RuntimeError as e:
            out.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - t0)
            break
    opt.close()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    timeout_s = float(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    C.save_result({name: run(name, rank, world, timeout_s) for name in ("long", "short")})
    dist.destroy_process_group()
