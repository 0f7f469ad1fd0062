"""Shared host memory owned by the trainer: memfd-backed arenas the worker maps by descriptor.

The trainer creates every arena and keeps its descriptor, so a worker that dies loses no
state: a new worker maps the same memory. `memfd_create` avoids Docker's 64 MB /dev/shm
and leaves no names behind; where it is missing, an unlinked file in /dev/shm (or the temp
directory) stands in. An arena is pinned (cudaHostRegister) when its owner asks — the host
tier does for CUDA params, for asynchronous copies — and unpinned at close. A process forked
from the trainer (a DataLoader worker, multiprocessing's fork) lets go of every arena at once
(forking.py), so an arena's memory goes back to the system when its owner closes it, whoever else
lives on.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import tempfile
import warnings
import weakref

from hybrid_opt import forking
from hybrid_opt.populate import BackgroundPopulate, memory_error, populate_now, punch_hole, reserve

PAGE = mmap.PAGESIZE
CACHE_LINE = 64
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
MAP_FIXED = 0x10
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)

libc = ctypes.CDLL(None, use_errno=True)  # this process's C library (mapped.py's mremap and munmap too)
libc_mmap = libc.mmap  # mmap(2) itself: Python's maps at no address it is given
libc_mmap.restype = ctypes.c_void_p
libc_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


def address(mm: mmap.mmap) -> int:
    """The address a mapping starts at (valid while it is mapped)."""
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf  # the buffer export would keep close() from unmapping


def outside(ranges, nbytes: int) -> list:
    """The (offset, nbytes) ranges of [0, nbytes) that none of `ranges` covers, in order."""
    out, at = [], 0
    for off, n in sorted(ranges):
        if off > at:
            out.append((at, off - at))
        at = max(at, off + n)
    if at < nbytes:
        out.append((at, nbytes - at))
    return out


def populate(mm: mmap.mmap, what: str = "shared memory", skip=(), threads: int | None = None) -> bool:
    """Fault in every page of a shared mapping now (but the page-aligned (offset, nbytes)
    ranges in `skip`), writable, allocating the pages the first time, with one thread per
    core (hybrid_opt/populate.py has the measurements): a first touch costs a page fault per
    4 KB — several microseconds each in a VM — and the worker would otherwise pay them in its
    first steps on every bank, slowing exactly the steps the scheduler measures. Allocating
    up front also turns memory that is not there into an error here, not a SIGBUS
    mid-training. Returns False where the kernel cannot (before 5.14): pages then come on
    first touch."""
    try:
        err = populate_now(address(mm), outside(skip, len(mm)), threads, MADV_POPULATE_WRITE)
    except (AttributeError, TypeError, OSError):  # no libc madvise to call
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
        return False
    if err:
        raise memory_error(len(mm), what, err)
    return True


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context; flags 0 pins for the current one only
_pin_warned = False


class CudaRuntime:
    """The CUDA runtime library this process loaded (torch's), called through ctypes. A failed
    call leaves its error for the next cudaGetLastError — which torch's next kernel launch
    check reads and reports as its own failure — so the error is cleared here, and that must
    be done in the same runtime instance that set it."""

    def __init__(self, lib):
        self.lib = lib
        for name, args in (
            ("cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
            ("cudaHostUnregister", [ctypes.c_void_p]),
            ("cudaGetLastError", []),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p

    def register(self, ptr: int, nbytes: int) -> int:
        return self.lib.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE)

    def unregister(self, ptr: int) -> int:
        return self.lib.cudaHostUnregister(ptr)

    def clear_error(self) -> int:
        return self.lib.cudaGetLastError()

    def error_string(self, code: int) -> str:
        text = self.lib.cudaGetErrorString(code)
        return text.decode(errors="replace") if text else f"CUDA error {code}"


def _loaded_cudart() -> str | None:
    """The path of the libcudart mapped into this process (torch links it dynamically)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcudart"):
                    return fields[5].strip()
    except OSError:
        pass
    return None


def cuda_runtime() -> CudaRuntime | None:
    """The CUDA runtime to pin with, or None when CUDA is unavailable or its runtime library
    cannot be found in this process."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    for path in (_loaded_cudart(), None):  # None: the symbols the process exports globally
        try:
            return CudaRuntime(ctypes.CDLL(path))
        except (OSError, AttributeError, TypeError):
            continue
    return None


def _in_context_of(device):
    """cudaHostRegister/Unregister act in the current device's CUDA context and create it when
    it does not exist yet: they run on the params' device (None: the current one), so a model
    on cuda:1 does not get a context — hundreds of MB — made on cuda:0 for it."""
    if device is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def _warn_unpinned(why: str) -> None:
    global _pin_warned
    if not _pin_warned:
        _pin_warned = True
        warnings.warn(
            f"hybrid_opt: the host tier's shared memory could not be pinned ({why}); it "
            f"runs unpinned: results are unchanged, but grad and param copies between "
            f"the GPU and the host are slower, and synchronous: a grad hook that stages a "
            f"speculative step waits for the GPU (pass speculative=False where that holds "
            f"backward back). Raise the locked-memory limit (ulimit -l) or free host memory "
            f"to pin it.",
            RuntimeWarning,
            stacklevel=3,
        )


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

    def pad(self, align: int) -> int:
        """Ends the layout so far at a multiple of `align` (the next region starts there);
        returns its size."""
        self.nbytes = align_up(self.nbytes, align)
        return self.nbytes


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
        raise OSError(
            e.errno, f"cannot size shared memory of {nbytes} bytes in {directory}: {e.strerror}"
        ) from e
    return fd


def _map_shared(fd: int, nbytes: int) -> mmap.mmap:
    """The file `fd` mapped shared, as a mmap object that holds no descriptor of its own:
    Python's mmap(fd) keeps a dup of it, which no one could close in a forked child. An
    anonymous reservation is made, then the file mapped over it (closing the object unmaps the
    range, whatever is mapped there)."""
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, prot=rw)
    if libc_mmap(address(mm), nbytes, rw, mmap.MAP_SHARED | MAP_FIXED, fd, 0) != address(mm):
        err = ctypes.get_errno()
        mm.close()
        raise OSError(err, f"cannot map {nbytes} bytes of shared memory: {os.strerror(err)}")
    no_huge_pages(mm)
    _MAPPINGS.live.add(mm)
    return mm


def no_huge_pages(mm: mmap.mmap) -> None:
    """4 KiB pages for an arena mapping on every host. Where the kernel gives shared memory 2 MiB
    pages unasked (populate.shmem_takes_huge_pages), one such page would span several regions (a
    bank, a dormant spare, staging slots) and the bytes the OS counts (`allocated_bytes`) would
    exceed what the budgets planned (docs/benchmarks.md, huge pages). A fault through a mapping
    so advised takes a 4 KiB page; the trainer's mapping and the worker's both ask, and the arena's
    memory is not reserved by fallocate there (populate.reserve). Where the kernel has no such
    advice there is nothing to refuse."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        mm.madvise(mmap.MADV_NOHUGEPAGE)


class _Mappings:
    """Every arena's mapping while it lasts (a view may keep a closed arena's), let go of in a
    forked child (forking.py): each is mapped over by an inaccessible reservation (its mmap
    object unmaps that with itself, so no later mapping of the child's takes the address
    meanwhile), so the memory goes back when the trainer lets go of it, whoever lives on."""

    def __init__(self):
        self.live: weakref.WeakSet = weakref.WeakSet()
        forking.let_go_in_child(self)

    def let_go(self) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE
        for mm in list(self.live):
            if not mm.closed:
                with contextlib.suppress(ValueError, OSError):
                    libc_mmap(address(mm), len(mm), 0, flags, -1, 0)  # PROT_NONE


_MAPPINGS = _Mappings()


class SharedArena:
    """One shared mapping; `tensor()` gives torch views of its regions (trainer side).

    prefault: populate the pages at construction (see populate()). `later`: page-aligned
    (offset, nbytes) ranges no step needs at once (spare banks): their memory is reserved now
    (fallocate: missing memory is still a MemoryError here) and populated by a background
    thread, in order; `wait_populated()` waits for a region (bounded). `dormant`: page-aligned
    ranges no step may use until `wake()` hands them out (spare banks backward has not shown it
    can fill): neither reserved, populated nor pinned, so they cost no memory until then."""

    def __init__(
        self,
        nbytes: int,
        name: str = "hybrid_opt",
        prefault: bool = True,
        later=(),
        defer: bool = False,
        dormant=(),
    ):
        """`defer`: the pages are reserved and populated by fill(), not here (the caller starts
        its worker first, so that its start-up overlaps the reservation)."""
        self.nbytes = align_up(max(nbytes, 1), PAGE)
        self.fd = _open_anonymous_fd(name, self.nbytes)
        try:
            self.mm = _map_shared(self.fd, self.nbytes)
        except OSError:
            os.close(self.fd)
            raise
        self._background: BackgroundPopulate | None = None
        self.populated = False
        self.later: tuple = ()  # the (offset, nbytes) ranges fill() left to the background
        self.dormant: list = sorted((off, n) for off, n in dormant if n > 0)  # wake() takes them out
        if any(off % PAGE or n % PAGE for off, n in self.dormant):
            os.close(self.fd)
            raise ValueError(f"dormant: ranges must be page-aligned, got {self.dormant}")
        self._pinned: list = []  # the (address, nbytes) ranges registered with CUDA (pin, wake)
        self._runtime: CudaRuntime | None = None
        self._pin_device = None
        self.closed = False
        self._fill_args: tuple | None = (name, prefault, later)
        forking.let_go_in_child(self)
        if not defer:
            try:
                self.fill()
            except BaseException:  # MemoryError, a bad range: no descriptor left behind
                self.close()
                raise

    def fill(self) -> None:
        """Reserves the arena's pages and populates those not left to the background (once).
        Raises MemoryError where the memory is not there; the owner then closes the arena."""
        if self._fill_args is None:
            return
        name, prefault, later = self._fill_args
        self._fill_args = None
        what = f"shared memory ({name})"
        later = [(off, n) for off, n in later if n > 0] if prefault else []
        if any(off % PAGE or n % PAGE for off, n in later):
            raise ValueError(f"later: ranges must be page-aligned, got {later}")
        if later and not reserve(self.fd, later, what):
            later = []  # nothing reserves the memory: populate it all now (the error promise)
        self.populated = prefault and populate(self.mm, what, skip=later + self.dormant)
        if self.populated and later:
            self.later = tuple(later)
            self._background = BackgroundPopulate(address(self.mm), later, what)

    def tensor(self, offset: int, numel: int, dtype):
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or offset + numel * itemsize > self.nbytes:
            raise ValueError(f"region [{offset}, +{numel * itemsize}) does not fit the arena")
        # through a memoryview: each view holds a buffer export, so close() cannot unmap
        # memory a live tensor still points at (the mapping then goes with the last view)
        return torch.frombuffer(memoryview(self.mm), dtype=dtype, count=numel, offset=offset)

    def wait_populated(self, offset: int = 0, nbytes: int | None = None, timeout_s: float = 120.0) -> None:
        """Returns once [offset, offset + nbytes) (everything when None) is populated; raises
        TimeoutError past `timeout_s`, MemoryError if the background population failed."""
        if self._background is not None:
            self._background.wait(offset, nbytes, timeout_s)

    def wait_populated_ranges(self, ranges, timeout_s: float = 120.0) -> None:
        """wait_populated() for every (offset, nbytes) of `ranges`, in one wait."""
        if self._background is not None:
            self._background.wait_ranges(ranges, timeout_s)

    @property
    def populating(self) -> bool:
        """Whether the background population is still running."""
        return self._background is not None and not self._background.done

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)

    def pin(self, device=None) -> bool:
        """Page-lock the arena for every CUDA context (async H2D/D2H copies); True when it is
        pinned. `device`: the CUDA device whose context registers it (the params'; None: the
        current one). A failure clears the CUDA error it set, warns once per process and leaves
        the arena unpinned (slower copies, same results). Dormant ranges are left out (their
        pages would be allocated): wake() registers each as it wakes."""
        if self._pinned:
            return True
        import torch

        runtime = cuda_runtime()
        if runtime is None:
            if torch.cuda.is_available():
                _warn_unpinned("the CUDA runtime library this process uses was not found")
            return False
        base = address(self.mm)
        self._runtime, self._pin_device = runtime, device
        for off, n in outside(self.dormant, self.nbytes):
            err = self._register(base + off, n)
            if err != 0:
                self._unregister_all()
                _warn_unpinned(
                    f"cudaHostRegister of {n} bytes failed: {runtime.error_string(err)} (error {err})"
                )
                return False
        return True

    def _register(self, ptr: int, nbytes: int) -> int:
        """cudaHostRegister of one range in the pinning device's context; 0, or the error
        (cleared)."""
        assert self._runtime is not None  # set by pin() first
        with _in_context_of(self._pin_device):
            err = self._runtime.register(ptr, nbytes)
            if err != 0:
                self._runtime.clear_error()
        if err == 0:
            self._pinned.append((ptr, nbytes))
        return err

    def _unregister(self, ptrs) -> None:
        """cudaHostUnregister of the registered ranges starting at `ptrs`, which leave _pinned."""
        if self._runtime is not None:
            for ptr, _ in [p for p in self._pinned if p[0] in ptrs]:
                try:
                    with _in_context_of(self._pin_device):
                        if self._runtime.unregister(ptr) != 0:
                            self._runtime.clear_error()  # the memory goes with the mapping anyway
                except Exception:
                    pass  # a device gone (interpreter shutdown): the mapping is closed all the same
        self._pinned = [p for p in self._pinned if p[0] not in ptrs]

    def _unregister_all(self) -> None:
        self._unregister({ptr for ptr, _ in self._pinned})
        self._runtime = self._pin_device = None

    def wake(self, ranges) -> None:
        """Takes dormant `ranges` (each one of them, whole) into use: their pages reserved,
        populated now and, in a pinned arena, registered. Raises MemoryError where the memory
        is not there, and RuntimeError where a pinned arena cannot pin them; the ranges then
        stay dormant (what was allocated of them is given back)."""
        ranges = sorted((off, n) for off, n in ranges if n > 0)
        for r in ranges:
            if r not in self.dormant:
                raise ValueError(f"{r} is not a dormant range of this arena ({self.dormant})")
        what, base = "shared memory (spare banks)", address(self.mm)
        try:
            reserve(self.fd, ranges, what)
            # every core: the step that wakes them waits (once; ~2 GB/s on a 2-core VM)
            err = populate_now(address(self.mm), ranges, None, MADV_POPULATE_WRITE)
            if err and err not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise memory_error(sum(n for _, n in ranges), what, err)
            if self._pinned:
                for off, n in ranges:
                    err = self._register(base + off, n)
                    if err != 0:
                        assert self._runtime is not None
                        raise RuntimeError(
                            f"cudaHostRegister of {n} bytes failed: {self._runtime.error_string(err)} "
                            f"(error {err})"
                        )
        except BaseException:
            self._unregister({base + off for off, _ in ranges})
            for off, n in ranges:
                punch_hole(self.fd, off, n)
            raise
        self.dormant = [r for r in self.dormant if r not in ranges]

    def let_go(self) -> None:
        """In a process forked from the owner (forking.py; _Mappings unmaps its mapping): the
        descriptor closed, nothing else touched. The pins are the owner's."""
        if self.closed:
            return
        self.closed = True
        self._background = None  # its thread did not survive the fork
        self._pinned, self._runtime = [], None
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._background is not None:
            self._background.stop()  # it holds no buffer export: unmapping below is safe after
        self._unregister_all()
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still exists somewhere; the mapping goes when the last view does
        os.close(self.fd)
