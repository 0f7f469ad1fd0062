"""The host tier's committed state as file pieces state_dict() maps without copying (mapped.py):
a resident subgroup's in its committed bank of the arena, an nvme subgroup's in the committed
slot of its file (checksum-verified first, mapped copy-on-write), or in the bank its last step
wrote while that write lands behind the step.

The invariant this part keeps: a held state_dict() tensor never reads bytes written after it
was taken. Every write into a bank or a slot is announced here first (`writing`): a bank the
pool hands out, a committed bank stepped or loaded in place, an nvme slot about to be
written; the held tensors over it then take copies of their own (HeldViews), keeping the
values they had when taken. close() does the same for all of them.
"""

from __future__ import annotations

import mmap

from hybrid_opt.mapped import HeldViews, Piece
from hybrid_opt.state.state_format import ABSMAX

# state_dict()'s names of a subgroup's state -> the bank region that holds it
_REGION = {"master": "p", "remainder": "rem", "exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "vmax"}


class HostViews:
    """Pieces of a HostTier's committed state, and the HeldViews over them."""

    def __init__(self, arena, banks, pool, files, fds, *, nvme: dict, io_bytes: int, written_bank):
        """`nvme`: {subgroup id: whether it lives on nvme} (HostTier's). `written_bank(sg)`: the
        bank holding an nvme subgroup's committed state while the write behind its last step
        lands, else None (HostStepping.written_bank)."""
        self._arena, self._banks, self._pool, self._files, self._fds = arena, banks, pool, files, fds
        self._nvme, self._io_bytes, self._written_bank = dict(nvme), io_bytes, written_bank
        self.held = HeldViews()

    def piece(self, sg: int, name: str, a: int, b: int, verified: set) -> Piece:
        """Elements [a, b) of subgroup `sg`'s committed state `name` ("master", "remainder",
        "exp_avg", "exp_avg_sq", "max_exp_avg_sq"; a q8 moment's codes under its name, its
        absmaxes under the name + "_absmax", blocks [a, b)). An nvme slot is checksum-verified once per
        `verified` (the caller's set, one per state_dict() call): OSError where it is corrupt."""
        fmt = self._banks.formats[sg]
        if name.endswith(ABSMAX):  # a q8 moment's absmaxes: [a, b) count blocks
            es, region = 4, self._banks.region_offset(_REGION[name[: -len(ABSMAX)]] + ABSMAX)
        else:
            es = 1 if fmt.is_q8(name) else fmt.dtype_of(name).itemsize
            region = self._banks.region_offset(_REGION[name])
        held = self._written_bank(sg) if self._nvme[sg] else None
        if not self._nvme[sg] or held is not None:
            bank = self._pool.committed[sg] if held is None else held
            off = self._banks.bank_offset + bank * self._banks.bank_stride + region + a * es
            return Piece(self._arena.fd, off, (b - a) * es, held=self.held, key=("bank", bank))
        slot = self._files.slot(sg)
        self._fds.check(sg)  # a file removed from outside: said, once (its descriptor still reads)
        if (sg, slot) not in verified:
            self._verify(sg, slot)
            verified.add((sg, slot))
        off = slot * self._io_bytes + region + a * es
        return Piece(
            self._fds.fd(sg), off, (b - a) * es, held=self.held, key=("slot", sg, slot), private=True
        )

    def _verify(self, sg: int, slot: int) -> None:
        """The slot's CRC32C, read through the page cache (what the tensors will read), against
        the one its commit noted."""
        from cpu_kernels.aio import checksum

        with mmap.mmap(
            self._fds.fd(sg), self._io_bytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=slot * self._io_bytes
        ) as mm:
            crc = checksum(mm)
        if crc != self._files.crc(sg, slot):
            raise OSError(
                f"checksum mismatch in nvme subgroup {sg}'s file, slot {slot}: expected "
                f"CRC32C {self._files.crc(sg, slot):08x}, read {crc:08x}; the file is "
                f"corrupt — restore from a checkpoint"
            )

    def writing(self, banks=(), slots=()) -> None:
        """`banks` and nvme `slots` [(subgroup, slot)] are about to be written: held tensors
        over them take copies of their own first."""
        self.held.release([("bank", b) for b in banks] + [("slot", sg, s) for sg, s in slots])

    def close(self) -> None:
        """Before the arena and the files go: every held tensor takes a copy of its own."""
        self.held.release_all()
