"""The host tier's shared arena, laid out before anything is allocated: one function that
HostTier builds its arena from and that the budgets count, so that what a placement is
checked against is the bytes the OS will report (`os.fstat` on the arena's descriptor, which
`opt.allocated_bytes["host"]` reads), not an estimate from element counts.

    | committed banks (one per resident subgroup) | spare banks | 2 io banks per nvme read |
    | staging slots |

Every bank has the largest subgroup's capacity (any bank serves any subgroup: a spare becomes
a committed bank at a commit); packed subgroups (layout.py) make all but one per bucket that
size. Each bank is laid out by tiers/compressed.bank_layout; the arena is page-aligned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_opt.shm import PAGE, ArenaLayout, align_up
from hybrid_opt.tiers.compressed import bank_layout
from hybrid_opt.tiers.host_io import _ALIGN_ELEMS, _slot_numel


@dataclass(frozen=True)
class ArenaPlan:
    capacity: int           # elements per bank
    slot_numel: int         # elements per staging slot
    regions: dict           # {region: byte offset inside a bank} (compressed.bank_layout)
    io_bytes: int           # a bank's state block: what a swap moves
    bank_stride: int
    resident: list          # the subgroups (indices into numels) with a committed bank
    spares: int
    io_banks: int           # nvme reads in flight (two banks each)
    slot_stride: int
    staging_slots: int
    bank_offset: int
    slot_offset: int
    nbytes: int             # the arena's size (page-aligned, as SharedArena truncates it)

    @property
    def n_banks(self) -> int:
        return len(self.resident) + self.spares + 2 * self.io_banks

    @property
    def bank_bytes(self) -> int:
        return self.bank_stride * len(self.resident)

    @property
    def spare_bytes(self) -> int:
        return self.bank_stride * (self.spares + 2 * self.io_banks)

    @property
    def staging_bytes(self) -> int:
        return self.slot_stride * self.staging_slots


def plan_arena(numels: list, nvme: list, *, fmt, amsgrad: bool, copy_dtype, remainders: list,
               grad_dtype, rollback: str, spare_banks: int | None, io_banks: int,
               staging_slots: int, slot_numel: int | None) -> ArenaPlan:
    """The arena of a host tier of subgroups `numels` (`nvme`, `remainders`: a flag each:
    on nvme, keeping its master as remainders) — HostTier's arguments, checked by it."""
    rem_mode = ("all" if all(remainders) else "some") if any(remainders) else "none"
    resident = [i for i in range(len(numels)) if not nvme[i]]
    spares = (len(resident) if spare_banks is None else spare_banks) if rollback == "exact" and resident else 0
    io = io_banks if any(nvme) else 0
    capacity = align_up(max(numels), _ALIGN_ELEMS)
    slot = _slot_numel(numels, slot_numel)
    regions, io_bytes, bank_stride = bank_layout(capacity, fmt, amsgrad, copy_dtype, rem_mode)
    slot_stride = align_up(slot * torch.empty((), dtype=grad_dtype).element_size(), PAGE)
    arena = ArenaLayout()
    bank_offset = arena.add("banks", bank_stride * (len(resident) + spares + 2 * io), PAGE)
    slot_offset = arena.add("slots", slot_stride * staging_slots, PAGE)
    return ArenaPlan(capacity, slot, regions, io_bytes, bank_stride, resident, spares, io, slot_stride,
                     staging_slots, bank_offset, slot_offset, align_up(max(arena.nbytes, 1), PAGE))
