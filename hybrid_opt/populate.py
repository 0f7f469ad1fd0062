"""Populating shared mappings: an arena's memory reserved at construction, its pages faulted in with
every core, and the part no step needs yet (the spare banks) in the background.

Invariant: everything is reserved up front (missing memory is a MemoryError at construction, not a
SIGBUS mid-training); a step that needs a bank still populating waits for it, bounded. The calls
go through ctypes, which releases the GIL. Measurements: docs/internals.md."""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import threading
import time

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
CHUNK = 64 << 20  # one madvise call (~60 ms here): threads share work and a stop is seen in time
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP)
_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        lib.fallocate.restype = ctypes.c_int
        _libc = lib
    return _libc


def madvise(addr: int, nbytes: int, advice: int = MADV_POPULATE_WRITE) -> int:
    """0, or the errno of madvise(addr, nbytes, advice) (the GIL is released meanwhile)."""
    if _lib().madvise(addr, nbytes, advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def memory_error(nbytes: int, what: str, err: int) -> MemoryError:
    return MemoryError(
        f"cannot allocate {nbytes / 1e9:.2f} GB of {what} ({os.strerror(err)}): "
        f"free host memory, or place less on the host tier (offload_fraction, "
        f"nvme_fraction, spare_banks)"
    )


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_takes_huge_pages() -> bool:
    """Whether this kernel gives shared memory 2 MiB pages unasked: `shmem_enabled` set to
    `always` or `within_size` (`never` is the kernel's default; `advise` gives them only to a
    mapping that asks, and arenas do not). HYBRID_OPT_SHMEM_ENABLED stands in for the file
    (tests: the path such a host takes, on any host)."""
    text = os.environ.get("HYBRID_OPT_SHMEM_ENABLED")
    if text is None:
        try:
            with open(SHMEM_ENABLED) as f:
                text = f.read()
        except OSError:
            return False
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    return chosen in ("always", "within_size")


def reserve(fd: int, ranges, what: str = "shared memory") -> bool:
    """Allocates a shared file's pages in (offset, nbytes) `ranges` now, neither zeroed nor
    mapped (fallocate): memory that is not there is a MemoryError here. False where the
    filesystem cannot (pages are then allocated when populated), and where shared memory takes
    2 MiB pages unasked: fallocate follows the file's policy, not a mapping's MADV_NOHUGEPAGE, so
    its pages would span regions no budget counted (shm.no_huge_pages); populating through the
    mapping allocates 4 KiB ones. No glibc posix_fallocate: where fallocate is missing it would
    write every block."""
    if shmem_takes_huge_pages():
        return False
    for off, n in ranges:
        if _lib().fallocate(fd, 0, off, n) != 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise memory_error(sum(k for _, k in ranges), what, err)
            return False
    return True


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Gives a shared file's pages in [offset, offset + nbytes) back to the system now (they
    read as zeros after); False where the filesystem cannot (they then go with the file)."""
    return _lib().fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, offset, nbytes) == 0


def _chunks(ranges) -> list:
    out = []
    for off, n in ranges:
        for a in range(off, off + n, CHUNK):
            out.append((a, min(CHUNK, off + n - a)))
    return out


def populate_now(addr: int, ranges, threads: int | None = None, advice: int = MADV_POPULATE_WRITE) -> int:
    """Populates page-aligned (offset, nbytes) ranges of the mapping at `addr` with `threads`
    threads (default: one per core this thread may run on); 0, or the first errno."""
    chunks = _chunks(ranges)
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    threads = max(1, min(threads, len(chunks)))
    lock, state = threading.Lock(), {"next": 0, "err": 0}

    def run() -> None:
        while True:
            with lock:
                k = state["next"]
                if k >= len(chunks) or state["err"]:
                    return
                state["next"] = k + 1
            off, n = chunks[k]
            err = madvise(addr + off, n, advice)
            if err:
                with lock:
                    state["err"] = state["err"] or err
                return

    if threads == 1:
        run()
    else:
        pool = [
            threading.Thread(target=run, name=f"hybrid_opt-populate-{i}", daemon=True) for i in range(threads)
        ]
        for t in pool:
            t.start()
        for t in pool:
            t.join()  # each madvise is a bounded amount of kernel work: CHUNK bytes
    return state["err"]


class BackgroundPopulate:
    """Populates (offset, nbytes) ranges of the mapping at `addr` in one thread, in order;
    `wait(offset, nbytes, timeout_s)` returns once that region is populated. Failures are
    kept: an unsupported kernel counts as done (pages come on first touch), anything else is
    raised by wait() as a MemoryError naming `what`."""

    def __init__(self, addr: int, ranges, what: str = "shared memory", name: str = "hybrid_opt-populate"):
        self.what = what
        self._chunks = _chunks(ranges)
        # wait() runs for every bank of every step: the chunk a region ends in is found by
        # bisection where the chunks are in address order (the host tier's are)
        self._starts = [a for a, _ in self._chunks]
        self._ordered = all(a + n <= b for (a, n), b in zip(self._chunks, self._starts[1:]))
        self._next = 0  # chunks before this one are populated
        self._err = 0
        self._stop = False
        self._cond = threading.Condition()
        self._addr = addr
        self.seconds: float | None = None  # how long it took, once finished
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        for off, n in self._chunks:
            if self._stop:
                break
            err = madvise(self._addr + off, n)
            with self._cond:
                if err and err not in _UNSUPPORTED:
                    self._err = err
                if err:
                    self._next = len(self._chunks)
                else:
                    self._next += 1
                self._cond.notify_all()
            if err:
                break
        with self._cond:
            self.seconds = time.perf_counter() - t0
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """Whether the population has ended: every chunk populated (from the moment wait() can
        return, the thread perhaps still on its way out), failed, or stopped. Not the thread's
        is_alive() alone: a waiter woken by the last chunk would still see it running, for longer
        on Python 3.13, whose threads are alive until their OS thread has exited."""
        return self._next >= len(self._chunks) or not self._thread.is_alive()

    def _last_chunk(self, offset: int, nbytes: int) -> int:
        """Index of the last chunk overlapping [offset, offset + nbytes), or -1."""
        if self._ordered:
            k = bisect.bisect_left(self._starts, offset + nbytes) - 1
            return k if k >= 0 and offset < self._starts[k] + self._chunks[k][1] else -1
        last = -1
        for k, (a, n) in enumerate(self._chunks):
            if a < offset + nbytes and offset < a + n:
                last = k
        return last

    def wait(self, offset: int = 0, nbytes: int | None = None, timeout_s: float = 120.0) -> None:
        """Until [offset, offset + nbytes) is populated (everything when nbytes is None).
        `timeout_s` bounds a stall, not the whole wait: a big arena takes minutes to populate
        in one thread, and a region late in the order is waited for as long as chunks keep
        being populated; TimeoutError once none was for `timeout_s`."""
        self.wait_ranges([(offset, nbytes)], timeout_s)

    def wait_ranges(self, ranges, timeout_s: float = 120.0) -> None:
        """wait() for every (offset, nbytes) of `ranges` at once (nbytes None: everything): the
        chunks are populated in order, so that is waiting for the last chunk any of them
        overlaps, with the same bound on a stall."""
        if self._next >= len(self._chunks) and not self._err:
            return  # finished: the per-step case, no search
        last = max(
            (
                len(self._chunks) - 1 if nbytes is None else self._last_chunk(offset, nbytes)
                for offset, nbytes in ranges
            ),
            default=-1,
        )
        with self._cond:
            seen, deadline = self._next, time.monotonic() + timeout_s
            while self._next <= last and not self._err and self._thread.is_alive():
                if self._next != seen:  # progress: the bound starts again
                    seen, deadline = self._next, time.monotonic() + timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    todo = sum(n for _, n in self._chunks[self._next :])
                    raise TimeoutError(
                        f"hybrid_opt: {todo / 1e9:.2f} GB of {self.what} still not "
                        f"populated, none of it for {timeout_s:.0f} s: the machine is "
                        f"short of memory or CPU; free some, or place less on the "
                        f"host tier"
                    )
                self._cond.wait(min(left, 0.1))
            if self._err:
                raise memory_error(sum(n for _, n in self._chunks), self.what, self._err)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Asks the thread to end after its current chunk; True once it has."""
        self._stop = True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
