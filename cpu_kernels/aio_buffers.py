"""cpu_kernels.aio_buffers: what the aio engine (aio.py) is built on — the C library's
declarations, errors and results, buffer resolution and O_DIRECT alignment, and CRC32C
checksums. Imported through `cpu_kernels.aio`, which re-exports the public names."""

from __future__ import annotations

import ctypes
import errno as _errno
import mmap
import os
import threading
import warnings
from typing import NamedTuple

from ._lib import lib

ALIGNMENT = 4096
# Chunks of a few MiB keep every thread busy on one large request while each pwrite stays
# large enough for the device; bench_nvme.py measures the choice on this disk.
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 120.0

_READ, _WRITE, _SYNC = 0, 1, 2
_OP_NAMES = {_READ: "read", _WRITE: "write", _SYNC: "fdatasync"}
_FLAG_CRC = 1
_EMISALIGNED_BUF, _EMISALIGNED_LEN, _EMISALIGNED_OFF = -1001, -1002, -1003
_PyBUF_SIMPLE, _PyBUF_WRITABLE = 0, 1

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Result(ctypes.Structure):  # mirrors hybrid_aio_result_t
    _fields_ = [
        ("id", ctypes.c_int64),
        ("bytes_done", ctypes.c_int64),
        ("error_offset", ctypes.c_int64),
        ("error", ctypes.c_int32),
        ("eof", ctypes.c_int32),
        ("crc", ctypes.c_uint32),
        ("reserved", ctypes.c_int32),
    ]


