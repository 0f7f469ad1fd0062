"""Messages between trainer and worker: length-prefixed binary frames over two pipes.

A pipe of fixed-layout structs, not a pickling queue: an empty round trip costs tens of
microseconds, and the pipe doubles as the liveness signal — the trainer reads EOF when the
worker dies, the worker reads EOF when the trainer dies and then exits (no orphans).
The payload of a request is a Task, plus its gather list; of a reply a Result, plus a
UTF-8 message on error.
Task and result name the subgroup, so every error can say which one failed.
"""

from __future__ import annotations

import os
import select
import struct
from dataclasses import dataclass, fields
from operator import attrgetter

OP_STEP, OP_INVERSE, OP_PING, OP_EXIT, OP_SWAP_IN, OP_SWAP_OUT = 1, 2, 3, 4, 5, 6
# no reply: the trainer waits in step() from now on, so every step queued before this one runs
# on the waited step's threads (Task.threads: the worker's `waited_threads`), not its own count
OP_TRAINER_WAITS = 7
STATUS_OK, STATUS_NONFINITE, STATUS_ERROR = 0, 1, 2
NO_BANK = -1  # out_bank for an in-place step
NO_COPY = -1  # copy_dtype when no param copy is written
# a task's dtype codes (grad_dtype, the moments'): bytes per element; 3 is a q8 code
DTYPE_SIZES = {0: 4, 1: 2, 2: 2, 3: 1}

_HEADER = struct.Struct("<I")


@dataclass
class Task:
    op: int
    task_id: int
    subgroup: int = 0
    numel: int = 0  # elements of this piece
    in_bank: int = 0
    out_bank: int = NO_BANK  # spare bank (exact mode) or NO_BANK (in place)
    elem_offset: int = 0  # first element of this piece inside the subgroup's bank
    slot: int = 0  # staging slot holding this piece's grads (from its start)
    grad_dtype: int = 0
    copy_dtype: int = NO_COPY
    amsgrad: int = 0
    decoupled: int = 1
    skip_nonfinite: int = 1  # check grads first; a non-finite piece is not stepped
    step: int = 1
    lr: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    weight_decay: float = 0.0
    grad_scale: float = 1.0
    file_slot: int = 0  # swap ops: which of the subgroup's two file slots
    crc: int = 0  # OP_SWAP_IN: the CRC32C the slot must have
    remainder: int = 0  # OP_STEP: the master is the bank's copy region (bf16) + int16 "rem"
    threads: int = 0  # OP_STEP / OP_INVERSE: the kernel's threads (0: the worker's own count)
    out_copy: int = -1  # OP_STEP: arena byte offset of the out bank's copy slot (-1: its "copy" region)
    in_copy: int = -1  # OP_STEP, remainder: the copy slot the high half is read from (-1: in bank's region)
    # remote gather: GATHER entries (byte offset in the slot, trainer address, bytes) the
    # worker reads from the trainer's memory into the slot first (address 0: zeros); the
    # trainer hands the entries to write_task, the worker reads them packed here
    gather: bytes = b""

    _STRUCT = struct.Struct("<B" + "q" * 7 + "i" * 5 + "q" + "d" * 6 + "iIiiqq")

    def pack(self) -> bytes:
        # the fields read directly (dataclasses.astuple deep-copies each one: ~20 us a task
        # on the trainer's core, most of what a send cost)
        return self._STRUCT.pack(*_TASK_FIELDS(self)) + self.gather

    @classmethod
    def unpack(cls, payload: bytes) -> "Task":
        head = cls._STRUCT.size
        # the struct's fields are those before `gather` (mypy cannot count a starred tuple)
        return cls(*cls._STRUCT.unpack(payload[:head]), gather=payload[head:])  # type: ignore[misc]


_TASK_FIELDS = attrgetter(*[f.name for f in fields(Task)][:-1])  # the struct's, in order

GATHER = struct.Struct("<qQq")


