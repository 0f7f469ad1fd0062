"""Rank script that never finishes: builds a HybridAdamW (its worker runs), writes the
worker's pid, then blocks — for the harness's deadline test."""

import os
import time

import torch
import torch.distributed as dist

from hybrid_opt import HybridAdamW

dist.init_process_group("gloo")
opt = HybridAdamW([torch.nn.Parameter(torch.zeros(64))], offload_fraction=1.0)
with open(os.path.join(os.environ["DIST_OUT"], f"worker{dist.get_rank()}.pid"), "w") as f:
    f.write(str(opt.worker_pid))
print(f"rank {dist.get_rank()} blocking", flush=True)
time.sleep(3600)
