"""cpu_kernels.aio: asynchronous O_DIRECT file I/O and CRC32C checksums, without torch. The engine is
here; its errors, buffers, alignment and checksums are aio_buffers.py (re-exported).

A C pool of pread/pwrite threads runs each request (one file range into or out of one caller-owned
buffer) in chunks; it is submitted at once and waited for later by id, with a bounded timeout.
Alignment is checked at submit, before any I/O; a failed request raises `AioError` naming the
operation, path, offset and bytes done. Usage and rules: docs/internals.md."""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import math
import operator
import os
import threading
import warnings
import weakref

from ._lib import lib
from .aio_buffers import (  # noqa: F401 - the public names re-exported, _checksum_portable too (tests)
    _EMISALIGNED_BUF,
    _EMISALIGNED_LEN,
    _EMISALIGNED_OFF,
    _FLAG_CRC,
    _HINTS,
    _MODES,
    _O_DIRECT,
    _OP_NAMES,
    _READ,
    _SYNC,
    _WRITE,
    ALIGNMENT,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    AioAlignmentError,
    AioError,
    AioResult,
    _checksum_portable,
    _errname,
    _resolve,
    _Result,
    align_up,
    aligned_buffer,
    checksum,
    checksum_combine,
    checksum_impl,
    open_direct,
)

__all__ = [
    "AioEngine",
    "AioError",
    "AioAlignmentError",
    "AioResult",
    "aligned_buffer",
    "align_up",
    "checksum",
    "checksum_combine",
    "checksum_impl",
    "ALIGNMENT",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TIMEOUT_S",
    "open_direct",
]


class _Request:
    __slots__ = ("op", "fd", "offset", "nbytes", "pin", "crc")

    def __init__(self, op, fd, offset, nbytes, pin, crc):
        self.op, self.fd, self.offset, self.nbytes, self.pin, self.crc = op, fd, offset, nbytes, pin, crc


_LIVE: "weakref.WeakSet[_State]" = weakref.WeakSet()  # engines of this process (os.fork: _State.forked)


class _State:
    """Everything the finalizer needs, kept apart from the engine object so that a
    collected engine still shuts its threads down before releasing in-flight buffers."""

    def __init__(self, handle):
        self.handle = handle
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.active = 0  # C calls in progress
        self.closed = False
        self.requests: dict[int, _Request] = {}
        self.paths: dict[int, str] = {}
        _LIVE.add(self)

    def forked(self) -> None:
        """In a child of os.fork(): the engine's threads (and maybe a holder of its lock) stay
        in the parent, so the child's copy is closed without a C call (shutting it down there
        waited forever on threads that do not exist) and its buffers are left to the parent."""
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.handle, self.closed, self.active = None, True, 0
        self.requests.clear()

    def shutdown(self, grace_s: float) -> int:
        with self.lock:
            if self.handle is None:
                return 0
            handle, self.closed = self.handle, True
        lib.hybrid_aio_shutdown(handle)  # wakes waiters, refuses submits
        with self.lock:
            self.idle.wait_for(lambda: self.active == 0, timeout=max(grace_s, 1.0))
            self.handle = None
        cancelled = lib.hybrid_aio_destroy(handle, int(grace_s * 1e9))
        # -1: a thread is stuck in the kernel and may still write into a buffer: keep them all
        if cancelled >= 0:
            for req in self.requests.values():
                if req.pin is not None:
                    req.pin.release()
            self.requests.clear()
        return cancelled


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [s.forked() for s in list(_LIVE)])