class _PyBuffer(ctypes.Structure):  # CPython's Py_buffer
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _declare():
    c_i64, c_int, c_vp, c_u32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32
    sig = {
        "hybrid_aio_create": (c_vp, [c_int, c_int, c_i64, c_i64, ctypes.POINTER(c_int)]),
        "hybrid_aio_submit": (c_i64, [c_vp, c_int, c_int, c_vp, c_i64, c_i64, c_int]),
        "hybrid_aio_wait": (c_int, [c_vp, ctypes.POINTER(c_i64), c_int, c_i64, ctypes.POINTER(_Result)]),
        "hybrid_aio_done": (c_int, [c_vp, c_i64]),
        "hybrid_aio_set_notify": (c_int, [c_vp, c_int]),
        "hybrid_aio_outstanding": (c_int, [c_vp]),
        "hybrid_aio_shutdown": (None, [c_vp]),
        "hybrid_aio_destroy": (c_int, [c_vp, c_i64]),
        "hybrid_crc32c": (c_u32, [c_u32, c_vp, c_i64]),
        "hybrid_crc32c_portable": (c_u32, [c_u32, c_vp, c_i64]),
        "hybrid_crc32c_combine": (c_u32, [c_u32, c_u32, c_i64]),
        "hybrid_crc32c_hw": (c_int, []),
        "hybrid_crc32c_set_hw": (c_int, [c_int]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    api = ctypes.pythonapi
    api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    api.PyObject_GetBuffer.restype = ctypes.c_int
    api.PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
    api.PyBuffer_Release.restype = None


_declare()


# ----------------------------------------------------------------------------------------
# errors and results


class AioError(OSError):
    """A failed, timed-out or refused I/O request. `errno` is set; `filename` is the path.

    Extra attributes (None where they do not apply): `op` ("read"/"write"/"fdatasync"),
    `offset`, `nbytes` (requested), `bytes_done`, `error_offset` (file offset of the first
    failure), `request_id`; after a `wait`, `results` holds every result of that wait and
    `failures` every AioError of it (this one is the first).
    """

    def __init__(
        self,
        err: int,
        message: str,
        *,
        path=None,
        op=None,
        offset=None,
        nbytes=None,
        bytes_done=None,
        error_offset=None,
        request_id=None,
    ):
        super().__init__(err, message)
        self.filename = path
        self.message = message
        self.op, self.offset, self.nbytes = op, offset, nbytes
        self.bytes_done, self.error_offset, self.request_id = bytes_done, error_offset, request_id
        self.results: list[AioResult] = []
        self.failures: list[AioError] = []

    def __str__(self):
        return self.message

    def __reduce__(self):  # survives pickling (e.g. sent back from the worker process)
        return (
            _rebuild_error,
            (
                self.errno,
                self.message,
                dict(
                    path=self.filename,
                    op=self.op,
                    offset=self.offset,
                    nbytes=self.nbytes,
                    bytes_done=self.bytes_done,
                    error_offset=self.error_offset,
                    request_id=self.request_id,
                ),
            ),
        )


class AioAlignmentError(AioError, ValueError):
    """An O_DIRECT request whose buffer address, length or offset breaks the alignment rule."""


def _rebuild_error(err, message, kwargs):
    return AioError(err, message, **kwargs)


class AioResult(NamedTuple):
    """One finished request: `crc` is its CRC32C when submitted with checksum=True, else None."""

    id: int
    op: str
    fd: int
    path: str
    offset: int | None
    nbytes: int
    bytes_done: int
    crc: int | None


def _errname(err: int) -> str:
    return _errno.errorcode.get(err, f"errno {err}")


_HINTS = {
    _errno.ENOSPC: "the filesystem is full: free space there or put the files elsewhere",
    _errno.EFBIG: "a file-size limit was hit (the process's RLIMIT_FSIZE / `ulimit -f`, "
    "or the filesystem's largest file)",
    _errno.EINVAL: "with O_DIRECT the filesystem may refuse this alignment or direct I/O itself",
}


# ----------------------------------------------------------------------------------------
# buffers and checksums


class _Pinned:
    """A buffer export held for the life of a request (or of one checksum call)."""

    __slots__ = ("view", "held")

    def __init__(self, obj, writable: bool):
        self.view = _PyBuffer()
        # raises the exporter's own TypeError/BufferError (e.g. read-only or not contiguous)
        ctypes.pythonapi.PyObject_GetBuffer(
            obj, ctypes.byref(self.view), _PyBUF_WRITABLE if writable else _PyBUF_SIMPLE
        )
        self.held = True

    @property
    def address(self) -> int:
        return self.view.buf or 0

    @property
    def nbytes(self) -> int:
        return self.view.len

    def release(self):
        if self.held:
            self.held = False
            ctypes.pythonapi.PyBuffer_Release(ctypes.byref(self.view))


def _resolve(buf, nbytes, writable: bool, what: str):
    """(address, nbytes, export or None) for an int address or a buffer-protocol object."""
    if isinstance(buf, bool):
        raise TypeError(f"{what}: buffer must be an int address or a buffer object, got a bool")
    if isinstance(buf, int):
        if nbytes is None:
            raise TypeError(f"{what}: nbytes is required with an int address")
        if buf < 0:
            raise ValueError(f"{what}: address must be >= 0, got {buf}")
        return buf, _check_nbytes(nbytes, what), None
    try:
        pin = _Pinned(buf, writable)
    except (TypeError, ValueError, BufferError) as e:
        need = "a writable, contiguous" if writable else "a contiguous"
        raise (ValueError if isinstance(e, ValueError) else TypeError)(
            f"{what}: the buffer must be an int address or {need} object "
            f"exposing the buffer protocol, got {type(buf).__name__} ({e})"
        ) from None
    if nbytes is None:
        nbytes = pin.nbytes
    else:
        nbytes = _check_nbytes(nbytes, what)
        if nbytes > pin.nbytes:
            pin.release()
            raise ValueError(f"{what}: nbytes={nbytes} exceeds the buffer's {pin.nbytes} bytes")
    return pin.address, nbytes, pin


def _check_nbytes(nbytes, what):
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"{what}: nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"{what}: nbytes must be >= 0, got {nbytes}")
    return nbytes


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """`n` rounded up to a multiple of `alignment` (the padded length of an O_DIRECT tail)."""
    return -(-n // alignment) * alignment


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` of zeroed anonymous memory, page-aligned (so O_DIRECT-aligned for any
    `alignment` up to the page size). Use `align_up` for the length of an O_DIRECT transfer.
    Freed when the mmap is closed or collected; pass it straight to submit_read/submit_write."""
    nbytes = _check_nbytes(nbytes, "aligned_buffer")
    if nbytes == 0:
        raise ValueError("aligned_buffer: nbytes must be > 0 (an mmap cannot be empty)")
    return mmap.mmap(
        -1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )


def checksum(buf, nbytes: int | None = None, *, seed: int = 0) -> int:
    """CRC32C (Castagnoli) of `nbytes` bytes of `buf` (an int address, or a buffer object:
    its whole length by default). Deterministic across machines and code paths;
    `checksum(b, seed=checksum(a)) == checksum(a + b)`. SSE4.2 three-stream loop when the
    CPU has it (~20 GB/s in cache, ~10 GB/s from DRAM on one core), a table fallback else."""
    return _crc(lib.hybrid_crc32c, buf, nbytes, seed)


def _checksum_portable(buf, nbytes: int | None = None, *, seed: int = 0) -> int:
    """The table path of `checksum`, whatever the CPU has (tests compare the two)."""
    return _crc(lib.hybrid_crc32c_portable, buf, nbytes, seed)


def _crc(fn, buf, nbytes, seed):
    if not 0 <= seed < 2**32:
        raise ValueError(f"checksum: seed must be a 32-bit unsigned int, got {seed}")
    addr, n, pin = _resolve(buf, nbytes, writable=False, what="checksum")
    try:
        return fn(seed, addr, n) if n else seed
    finally:
        if pin is not None:
            pin.release()


def checksum_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of A+B from checksum(A), checksum(B) and len(B)."""
    return lib.hybrid_crc32c_combine(crc_a, crc_b, len_b)


_CHECKSUM_IMPLS = ("portable", "sse4.2", "vpclmulqdq")


def checksum_impl() -> str:
    """The path `checksum` uses on this CPU: "vpclmulqdq" (a carry-less fold, 512 bits at a time,
    where the CPU has AVX-512 VPCLMULQDQ: Ice Lake, Zen 4 and later), "sse4.2" (the crc32
    instruction, three streams) or "portable" (tables)."""
    return _CHECKSUM_IMPLS[lib.hybrid_crc32c_hw()]


def _set_checksum_impl(name: str) -> str:
    """Tests and benchmarks: the path `name` or the best below it this CPU has; returns the path now."""
    return _CHECKSUM_IMPLS[lib.hybrid_crc32c_set_hw(_CHECKSUM_IMPLS.index(name))]


# ----------------------------------------------------------------------------------------
# the engine

_warn_lock = threading.Lock()
_warned_buffered = False


def open_direct(path: str, flags: int, perm: int = 0o600, *, warn: bool = True) -> int:
    """os.open(path, flags | O_DIRECT), or buffered where the filesystem refuses O_DIRECT
    (EINVAL, e.g. an older kernel's tmpfs), then warned of once per process unless not `warn`."""
    if not _O_DIRECT:
        return os.open(path, flags, perm)
    try:
        return os.open(path, flags | _O_DIRECT, perm)
    except OSError as e:
        if e.errno != _errno.EINVAL:
            raise
        if warn:
            _warn_buffered_once(path, e)
        return os.open(path, flags, perm)


def _warn_buffered_once(path: str, err: OSError):
    global _warned_buffered
    with _warn_lock:
        if _warned_buffered:
            return
        _warned_buffered = True
    warnings.warn(
        f"the filesystem holding {path} refuses O_DIRECT ({err.strerror}); using "
        f"buffered I/O for it and any other such file in this process (slower, "
        f"and it fills the page cache)",
        RuntimeWarning,
        stacklevel=3,
    )
