"""process_group mode's collective buffers (zero.py): a bounded window of slots that the
reductions (packed input and output) and the gathers (staging) borrow, each slot given back
as its bucket completes — reduced and averaged, or landed — so the comm memory covers the
buckets in flight, not the whole model.

Before (#21) every bucket kept its own for the optimizer's life: the packed grads, the
reduction's output and the gather staging, about one fp32 model each (292 MiB per rank of the
23.1M-param bench GPT at 2 gloo ranks, with this rank's averaged chunks). Now a slot holds
the largest need of any bucket of its (dtype, device) — a reduction's input + output, which
is more than a gather's staging — and there are WINDOW slots per (dtype, device), or as many
as fit in WINDOW_FLOOR_BYTES where buckets are small (a window of a few MiB saves nothing
and would cost overlap), never more than there are buckets; all made at the key's first use
(zeroed once: no first touch per step). A bucket that finds no slot free completes the
oldest holder first: the oldest pending reduction is waited and averaged, the oldest pending
gather landed — bounded waits on collectives this rank has issued already, which every rank
issues in the same order (zero.py), so no rank waits on one that another has not issued.

What stays per bucket: its averaged chunks (`out`: this rank's grads for the step, 1/world of
the model, read by the step as the grads) and a direct bucket's has-grad counts (2·world).
"""
from __future__ import annotations

import torch

WINDOW = 2                      # slots per (dtype, device): buckets in flight at once
WINDOW_FLOOR_BYTES = 8 << 20    # ... or as many as fit in this, for small buckets


class SlotPool:
    """Flat buffers of one size per (dtype, device) key, made all at once on first use."""

    def __init__(self, numels: dict, counts: dict):
        self.numels, self.counts = numels, counts  # key -> elements per slot, slots
        self.free: dict = {}                       # key -> [slot], made and not borrowed
        self.made: dict = {}                       # key -> [slot]

    def take(self, key):
        """A free slot of `key`, or None when every one is borrowed."""
        if key not in self.made:
            dtype, device = key
            self.made[key] = [torch.zeros(self.numels[key], dtype=dtype, device=device)
                              for _ in range(self.counts[key])]
            self.free[key] = list(self.made[key])
        return self.free[key].pop() if self.free[key] else None

    def give(self, key, slot, lost: bool = False) -> None:
        """`slot` back to the pool; `lost`: a collective that failed may still write it, so it
        is dropped and a new one made in its place."""
        if lost:
            i = next(i for i, t in enumerate(self.made[key]) if t is slot)
            slot = self.made[key][i] = torch.zeros_like(slot)
        self.free[key].append(slot)

    def tensors(self) -> list:
        return [t for ts in self.made.values() for t in ts]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class CommWindow:
    """ZeroSharding's side (a mixin): the slots its buckets borrow and give back."""

    def _reduce_numels(self, b) -> tuple:
        """(input, output) elements of b's reduction: every rank's segment in; all_to_all gets
        every rank's segment for this rank, reduce_scatter one, all_reduce works in place."""
        out = {"all_to_all": self.world * b.seg, "reduce_scatter": b.seg}.get(self._kind, 0)
        return self.world * b.seg, out

    def _init_window(self) -> None:
        numels, buckets = {}, {}
        for b in self.buckets:
            key = (b.dtype, b.device)
            # a gather's staging (world · width) fits in a reduction's input (world · seg)
            numels[key] = max(numels.get(key, 0), sum(self._reduce_numels(b)))
            buckets[key] = buckets.get(key, 0) + 1
        counts = {}
        for key, n in numels.items():
            fit = WINDOW_FLOOR_BYTES // max(1, n * key[0].itemsize)
            counts[key] = min(buckets[key], max(1, WINDOW, fit))
        self._pool = SlotPool(numels, counts)
        self._holders: list = []  # [(what, bucket, slot)] in the order borrowed: "reduce" / "gather"

    def _borrow(self, b, what: str) -> torch.Tensor:
        """A slot for b's reduction or gather; none free: the oldest holder completes first."""
        key = (b.dtype, b.device)
        slot = self._pool.take(key)
        while slot is None:
            self._complete_oldest(key)
            slot = self._pool.take(key)
        self._holders.append((what, b, slot))
        self.stats["buffer_bytes"] = self._pool.nbytes() + self._counts_bytes
        return slot

    def _give_back(self, b, what: str, lost: bool = False) -> None:
        for i, (w, hb, slot) in enumerate(self._holders):
            if w == what and hb is b:
                del self._holders[i]
                self._pool.give((b.dtype, b.device), slot, lost)
                if what == "reduce":
                    b.red = b.scratch = None
                else:
                    b.staging = None
                return

    def _complete_oldest(self, key) -> None:
        for what, b, _ in self._holders:
            if (b.dtype, b.device) == key:
                if what == "reduce":
                    self.poll(wait=True, until=b)
                else:
                    self._land(b)
                return
        raise RuntimeError("process_group: no comm slot free and none borrowed (a slot per "
                           "(dtype, device) is made for every bucket key)")

    def _reduce_slot(self, b) -> None:
        """b.red / b.scratch: views of a borrowed slot while its reduction is in flight."""
        slot = self._borrow(b, "reduce")
        n_in, n_out = self._reduce_numels(b)
        b.red, b.scratch = slot[:n_in], slot[n_in:n_in + n_out]

    def comm_tensors(self) -> list:
        """Every tensor of the comm figure (allocated.py): the slots, each bucket's averaged
        chunks and counts."""
        return self._pool.tensors() + [t for b in self.buckets for t in (b.out, b.counts)]
