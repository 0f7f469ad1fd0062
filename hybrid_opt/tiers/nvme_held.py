"""nvme state held in memory between steps: the banks that hold a subgroup's committed state while
its file slot is read ahead of its next step (`read_ahead`) or written behind its last one
(write-behind). `NvmeHeld` owns both; HostStepping takes a held state into a step (`take`) and
hands over each committed step's write (`hold_write`). docs/internals.md, "Writes behind the step".

A write behind a step: the bank the step wrote holds the committed state while the worker
writes it to the file's other slot. The slot map flips when the write lands (`settle`); until
then state() reads the bank (`written_bank`), and the next step reads it as a read already done.
A write that failed is sent again at the next settle; its state stays committed in its bank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hybrid_opt.tiers.host_io import _Piece
from hybrid_opt.worker import protocol as proto
from hybrid_opt.worker.client import WorkerError

if TYPE_CHECKING:
    from hybrid_opt.tiers.nvme_files import FileSlots


def swap_piece(op: int, sg: int, bank: int, file_slot: int, crc: int = 0) -> _Piece:
    """A read (OP_SWAP_IN) or write (OP_SWAP_OUT) of one file slot through one bank."""
    task = proto.Task(op, 0, sg, in_bank=bank, file_slot=file_slot, crc=crc)
    # no staging slot; a write is settled by its owner (NvmeHeld.settle), whatever wait collects it
    return _Piece(sg, 0, 0, -1, task, freed=True, quiet=op == proto.OP_SWAP_OUT)


@dataclass
class HeldRead:
    """A bank with a subgroup's committed state in it, or being read into it by `piece` (None:
    the state is there already, a settled write's bank)."""

    bank: int
    piece: _Piece | None


@dataclass
class _HeldWrite:
    """A committed step's write, landing behind it: `bank` holds the committed state until the
    write (`piece`, whose result has the CRC32C) lands in `file_slot`."""

    bank: int
    file_slot: int
    piece: _Piece

    def landed(self) -> bool:
        r = self.piece.result
        return r is not None and r.status == proto.STATUS_OK

    def in_flight(self) -> bool:
        return self.piece.result is None