def pack_gather(entries) -> bytes:
    """[(slot byte offset, trainer address or 0 for zeros, bytes)] -> a Task's gather list."""
    return b"".join(GATHER.pack(*e) for e in entries)


@dataclass
class Result:
    op: int
    task_id: int
    status: int
    subgroup: int = 0
    sum_sq: float = 0.0  # grad_stats of this piece's grads (scaled by nothing)
    finite: int = 1
    elapsed_ns: int = 0
    crc: int = 0  # OP_SWAP_OUT: the CRC32C of the slot just written
    message: str = ""

    _STRUCT = struct.Struct("<BqbqdbqI")

    def pack(self) -> bytes:
        return (
            self._STRUCT.pack(
                self.op,
                self.task_id,
                self.status,
                self.subgroup,
                self.sum_sq,
                self.finite,
                self.elapsed_ns,
                self.crc,
            )
            + self.message.encode()
        )

    @classmethod
    def unpack(cls, payload: bytes) -> "Result":
        head = cls._STRUCT.size
        # the struct's fields are those before `message` (mypy cannot count a starred tuple)
        fields = cls._STRUCT.unpack(payload[:head])
        return cls(*fields, message=payload[head:].decode(errors="replace"))  # type: ignore[misc]


FD_SETSIZE = 1024  # select()'s bound on descriptor numbers
_READY = select.POLLIN | select.POLLHUP | select.POLLERR


def readable(fd: int, timeout_s: float | None) -> bool:
    """Whether `fd` has data (or EOF) within `timeout_s` seconds (None: no bound). select()
    where the number allows it (microsecond timeouts), poll() above FD_SETSIZE: a trainer
    holding thousands of nvme files has its pipes there, and so has its worker, which
    inherits those files with their numbers (select raised 'filedescriptor out of range')."""
    if fd < FD_SETSIZE:
        return bool(select.select([fd], [], [], timeout_s)[0])
    p = select.poll()
    p.register(fd, _READY)
    return bool(p.poll(None if timeout_s is None else timeout_s * 1000.0))


def low_numbered(fd: int) -> int:
    """`fd`, or where it is numbered at FD_SETSIZE or above a duplicate below it (the original
    closed) when a number there is free: readable()'s select() then waits in microseconds,
    not poll()'s whole milliseconds. A worker inheriting thousands of nvme files has its
    request pipe up there, and waited 1 ms instead of 0.5 between polls of its nvme I/O."""
    if fd < FD_SETSIZE:
        return fd
    low = os.dup(fd)  # the lowest free number
    if low >= FD_SETSIZE:
        os.close(low)
        return fd
    os.close(fd)
    return low


def frame(payload: bytes) -> bytes:
    """`payload` as one frame: its length, then itself."""
    return _HEADER.pack(len(payload)) + payload


def write_frame(fd: int, payload: bytes) -> None:
    data = frame(payload)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def write_task(fd: int, task: Task, gather=()) -> None:
    """One task and its gather list (`gather`: pack_gather's entries), packed as one frame (the
    trainer's side of the request pipe). The worker reads the list back as the Task's `gather`."""
    write_frame(fd, task.pack() + pack_gather(gather) if gather else task.pack())


class FrameReader:
    """Reassembles frames from a non-blocking or blocking descriptor."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.eof = False

    def feed(self) -> None:
        """One read; sets eof when the other side has closed."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            self.eof = True
        self.buf += chunk

    def frames(self):
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + n:
                break
            payload = bytes(self.buf[_HEADER.size : _HEADER.size + n])
            del self.buf[: _HEADER.size + n]
            yield payload

    def read_results(self, timeout_s: float | None = None) -> list | None:
        """One read (feed()), and the Results of every frame now complete (the trainer's side
        of the result pipe); eof is set when the worker has closed it. With `timeout_s`, first
        a wait of up to that long for the pipe to be readable: None if it did not become so."""
        if timeout_s is not None and not readable(self.fd, timeout_s):
            return None
        self.feed()
        return [Result.unpack(payload) for payload in self.frames()]
