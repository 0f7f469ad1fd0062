"""process_group mode's collectives record (zero.py): the group our collectives run on, this
rank of the world, which collectives carry a bucket (the kind, fixed per backend, and the same
on every rank), and the bounded wait on each. Every part of ZeroSharding issues its
collectives through one Collectives: the kind one part falls back to (all_reduce, where a
backend turns out to lack reduce_scatter_tensor) is the one every part then uses."""
from __future__ import annotations

import datetime
import warnings

WAIT_S = 300.0              # bound on each wait for a collective (a peer rank that died)


def wait_collective(work, what: str, cuda: bool = False) -> None:
    """A collective's completion, bounded. On CUDA the current stream waits for it and the
    host does not (NCCL's wait with a timeout blocks the CPU until the collective is done);
    the bound is then the process group's own timeout (NCCL's watchdog)."""
    # on CUDA WAIT_S bounds nothing: a hang ends at the group's timeout (init_process_group
    # (timeout=)), where NCCL's watchdog ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING)
    bound = "the process group's timeout" if cuda else f"{WAIT_S:.0f} s"
    try:
        ok = work.wait() if cuda else work.wait(timeout=datetime.timedelta(seconds=WAIT_S))
    except RuntimeError as e:
        raise RuntimeError(f"process_group: {what} did not complete within {bound} or "
                           f"failed ({e}): a peer rank died or stopped stepping; every rank "
                           f"must call backward() and step() alike") from e
    if ok is False:
        raise RuntimeError(f"process_group: {what} did not complete within {bound}: a "
                           f"peer rank died or stopped stepping")


class Collectives:
    """torch.distributed over our own group: `rank` of `world`, `kind` the collectives that
    carry a bucket ("all_to_all", "reduce_scatter" or "all_reduce": zero.py COLLECTIVES)."""

    def __init__(self, dist, group, rank: int, world: int, kind: str):
        self.dist, self.group = dist, group
        self.rank, self.world = rank, world
        self.kind = kind

    def wait(self, work, what: str, cuda: bool = False) -> None:
        wait_collective(work, what, cuda)

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
        warnings.warn(f"process_group: the {self.dist.get_backend(self.group)} backend has no "
                      f"reduce_scatter_tensor ({e}); each bucket is all-reduced instead (every "
                      f"rank keeps its chunk: twice the traffic)", stacklevel=4)
