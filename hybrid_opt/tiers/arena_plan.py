"""The host tier's shared arena, laid out before anything is allocated: one function that HostTier
builds its arena from and that the budgets count, so a placement is checked against the bytes the
OS will report, not an estimate.

    | committed banks | spare banks | 2 io banks per nvme read | [copy slots] | staging slots |

Every bank has the largest subgroup's capacity, so any bank serves any subgroup. A tier of q8
moments with exact rollback keeps the model-dtype copies (written by a step, read once by its
commit into the model's param; with remainders the masters' high halves) in copy slots, one per
spare and io bank, not in every bank: a committed bank's copy is the model's param already
(BankPool.copy_of); a step of a remainder subgroup reads its high half from there (fill_high)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_opt.shm import PAGE, ArenaLayout, align_up
from hybrid_opt.state.state_format import Q8_BLOCK
from hybrid_opt.tiers.compressed import bank_layout

_ALIGN_ELEMS = 64  # bank capacity and slot sizes in whole cache lines of fp32
DEFAULT_SLOT_NUMEL = 1 << 20
STAGING_SLOTS = 8  # default staging slots (two 4Mi subgroups of 1Mi pieces)
MAX_STAGING_SLOTS = 32  # staging_slots_for(): at most 128 MB of fp32 grads


def _slot_numel(numels: list, slot_numel: int | None, quantized: bool = False) -> int:
    """Elements per staging slot: `slot_numel` (default 1Mi: 4 MB of fp32 grads — a task that
    long costs the worker ~1 ms, its messaging overhead ~50 us; larger only costs memory),
    at most the largest subgroup, in whole cache lines — in whole q8 blocks where a subgroup is
    `quantized`, so every piece of it starts on a block."""
    align = Q8_BLOCK if quantized else _ALIGN_ELEMS
    return align_up(min(slot_numel or DEFAULT_SLOT_NUMEL, align_up(max(numels), align)), align)


def staging_slots_for(
    bursts: list, numels: list, slot_numel: int | None = None, quantized: bool = False
) -> int:
    """Staging slots for a host tier whose subgroups become ready in `bursts` (lists of
    subgroup indices into `numels` that one grad hook completes together: a parameter that
    spans several subgroups completes them all at once). A speculated step takes all its
    slots when it is launched, and backward never waits for the worker, so a burst larger
    than the free slots is deferred to the next hook — the worker idles meanwhile. Enough
    slots for the two largest bursts (one may arrive while the worker still holds the slots
    of the one before), within [STAGING_SLOTS, MAX_STAGING_SLOTS]."""
    slot = _slot_numel(numels, slot_numel, quantized)
    sizes = sorted(sum(-(-numels[i] // slot) for i in b) for b in bursts)
    return max(STAGING_SLOTS, min(MAX_STAGING_SLOTS, sum(sizes[-2:])))


@dataclass(frozen=True)
class ArenaPlan:
    capacity: int  # elements per bank
    slot_numel: int  # elements per staging slot
    regions: dict  # {region: byte offset inside a bank} (compressed.bank_layout)
    io_bytes: int  # a bank's state block: what a swap moves
    bank_stride: int
    resident: list  # the subgroups (their ids: plan_arena's `ids`) with a committed bank
    spares: int
    io_banks: int  # nvme reads in flight (two banks each)
    slot_stride: int
    staging_slots: int
    bank_offset: int
    slot_offset: int
    nbytes: int  # the arena's size (page-aligned, as SharedArena truncates it)
    copy_offset: int = 0  # the copy slots (regions["copy"] == -1), one per spare and io bank
    copy_stride: int = 0

    @property
    def copy_slots(self) -> bool:
        return self.regions["copy"] == -1

    @property
    def n_banks(self) -> int:
        return len(self.resident) + self.spares + 2 * self.io_banks

    @property
    def bank_bytes(self) -> int:
        return self.bank_stride * len(self.resident)

    @property
    def spare_bytes(self) -> int:
        """The spare and io banks, and their copy slots."""
        return (self.bank_stride + self.copy_stride) * (self.spares + 2 * self.io_banks)

    @property
    def staging_bytes(self) -> int:
        return self.slot_stride * self.staging_slots


def plan_arena(
    numels: list,
    nvme: list,
    *,
    fmt,
    amsgrad: bool,
    copy_dtype,
    remainders: list,
    grad_dtype,
    rollback: str,
    spare_banks: int | None,
    io_banks: int,
    staging_slots: int,
    slot_numel: int | None,
    quantized: list | None = None,
    ids: list | None = None,
) -> ArenaPlan:
    """The arena of a host tier of subgroups `numels` (`nvme`, `remainders`, `quantized`: a flag
    each: on nvme, keeping its master as remainders, keeping q8 moments) — HostTier's
    arguments, checked by it. `ids`: the subgroups' ids, in numels' order (default 0..n-1):
    `resident` names them so."""
    rem_mode = ("all" if all(remainders) else "some") if any(remainders) else "none"
    quantized = list(quantized or [False] * len(numels))
    q8_mode = ("all" if all(quantized) else "some") if any(quantized) and fmt.quantized_moments else "none"
    if q8_mode == "none":
        fmt = fmt.unquantized()
    ids = list(range(len(numels))) if ids is None else list(ids)
    resident = [ids[k] for k in range(len(numels)) if not nvme[k]]
    spares = (
        (len(resident) if spare_banks is None else spare_banks) if rollback == "exact" and resident else 0
    )
    io = io_banks if any(nvme) else 0
    capacity = align_up(max(numels), _ALIGN_ELEMS)
    slot = _slot_numel(numels, slot_numel, q8_mode != "none")
    # the largest subgroup of small params (fp32 in place of q8 moments): it sizes the moment
    # regions only where it outgrows the codes of the largest quantized one (bank_layout)
    small = [n for n, q in zip(numels, quantized) if not q]
    small_capacity = align_up(max(small), _ALIGN_ELEMS) if small else 0
    pooled = q8_mode != "none" and rollback == "exact" and copy_dtype is not None and spares + 2 * io > 0
    regions, io_bytes, bank_stride = bank_layout(
        capacity, fmt, amsgrad, copy_dtype, rem_mode, q8_mode, small_capacity, pooled_copy=pooled
    )
    copy_stride = align_up(capacity * 2, PAGE) if pooled else 0
    slot_stride = align_up(slot * torch.empty((), dtype=grad_dtype).element_size(), PAGE)
    arena = ArenaLayout()
    bank_offset = arena.add("banks", bank_stride * (len(resident) + spares + 2 * io), PAGE)
    copy_offset = arena.add("copies", copy_stride * (spares + 2 * io), PAGE) if pooled else 0
    slot_offset = arena.add("slots", slot_stride * staging_slots, PAGE)
    return ArenaPlan(
        capacity,
        slot,
        regions,
        io_bytes,
        bank_stride,
        resident,
        spares,
        io,
        slot_stride,
        staging_slots,
        bank_offset,
        slot_offset,
        align_up(max(arena.nbytes, 1), PAGE),
        copy_offset,
        copy_stride,
    )
