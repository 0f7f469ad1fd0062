"""Tensors over pieces of files, mapped side by side: how state_dict() hands out a param's state
without copying it, wherever it lies (arena banks, nvme slots, the CPU device tier's memory).

A `Span` maps each piece (a byte range of a memfd or swap file) at the next address, so pieces read
as one range. Invariant: a span never reads memory written after it was handed out; before the
owner writes it again, `HeldViews.release` gives each live span a private copy. Design notes:
docs/internals.md."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, NamedTuple

from hybrid_opt.shm import MAP_FIXED, MAP_NORESERVE, PAGE, address, libc, libc_mmap

if TYPE_CHECKING:
    import torch

_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value

_mremap = libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_munmap = libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Piece(NamedTuple):
    """`nbytes` bytes of the file open as `fd`, from byte `offset`; a span over it is added to
    `held` under `key` (its owner releases it there before writing those bytes again).
    `private`: mapped copy-on-write (an nvme slot: a write through a tensor must never reach
    the file its checksum covers); else shared (a write reaches the state, as a write into
    torch's own state tensors does)."""

    fd: int
    offset: int
    nbytes: int
    held: "HeldViews | None" = None
    key: Hashable = None  # HeldViews' key of the memory it reads (a subgroup index, ("bank", k))
    private: bool = False


def side_by_side(pieces: list) -> bool:
    """Whether `pieces` can be mapped as one contiguous range: each piece after the first starts
    on a page boundary, each piece before the last ends on one."""
    return all(p.offset % PAGE == 0 for p in pieces[1:]) and all(
        (p.offset + p.nbytes) % PAGE == 0 for p in pieces[:-1]
    )


def _align_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class Span(mmap.mmap):
    """Reserved address space (an anonymous mapping of its own, which Python unmaps with the
    object) with file pieces mapped over it; tensors over it hold it through their buffer."""

    def __new__(cls, nbytes: int, private: bool):
        # anonymous and never touched: address space only, until the pieces replace it
        return super().__new__(
            cls,
            -1,
            nbytes,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )

    def __init__(self, nbytes: int, private: bool):
        self.base = address(self)
        self.private = private  # its pieces are mapped copy-on-write
        self.snapped = False  # its bytes are a private copy now (snapshot)

    def snapshot(self) -> None:
        """The span's bytes become anonymous memory of its own, with the values they have now:
        a copy mapped in place of the files' pages in one mremap, so no tensor over it ever
        sees a missing page. Idempotent."""
        if self.snapped or self.closed:
            return
        n = len(self)
        fresh = libc_mmap(
            None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
        )
        if fresh in (None, _MAP_FAILED):
            raise _os_error("cannot allocate the private copy of a held state_dict() tensor", n)
        ctypes.memmove(fresh, self.base, n)
        moved = _mremap(fresh, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, self.base)
        if moved in (None, _MAP_FAILED):
            err = _os_error("cannot swap in the private copy of a held state_dict() tensor", n)
            _munmap(fresh, n)
            raise err
        self.snapped = True


def _os_error(what: str, nbytes: int) -> OSError:
    code = ctypes.get_errno() or errno.ENOMEM
    return OSError(code, f"{what} ({nbytes} bytes): {os.strerror(code)}")


def map_pieces(pieces: list) -> tuple | None:
    """(span, byte offset of the first piece's first byte in it) of `pieces` mapped side by
    side and added to their owners' HeldViews, or None where they cannot be (not
    side_by_side, or the kernel refused: too many mappings)."""
    if not pieces or not side_by_side(pieces):
        return None
    private = any(p.private for p in pieces)
    lead = pieces[0].offset % PAGE
    total = _align_up(lead + sum(p.nbytes for p in pieces))
    try:
        span = Span(total, private)
    except OSError:
        return None
    flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | MAP_FIXED
    at = span.base
    for k, p in enumerate(pieces):
        start = p.offset - (lead if k == 0 else 0)
        length = (lead if k == 0 else 0) + p.nbytes
        length = _align_up(length) if k == len(pieces) - 1 else length
        got = libc_mmap(at, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, p.fd, start)
        if got in (None, _MAP_FAILED):
            span.close()
            return None
        at += length
    for p in pieces:
        if p.held is not None:
            p.held.add(span, [p.key])
    return span, lead


def map_tensor(pieces: list, dtype, shape) -> "torch.Tensor | None":
    """A tensor of `dtype` and `shape` over `pieces` mapped side by side (its storage of its
    own, exactly its bytes: torch.save writes those), or None where they cannot be."""
    import torch

    mapped = map_pieces(pieces)
    if mapped is None:
        return None
    span, lead = mapped
    numel = sum(p.nbytes for p in pieces) // dtype.itemsize
    return torch.frombuffer(span, dtype=dtype, count=numel, offset=lead).view(shape)


class HeldViews:
    """The spans state_dict() handed out, weakly, under the memory each reads (hashable keys
    the owners choose: ("bank", b), ("slot", subgroup, slot), ("device", subgroup)).
    `release(keys)` before that memory is written again; `release_all()` before it goes."""

    def __init__(self):
        # key -> WeakSet of spans; empty while nobody holds one (what a caller on a hot path reads
        # before calling release)
        self.by_key: dict = {}

    def add(self, span: Span, keys) -> None:
        for key in keys:
            self.by_key.setdefault(key, weakref.WeakSet()).add(span)

    def release(self, keys) -> None:
        """Each live span over any of `keys` takes a private copy of its bytes."""
        spans = []
        for key in keys:
            held = self.by_key.pop(key, None)
            if held:
                spans.extend(held)
        for span in spans:
            span.snapshot()

    def release_all(self) -> None:
        self.release(list(self.by_key))

    def __len__(self) -> int:
        """Live spans (a span over several keys counts once)."""
        return len({id(s) for held in self.by_key.values() for s in held if not s.snapped})
