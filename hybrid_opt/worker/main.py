"""The worker process: steps host-tier subgroups on shared memory it is handed by descriptor.

Started by WorkerClient as a fresh interpreter (`python -m hybrid_opt.worker.main CONFIG`), never
through multiprocessing. It imports no torch: it maps the trainer's arena and calls the C kernels
on raw addresses. Invariant: it owns nothing that must survive it (every byte of state is the
trainer's) and exits when its request pipe reports EOF. CONFIG, the nvme pipeline and the test-only
fault injection: docs/internals.md."""

from __future__ import annotations

import collections
import ctypes
import json
import mmap
import os
import select
import shutil
import signal
import sys
import time
from typing import TYPE_CHECKING

from hybrid_opt.populate import BackgroundPopulate
from hybrid_opt.shm import address, no_huge_pages, populate
from hybrid_opt.worker import protocol as proto
from hybrid_opt.worker.arena_steps import ArenaSteps

if TYPE_CHECKING:
    from cpu_kernels.aio import AioEngine

IOV_BATCH = 512  # iovecs per process_vm_readv call (the kernel's limit is 1024)
IO_POLL_S = 0.0005  # between looks at the nvme I/O in flight, where no eventfd tells of it
# the longest sleep with nvme I/O in flight and its eventfd set: a bound, never reached while
# the engines tell of each finished request (a lost wake-up would cost this much, no more)
IO_WAIT_S = 0.05


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return libc


class _Fault:
    def __init__(self, spec: str | None):
        self.stage, self.at = None, 0
        if spec:
            stage, _, k = spec.partition(":")
            self.stage, self.at = stage, int(k or 1)
        self.steps = 0

    def count(self) -> None:
        self.steps += 1

    def maybe_die(self, stage: str) -> None:
        if self.stage == stage and self.steps == self.at:
            if stage == "raise":
                raise RuntimeError("fault injected by HYBRID_OPT_WORKER_FAULT")
            os.kill(os.getpid(), signal.SIGKILL)


