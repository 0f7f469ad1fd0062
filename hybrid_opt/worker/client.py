"""The trainer's side of the worker: start it, send tasks, wait for results, notice its death.

Every wait is bounded: a worker that dies is seen within ~0.1 s (its end of the result
pipe closes, so the read side reports EOF), one that hangs past `timeout_s` raises
WorkerTimeout naming the subgroups still outstanding (the host tier then kills and replaces it:
unanswered_error()).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from hybrid_opt import forking
from hybrid_opt.distributed.node import NodeInfo, core_slice
from hybrid_opt.distributed.node import info as node_info
from hybrid_opt.worker import protocol as proto

_POLL_S = 0.1


class WorkerError(RuntimeError):
    """The worker raised while stepping a subgroup; the message names it and the cause."""


class WorkerDied(RuntimeError):
    """The worker process is gone (killed, crashed, or exited)."""

    def __init__(self, message: str, pending: list[proto.Task]):
        super().__init__(message)
        self.pending = pending


class WorkerTimeout(RuntimeError):
    pass


# why a worker does not answer, and what to look at (HybridAdamW has no timeout argument)
UNANSWERED = (
    "it may be starved of CPU, swapped out or stopped (SIGSTOP, a debugger): check the "
    "machine's load and memory"
)


class TornState(RuntimeError):
    """rollback='inverse': in-place steps of `subgroups` (their ids) may have written
    part of their state when `why` happened (a worker that died or did not answer, a failed
    piece): only a checkpoint restores them."""

    def __init__(self, why: str, subgroups: list):
        self.why, self.subgroups = why, sorted(subgroups)
        super().__init__(
            f"{why}. rollback='inverse' steps in place, so the state of subgroups "
            f"{self.subgroups} may be torn; restore them from a checkpoint "
            f"(rollback='exact' survives this)"
        )


class TornInterrupt(KeyboardInterrupt):
    """A KeyboardInterrupt (Ctrl-C) that cut rollback='inverse' in-place steps short: still one
    (the program stops), naming the `subgroups` (their ids) that may be torn."""

    def __init__(self, message: str, subgroups: list):
        self.subgroups = sorted(subgroups)
        super().__init__(message)


def _package_root() -> str:
    import hybrid_opt

    return os.path.dirname(os.path.dirname(os.path.abspath(hybrid_opt.__file__)))


def _allow_reads_by(pid: int) -> None:
    """Lets the worker read this process's memory (remote gather) where Yama's ptrace scope 1
    would refuse a child reading its parent: prctl(PR_SET_PTRACER, pid). Without Yama, or
    where it forbids this, nothing changes; the host tier's probe then decides."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, ctypes.c_ulong(pid), 0, 0, 0)  # PR_SET_PTRACER
    except Exception:
        pass


def _thread_counts() -> tuple:
    """(torch's, cpu_kernels') intra-op thread counts, read together before either changes."""
    import torch

    import cpu_kernels

    return torch.get_num_threads(), cpu_kernels.get_num_threads()


def _set_thread_counts(counts: tuple) -> None:
    # cpu_kernels first, torch last: where both share one OpenMP runtime, the last call sets
    # both, and torch's own bookkeeping must hold its count
    import torch

    import cpu_kernels

    cpu_kernels.set_num_threads(max(1, int(counts[1])))
    torch.set_num_threads(max(1, int(counts[0])))


DEFAULT_WORKER_SHARE = 0.5  # the worker's cores on a GPU host, where its params are not on the CPU
# split: the cores a step the trainer waits for leaves to the trainer's own thread, which stages
# the grads meanwhile (on a GPU host it waits on their copies' CUDA events, which spin) and sends
# the params back: a kernel thread sharing its core would hold up the whole team at each barrier
WAITED_TRAINER_CORES = 1


def _ranges(cpus: list) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[list[int]] = []
    cpus = sorted(cpus)
    for k, c in enumerate(cpus):
        if k and c == cpus[k - 1] + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out) or "none"


