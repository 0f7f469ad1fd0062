"""process_group mode's collective buffers (zero.py): a bounded window of slots that the reductions
and the gathers borrow, each given back as its bucket completes.

The comm memory covers the buckets in flight, not the whole model. A bucket that finds no slot free
completes the oldest holder first: a bounded wait on a collective every rank has already issued in
the same order. Design notes: docs/internals.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_opt.distributed.zero_reduce import reduce_numels

if TYPE_CHECKING:
    from hybrid_opt.distributed.zero import Bucket

WINDOW = 2  # slots per (dtype, device): buckets in flight at once
WINDOW_FLOOR_BYTES = 4 << 20  # ... or as many as fit in this, for small buckets


class SlotPool:
    """Flat buffers of one size per (dtype, device) key, made all at once on first use, and at
    most `counts[key]` borrowed at a time. A need larger than the slot (a gather staged for a
    bucket of one large param, zeros for a one-param bucket without a grad here) gets a tensor
    of its own, dropped when given back; it counts against the same bound, and against WINDOW
    at most, so the window stays bounded."""

    def __init__(self, numels: dict, counts: dict):
        self.numels, self.counts = numels, counts  # key -> elements per slot, slots
        self.free: dict = {}  # key -> [slot], made and not borrowed
        self.made: dict = {}  # key -> [slot]
        self.held: dict = dict.fromkeys(counts, 0)  # key -> borrowed now (slots and own tensors)
        self.own: dict = {}  # id -> a tensor of its own, while borrowed

    def take(self, key, numel: int):
        """A free buffer of `key` of at least `numel` elements, or None when the bound is reached."""
        dtype, device = key
        if key not in self.made:
            self.made[key] = [
                torch.zeros(self.numels[key], dtype=dtype, device=device) for _ in range(self.counts[key])
            ]
            self.free[key] = list(self.made[key])
        fits = numel <= self.numels[key]
        if self.held[key] >= (self.counts[key] if fits else min(self.counts[key], WINDOW)):
            return None
        self.held[key] += 1
        if fits:
            return self.free[key].pop()
        t = torch.empty(numel, dtype=dtype, device=device)
        self.own[id(t)] = t
        return t

    def give(self, key, slot, lost: bool = False) -> None:
        """`slot` back to the pool; `lost`: a collective that failed may still write it, so it
        is dropped and a new one made in its place."""
        self.held[key] -= 1
        if self.own.pop(id(slot), None) is not None:
            return
        if lost:
            i = next(i for i, t in enumerate(self.made[key]) if t is slot)
            slot = self.made[key][i] = torch.zeros_like(slot)
        self.free[key].append(slot)

    def tensors(self) -> list:
        return [t for ts in self.made.values() for t in ts] + list(self.own.values())

    def nbytes(self) -> int:
        """The slots' bytes (made once; tensors of their own come and go)."""
        return sum(t.numel() * t.element_size() for ts in self.made.values() for t in ts)


@dataclass(eq=False)
class Holder:
    """A slot borrowed: for what ("reduce" or "gather"), by which bucket."""

    what: str
    bucket: Bucket
    slot: torch.Tensor


class CommWindow:
    """ZeroSharding's part (zero.py) for the slots its buckets' reductions and gathers borrow
    and give back (module docstring): the pool, and who holds which slot, oldest first."""

    def __init__(self, buckets: list, comm):
        self._comm = comm  # Collectives (zero_group.py): the kind and world a slot is sized by
        numels: dict = {}
        per_key: dict = {}
        for b in buckets:
            key = (b.dtype, b.device)
            numels[key] = max(numels.get(key, 0), self.slot_numel(b))
            per_key[key] = per_key.get(key, 0) + 1
        counts = {}
        for key, n in numels.items():
            fit = WINDOW_FLOOR_BYTES // max(1, n * key[0].itemsize)
            counts[key] = min(per_key[key], max(1, WINDOW, fit))
        self._pool = SlotPool(numels, counts)
        self._holders: list = []  # [Holder] in the order borrowed
        # what completes the oldest holder of each kind, to free its slot (completes_with)
        self._complete: dict = dict.fromkeys(("reduce", "gather"))

    def completes_with(self, reduce, gather) -> None:
        """`reduce(b)` completes b's pending reduction (and every earlier one), `gather(b)`
        lands b's pending gather: how a borrow that finds no slot free frees the oldest. Set
        once, by ZeroSharding, when the parts that borrow are made."""
        self._complete = {"reduce": reduce, "gather": gather}

    def slot_numel(self, b) -> int:
        """Elements a slot needs for b: what its reduction sends (and, from 3 ranks on under
        all_to_all, receives: zero_reduce.py), or its gather's staging where that is staged
        even when step() waits (several params: zero_gather.py) — the larger."""
        staged = len(b.params) > 1 or (self._comm.kind == "reduce_scatter" and not b.direct)
        return max(sum(reduce_numels(b, self._comm)), self._comm.world * b.width if staged else 0)

    def borrow(self, b, what: str, numel: int) -> torch.Tensor:
        """`numel` elements of a slot for b's reduction or gather; none free: the oldest holder
        completes first."""
        key = (b.dtype, b.device)
        slot = self._pool.take(key, numel)
        while slot is None:
            self._complete_oldest(key)
            slot = self._pool.take(key, numel)
        self._holders.append(Holder(what, b, slot))
        return slot[:numel]

    def release(self, b, what: str, lost: bool = False) -> None:
        """b's slot for `what` back (none held: nothing to do); `lost`: SlotPool.give."""
        for i, h in enumerate(self._holders):
            if h.what == what and h.bucket is b:
                del self._holders[i]
                self._pool.give((b.dtype, b.device), h.slot, lost)
                return

    def _complete_oldest(self, key) -> None:
        for h in self._holders:
            if (h.bucket.dtype, h.bucket.device) == key:
                self._complete[h.what](h.bucket)
                return
        raise RuntimeError(
            "process_group: no comm slot free and none borrowed (a slot per "
            "(dtype, device) is made for every bucket key)"
        )

    def holders(self, what: str) -> list:
        """The buckets holding a slot for `what` ("reduce" or "gather") now, oldest first
        (tests: no reduction keeps one once averaged; overlapped gathers keep at most WINDOW)."""
        return [h.bucket for h in self._holders if h.what == what]

    def slot_counts(self) -> dict:
        """(dtype, device) -> the slots of that key (tests: the window's size)."""
        return dict(self._pool.counts)

    def nbytes(self) -> int:
        """The slots' bytes (stats["buffer_bytes"], with the count buffers)."""
        return self._pool.nbytes()

    def tensors(self) -> list:
        """The slots, and tensors of their own while borrowed (comm_tensors)."""
        return self._pool.tensors()
