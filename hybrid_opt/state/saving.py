"""`save_state_dict(f)`: what `torch.save(opt.state_dict(), f)` writes, one param's state in memory
at a time.

Each param's entry is made, written into the file and dropped before the next, so a checkpoint of
a state larger than RAM can be taken; the file is torch's zip format, read by `torch.load`. A path
is written whole or not at all. Design notes: docs/internals.md."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pickle
import secrets
import stat
import sys
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.serialization
from torch.serialization import _open_zipfile_writer, location_tag

_get_storage_alignment = getattr(torch.serialization, "_get_storage_alignment", None)  # torch >= 2.7


class _Record(NamedTuple):
    """A storage written as record `data/<key>`: what its pickle names (torch's persistent id)."""

    key: str
    dtype: torch.dtype
    numel: int
    location: str


class _Written(NamedTuple):
    """A state tensor whose bytes are in the file already: pickled as torch pickles a tensor."""

    record: _Record
    shape: tuple


def save(f, sd: dict, entries=None) -> None:
    """Writes `sd` (torch's optimizer state_dict format) into `f`, a path or a writable binary
    file, as torch.save would write it; with `entries` — (param index, entry) pairs, each made
    when asked for — those are its "state", followed by `sd`'s own "state" entries under other
    keys (torch's state_dict carries `opt.state`'s entries under keys that are not params),
    else `sd` is written exactly as it is. A path is written whole or not at all (written_whole)."""
    if not isinstance(f, (str, os.PathLike)):
        return _save(f, sd, entries)
    with written_whole(f, "save_state_dict") as part:
        _save(part, sd, entries)


@contextlib.contextmanager
def written_whole(f, what: str = "save"):
    """Yields the path to write `f`'s new contents to: a new file beside the target (a
    symlink's), synced and renamed over it once the block completes, with the mode the target
    had. A save that fails part-way (a full disk, an interrupt) leaves the file that was there.
    Where the directory takes no new file, the target itself, as torch.save writes it."""
    path = os.path.realpath(os.fspath(f))
    directory = os.path.dirname(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what}: {path} is a directory; pass a file path")
    if not os.path.isdir(directory):
        raise RuntimeError(f"Parent directory {directory} does not exist.")  # torch.save's words
    part = os.path.join(directory, f".{what}-{os.getpid()}-{secrets.token_hex(4)}.part")
    try:  # the mode open() gives a new file (0o666 less the umask), as torch.save's has
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
    except PermissionError:
        yield path
        return
    try:
        yield part
        if os.path.exists(path):
            os.chmod(part, stat.S_IMODE(os.stat(path).st_mode))
        _fsync(part)
        os.replace(part, path)
        _fsync(directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def _save(f, sd: dict, entries) -> None:
    with _open_zipfile_writer(f) as zf:
        writer = _Writer(zf)
        if entries is None:
            return writer.write_pickle(sd)
        state = {}
        # closed on the way out: a save that raised holds no param's state through its traceback
        with contextlib.closing(iter(entries)) as it:
            while (got := next(it, None)) is not None:
                idx, entry = got
                state[idx] = {k: writer.write(v) for k, v in entry.items()}
                del got, entry  # written: dropped before the next param's is made,
                _trim()  # and its memory given back to the OS
        state.update((k, v) for k, v in sd["state"].items() if k not in state)
        writer.write_pickle({**sd, "state": state})


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writer:
    """torch's zip format written as the state is made: each state tensor's bytes at once,
    the pickle and torch's metadata records at the end."""

    def __init__(self, zf):
        self.zf = zf
        self.keys = 0
        self.storages: dict = {}  # key -> a storage met while pickling, written after the pickle
        self.ids: dict = {}  # a pickled storage's _cdata -> its key

    def _key(self) -> str:
        key, self.keys = str(self.keys), self.keys + 1
        return key

    def write(self, value):
        """A state entry's value as it will be pickled: a tensor's bytes written now (its
        stand-in is pickled at the end), anything else as it is."""
        if type(value) is not torch.Tensor:
            return value  # a DTensor (sharded state) is pickled whole at the end, as torch.save pickles it
        t = value.detach()
        if t.numel() >= 2 and t.device.type != "cpu":
            t = t.cpu()  # one param's state on the host at a time (its own elements: no device copy)
        if (
            not t.is_contiguous()
            or t.storage_offset()
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()
        ):
            t = t.clone(
                memory_format=torch.contiguous_format
            )  # a view of a larger buffer (the device tier's)
        if t.numel() < 2:
            return t  # a `step`, a one-element param's state: pickled whole on its device, its own storage
        storage = t.untyped_storage()
        record = _Record(self._key(), t.dtype, t.numel(), location_tag(value.untyped_storage()))
        self.zf.write_record(f"data/{record.key}", storage, storage.nbytes())
        return _Written(record, tuple(t.shape))

    def write_pickle(self, obj: dict) -> None:
        """The checkpoint's pickle (`data.pkl`, every tensor a record already written) and its end."""
        buf = io.BytesIO()
        _Pickler(buf, self).dump(obj)
        data = buf.getvalue()
        self.zf.write_record("data.pkl", data, len(data))
        # torch.save's metadata records, as it writes them
        self.zf.write_record(".format_version", "1", len("1"))
        if _get_storage_alignment is not None:  # torch >= 2.7 writes it
            alignment = str(_get_storage_alignment())
            self.zf.write_record(".storage_alignment", alignment, len(alignment))
        self.zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, storage in self.storages.items():
            if storage.device.type != "cpu":
                storage = storage.cpu()
            self.zf.write_record(f"data/{key}", storage, storage.nbytes())

    def persistent_id(self, obj):
        """torch's persistent id of a storage: ("storage", its legacy type, key, location,
        numel) — for a written tensor's record, and for any other storage met while pickling
        (a `step`, a tensor learning rate in param_groups), written after the pickle."""
        if isinstance(obj, _Record):
            return "storage", _storage_type(obj.dtype), obj.key, obj.location, obj.numel
        if isinstance(obj, torch.storage.TypedStorage):
            storage, kind, numel = (
                obj._untyped_storage,
                getattr(torch, obj._pickle_storage_type()),
                obj._size(),
            )
        elif isinstance(obj, torch.UntypedStorage):
            storage, kind, numel = obj, torch.UntypedStorage, obj.nbytes()
        else:
            return None
        key = self.ids.get(storage._cdata)
        if key is None:
            key = self.ids[storage._cdata] = self._key()
            self.storages[key] = storage
        return "storage", kind, key, location_tag(storage), numel


class _Pickler(pickle.Pickler):
    def __init__(self, buf, writer: _Writer):
        super().__init__(buf, protocol=2)  # torch.save's DEFAULT_PROTOCOL
        self.writer = writer

    def persistent_id(self, obj):
        return self.writer.persistent_id(obj)

    def reducer_override(self, obj):
        if isinstance(obj, _Written):
            n = len(obj.shape)
            stride = tuple(int(torch.Size(obj.shape[i + 1 :]).numel()) for i in range(n))
            return torch._utils._rebuild_tensor_v2, (obj.record, 0, obj.shape, stride, False, OrderedDict())
        return NotImplemented


def _trim() -> None:
    """glibc's malloc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) for
    reuse, in pieces the next param's state may not fit: without this, 64-192 MiB stayed held
    at 16 MiB params (benchmarks/bench_checkpoint.py; 31.7 with it). malloc_trim gives them back;
    elsewhere (musl, macOS) nothing is done."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def _storage_type(dtype: torch.dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