class Worker:
    def __init__(self, cfg: dict):
        cores = cfg.get("cores")
        if cores and hasattr(os, "sched_setaffinity"):
            # before the C library loads: OpenMP's threads inherit this thread's affinity
            os.sched_setaffinity(0, cores)
        from cpu_kernels import _lib  # noqa: PLC0415  (after the affinity is set)

        # the kernels' threads: the worker's own count, or a task's (Task.threads: a step the
        # trainer waits for, on cores the trainer shares with it and does not use meanwhile)
        self.threads = int(cfg.get("threads") or 0) or _lib.get_num_threads()
        self._threads_now = self.threads
        _lib.set_num_threads(self.threads)
        self._set_threads = _lib.set_num_threads
        # split cores: such a step runs on the trainer's cores too (waited_cores), its threads
        # moved there for it and back to the worker's own (`cores`) for the next speculated step
        self.cores = list(cores or ())
        self.waited_cores = list(cfg.get("waited_cores") or ()) or None
        # a step the trainer waits for: its threads (OP_TRAINER_WAITS gives them to steps queued
        # during backward once step() waits for them; 0: none beyond the worker's own)
        self.waited_threads = int(cfg.get("waited_threads") or 0)
        self._wide = False
        self._set_cpus = _lib.set_thread_cpus
        self.mm = mmap.mmap(
            cfg["arena_fd"], cfg["arena_nbytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        no_huge_pages(self.mm)  # as the trainer's mapping: 4 KiB pages, as every budget counted
        # the trainer allocated the pages; map them all now rather than a fault per 4 KB in
        # the first steps on each bank; the ranges it populates in the background (spare
        # banks) are mapped here in the background too, in the same order, so the two threads
        # share the pages' first touch. Dormant spare banks are left alone: their memory is
        # allocated when the trainer wakes them (HostTier.wake_spares), and this side faults
        # their pages in on first use
        later = [tuple(r) for r in cfg.get("populate_later") or ()]
        populate(self.mm, skip=later + [tuple(r) for r in cfg.get("dormant") or ()])
        self._populating = (
            BackgroundPopulate(address(self.mm), later, "the worker's arena") if later else None
        )
        # the kernels over this mapping (the trainer's inline steps use the same class)
        self.steps = ArenaSteps(cfg, ctypes.addressof(ctypes.c_char.from_buffer(self.mm)), self._kernel)
        self.req, self.resp = proto.low_numbered(cfg["req_fd"]), cfg["resp_fd"]
        self.fault = _Fault(os.environ.get("HYBRID_OPT_WORKER_FAULT"))
        self.nvme = cfg.get("nvme")
        self.parent = os.getppid()
        self.trainer = int(cfg.get("trainer_pid") or self.parent)
        self.libc = _libc()
        self.aio: AioEngine | None = None
        self.aio_write: AioEngine | None = None
        self.notify = -1  # the nvme engines' eventfd (_notify_fd), or -1: their I/O is polled
        self._waiter: select.poll | None = None  # polls the request pipe and `notify` at once
        # the trainer's descriptors of the nvme files, inherited (O_DIRECT as it opened them)
        self.fds = {int(sg): fd for sg, fd in (cfg.get("file_fds") or {}).items()}
        if self.nvme:
            from cpu_kernels.aio import AioEngine  # noqa: PLC0415

            # reads and writes on engines of their own: a swap-out does not queue behind the
            # prefetched swap-ins (nor they behind it), so the disk sees both streams at once
            threads = int(self.nvme.get("threads", 4))
            self.aio = AioEngine(threads=threads, queue_depth=256)
            self.aio_write = AioEngine(threads=threads, queue_depth=256)
            for sg, fd in self.fds.items():  # their errors name the file
                path = os.path.join(self.nvme["dir"], f"sg{sg}.state")
                self.aio.register(fd, path)
                self.aio_write.register(fd, path)
            # a finished read or write wakes the serve loop through this eventfd: it sleeps until
            # a request or a result is there (polling done() every 0.5 ms cost a wake-up each,
            # each one taking a core from the trainer's forward and backward on a CPU-only host)
            self.notify = _notify_fd()
            if self.notify >= 0:
                self._waiter = select.poll()
                for fd in (self.req, self.notify):
                    self._waiter.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
                for engine in (self.aio, self.aio_write):
                    engine.set_notify(self.notify)

    # ------------------------------------------------------------------ nvme swap
    def _file(self, sg: int) -> int:
        fd = self.fds.get(sg)
        if fd is None:
            raise ValueError(
                f"subgroup {sg} has no nvme file: the trainer handed this worker "
                f"descriptors for subgroups {sorted(self.fds)} only (a task for a "
                f"subgroup not on the nvme tier; a bug in hybrid_opt, please report it)"
            )
        return fd

    def _submit_swap(self, t: proto.Task) -> tuple:
        """(the engine, its request) of swap task `t` (a worker with an nvme tier)."""
        assert self.nvme is not None and self.aio is not None and self.aio_write is not None
        io = self.nvme["io_bytes"]
        addr = self.steps.bank_start(t.in_bank)
        fd = self._file(t.subgroup)
        if t.op == proto.OP_SWAP_IN:
            return self.aio, self.aio.submit_read(fd, addr, io, t.file_slot * io, checksum=True)
        return self.aio_write, self.aio_write.submit_write(fd, addr, io, t.file_slot * io, checksum=True)

    def _finish_swap(self, t: proto.Task, req) -> proto.Result:
        from cpu_kernels.aio import AioError  # noqa: PLC0415

        engine, rid = req
        try:
            (res,) = engine.wait([rid], timeout_s=60.0)
        except AioError as e:
            return proto.Result(t.op, t.task_id, proto.STATUS_ERROR, t.subgroup, message=f"AioError: {e}")
        if t.op == proto.OP_SWAP_IN and res.crc != t.crc:
            return proto.Result(
                t.op,
                t.task_id,
                proto.STATUS_ERROR,
                t.subgroup,
                message=(
                    f"checksum mismatch in {res.path} slot {t.file_slot}: expected CRC32C "
                    f"{t.crc:08x}, read {res.crc:08x}; the file is corrupt (disk fault or outside "
                    f"write) — restore from a checkpoint"
                ),
            )
        return proto.Result(t.op, t.task_id, proto.STATUS_OK, t.subgroup, crc=res.crc or 0)

    def gather(self, t: proto.Task) -> None:
        """Reads a piece's grads from the trainer's memory into its staging slot (remote
        gather: the trainer's backward does not spend its own core copying them)."""
        dst = self.steps.slot(t.slot)
        reads = []
        for off, addr, nbytes in proto.GATHER.iter_unpack(t.gather):
            if off < 0 or nbytes < 0 or off + nbytes > self.steps.slot_stride:
                raise ValueError(f"gather entry ({off}, {nbytes}) outside the staging slot")
            if addr == 0:
                ctypes.memset(dst + off, 0, nbytes)
            elif nbytes:
                reads.append((dst + off, addr, nbytes))
        for k in range(0, len(reads), IOV_BATCH):
            batch = reads[k : k + IOV_BATCH]
            local = (_IoVec * len(batch))(*[_IoVec(d, n) for d, _, n in batch])
            remote = (_IoVec * len(batch))(*[_IoVec(a, n) for _, a, n in batch])
            want = sum(n for _, _, n in batch)
            got = self.libc.process_vm_readv(self.trainer, local, len(batch), remote, len(batch), 0)
            if got != want:
                err = ctypes.get_errno()
                raise OSError(
                    err,
                    f"process_vm_readv from the trainer (pid {self.trainer}) read "
                    f"{got} of {want} bytes: {os.strerror(err) if got < 0 else 'short read'}",
                )

    def step(self, t: proto.Task) -> proto.Result:
        self.fault.count()
        self.fault.maybe_die("before_step")
        self.fault.maybe_die("raise")
        r = self.steps.step(t)
        if r.status == proto.STATUS_OK:
            self.fault.maybe_die("after_step")
        return r

    def _kernel(self, call, argv: list) -> None:
        """A piece's kernel calls (ArenaSteps' run_kernel): the mid_step fault writes the first
        half of each, then kills the worker: a torn write."""
        if self.fault.stage == "mid_step" and self.fault.steps == self.fault.at:
            for a in argv:
                a.n //= 2
            call(argv)
            self.fault.maybe_die("mid_step")  # never returns: the stage and step are this one's
        call(argv)

    def _use_threads(self, t: proto.Task) -> None:
        want = t.threads or self.threads
        wide = bool(t.threads) and self.waited_cores is not None and bool(self.cores)
        if wide != self._wide and self.waited_cores is not None:
            # every pool thread a region may take (the widest team's worth) moves; a core the
            # OS refuses leaves a thread where it was: slower, the same bits
            self._set_cpus(self.waited_cores if wide else self.cores, len(self.waited_cores))
            self._wide = wide
        if want != self._threads_now:
            self._set_threads(want)
            self._threads_now = want

    def _run(self, t: proto.Task) -> proto.Result:
        t0 = time.perf_counter_ns()
        try:
            if t.op in (proto.OP_STEP, proto.OP_INVERSE):
                self._use_threads(t)
            if t.gather:
                self.gather(t)
            if t.op == proto.OP_STEP:
                r = self.step(t)
            elif t.op == proto.OP_INVERSE:
                r = self.steps.inverse(t)
            else:
                r = proto.Result(t.op, t.task_id, proto.STATUS_OK, t.subgroup)
        except Exception as e:  # comes back to the trainer as an exception there
            r = proto.Result(
                t.op, t.task_id, proto.STATUS_ERROR, t.subgroup, message=f"{type(e).__name__}: {e}"
            )
        r.elapsed_ns = time.perf_counter_ns() - t0
        return r

    def serve(self) -> int:
        reader = proto.FrameReader(self.req)
        queue: collections.deque = collections.deque()  # tasks not yet run, arrival order
        io: dict = {}  # task_id -> (task, aio request id, start ns)
        reading: set = set()  # banks whose swap-in has not been verified yet
        held: collections.deque = collections.deque()  # swap-ins waiting for room to be read
        ran = False  # the last turn ran a task from the queue
        while True:
            if not reader.eof:
                # a queue the last turn ran from may hold more that can run: look again at once;
                # one waiting for I/O (or none) sleeps until a request or a result comes
                if not (queue or io or held):
                    wait_s = None
                elif (queue and ran) or not io:
                    wait_s = 0.0
                else:
                    wait_s = IO_POLL_S if self.notify < 0 else IO_WAIT_S
                if self._readable(wait_s, io):
                    reader.feed()
                    for payload in reader.frames():
                        t = proto.Task.unpack(payload)
                        if t.op == proto.OP_EXIT:
                            return 0
                        if t.op == proto.OP_TRAINER_WAITS:
                            self._trainer_waits(queue)
                            continue
                        if t.op == proto.OP_SWAP_IN:  # read at once (the prefetch), as there is room
                            reading.add(t.in_bank)
                            held.append(t)
                        else:
                            queue.append(t)
            if reader.eof:
                # the trainer is gone (reparented: not merely a closed pipe): leave nothing behind
                if self.nvme and self._parent_gone():
                    shutil.rmtree(self.nvme["dir"], ignore_errors=True)
                return 0
            for tid in [k for k, (t, (eng, rid), _) in io.items() if eng.done(rid)]:
                t, req, t0 = io.pop(tid)
                r = self._finish_swap(t, req)
                r.elapsed_ns = time.perf_counter_ns() - t0
                reading.discard(t.in_bank)
                self._reply(r)
            self._start_swap_ins(held, io, reading)
            # run what is runnable, in order; a task waits only for earlier work on its banks
            blocked: set = set()
            ran = False
            for t in list(queue):
                banks = (
                    {t.in_bank}
                    if t.op != proto.OP_STEP or t.out_bank == proto.NO_BANK
                    else {t.in_bank, t.out_bank}
                )
                if t.op in (proto.OP_PING, proto.OP_EXIT):
                    banks = set()
                if banks & (blocked | reading) or (t.op == proto.OP_SWAP_OUT and self._full(self.aio_write)):
                    blocked |= banks  # what follows on its banks waits for it
                    continue
                queue.remove(t)
                if t.op == proto.OP_SWAP_OUT:
                    self._submit(t, io)
                else:
                    self._reply(self._run(t))
                ran = True
                break  # one compute task per turn: new requests and finished I/O come first

    def _trainer_waits(self, queue) -> None:
        """The trainer waits in step() now: the steps it queued during backward (speculated, on the
        worker's own threads) run on the waited step's, as the ones step() sends do."""
        if self.waited_threads:
            for t in queue:
                if t.op in (proto.OP_STEP, proto.OP_INVERSE) and not t.threads:
                    t.threads = self.waited_threads

    def _readable(self, wait_s: float | None, io: dict) -> bool:
        """Whether the request pipe has data (or EOF) within `wait_s` seconds (None: no bound).
        With the nvme engines' eventfd, a finished read or write ends the wait too (the count
        is taken: the caller looks at every request in flight next)."""
        if self._waiter is None or not io:
            return proto.readable(self.req, wait_s)
        ready = dict(self._waiter.poll(None if wait_s is None else wait_s * 1000.0))
        if self.notify in ready:
            try:
                os.read(self.notify, 8)
            except BlockingIOError:
                pass
        return self.req in ready

    @staticmethod
    def _full(engine) -> bool:
        """Whether `engine` takes no more requests now (one more submit would raise EAGAIN)."""
        return engine.outstanding >= engine.queue_depth

    def _start_swap_ins(self, held, io: dict, reading: set) -> None:
        """Submits the swap-ins held back, in arrival order, while the read engine has room: the
        trainer's prefetch sends one per free bank, which can be more than its queue_depth (a
        few hundred nvme subgroups with as many spare banks failed a step at every step)."""
        while held and not self._full(self.aio):
            t = held.popleft()
            if not self._submit(t, io):
                reading.discard(t.in_bank)

    def _submit(self, t: proto.Task, io: dict) -> bool:
        """Submits swap task `t` (in flight in `io` from now); a refusal goes back to the
        trainer as its result (False)."""
        try:
            io[t.task_id] = (t, self._submit_swap(t), time.perf_counter_ns())
            return True
        except Exception as e:
            self._reply(
                proto.Result(
                    t.op, t.task_id, proto.STATUS_ERROR, t.subgroup, message=f"{type(e).__name__}: {e}"
                )
            )
            return False

    def _parent_gone(self, within_s: float = 1.0) -> bool:
        # the pipe closes while the trainer exits, a moment before we are reparented
        deadline = time.monotonic() + within_s
        while os.getppid() == self.parent:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _reply(self, r: proto.Result) -> None:
        proto.write_frame(self.resp, r.pack())


def _notify_fd() -> int:
    """A non-blocking eventfd for the nvme engines to tell of finished requests, or -1 where
    the platform has none (the serve loop then polls them)."""
    if not hasattr(os, "eventfd"):
        return -1
    try:
        return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    except OSError:
        return -1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "--config-fd":  # WorkerClient's way: the configuration in a file it inherits
        with os.fdopen(int(argv[1]), "rb") as f:
            cfg = json.loads(f.read())
    else:
        cfg = json.loads(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        return Worker(cfg).serve()
    except BrokenPipeError:
        return 0  # the trainer closed its end while we answered


if __name__ == "__main__":
    sys.exit(main())