class AioEngine:
    """A pool of `threads` I/O threads with room for `queue_depth` requests submitted and
    not yet waited for.

    threads: concurrent system calls (a virtual disk here saturates at 2-4).
    queue_depth: outstanding requests; one more submit raises AioError(EAGAIN).
    chunk_bytes: the split of a large request across threads (multiple of `alignment`).
    alignment: the O_DIRECT rule for address, length and offset (power of two).

    Thread-safe: submits and waits may come from several threads. `close()` (idempotent,
    also at garbage collection and interpreter exit) cancels requests not yet started and
    joins every thread.
    """

    def __init__(
        self,
        threads: int = 4,
        queue_depth: int = 32,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        alignment: int = ALIGNMENT,
    ):
        for name, v in (
            ("threads", threads),
            ("queue_depth", queue_depth),
            ("chunk_bytes", chunk_bytes),
            ("alignment", alignment),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AioEngine: {name} must be a positive int, got {v!r}")
        if alignment & (alignment - 1):
            raise ValueError(f"AioEngine: alignment must be a power of two, got {alignment}")
        if chunk_bytes % alignment or chunk_bytes > 1 << 30:
            raise ValueError(
                f"AioEngine: chunk_bytes must be a multiple of alignment "
                f"({alignment}) and at most 1 GiB, got {chunk_bytes}"
            )
        if threads > 1024 or queue_depth > 1 << 20:
            raise ValueError(
                f"AioEngine: at most 1024 threads and a queue depth of 2**20, got "
                f"threads={threads}, queue_depth={queue_depth}"
            )
        err = ctypes.c_int(0)
        handle = lib.hybrid_aio_create(threads, queue_depth, chunk_bytes, alignment, ctypes.byref(err))
        if not handle:
            raise OSError(
                err.value, f"AioEngine: could not start {threads} I/O threads: {os.strerror(err.value)}"
            )
        self.threads, self.queue_depth = threads, queue_depth
        self.chunk_bytes, self.alignment = chunk_bytes, alignment
        self._s = _State(handle)
        self._finalizer = weakref.finalize(self, self._s.shutdown, 5.0)

    # -- files --------------------------------------------------------------------------

    def open(self, path, mode: str = "r", *, direct: bool = True, perm: int = 0o600) -> int:
        """Opens `path` and returns a raw fd registered with this engine (errors name it).

        mode: "r", "r+", "w", "w+", "x", "x+" as for open(); files are created with `perm`.
        direct: O_DIRECT when the filesystem accepts it; where it refuses (EINVAL, e.g. an
        older kernel's tmpfs) the file is opened buffered and one warning per process says
        so. `is_direct(fd)` tells which. Close it with `close_fd`.
        """
        if mode not in _MODES:
            raise ValueError(f"AioEngine.open: mode must be one of {sorted(_MODES)}, got {mode!r}")
        path = os.fspath(path)
        flags = _MODES[mode] | os.O_CLOEXEC
        fd = open_direct(path, flags, perm) if direct else os.open(path, flags, perm)
        self.register(fd, path)
        return fd

    def register(self, fd: int, path: str) -> None:
        """Names an fd opened elsewhere, so that its errors name the file."""
        with self._s.lock:
            self._s.paths[fd] = os.fspath(path)

    def close_fd(self, fd: int) -> None:
        """Closes an fd and forgets its path; refused while requests on it are outstanding
        (a closed and reused descriptor would send their I/O to another file)."""
        with self._s.lock:
            busy = sum(1 for r in self._s.requests.values() if r.fd == fd)
            if busy:
                raise AioError(
                    _errno.EBUSY,
                    f"close_fd: {busy} request(s) on fd {fd} "
                    f"({self._path(fd)}) are not waited for yet; wait() first",
                    path=self._path(fd),
                )
            self._s.paths.pop(fd, None)
        os.close(fd)

    @staticmethod
    def is_direct(fd: int) -> bool:
        """Whether fd bypasses the page cache (O_DIRECT)."""
        return bool(_O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)

    def _path(self, fd: int) -> str:
        path = self._s.paths.get(fd)
        if path is None:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = f"fd {fd}"
        return path

    # -- requests -----------------------------------------------------------------------

    def submit_read(
        self, fd: int, buf, nbytes: int | None = None, offset: int | None = 0, *, checksum: bool = False
    ) -> int:
        """Queues a read of `nbytes` at file `offset` into `buf` (int address or writable
        buffer object; nbytes defaults to its length). offset=None reads at the fd's own
        position in one piece (pipes, FIFOs). checksum=True: the result carries the CRC32C
        of the bytes read, computed by the I/O threads. Returns the request id."""
        return self._submit(_READ, fd, buf, nbytes, offset, checksum)

    def submit_write(
        self, fd: int, buf, nbytes: int | None = None, offset: int | None = 0, *, checksum: bool = False
    ) -> int:
        """Queues a write of `nbytes` of `buf` at file `offset`; as `submit_read`."""
        return self._submit(_WRITE, fd, buf, nbytes, offset, checksum)

    def submit_sync(self, fd: int) -> int:
        """Queues an fdatasync of fd: O_DIRECT bypasses the page cache, not the device's
        write cache, so a crash-consistent commit syncs before flipping its slot map."""
        return self._submit(_SYNC, fd, None, 0, 0, False)

    def _submit(self, op, fd, buf, nbytes, offset, want_crc):
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"{_OP_NAMES[op]}: fd must be an int, got {type(fd).__name__}")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise TypeError(f"{_OP_NAMES[op]}: offset must be an int or None, got {type(offset).__name__}")
        if offset is not None and offset < 0:
            raise ValueError(
                f"{_OP_NAMES[op]}: offset must be >= 0 (or None for the fd's position), got {offset}"
            )
        if op == _SYNC:
            addr, pin = 0, None
        else:
            addr, nbytes, pin = _resolve(buf, nbytes, writable=(op == _READ), what=_OP_NAMES[op])
        s = self._s
        try:
            with s.lock:
                if s.closed:
                    raise ValueError("AioEngine is closed")
                s.active += 1
                handle = s.handle
            try:
                rid = lib.hybrid_aio_submit(
                    handle,
                    op,
                    fd,
                    addr,
                    nbytes,
                    -1 if offset is None else offset,
                    _FLAG_CRC if want_crc else 0,
                )
                if rid > 0:
                    with s.lock:
                        s.requests[rid] = _Request(op, fd, offset, nbytes, pin, want_crc)
            finally:
                with s.lock:
                    s.active -= 1
                    s.idle.notify_all()
        except BaseException:
            if pin is not None:
                pin.release()
            raise
        if rid < 0:
            if pin is not None:
                pin.release()
            raise self._submit_error(int(rid), op, fd, addr, nbytes, offset)
        return int(rid)

    def _describe(self, op, fd, offset, nbytes) -> str:
        path = self._path(fd)
        if op == _SYNC:
            return f"fdatasync of {path}"
        where = "at the descriptor's position" if offset is None else f"at offset {offset}"
        return f"{_OP_NAMES[op]} of {nbytes} bytes {where} {'from' if op == _READ else 'to'} {path}"

    def _submit_error(self, code, op, fd, addr, nbytes, offset) -> AioError:
        what = self._describe(op, fd, offset, nbytes)
        path, a = self._path(fd), self.alignment
        kw = dict(path=path, op=_OP_NAMES[op], offset=offset, nbytes=nbytes, bytes_done=0)
        if code == _EMISALIGNED_BUF:
            return AioAlignmentError(
                _errno.EINVAL,
                f"{what} refused: the file is open with "
                f"O_DIRECT and the buffer address {addr:#x} is not a "
                f"multiple of {a} (use aligned_buffer())",
                **kw,
            )
        if code == _EMISALIGNED_LEN:
            return AioAlignmentError(
                _errno.EINVAL,
                f"{what} refused: the file is open with "
                f"O_DIRECT and {nbytes} bytes is not a multiple of {a} "
                f"(pad to align_up(nbytes) = {align_up(nbytes, a)})",
                **kw,
            )
        if code == _EMISALIGNED_OFF:
            return AioAlignmentError(
                _errno.EINVAL,
                f"{what} refused: the file is open with "
                f"O_DIRECT and offset {offset} is not a multiple of {a}",
                **kw,
            )
        err = -code
        if err == _errno.EAGAIN:
            msg = (
                f"{what} refused: the queue is full ({self.queue_depth} requests submitted "
                f"and not yet waited for); wait() for some first or raise queue_depth"
            )
        elif err == _errno.EBADF:
            mode = "reading" if op == _READ else "writing" if op == _WRITE else "I/O"
            msg = f"{what} refused: fd {fd} is not an open descriptor for {mode}"
        elif err == _errno.ESHUTDOWN:
            msg = f"{what} refused: the engine is closing"
        else:
            msg = f"{what} refused: {os.strerror(err)} ({_errname(err)})"
        return AioError(err, msg, **kw)

    def wait(self, ids=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[AioResult]:
        """Waits for the given request ids (an int, an iterable, or None: every outstanding
        request) and returns their results in the same order.

        Raises AioError(ETIMEDOUT) when they have not all finished within timeout_s (nothing
        is consumed then: wait again, or close()); AioError for the first failed request
        otherwise, after every one of them has finished and been consumed (`e.results`,
        `e.failures` carry them all). Every id is waited for once.
        """
        if not (
            isinstance(timeout_s, (int, float))
            and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s)
            and timeout_s >= 0
        ):
            raise ValueError(
                f"wait: timeout_s must be a finite number >= 0 (every wait is bounded), got {timeout_s!r}"
            )
        s = self._s
        with s.lock:
            if s.closed:
                raise ValueError("AioEngine is closed")
            if ids is None:
                ids = list(s.requests)
            else:
                try:
                    ids = [operator.index(ids)]
                except TypeError:
                    ids = [operator.index(i) for i in ids]
                for i in ids:
                    if i not in s.requests:
                        raise ValueError(
                            f"wait: request id {i!r} is not outstanding "
                            f"(never submitted here, or already waited for)"
                        )
                if len(set(ids)) != len(ids):
                    raise ValueError("wait: the same request id is given twice")
            if not ids:
                return []
            s.active += 1
            handle = s.handle
        n = len(ids)
        c_ids = (ctypes.c_int64 * n)(*ids)
        out = (_Result * n)()
        try:
            rc = lib.hybrid_aio_wait(handle, c_ids, n, min(int(timeout_s * 1e9), 1 << 62), out)
        finally:
            with s.lock:
                s.active -= 1
                s.idle.notify_all()
        if rc == -_errno.ETIMEDOUT:
            raise self._timeout_error(ids, timeout_s)
        if rc == -_errno.ESHUTDOWN:
            raise AioError(_errno.ESHUTDOWN, f"wait: the engine was closed while waiting for {n} request(s)")
        if rc != 0:
            raise ValueError(
                f"wait: request ids {ids} are not all outstanding (another thread waited for one of them)"
            )
        results, failures = [], []
        with s.lock:
            reqs = [s.requests.pop(i) for i in ids]
        for i, req, res in zip(ids, reqs, out):
            if req.pin is not None:
                req.pin.release()
            results.append(
                AioResult(
                    i,
                    _OP_NAMES[req.op],
                    req.fd,
                    self._path(req.fd),
                    req.offset,
                    req.nbytes,
                    res.bytes_done,
                    res.crc if req.crc and res.error == 0 else None,
                )
            )
            if res.error:
                failures.append(self._request_error(i, req, res))
        if failures:
            first = failures[0]
            first.results, first.failures = results, failures
            raise first
        return results

    def _request_error(self, rid, req, res) -> AioError:
        what = self._describe(req.op, req.fd, req.offset, req.nbytes)
        done = "read" if req.op == _READ else "written"
        if req.op == _SYNC:
            msg = f"{what} failed: {os.strerror(res.error)} ({_errname(res.error)})"
        elif res.eof:
            msg = (
                f"{what} failed: short read, end of file at offset {res.error_offset} "
                f"({_errname(res.error)}); {res.bytes_done} bytes {done}"
            )
        else:
            at = (
                f" at offset {res.error_offset}"
                if req.offset is not None
                else f" after {res.error_offset} bytes"
            )
            msg = (
                f"{what} failed{at}: {os.strerror(res.error)} ({_errname(res.error)}); "
                f"{res.bytes_done} bytes {done}"
            )
        if res.error in _HINTS and not res.eof:
            msg += f" — {_HINTS[res.error]}"
        return AioError(
            res.error,
            msg,
            path=self._path(req.fd),
            op=_OP_NAMES[req.op],
            offset=req.offset,
            nbytes=req.nbytes,
            bytes_done=res.bytes_done,
            error_offset=res.error_offset,
            request_id=rid,
        )

    def _timeout_error(self, ids, timeout_s) -> AioError:
        s = self._s
        with s.lock:
            pending = [i for i in ids if s.handle is not None and lib.hybrid_aio_done(s.handle, i) == 0]
            rid = pending[0] if pending else ids[0]
            first = s.requests.get(rid)
        if first is None:  # another thread took it meanwhile
            return AioError(_errno.ETIMEDOUT, f"wait timed out after {timeout_s:g} s")
        return AioError(
            _errno.ETIMEDOUT,
            f"wait timed out after {timeout_s:g} s with {len(pending)} of {len(ids)} "
            f"request(s) unfinished, first: "
            f"{self._describe(first.op, first.fd, first.offset, first.nbytes)}; the "
            f"device is stalled or the descriptor never delivers. The requests stay "
            f"outstanding: wait() again or close()",
            path=self._path(first.fd),
            op=_OP_NAMES[first.op],
            offset=first.offset,
            nbytes=first.nbytes,
            bytes_done=0,
            request_id=rid,
        )

    def set_notify(self, fd: int) -> None:
        """From now on each request that finishes writes 8 bytes holding 1 to `fd` (an eventfd:
        os.eventfd), so a caller can sleep in select()/poll() on it and on its other descriptors
        until a result is there, instead of polling done() on a timer. -1 stops it. The engine
        does not own `fd`: close it after close()."""
        s = self._s
        with s.lock:
            if s.closed:
                raise ValueError("AioEngine is closed")
            rc = lib.hybrid_aio_set_notify(s.handle, fd)
        if rc != 0:
            raise ValueError(f"set_notify: fd must be -1 or a descriptor, got {fd}")

    def done(self, rid: int) -> bool:
        """Whether request `rid` has finished (its result still awaits `wait`)."""
        s = self._s
        with s.lock:
            if s.closed:
                raise ValueError("AioEngine is closed")
            if rid not in s.requests:
                raise ValueError(f"done: request id {rid!r} is not outstanding")
            return lib.hybrid_aio_done(s.handle, rid) == 1

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet waited for."""
        with self._s.lock:
            return len(self._s.requests)

    # -- blocking helpers ----------------------------------------------------------------

    def read(
        self,
        fd: int,
        buf,
        nbytes: int | None = None,
        offset: int | None = 0,
        *,
        checksum: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> AioResult:
        """submit_read + wait."""
        return self.wait([self.submit_read(fd, buf, nbytes, offset, checksum=checksum)], timeout_s)[0]

    def write(
        self,
        fd: int,
        buf,
        nbytes: int | None = None,
        offset: int | None = 0,
        *,
        checksum: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> AioResult:
        """submit_write + wait."""
        return self.wait([self.submit_write(fd, buf, nbytes, offset, checksum=checksum)], timeout_s)[0]

    # -- life cycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._s.closed

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancels requests not yet started, gives running system calls `timeout_s` to end
        (then cancels their threads), joins every thread. Idempotent. Outstanding requests
        are dropped unreported; registered fds stay open (they belong to the caller)."""
        if self._finalizer.detach() is None:
            return
        cancelled = self._s.shutdown(timeout_s)
        if cancelled:
            warnings.warn(
                f"AioEngine.close: {'some' if cancelled < 0 else cancelled} I/O "
                f"thread(s) still inside a system call after {timeout_s:g} s were "
                f"cancelled" + (" (one could not be joined; its memory is kept)" if cancelled < 0 else ""),
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.outstanding} outstanding"
        return (
            f"AioEngine(threads={self.threads}, queue_depth={self.queue_depth}, "
            f"chunk_bytes={self.chunk_bytes}, {state})"
        )
