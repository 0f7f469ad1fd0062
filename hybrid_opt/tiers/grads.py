"""A subgroup's grads as the host tier reads them: `GradGatherer` copies them into a staging
slot, or names their memory for the worker to read itself.

Remote gather: the worker reads a piece's grads straight from the trainer's memory
(process_vm_readv, the gather list of its task) instead of the trainer staging them, so
speculation costs backward no copy. HYBRID_OPT_REMOTE_GATHER=0 turns it off; a kernel that
forbids it (Yama ptrace scope 2-3, seccomp) is found by `probe` at start, and the trainer
stages grads itself. host_io.py decides per piece (only while the worker has little queued)
and hands the piece's gather list to the worker with its task (HostIO._remote_segments).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_opt.tiers.staging import copy_async
from hybrid_opt.worker import protocol as proto

if TYPE_CHECKING:
    from hybrid_opt.state.layout import Subgroup


@dataclass(eq=False)  # compared by identity, as any object
class GradGatherer:
    """Writes a subgroup's grads [offset, offset + numel) into a staging buffer; params without
    a grad contribute zeros (their elements are outside every run, so never stepped). CUDA
    grads are copied non-blocking, on the host tier's side stream (tiers/staging.py).

    `grads`: per slice of `sg`, the memory holding this rank's elements of its param's grad
    (distributed.local_of, resolved once by whoever names the grads: speculation.py), or None
    where the param has no grad."""

    sg: Subgroup
    grads: list

    def overlaps(self, offset: int, numel: int):
        """(slice, a, b) for each slice overlapping [offset, offset + numel), [a, b) in
        subgroup elements."""
        for sl, a, b, _ in self._overlapping(offset, numel):
            yield sl, a, b

    def _overlapping(self, offset: int, numel: int) -> list:
        """[(slice, a, b, its grad's local memory or None)], as overlaps(). It runs once per piece
        per step for every param: a list, not a generator, and a piece that is the whole subgroup
        takes every slice whole."""
        pairs = zip(self.sg.slices, self.grads)
        if offset == 0 and numel == self.sg.numel:
            return [(sl, sl.sub_offset, sl.sub_offset + sl.numel, g) for sl, g in pairs]
        end = offset + numel
        spans = [(sl, max(offset, sl.sub_offset), min(end, sl.sub_offset + sl.numel), g) for sl, g in pairs]
        return [span for span in spans if span[1] < span[2]]

    def cuda_device(self):
        """The CUDA device of this subgroup's grads, or None (CPU grads: staged synchronously)."""
        for g in self.grads:
            if g is not None and g.is_cuda:
                return g.device
        return None

    def __call__(self, dst: torch.Tensor, offset: int, numel: int, non_blocking: bool = False) -> None:
        for sl, a, b, g in self._overlapping(offset, numel):
            if g is None:
                dst[a - offset : b - offset].zero_()
                continue
            start = sl.param_offset - sl.sub_offset  # subgroup element -> grad element
            src = g.reshape(-1)[start + a : start + b]
            if non_blocking:  # on the side stream; the grad's memory is kept until the copy ran
                copy_async(dst[a - offset : b - offset], src)
            else:
                dst[a - offset : b - offset].copy_(src, non_blocking=False)

    def segments(self, offset: int, numel: int, dtype):
        """Remote gather: [(element offset in the piece, address, elements)] (address 0: zeros)
        and the grad tensors to keep alive, for the worker to read itself; None when a grad
        is on a GPU, non-contiguous or of another dtype (then __call__ stages it here)."""
        entries, keep = [], []
        size = dtype.itemsize
        for sl, a, b, g in self._overlapping(offset, numel):
            if g is None:
                entries.append((a - offset, 0, b - a))
                continue
            if g.dtype is not dtype or g.is_cuda or not g.is_contiguous():
                return None
            start = sl.param_offset - sl.sub_offset  # subgroup element -> grad element
            entries.append((a - offset, g.data_ptr() + (start + a) * size, b - a))
            keep.append(g)
        return entries, keep


def probe(send_and_wait, slot_view: torch.Tensor, slot: int) -> bool:
    """Whether the worker copies a probe from this process's memory into staging slot `slot`
    (`slot_view`: its memory) — a ping with a gather list; send_and_wait(task, gather) -> its
    Result."""
    if os.environ.get("HYBRID_OPT_REMOTE_GATHER", "1") == "0":
        return False
    probe_t = torch.arange(1, 65, dtype=torch.float32)
    dst = slot_view.view(torch.uint8)[: probe_t.numel() * 4]
    dst.zero_()
    task = proto.Task(proto.OP_PING, 0, slot=slot)
    try:
        r = send_and_wait(task, [(0, probe_t.data_ptr(), probe_t.numel() * 4)])
    except Exception:
        return False
    ok = r.status == proto.STATUS_OK and torch.equal(dst.view(torch.float32), probe_t)
    dst.zero_()
    return ok
