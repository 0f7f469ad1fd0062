"""process_group mode's collectives (zero.py): the group ours run on, this rank of the world, the
collective kind that carries a bucket, and the bounded wait on each.

Invariant: every part of ZeroSharding issues collectives through one `Collectives`, so a fallback
(all_reduce where reduce_scatter is missing) is the same for every part and every rank. Each wait is
bounded by the timeout of the process group the user gave."""

from __future__ import annotations

import datetime
import warnings


def group_timeout(dist, group, device_type: str) -> datetime.timedelta:
    """The timeout `group`'s backend for `device_type` was made with. torch (2.13) has no public
    getter; its own DeviceMesh reads the backend options' `_timeout` (device_mesh.py), as here.
    A backend without options (a third-party one) has torch's default for its kind, which is
    what its group was given unless the user passed one: that default."""
    import torch

    try:
        timeout = group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    if not isinstance(timeout, datetime.timedelta):
        timeout = dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
    return timeout


def wait_collective(work, what: str, timeout: datetime.timedelta, cuda: bool = False) -> None:
    """A collective's completion, bounded by `timeout` (the group's: group_timeout). On CUDA the
    current stream waits for it and the host does not (NCCL's wait with a timeout blocks the
    CPU until the collective is done); the bound is then NCCL's watchdog, at the group's timeout
    too (TORCH_NCCL_ASYNC_ERROR_HANDLING ends the process)."""
    bound = f"the process group's timeout ({timeout.total_seconds():.0f} s)"
    try:
        ok = work.wait() if cuda else work.wait(timeout=timeout)
    except RuntimeError as e:
        raise RuntimeError(
            f"process_group: {what} did not complete within {bound} or "
            f"failed ({e}): a peer rank died or stopped stepping; every rank "
            f"must call backward() and step() alike"
        ) from e
    if ok is False:
        raise RuntimeError(
            f"process_group: {what} did not complete within {bound}: a peer rank died or stopped stepping"
        )


class Collectives:
    """torch.distributed over our own group: `rank` of `world`, `kind` the collectives that
    carry a bucket ("all_to_all", "reduce_scatter" or "all_reduce": zero.py COLLECTIVES),
    `timeout` the bound on each wait (the user's group's: group_timeout)."""

    def __init__(self, dist, group, rank: int, world: int, kind: str, timeout: datetime.timedelta):
        self.dist, self.group = dist, group
        self.rank, self.world = rank, world
        self.kind = kind
        self.timeout = timeout

    def wait(self, work, what: str, cuda: bool = False) -> None:
        wait_collective(work, what, self.timeout, cuda)

    def all_to_all(self, out, inp, seg: int) -> list:
        """Each other rank's `seg` elements of `inp` sent to it, theirs received into `out`."""
        if self.world == 1:
            return []
        splits = [0 if r == self.rank else seg for r in range(self.world)]
        return [self.dist.all_to_all_single(out, inp, splits, splits, group=self.group, async_op=True)]

    def reduce_scatter(self):
        """The reduce-scatter function: reduce_scatter_single is the newer name (torch 2.13
        deprecates _tensor)."""
        return getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor

    def fall_back(self, e: Exception) -> None:
        """The backend has no reduce_scatter_tensor: all_reduce from now on (the same backend
        on every rank, so every rank falls back at the same bucket)."""
        self.kind = "all_reduce"
        warnings.warn(
            f"process_group: the {self.dist.get_backend(self.group)} backend has no "
            f"reduce_scatter_tensor ({e}); each bucket is all-reduced instead (every "
            f"rank keeps its chunk: twice the traffic)",
            stacklevel=4,
        )