class NvmeHeld:
    """The reads ahead of the nvme subgroups' next steps and the writes behind their last ones,
    each holding one bank of the tier's pool. Works through the pool, the FileSlots (the slot
    map, flipped as a write lands) and HostIO (the worker). Every wait is HostIO's, bounded."""

    def __init__(self, io, pool, files: FileSlots, nvme: dict):
        self._io, self._pool, self._files = io, pool, files
        self.nvme = dict(nvme)  # by subgroup id (HostTier's)
        self._reads: dict[int, HeldRead] = {}
        self._writes: dict[int, _HeldWrite] = {}

    def forget_all(self) -> None:
        """The tier closes: every read and write is forgotten."""
        self._reads.clear()
        self._writes.clear()

    # ------------------------------------------------------------------ writes behind
    def hold_write(self, sg: int, bank: int, file_slot: int, piece: _Piece) -> None:
        """`sg`'s step committed: `bank` holds its state while `piece` writes `file_slot`."""
        self._writes[sg] = _HeldWrite(bank, file_slot, piece)

    @property
    def writes_behind(self) -> list:
        """The nvme subgroups committed while their write may still be landing (a copy)."""
        return list(self._writes)

    def written_bank(self, sg: int) -> int | None:
        """The bank that holds `sg`'s committed state while the write behind its last step is
        landing (or failed); None when its committed slot holds it."""
        w = self._writes.get(sg)
        return None if w is None else w.bank

    def write_landed(self, sg: int, wait: bool = False) -> bool:
        """Whether the write behind `sg`'s last step has landed (wait: a write in flight is
        waited for first; one that failed stays failed until the next settle)."""
        w = self._writes[sg]
        if wait and w.in_flight():
            self._io.wait_for([w.piece])
        return w.landed()

    def any_write_landed(self) -> bool:
        return any(w.landed() for w in self._writes.values())

    def settle(self, sg: int) -> HeldRead:
        """`sg`'s write lands (bounded wait): its slot becomes the committed one, and the bank,
        which holds the same state, is returned as a read already done, for the caller to keep
        (`keep`) or give back (`release`). A write that failed is sent again first; one that
        fails again raises the worker's error, naming the file and the bytes, and the state stays
        in the bank, committed, for the next try."""
        w = self._writes[sg]
        if not w.in_flight() and not w.landed():
            w.piece = swap_piece(proto.OP_SWAP_OUT, sg, w.bank, w.file_slot)
            self._io.send(w.piece)
        self._io.wait_for([w.piece])
        res = w.piece.result
        assert res is not None  # waited for
        if res.status != proto.STATUS_OK:
            raise WorkerError(
                f"hybrid_opt worker failed on subgroup {sg}: {res.message} (writing the state its "
                f"last step committed, sent again now; that state stays in memory, committed, and "
                f"is written again at the next step)"
            )
        del self._writes[sg]
        self._files.commit(sg, w.file_slot, res.crc)
        return HeldRead(w.bank, None)

    def settle_writes(self, keep: bool = False) -> None:
        """Every write behind lands (each a bounded wait; a failure raises as settle says).
        keep: each bank stays, as a read ahead of its subgroup's next step; else it goes back
        to the pool."""
        for sg in list(self._writes):
            held = self.settle(sg)
            if keep:
                self._reads[sg] = held
            else:
                self.release(held)

    def evict(self, wait: bool) -> bool:
        """One bank back to the pool from a write behind (the oldest, once its write landed;
        wait: waiting for it); False when there is none to take."""
        for sg, w in list(self._writes.items()):
            if wait or w.landed():
                self.release(self.settle(sg))
                return True
        return False

    def land_write(self, sg: int) -> None:
        """`sg`'s write behind ends, not sent again (bounded wait): landed, its slot is the
        committed one and its bank goes back; failed, it stays (its bank the committed state)
        until replaced() or the next settle."""
        if sg in self._writes and self.write_landed(sg, wait=True):
            self.release(self.settle(sg))

    def replaced(self, sg: int) -> None:
        """`sg`'s committed state was replaced (a load wrote and committed a slot): a failed
        write behind it is forgotten, its bank back in the pool."""
        w = self._writes.pop(sg, None)
        if w is not None:
            self._pool.release(w.bank)

    # ------------------------------------------------------------------ reads ahead
    def read(self, sg: int, bank: int) -> _Piece:
        """The worker starts reading `sg`'s committed slot into `bank` at once."""
        slot = self._files.slot(sg)
        piece = swap_piece(proto.OP_SWAP_IN, sg, bank, slot, self._files.crc(sg, slot))
        self._io.send(piece)
        return piece

    def read_ahead(self, take_bank: Callable[[], int | None], skip, keep_free: int) -> None:
        """The nvme subgroups' committed slots are read into banks (`take_bank`) now, in subgroup
        order, while more than `keep_free` banks are free; those in `skip` (a speculation holds
        them), or whose state is held already, are left. Best effort: a read that cannot start
        is left to the step, which reads it itself and reports what went wrong."""
        try:
            for sg in sorted(s for s, on in self.nvme.items() if on):
                if sg in skip or sg in self._reads or sg in self._writes:
                    continue
                if len(self._pool.free) <= keep_free:
                    break
                bank = take_bank()
                assert bank is not None  # the pool had free banks
                self._reads[sg] = HeldRead(bank, None)  # held before it is sent: released on error
                self._reads[sg].piece = self.read(sg, bank)
        except Exception:
            self.release_reads()

    @property
    def reads_ahead(self) -> list:
        """The nvme subgroups whose next step finds their state in memory: read ahead, or
        still in the bank their last step wrote (a copy)."""
        return list(self._reads) + list(self._writes)

    def holds_read(self, sg: int) -> bool:
        return sg in self._reads

    def take(self, sg: int) -> HeldRead | None:
        """`sg`'s read ahead, now the caller's (its step's); None when none is held."""
        return self._reads.pop(sg, None)

    def keep(self, sg: int, held: HeldRead) -> None:
        """`held` (a landed write's bank) is `sg`'s read ahead of its next step."""
        self._reads[sg] = held

    def release(self, held: HeldRead) -> None:
        """A read no step takes ends (bounded wait) and gives its bank back."""
        try:
            if held.piece is not None:
                self._io.wait_for([held.piece])
        finally:
            self._pool.release(held.bank)

    def release_reads(self) -> None:
        """Every read ahead ends and gives its bank back (their slot may be about to change, or
        the banks are needed)."""
        reads, self._reads = self._reads, {}
        for held in reads.values():
            self.release(held)
