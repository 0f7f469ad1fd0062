"""process_group mode's has-grad counts (zero.py): which params got a grad on some rank.

A param without a grad here gets the averaged grad (and is stepped) when another rank had one,
and keeps grad None when none had. On CUDA the counts are read lazily, all buckets' in one copy at
step(), so backward never waits on the device for them. Design notes: docs/internals.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_opt.distributed.local_shards import chunk_rows, zero_maps

if TYPE_CHECKING:
    from hybrid_opt.distributed.zero import Bucket

LAZY = None  # None: lazy on CUDA buckets only; True / False: always / never


@dataclass(eq=False)
class KeptCounts:
    """A completed bucket's has-grad counts kept on its device until step() reads them: the
    grads its reduction read, the params without one here (indices), the counts themselves."""

    bucket: Bucket
    grads: list
    missing: list
    counts: torch.Tensor


class GradCounts:
    """ZeroSharding's part (zero.py) for the has-grad counts: a direct bucket's own count
    buffers, the completed buckets whose counts are not read yet, and the delivery of each
    reduced param (its chunk mapped, the optimizer's hook run)."""

    def __init__(self, rank: int, world: int, reads, release):
        self._rank, self._world = rank, world
        self._reads = reads  # GradReads (zero_edits.py): a granted grad is what was reduced
        self._release = release  # GradRelease (zero_release.py): placeholders for release_grads
        self._on_reduced = None  # the optimizer's speculation hook (install)
        self._unread: dict = {}  # bucket index -> KeptCounts: not read yet (module docstring)
        self._direct: dict = {}  # bucket index -> a direct bucket's counts (2 · world), kept
        self._nbytes = 0
        self.count_reads = 0  # the reads of counts (stats["count_reads"]): each one a sync on CUDA

    def install(self, on_reduced) -> None:
        """`on_reduced(p)` runs once p's averaged chunk is in place."""
        self._on_reduced = on_reduced

    def _lazy(self, b) -> bool:
        return b.device.type == "cuda" if LAZY is None else bool(LAZY)

    def buffer(self, b) -> torch.Tensor:
        """A direct bucket's has-grad counts (2 · world, sent then received), kept: made on first use."""
        if b.index not in self._direct:
            counts = self._direct[b.index] = torch.zeros(2 * self._world, dtype=b.dtype, device=b.device)
            self._nbytes += counts.numel() * counts.element_size()
        return self._direct[b.index]

    def of(self, b):
        """b's count buffer (buffer()), or None where none was made."""
        return self._direct.get(b.index)

    def tensors(self) -> list:
        """The direct buckets' count buffers made so far (the comm figure, with comm_tensors)."""
        return list(self._direct.values())

    def nbytes(self) -> int:
        """The count buffers' bytes (stats["buffer_bytes"], with the comm window's slots)."""
        return self._nbytes

    def _counts(self, b, kind: str) -> torch.Tensor:
        """A completed reduction's has-grad counts, one per param of the bucket, on its device
        (not read: no sync): after the averaged chunks in b.buf (zero_reduce.py), or a direct
        bucket's own (all_to_all: every rank's, summed here)."""
        if b.direct and kind != "all_reduce":
            counts = self._direct[b.index]
            if kind == "all_to_all":
                return counts[self._world :].sum().reshape(1)
            return counts[self._world : self._world + 1].clone()
        return b.buf[b.width :].clone()

    def delivered(self, b, kind: str, grads: list) -> None:
        """A bucket's reduction is averaged into b.out: its params with a grad here get their
        chunk and the speculation hook; those without wait for their counts (module docstring)."""
        self._unread.pop(b.index, None)  # this reduction's counts replace an earlier one's
        missing = [
            k for k, p in enumerate(b.params) if grads[k] is None and p.grad is None and p.requires_grad
        ]
        if missing and self._lazy(b):
            self._unread[b.index] = KeptCounts(b, grads, missing, self._counts(b, kind))
            return self._deliver(b, grads, [k for k in range(len(b.params)) if k not in missing])
        if missing:
            self.count_reads += 1
            self._grant(b, grads, missing, self._counts(b, kind).tolist())
        self._deliver(b, grads, range(len(b.params)))

    def read(self) -> None:
        """step(): the kept counts of every bucket, read in one copy; the params another rank
        had a grad for get a zero p.grad whose chunk is the average, and are delivered."""
        if not self._unread:
            return
        kept, self._unread = list(self._unread.values()), {}
        values = torch.cat([c.counts.reshape(-1).to(torch.float64) for c in kept]).tolist()
        self.count_reads += 1
        at = 0
        for c in kept:
            n = c.counts.numel()
            self._grant(c.bucket, c.grads, c.missing, values[at : at + n])
            at += n
            self._deliver(c.bucket, c.grads, [k for k in c.missing if c.grads[k] is not None])

    def clear(self) -> None:
        """After step(): counts left unread (a step that failed before reading them) dropped."""
        self._unread.clear()

    def _grant(self, b, grads: list, missing: list, counts: list) -> None:
        for k in missing:
            p = b.params[k]
            if counts[k] > 0 and grads[k] is None and p.grad is None:
                # unused here, used on another rank: the averaged grad is this rank's too. A
                # grad made since by someone else (lazy counts are read in step(): a DDP wrapper
                # with find_unused_parameters writes its average into such a param at the end
                # of backward, a user may set one) is left to zero.py finish: adopted where it
                # holds that average, refused otherwise. release_grads: a placeholder, only the
                # chunk is read (zero_release.py)
                p.grad = self._release.placeholder(p) if self._release.enabled else torch.zeros_like(p)
                self._reads.note(p)
                grads[k] = p.grad

    def _deliver(self, b, grads: list, ks: list[int] | range) -> None:
        """Each param k in `ks` still holding the grad its reduction read: its averaged chunk
        mapped (distributed.local_of reads it), then the optimizer's speculation hook."""
        live = [k for k in ks if grads[k] is not None and b.params[k].grad is grads[k]]
        for k in live:
            if self._release.enabled:  # the full grad dropped, a placeholder read instead (zero_release.py)
                grads[k] = self._release.release(b.params[k])
            self.map_chunk(b, k, grads[k])
        if self._on_reduced is not None:
            for k in live:
                self._on_reduced(b.params[k])

    def map_chunk(self, b, k: int, grad) -> None:
        """`grad` of b's param k reads as its averaged chunk (distributed.local_of)."""
        p = b.params[k]
        a, n = b.offsets[k][self._rank], b.numels[k][self._rank]
        rows_a, rows_b = chunk_rows(p.shape[0], self._rank, self._world)
        zero_maps()[1][grad] = b.out[a : a + n].view((rows_b - rows_a,) + tuple(p.shape[1:]))