class CoreSplit:
    """Splits this process's CPUs between the trainer and the worker, and restores them.

    On Linux affinity is per thread: the trainer's mask is applied to every thread it has
    (torch's pools included) and torch's and cpu_kernels' thread counts are sized to it; the
    worker sets its own mask before its OpenMP pool starts. `restore()` puts back each
    thread's old mask and both old thread counts. The two counts are saved and restored as
    one: torch's CPU wheel and cpu_kernels load the same libgomp, so setting either sets both
    (reading cpu_kernels' count after the split and restoring it last left torch at one
    thread). Splits may be restored in any order: one restored while a
    later one is still applied hands what it saved to that later one, so the process gets
    its own masks back when the last one goes (restored out of order otherwise, the process
    would stay pinned to the trainer's share). Several ranks on one node (node.py) each split only
    their own slice of the cores, so no two ranks' workers share a core while the node has
    at least as many cores as ranks.
    """

    # while any split is applied, later splits divide the process's original CPUs, not the
    # trainer's share of them (a second optimizer in the same process gets its own worker core)
    _applied: list = []  # the applied splits, oldest first
    _original: set | None = None

    def __init__(
        self,
        worker_share: float | None = 0.5,
        worker_cores: list[int] | None = None,
        *,
        allowed: list[int] | None = None,
        node: NodeInfo | None = None,
    ):
        """`worker_share`: the worker's fraction of the cores; None: trainer and worker share
        every core (a CPU-only host, where the forward and backward need them all and the host
        step fills the trainer's idle moments). `allowed`: the process's cores (default: its
        affinity, or the original one while other splits are applied); `node`: its place on the
        node (default: node.info()). With several ranks on the node, this rank first takes its
        slice of `allowed` (node.core_slice: disjoint across local ranks) and splits that."""
        if worker_share is not None and not 0.0 < worker_share <= 1.0:
            raise ValueError(f"worker_share must be in (0, 1], got {worker_share}")
        self.saved_masks: dict[int, set[int]] = {}
        self.saved_thread_counts: tuple | None = None
        self.applied = False
        if allowed is not None:
            base = sorted(allowed)
        elif not hasattr(os, "sched_getaffinity"):
            base = []
        else:
            base = sorted(CoreSplit._original or os.sched_getaffinity(0))
        self.node = node_info() if node is None else node
        cpus = core_slice(base, self.node)
        # a rank's slice is pinned even when its trainer and worker share it (one core each)
        self.sliced = set(cpus) != set(base)
        if worker_cores is not None:
            self.worker, self.trainer = list(worker_cores), [c for c in cpus if c not in worker_cores] or cpus
        elif len(cpus) < 2 or worker_share is None:
            self.worker, self.trainer = cpus, cpus  # both share every core (one core: they must)
        else:
            k = min(len(cpus) - 1, max(1, round(len(cpus) * worker_share)))
            self.worker, self.trainer = cpus[-k:], cpus[:-k]
        # sharing, the worker runs DEFAULT_WORKER_SHARE of the cores' worth of threads, which
        # sleep when idle: on 2 cores (bench GPT, offload 1) its one thread beside the trainer's
        # two ran an iteration at 1.09x torch's, two spinning threads at 1.5x, two sleeping 1.13x
        self.shared = worker_cores is None and worker_share is None and len(cpus) > 1
        self.worker_threads = (
            max(1, round(len(cpus) * DEFAULT_WORKER_SHARE)) if self.shared else len(self.worker)
        )
        # a step the trainer waits for (after backward) runs on every core of this rank's slice:
        # sharing, all of them (the trainer sleeps meanwhile); split, the worker's threads move
        # onto the trainer's cores for it, but WAITED_TRAINER_CORES, and back for the next
        # speculated step (the H200's worker stepped 2.75 Gelem/s on its 8 of 16 cores, the
        # in-process kernel 4.96 on all 16). Cores named by worker_cores stay the worker's alone.
        # 0: the worker's own count.
        self.waited_cores = cpus if worker_cores is None and len(cpus) > 1 else []
        keep = 0 if self.shared else WAITED_TRAINER_CORES
        wide = len(self.waited_cores) - keep
        self.waited_threads = wide if self.shared or wide > len(self.worker) else 0

    @staticmethod
    def _threads() -> list[int]:
        try:
            return [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return [0]

    def describe(self, trainer_steps: bool = False) -> str:
        """The arrangement in words (the demo's summary says it). trainer_steps: the trainer runs
        the steps step() waits for itself (HostTier.inline)."""
        if self.shared and trainer_steps:
            return (
                f"shared: the trainer keeps all {len(self.trainer)} cores for forward and backward, and "
                f"runs the host steps step() waits for itself on all of them (no grad copied); the "
                f"worker's {self.worker_threads} sleeping thread(s) speculate during backward where asked"
            )
        if self.shared:
            return (
                f"shared: the trainer keeps all {len(self.trainer)} cores for forward and backward; the "
                f"worker steps on all {self.waited_threads} while step() waits for it, and in "
                f"{self.worker_threads} sleeping thread(s) during backward where it speculates"
            )
        if self.separate and self.widens:
            return (
                f"split: the trainer on cores {_ranges(self.trainer)}, the worker on cores "
                f"{_ranges(self.worker)} during backward, and {self.waited_threads} threads on cores "
                f"{_ranges(self.waited_cores)} while step() waits for it"
            )
        if self.separate:
            return (
                f"split: the trainer on cores {_ranges(self.trainer)}, the worker on cores "
                f"{_ranges(self.worker)}"
            )
        return f"one core ({_ranges(self.worker)}): the trainer and the worker take turns on it"

    @property
    def widens(self) -> bool:
        """Whether a step the trainer waits for runs on cores beyond the worker's own (split
        by worker_share: the trainer's too)."""
        return self.waited_threads > 0 and not self.shared

    @property
    def separate(self) -> bool:
        """Whether the trainer and the worker get cores of their own (two or more cores and a
        settable affinity); if not, they share every core and `apply()` does nothing."""
        return hasattr(os, "sched_setaffinity") and bool(self.trainer) and self.trainer != self.worker

    @property
    def pins(self) -> bool:
        """Whether `apply()` pins the trainer: its cores differ from the worker's, or this
        rank's slice of the node is narrower than the process's cores."""
        return (
            hasattr(os, "sched_setaffinity")
            and bool(self.trainer)
            and (self.trainer != self.worker or self.sliced)
        )

    def apply(self) -> None:
        if not self.pins:
            return
        if not CoreSplit._applied:
            CoreSplit._original = os.sched_getaffinity(0)
        CoreSplit._applied.append(self)
        self.applied = True
        for tid in self._threads():
            try:
                self.saved_masks[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, self.trainer)
            except OSError:
                pass  # the thread ended meanwhile
        self.saved_thread_counts = _thread_counts()
        _set_thread_counts((len(self.trainer), len(self.trainer)))

    def restore(self) -> None:
        if self.applied:
            self.applied = False
            stack = CoreSplit._applied
            k = stack.index(self)
            stack.pop(k)
            if k < len(stack):
                # a later split is applied over this one: the masks now are its own, and what
                # it saved (this split's trainer masks) is stale; it restores what this saved
                later = stack[k]
                later.saved_masks, later.saved_thread_counts = self.saved_masks, self.saved_thread_counts
                self.saved_masks, self.saved_thread_counts = {}, None
                return
            if not stack:
                CoreSplit._original = None
        for tid, mask in self.saved_masks.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass
        if self.saved_masks:
            # threads started after apply() inherited the trainer mask: widen them back too
            main = self.saved_masks.get(os.getpid())
            for tid in self._threads():
                if tid not in self.saved_masks and main:
                    try:
                        os.sched_setaffinity(tid, main)
                    except OSError:
                        pass
        self.saved_masks = {}
        if self.saved_thread_counts is not None:
            _set_thread_counts(self.saved_thread_counts)
            self.saved_thread_counts = None


def _config_file(data: bytes) -> int:
    """A descriptor of an unnamed file holding `data`, at its start, for a worker to inherit."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("hybrid_opt-worker-config")  # CLOEXEC: pass_fds hands it on alone
    else:
        import tempfile

        with tempfile.TemporaryFile() as f:  # held open until its descriptor is duplicated
            fd = os.dup(f.fileno())
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class WorkerClient:
    """One worker process over one shared arena. Not thread-safe (the trainer's one thread).

    Public interface (what the host tier uses): launch()/wait_started() or start(), send(),
    wait(), poll(), drain(), ping(), restart(), close(); `connected` and death_error() to see
    and describe a worker that is gone; `results` (task id -> Result, taken by whoever
    collects them), `pending`, `timeout_s`, `pid`.

    `files` (the nvme tier's NvmeFiles, or anything whose items() are (subgroup, fd)): the
    trainer's open descriptors of the swap files, read at each launch. Every worker, the first
    and each replacement, inherits them as it inherits the arena's (pass_fds: the same numbers,
    the same open files, O_DIRECT kept) and never opens a file by path, so a file removed from
    outside (a tmp cleaner) stays reachable for a restarted worker too."""

    def __init__(
        self,
        arena,
        layout: dict,
        *,
        cores: list[int] | None = None,
        threads: int | None = None,
        passive: bool = False,
        waited_cores: list[int] | None = None,
        waited_threads: int = 0,
        timeout_s: float = 120.0,
        start_timeout_s: float = 30.0,
        files=None,
    ):
        """`cores`: the worker's affinity; `threads`: its OpenMP threads (default: one per core);
        `passive`: its idle threads sleep instead of spinning (cores it shares with the trainer);
        `waited_cores`: where a task with `threads` set (a step the trainer waits for) runs, when
        wider than `cores` (CoreSplit.widens); `waited_threads`: the threads the steps sent
        before a blocking drain() get (OP_TRAINER_WAITS; 0: none)."""
        self.arena = arena
        self.layout = dict(layout)
        self.files = files
        self.cores = cores
        self.threads = threads if threads is not None else (len(cores) if cores else None)
        self.passive = passive
        self.waited_cores = waited_cores
        self.waited_threads = waited_threads
        # a step sent on the worker's own threads (a speculation) since the last OP_TRAINER_WAITS
        self._unwaited = False
        self._waits_frame = proto.frame(proto.Task(proto.OP_TRAINER_WAITS, 0).pack())
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.next_id = 1
        self.pending: dict[int, proto.Task] = {}
        self.results: dict[int, proto.Result] = {}
        self.restarts = 0
        self._req: int | None = None
        self._resp: int | None = None
        self._reader: proto.FrameReader | None = None
        self._stderr_fd: int | None = None
        forking.let_go_in_child(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Starts the worker and waits until it answers."""
        self.launch()
        self.wait_started()

    def wait_started(self) -> None:
        """Waits (bounded) for a launched worker's first answer."""
        self.ping(timeout_s=self.start_timeout_s)

    def launch(self) -> None:
        """Starts the worker process without waiting for it (wait_started() does): its start-up
        overlaps what the trainer does meanwhile (the arena's reservation: tiers/host.py)."""
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        self._stderr_fd = os.memfd_create("hybrid_opt-worker-stderr") if hasattr(os, "memfd_create") else None
        files = {int(sg): fd for sg, fd in self.files.items()} if self.files is not None else {}
        cfg = dict(
            self.layout,
            arena_fd=self.arena.fd,
            arena_nbytes=self.arena.nbytes,
            req_fd=req_r,
            resp_fd=resp_w,
            cores=self.cores,
            waited_cores=self.waited_cores,
            waited_threads=self.waited_threads,
            trainer_pid=os.getpid(),
            threads=self.threads,
            file_fds=files,
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.passive:  # OpenMP threads spinning between steps would take the trainer's cores
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if self.restarts:
            env.pop("HYBRID_OPT_WORKER_FAULT", None)  # an injected fault kills one worker, once
        # the configuration travels in a file of its own, not on the command line (one argument
        # is at most 128 KiB: ~9,000 nvme files' descriptors)
        cfg_fd = _config_file(json.dumps(cfg).encode())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybrid_opt.worker.main", "--config-fd", str(cfg_fd)],
                pass_fds=(self.arena.fd, req_r, resp_w, cfg_fd, *files.values()),
                env=env,
                stdin=subprocess.DEVNULL,
                stderr=self._stderr_fd if self._stderr_fd is not None else None,
                start_new_session=True,
            )  # the terminal's Ctrl-C goes to the trainer alone
        except OSError:
            os.close(req_w)
            os.close(resp_r)
            raise
        finally:
            os.close(req_r)
            os.close(resp_w)
            os.close(cfg_fd)
        self._req, self._resp = req_w, resp_r
        self._reader = proto.FrameReader(resp_r)
        _allow_reads_by(self.proc.pid)

    def _stderr_tail(self) -> str:
        if self._stderr_fd is None:
            return ""
        try:
            size = os.fstat(self._stderr_fd).st_size
            data = os.pread(self._stderr_fd, 2000, max(0, size - 2000))
            return data.decode(errors="replace").strip()
        except OSError:
            return ""

    @property
    def connected(self) -> bool:
        """Whether the result pipe is open: False once a dead worker was reaped (death_error())
        and before restart() or a new launch(); then only death_error() or restart() help."""
        return self._resp is not None

    def death_error(self, how: str | None = None) -> WorkerDied:
        """The error describing this worker's end — how it ended (a signal, an exit code, no
        answer; or `how`, said by the caller), the subgroups it had in flight, the tail of its
        stderr — after reaping it (killed if still running; its pipes closed). The caller raises
        it (or restarts)."""
        if how is None:
            code = self.proc.poll() if self.proc is not None else None
            if code is None and self.proc is not None:
                try:
                    code = self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = None
            how = (
                f"killed by signal {signal.Signals(-code).name}"
                if code is not None and code < 0
                else f"exited with code {code}"
                if code is not None
                else "stopped answering"
            )
        self._take_written()
        tail = self._stderr_tail()
        pending = list(self.pending.values())
        subgroups = sorted({t.subgroup for t in pending if t.op in (proto.OP_STEP, proto.OP_INVERSE)})
        msg = (
            f"hybrid_opt worker (pid {self.pid}) {how}"
            + (f" with subgroups {subgroups} in flight" if subgroups else "")
            + (f"; its last output:\n{tail}" if tail else "")
        )
        self._reap()
        return WorkerDied(msg, pending)

    def _take_written(self) -> None:
        """The results a worker that is gone wrote before its end and nobody read yet (a death
        met by send(), not drain()): taken, so a task it finished is not counted lost."""
        try:
            # the reader is made with _resp; read_results() without a timeout gives a list
            while self._resp is not None and not self._reader.eof and proto.readable(self._resp, 0):  # type: ignore[union-attr]
                for r in self._reader.read_results():  # type: ignore[union-attr]
                    self.pending.pop(r.task_id, None)
                    self.results[r.task_id] = r
        except OSError:
            pass  # nothing more can be read: what was taken stands

    def unanswered_error(self, waited_s: float) -> WorkerDied:
        """A worker that did not answer for `waited_s` (stopped, swapped out, stuck) is treated
        as dead: killed with SIGKILL at once (a stopped process dies of it too), reaped, and
        described as death_error() does. The caller recovers as from a death."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        return self.death_error(f"did not answer within {waited_s:.0f} s and was killed (SIGKILL)")

    def _reap(self) -> None:
        # kill before closing the pipes: a live worker reads EOF as "the trainer died" and
        # would remove the nvme swap files the trainer still uses
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass  # in uninterruptible sleep: it dies of the SIGKILL when it wakes
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._req, self._resp, self._stderr_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._req = self._resp = self._stderr_fd = None

    def restart(self) -> list[proto.Task]:
        """Start a fresh worker; returns the tasks the dead one left unfinished (not resent)."""
        pending = list(self.pending.values())
        self._reap()
        self.pending.clear()
        self.restarts += 1
        self.start()
        return pending

    def let_go(self) -> None:
        """In a forked child (forking.py): its copies of the pipes and the stderr file closed,
        so the worker sees the trainer's exit (EOF) whoever lives on, and the worker forgotten:
        it is the trainer's (a child cannot wait for it, and must not stop it)."""
        self._close_fds()
        self._reader = None
        self.proc = None

    def close(self, timeout_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self._req is not None:
            try:
                proto.write_frame(self._req, proto.Task(proto.OP_EXIT, 0).pack())
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._reap()
        self.proc = None

    # ------------------------------------------------------------------ tasks
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._req is not None

    def send(self, task: proto.Task, gather=()) -> int:
        """Sends `task` (with its gather list: protocol.write_task) and returns its task id."""
        if not self.alive():
            raise self.death_error()
        task.task_id = self.next_id
        self.next_id += 1
        self.pending[task.task_id] = task
        if task.op in (proto.OP_STEP, proto.OP_INVERSE) and not task.threads:
            self._unwaited = True
        try:
            proto.write_task(self._req, task, gather)  # type: ignore[arg-type]  # alive(): an open pipe
        except BrokenPipeError:
            raise self.death_error() from None
        return task.task_id

    def drain(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for results and moves those that arrived into
        `results`; raises death_error() when the worker is gone (EOF, an exited process, or
        one already reaped: not `connected`). A wait (timeout > 0) after speculated steps were
        sent tells the worker first that the trainer waits (waited_threads)."""
        if self._resp is None:
            raise self.death_error()
        assert self._reader is not None and self.proc is not None  # started with _resp
        if timeout > 0 and self._unwaited and self.waited_threads:
            # the trainer blocks on the worker now (step(), a ping): the speculated steps still
            # queued there run on the waited step's threads (OP_TRAINER_WAITS, no reply); a
            # worker gone is found by the read below
            self._unwaited = False
            try:  # one write: a frame shorter than PIPE_BUF goes whole into the pipe
                os.write(self._req, self._waits_frame)  # type: ignore[arg-type]  # open with _resp
            except BrokenPipeError:
                pass
        results = self._reader.read_results(timeout)
        if results is None:  # nothing within `timeout`
            if self.proc.poll() is not None:
                raise self.death_error()
            return
        for r in results:
            self.pending.pop(r.task_id, None)
            self.results[r.task_id] = r
        if self._reader.eof:
            raise self.death_error()

    def poll(self) -> None:
        """Collect whatever results have arrived, without waiting."""
        if self._resp is not None:
            while proto.readable(self._resp, 0):
                self.drain(0)
                if self._resp is None:
                    break

    def wait(self, task_ids, timeout_s: float | None = None) -> list[proto.Result]:
        """Results of `task_ids` (in that order); raises on error, death or timeout."""
        task_ids = list(task_ids)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while any(t not in self.results for t in task_ids):
            if self._resp is None:
                raise self.death_error()
            left = deadline - time.monotonic()
            if left <= 0:
                waited = self.timeout_s if timeout_s is None else timeout_s
                outstanding = sorted(
                    {
                        self.pending[t].subgroup
                        for t in task_ids
                        if t in self.pending and self.pending[t].op in (proto.OP_STEP, proto.OP_INVERSE)
                    }
                )
                what = f"did not finish subgroups {outstanding}" if outstanding else "did not answer"
                raise WorkerTimeout(
                    f"hybrid_opt worker (pid {self.pid}) {what} within {waited:.0f} s; {UNANSWERED}"
                )
            self.drain(min(_POLL_S, left))
        out = [self.results.pop(t) for t in task_ids]
        for r in out:
            if r.status == proto.STATUS_ERROR:
                raise WorkerError(f"hybrid_opt worker failed on subgroup {r.subgroup}: {r.message}")
        return out

    def ping(self, timeout_s: float | None = None) -> float:
        """One empty round trip; returns its duration in seconds."""
        t0 = time.perf_counter()
        tid = self.send(proto.Task(proto.OP_PING, 0))
        self.wait([tid], timeout_s)
        return time.perf_counter() - t0
