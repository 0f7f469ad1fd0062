"""Shared host memory owned by the trainer: memfd-backed arenas the worker maps by descriptor.

The trainer creates every arena and keeps its descriptor, so a worker that dies loses no
state: a new worker maps the same memory. `memfd_create` avoids Docker's 64 MB /dev/shm
and leaves no names behind; where it is missing, an unlinked file in /dev/shm (or the temp
directory) stands in. Arenas are pinned (cudaHostRegister) when CUDA is present, for
asynchronous copies, and unpinned at close.
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile

PAGE = mmap.PAGESIZE
CACHE_LINE = 64
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def populate(mm: mmap.mmap, what: str = "shared memory") -> bool:
    """Fault in every page of a shared mapping now, writable (allocating the pages the
    first time): a first touch costs a page fault per 4 KB — several microseconds each in a
    VM — and the worker would otherwise pay them in its first steps on every bank, slowing
    exactly the steps the scheduler measures. Allocating up front also turns memory that is
    not there into an error here, not a SIGBUS mid-training. Returns False where the kernel
    cannot (before 5.14): pages then come on first touch."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
        return True
    except (AttributeError, ValueError):
        return False
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return False
        raise MemoryError(f"cannot allocate {len(mm) / 1e9:.2f} GB of {what} "
                          f"({os.strerror(e.errno)}): free host memory, or place less on the "
                          f"host tier (offload_fraction, nvme_fraction, spare_banks)") from e


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class ArenaLayout:
    """Offsets of named regions inside one arena, each aligned (64 B by default)."""

    def __init__(self):
        self.regions: dict[str, tuple[int, int]] = {}
        self.nbytes = 0

    def add(self, name: str, nbytes: int, align: int = CACHE_LINE) -> int:
        if name in self.regions:
            raise ValueError(f"region {name!r} already laid out")
        off = align_up(self.nbytes, align)
        self.regions[name] = (off, nbytes)
        self.nbytes = off + nbytes
        return off

    def offset(self, name: str) -> int:
        return self.regions[name][0]


def _open_anonymous_fd(name: str, nbytes: int) -> int:
    if hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(name, 0)  # inheritable on purpose: the worker gets it by pass_fds
            os.ftruncate(fd, nbytes)
            return fd
        except OSError:
            pass
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=directory)
    os.unlink(path)  # no name left behind, whatever happens next
    try:
        os.ftruncate(fd, nbytes)
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, f"cannot size shared memory of {nbytes} bytes in {directory}: "
                               f"{e.strerror}") from e
    return fd


class SharedArena:
    """One shared mapping; `tensor()` gives torch views of its regions (trainer side)."""

    def __init__(self, nbytes: int, name: str = "hybrid_opt", prefault: bool = True):
        self.nbytes = align_up(max(nbytes, 1), PAGE)
        self.fd = _open_anonymous_fd(name, self.nbytes)
        try:
            self.mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        try:
            self.populated = prefault and populate(self.mm, f"shared memory ({name})")
        except MemoryError:
            self.mm.close()
            os.close(self.fd)
            raise
        self._pinned_ptr = None
        self.closed = False

    def tensor(self, offset: int, numel: int, dtype):
        import torch
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or offset + numel * itemsize > self.nbytes:
            raise ValueError(f"region [{offset}, +{numel * itemsize}) does not fit the arena")
        # through a memoryview: each view holds a buffer export, so close() cannot unmap
        # memory a live tensor still points at (the mapping then goes with the last view)
        return torch.frombuffer(memoryview(self.mm), dtype=dtype, count=numel, offset=offset)

    def pin(self) -> bool:
        """Page-lock the arena for async H2D/D2H copies; True when it was pinned."""
        import torch
        if not torch.cuda.is_available() or self._pinned_ptr is not None:
            return False
        ptr = self.tensor(0, self.nbytes, torch.uint8).data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0)
        if int(err) != 0:
            return False
        self._pinned_ptr = ptr
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pinned_ptr is not None:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still exists somewhere; the mapping goes when the last view does
        os.close(self.fd)
