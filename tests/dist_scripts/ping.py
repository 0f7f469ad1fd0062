"""Rank script: the smallest launch — one all_reduce of the ranks' numbers, saved (for the
harness's own tests: ports, several launches at once)."""

import common as C
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
C.save_result(dict(rank=dist.get_rank(), world=dist.get_world_size(), total=float(t)))
dist.destroy_process_group()
