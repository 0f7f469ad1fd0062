"""Staging slots, pieces and the traffic with the worker: how a host step's grads reach the worker's
shared memory (staged by the trainer, or gathered by the worker itself) and how its results come
back, within a bounded wait.

A worker that dies or does not answer is replaced and its unfinished tasks sent again, so training
continues on the same trajectory; a subgroup an in-place step left half-written is forgotten and
named (TornState). Design notes: docs/internals.md."""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybrid_opt.tiers import grads as RG
from hybrid_opt.tiers.inputs import AdamInputs, _with_step
from hybrid_opt.tiers.staging import CopyQueue, CudaStager, copy_async, staging_device
from hybrid_opt.worker import protocol as proto
from hybrid_opt.worker.client import UNANSWERED, TornState, WorkerDied, WorkerError, WorkerTimeout

_DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
REMOTE_GATHER_QUEUE = 2  # pieces in flight below which the worker gathers grads itself


@dataclass
class _Piece:
    subgroup: int
    offset: int
    numel: int
    slot: int
    task: proto.Task
    result: proto.Result | None = None
    freed: bool = False  # its staging slot is back in the ring
    gather: tuple | list = ()  # remote gather: its gather list (protocol.pack_gather's entries)
    keep: list | None = None  # remote gather: the grads the worker reads, alive until it has
    copy_done: torch.cuda.Event | None = None  # the event of its staging copy while that is in flight (CUDA)
    queued: bool = False  # waits in the CopyQueue to be sent
    held: bool = False  # a speculated in-place step's: its slot (its grads) is kept
    # after its result, until validation frees it (the undo reads it)
    cancelled: bool = False  # its step was discarded while queued: never sent
    # an nvme write behind a committed step: its failure is its owner's to handle (the write is
    # sent again: HostStepping._settle), never an error of whatever wait collects it
    quiet: bool = False

    # the CopyQueue's marks (staging.py): it changes a piece only through these
    def enqueue(self) -> None:
        self.queued = True

    def dequeue(self) -> None:
        self.queued = False

    def copy_landed(self) -> None:
        """Its staging copy has landed: the slot holds the grads."""
        self.copy_done = None


class HostIO:
    """Staging slots and worker traffic of a HostTier: it owns the slots, the pieces in flight,
    the queue of pieces whose staging copies are landing, the stagers and the worker's error
    and counters. The speculations stay with HostStepping: it marks the pieces of a speculated
    in-place step held (stage_steps(hold=True): they keep their grads until validation), and
    is told through one callback, forget(sg), of a subgroup torn by a worker death (inverse
    mode), to be forgotten."""

    def __init__(
        self,
        client,
        slots: list,
        *,
        slot_numel: int,
        grad_dtype,
        copy_dtype,
        remainders: dict,
        rollback: str,
        nvme: dict,
        forget,
        waited_threads: int = 0,
        copy_addrs=None,
        refill_high=None,
        inline=None,
    ):
        """`waited_threads`: the kernel threads of a step the trainer waits for (stage_steps'
        waited=True), where the worker shares the trainer's cores (0: the worker's own count).
        `copy_addrs(in bank, out bank)`: a step's (in, out) copy slots, -1 for none;
        `refill_high(sg, addr, offset, numel)`: a piece's committed high half into its copy slot
        again, before the piece goes to a new worker (StateBanks'). `inline`: an InlineSteps where
        the trainer runs the steps it waits for itself (a CPU-only host: inline_steps.py)."""
        self.client = client
        self.waited_threads = waited_threads
        self.grad_dtype, self.copy_dtype = grad_dtype, copy_dtype
        # by subgroup id (HostTier's)
        self._remainders, self._rollback, self._nvme = dict(remainders), rollback, dict(nvme)
        self._forget = forget
        self._copy_addrs = copy_addrs or (lambda in_bank, out_bank: (-1, -1))
        self._refill_high = refill_high
        self.inline = inline
        self._slots = list(slots)
        self.slot_numel = slot_numel  # elements per staging slot: the most one piece has
        self._free_slots = list(range(len(slots)))[::-1]
        self._inflight: dict[int, _Piece] = {}
        self._copies = CopyQueue()  # pieces whose staging copies are still landing (CUDA)
        self._block_copies = False  # True inside finish(): step() may wait for them
        self._stagers: dict = {}  # CUDA device -> its side-stream stager
        self._copy_stager = None  # replaces the CUDA stagers (tests: events they complete)
        self._error: WorkerError | None = None
        self.remote_gather = False
        # {subgroup id: cumulative seconds}: compute and I/O in the worker
        self.worker_seconds = dict.fromkeys(nvme, 0.0)
        self._counts = {"worker_restarts": 0, "worker_seconds": 0.0, "remote_gathered": 0}

    # ------------------------------------------------------------------ read-only views
    @property
    def counts(self):
        """worker_restarts, worker_seconds (all subgroups: the worker's tasks' time, and the
        trainer's own steps' where it runs them, InlineSteps), remote_gathered (pieces whose grads
        the worker read itself): a copy."""
        return dict(self._counts)

    @property
    def slots(self):
        """The staging slots (grad_dtype tensors in the arena)."""
        return tuple(self._slots)

    @property
    def free_slots(self):
        """How many staging slots are free now."""
        return len(self._free_slots)

    @property
    def pieces_in_flight(self):
        """Pieces sent to the worker whose results have not been collected."""
        return len(self._inflight)

    @property
    def stagers(self):
        """{CUDA device: its side-stream CudaStager}, made on first use (a copy)."""
        return dict(self._stagers)

    @property
    def copy_stager(self):
        """The stager replacing the CUDA ones (use_stager), or None."""
        return self._copy_stager

    def use_stager(self, stager) -> None:
        """Every asynchronous staging copy goes through `stager` (None: the CUDA stagers again);
        tests drive the copy queue with events they complete themselves."""
        self._copy_stager = stager

    def set_remote_gather(self, on: bool) -> None:
        """Whether the worker may read grads itself (probe_remote_gather() decides at start)."""
        self.remote_gather = bool(on)

    # ------------------------------------------------------------------ remote gather
    def probe_remote_gather(self) -> bool:
        """Whether the worker can read grads straight from this process's memory: sets
        remote_gather (tiers/grads.py)."""
        slot = self._free_slots[-1] if self._free_slots else None
        self.remote_gather = slot is not None and RG.probe(
            lambda task, gather: self.client.wait([self.send_task(task, gather)])[0], self._slots[slot], slot
        )
        return self.remote_gather

    def _remote_segments(self, grad, offset: int, numel: int):
        """(gather list, tensors to keep alive) for the worker to read a piece of grads itself;
        None when it cannot (CUDA or non-contiguous grads, another dtype): stage it here."""
        es = self._slots[0].element_size()
        if callable(grad):
            seg = getattr(grad, "segments", None)
            got = seg(offset, numel, self.grad_dtype) if seg is not None else None
            if got is None:
                return None
            entries, keep = got
            return [(o * es, a, n * es) for o, a, n in entries], keep
        if grad.is_cuda or grad.dtype != self.grad_dtype or not grad.is_contiguous():
            return None
        return ((0, grad.data_ptr() + offset * es, numel * es),), [grad]

    # ------------------------------------------------------------------ tasks and slots
    def _task(
        self,
        op,
        sg,
        inputs: AdamInputs,
        in_bank,
        out_bank,
        offset,
        numel,
        slot,
        skip_nonfinite,
        threads: int = 0,
    ):
        in_copy, out_copy = self._copy_addrs(in_bank, out_bank)
        return proto.Task(
            op,
            0,
            sg,
            numel,
            in_bank,
            proto.NO_BANK if out_bank is None else out_bank,
            offset,
            slot,
            _DT_CODE[self.grad_dtype],
            _DT_CODE[self.copy_dtype] if self.copy_dtype is not None else proto.NO_COPY,
            int(inputs.amsgrad),
            int(inputs.decoupled),
            int(skip_nonfinite),
            inputs.step,
            float(inputs.lr),
            float(inputs.beta1),
            float(inputs.beta2),
            float(inputs.eps),
            float(inputs.weight_decay),
            float(inputs.grad_scale),
            remainder=int(self._remainders[sg]),
            threads=threads,
            out_copy=out_copy,
            in_copy=in_copy,
        )

    def stage_steps(
        self,
        pieces: list,
        sg: int,
        inputs: AdamInputs,
        runs: tuple,
        in_bank,
        out_bank,
        skip_nonfinite: bool,
        grad,
        *,
        remote: bool,
        checked: bool,
        hold: bool,
        progress=None,
        need: int | None = None,
        waited: bool = False,
    ) -> bool:
        """Every piece of one subgroup's step: `runs` (inputs.ranges: (offset, numel, step)) cut
        into slot-sized pieces, each appended to `pieces` as soon as it holds a staging slot
        (every failure path frees it), and sent. checked: sent only once all are staged and
        every grad is finite (send_checked, inverse mode); hold: a speculated in-place step's
        pieces, their slots kept until validation (the undo reads the grads). need: polled
        first, and unless `need` slots are free then, nothing is staged: False (None: no poll).
        waited: the trainer waits for this step (not a speculation during backward): its
        kernels run on `waited_threads`."""
        if need is not None and self.poll() < need:
            return False
        for run_off, run_n, step in runs:
            run_inputs = inputs if step == inputs.step else _with_step(inputs, step)
            for off in range(run_off, run_off + run_n, self.slot_numel):
                self._stage_step(
                    pieces,
                    sg,
                    run_inputs,
                    in_bank,
                    out_bank,
                    off,
                    min(self.slot_numel, run_off + run_n - off),
                    skip_nonfinite,
                    grad,
                    remote=remote,
                    send=not checked,
                    hold=hold,
                    progress=progress,
                    waited=waited,
                )
        if checked:
            self.send_checked(pieces)
        return True

    def _stage_step(
        self,
        pieces: list,
        sg: int,
        inputs: AdamInputs,
        in_bank,
        out_bank,
        offset: int,
        numel: int,
        skip_nonfinite: bool,
        grad,
        *,
        remote: bool,
        send: bool,
        hold: bool,
        progress,
        waited: bool = False,
    ) -> _Piece:
        """One piece (elements offset..offset+numel of `sg`): takes a staging slot (waiting for
        one if none is free; progress(): work to do meanwhile), appends the piece to `pieces`,
        has the worker gather its grads (remote) or stages them, and sends it (send=False: the
        caller sends the pieces later, send_checked). waited: the trainer waits for it, so
        where it steps such pieces itself (inline) it does so now."""
        threads = self.waited_threads if waited else 0
        slot = self._acquire_slot(progress)
        piece = _Piece(
            sg,
            offset,
            numel,
            slot,
            self._task(
                proto.OP_STEP, sg, inputs, in_bank, out_bank, offset, numel, slot, skip_nonfinite, threads
            ),
            held=hold,
        )
        pieces.append(piece)  # owns the slot from here: every failure path frees it
        if waited and send and not hold and self.inline is not None:
            self._step_inline(piece, grad)
            return piece
        # the worker reads the grads itself only while it has little else queued: a
        # busy worker would finish later, so then the trainer copies them (its copy
        # overlaps the worker's compute) — the copying is shared by whichever core is free
        seg = (
            self._remote_segments(grad, offset, numel)
            if remote and len(self._inflight) < REMOTE_GATHER_QUEUE
            else None
        )
        if seg is not None:
            piece.gather, piece.keep = seg
            self._counts["remote_gathered"] += 1
        else:
            piece.copy_done = self._stage(slot, grad, offset, numel)  # an event: sent once it lands
        if send:
            self.send(piece)
        return piece

    def _step_inline(self, piece: _Piece, grad) -> None:
        """A piece the trainer waits for, stepped here (InlineSteps): its grads read where they
        lie where they are the kernel's dtype and contiguous (a q8 piece: in one run), else
        copied into its slot first. Its result is taken at once, and its slot freed."""
        assert self.inline is not None
        seg = self._remote_segments(grad, piece.offset, piece.numel)
        where = None
        if seg is not None and all(addr for _, addr, _ in seg[0]):
            if len(seg[0]) == 1 or not self.inline.quantized(piece.subgroup):
                where = seg[0]
        if where is None:
            landing = self._stage(piece.slot, grad, piece.offset, piece.numel)
            if landing is not None:  # CUDA grads (never on a CPU-only host): the copy lands first
                landing.synchronize()
        self._take(piece, self.inline.step(piece.task, where), "host step in the trainer")

    def _acquire_slot(self, progress) -> int:
        while not self._free_slots:
            if not self._inflight and not len(self._copies):
                raise RuntimeError(
                    "every staging slot is held by a speculated step awaiting "
                    "validation; call finish() (or use more staging_slots)"
                )
            # progress(): work the trainer does while it waits for a staging slot (from finish())
            self.wait(lambda: (progress is not None and progress()) or bool(self._free_slots))
        return self._free_slots.pop()

    def _stage(self, slot: int, grad, offset: int, numel: int):
        """Copies a piece of grads into its staging slot. Returns None once the copy is done
        (CPU grads), or the event of a copy still in flight (CUDA grads: on the tier's side
        stream, never blocking the caller); send then holds the piece until it completes."""
        dst = self._slots[slot][:numel]
        stager = self.stager_for(grad)
        if stager is not None:
            if callable(grad):
                return stager.copy(lambda: grad(dst, offset, numel, non_blocking=True))
            src = grad.reshape(-1)[offset : offset + numel]
            return stager.copy(lambda: copy_async(dst, src))
        if callable(grad):  # a provider that gathers the subgroup's grads itself
            grad(dst, offset, numel)
        else:
            dst.copy_(grad.reshape(-1)[offset : offset + numel])
        return None

    def stager_for(self, grad):
        """The asynchronous stager for these grads (one side stream per device, made on first
        use), or None: CPU grads are copied synchronously. `copy_stager`, when set, replaces
        the CUDA one (tests drive the queue with events they complete themselves)."""
        if self._copy_stager is not None:
            return self._copy_stager
        device = staging_device(grad)
        if device is None:
            return None
        stager = self._stagers.get(device)
        if stager is None:
            stager = self._stagers[device] = CudaStager(device)
        return stager

    def send(self, piece: _Piece) -> None:
        """Sends a piece to the worker, or queues it behind the staging copies still landing."""
        if piece.copy_done is not None or len(self._copies):
            # its copy is still landing, or pieces ahead of it wait for theirs: order is kept
            self._copies.push([piece])
            self._send_copied()
            return
        self._send_now(piece)

    def _send_now(self, piece: _Piece) -> None:
        try:
            tid = self.send_task(piece.task, piece.gather)
        except TornState as e:
            # the worker died under other subgroups' in-place steps and was replaced: a piece of
            # a subgroup not torn goes to the new one all the same (it must get its result)
            if piece.subgroup not in e.subgroups:
                self._inflight[self.client.send(piece.task, piece.gather)] = piece
            raise
        self._inflight[tid] = piece

    def _send_all(self, pieces: list) -> None:
        """_send_now() of each of `pieces`, every one tried before a TornState is raised."""
        torn = None
        for p in pieces:
            try:
                self._send_now(p)
            except TornState as e:
                torn = torn or e
        if torn is not None:
            raise torn

    def send_checked(self, pieces: list) -> None:
        """Inverse mode: a subgroup whose grads are not all finite is not stepped at all (an
        in-place step and its undo would cost a few ulps); every piece is staged, so all are
        checked — once their copies have landed — before any is sent."""
        if len(self._copies) or any(p.copy_done is not None for p in pieces):
            self._copies.push(pieces, whole=True)
            self._send_copied()
            return
        self._send_if_finite(pieces)

    def _send_if_finite(self, pieces: list) -> None:
        import cpu_kernels

        if all(cpu_kernels.grad_stats(self._slots[p.slot][: p.numel])[1] for p in pieces):
            self._send_all(pieces)
        else:
            for p in pieces:
                p.result = proto.Result(proto.OP_STEP, 0, proto.STATUS_NONFINITE, p.subgroup, float("inf"), 0)

    def _send_copied(self, block: bool = False) -> None:
        """Sends the queued pieces whose staging copies have landed, in launch order. block:
        wait for every copy still in flight (step() only; a grad hook never blocks on one)."""
        if not self._copies:
            return
        for pieces, whole in self._copies.ready(block):
            if any(p.cancelled for p in pieces):
                for p in pieces:  # their step was discarded: the slots are free now the copies landed
                    self.release_slot(p)
            elif whole:
                self._send_if_finite(pieces)
            else:
                self._send_all(pieces)

    def copies_in_flight(self) -> int:
        """Pieces still waiting for their staging copies (poll() sends those that landed)."""
        return len(self._copies)

    @contextmanager
    def finishing(self, pieces: list):
        """step()'s stage: inside, waits may block on the staging copies still landing (never a
        hook's); on entry, waits (bounded) until every one of `pieces` has its result."""
        self._block_copies = True
        try:
            self.wait_for(pieces)
            yield
        finally:
            self._block_copies = False

    def _settle_copies(self) -> None:
        """close(): every staging copy still in flight lands before the arena is unpinned and
        unmapped under it."""
        for piece in self._copies.pieces():
            try:
                if piece.copy_done is not None:
                    piece.copy_done.synchronize()
            except Exception:
                pass  # a failed device: nothing more is copied into the arena
        self._copies = CopyQueue()

    def send_task(self, task: proto.Task, gather=()) -> int:
        """Sends one task with its gather list (a new worker first if this one died); returns
        its task id."""
        try:
            return self.client.send(task, gather)
        except WorkerDied as e:
            self._recover(e)
            return self.client.send(task, gather)

    def release_slots(self, pieces: list) -> None:
        """release_slot() of each of `pieces`."""
        for p in pieces:
            self.release_slot(p)

    def release_slot(self, piece: _Piece) -> None:
        """Returns a piece's staging slot to the ring, once (every path may call it)."""
        if piece.queued:
            # never sent: its step is being discarded. A copy may still be writing the slot:
            # _send_copied frees it once that copy has landed
            piece.cancelled = True
            return
        if not piece.freed and piece.slot >= 0:
            if piece.copy_done is not None:
                # staged but never queued (a launch that failed before its pieces were handed
                # on, inverse mode): its copy may still be writing the slot. A failure path:
                # waiting is fine there
                try:
                    piece.copy_done.synchronize()
                except Exception:
                    pass  # a failed device: nothing more lands in the slot
                piece.copy_done = None
            piece.freed = True
            self._free_slots.append(piece.slot)

    def _release_piece(self, piece: _Piece) -> None:
        # a speculated in-place piece keeps its grads until validation (the undo needs them)
        if piece.held:
            return
        self.release_slot(piece)

    def _collect(self) -> int:
        """Takes the results that arrived for the pieces in flight; returns how many."""
        arrived = [t for t in self._inflight if t in self.client.results]
        for tid in arrived:
            self._take(self._inflight.pop(tid), self.client.results.pop(tid), "worker")
        return len(arrived)

    def _take(self, piece: _Piece, r: proto.Result, who: str) -> None:
        """A piece's result: its time counted, its slot freed (a held one's stays), its error
        kept for raise_error()."""
        piece.result = r
        self._counts["worker_seconds"] += r.elapsed_ns * 1e-9
        self.worker_seconds[piece.subgroup] += r.elapsed_ns * 1e-9
        piece.keep = None  # the worker has read its grads
        self._release_piece(piece)
        if r.status == proto.STATUS_ERROR and self._error is None and not piece.quiet:
            self._error = WorkerError(f"hybrid_opt {who} failed on subgroup {r.subgroup}: {r.message}")

    def raise_error(self) -> None:
        """Raises the worker's first error since the last one raised (it names the subgroup)."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def quiesce(self) -> None:
        """After a failure: let every in-flight task end before its buffers are reused."""
        try:
            self.wait(lambda: not self._inflight, raise_errors=False, retry=False)
        except Exception:
            pass
        self._error = None

    def wait(self, done, raise_errors: bool = True, retry: bool = True) -> None:
        """Wait until done() holds, collecting results and surviving worker deaths; bounded:
        timeout_s without a result from the worker (or a staging copy landing) ends it
        (_timed_out), a long wait on a worker that answers does not."""
        deadline = time.monotonic() + self.client.timeout_s
        replaced = not retry  # a worker that did not answer was replaced (retry=False: failure handling)
        while True:
            copying = len(self._copies)
            self._send_copied(block=self._block_copies)
            if self._collect() or len(self._copies) < copying:
                deadline = time.monotonic() + self.client.timeout_s
            if raise_errors:
                self.raise_error()
            if done():
                return
            if time.monotonic() > deadline:
                self._timed_out(retry=not replaced)
                replaced, deadline = True, time.monotonic() + self.client.timeout_s
            try:
                # a worker already gone raises here (death_error); staging copies still
                # landing: look again soon (only step() blocks on them)
                self.client.drain(0.0005 if len(self._copies) else 0.1)
            except WorkerDied as e:
                self._recover(e)

    def wait_for(self, pieces: list) -> None:
        """wait() until every one of `pieces` has its result."""
        self.wait(lambda: all(p.result is not None for p in pieces))

    def _timed_out(self, retry: bool) -> None:
        """A wait ran past the timeout. With tasks at the worker, it did not answer them: it is
        killed and replaced as a dead one is, its tasks sent again, and (`retry`: the first time
        in this wait) the wait goes on, warned of: exact, as after a death. Otherwise it raises
        naming the subgroups not stepped (inverse mode: TornState for the in-place steps the
        worker had), and what comes next (a backward cancelling a speculation, state_dict(),
        the next step) finds a worker that answers."""
        copying = sorted({p.subgroup for p in self._copies.pieces()})
        subgroups = sorted({p.subgroup for p in self._inflight.values()} | set(copying))
        t = self.client.timeout_s
        msg = f"hybrid_opt host tier: subgroups {subgroups} not stepped within {t:.0f} s"
        if copying:
            msg += f" (the GPU never finished copying the grads of {copying}: check the device)"
        if not self._inflight:
            raise TimeoutError(msg)
        pid = self.client.pid
        err = self.client.unanswered_error(t)
        self._recover(err)  # inverse mode: raises TornState for the in-place steps it had
        if retry:
            warnings.warn(
                f"{msg}: the worker (pid {pid}) did not answer, so it was killed and a new "
                f"one was sent its tasks again (exact: the wait goes on); {UNANSWERED}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        raise WorkerTimeout(
            f"{msg}: the worker (pid {pid}) did not answer, so it was killed and a "
            f"new one started (the committed state is intact); {UNANSWERED}"
        ) from err

    def _in_place(self, piece: _Piece) -> bool:
        return (
            self._rollback == "inverse"
            and not self._nvme[piece.subgroup]
            and piece.task.op in (proto.OP_STEP, proto.OP_INVERSE)
        )

    def _recover(self, err: WorkerDied) -> None:
        """A new worker, sent again every task the dead one left unfinished but those of the
        subgroups an unfinished in-place step or undo may have torn: forgotten, and raised
        (TornState). A worker that died idle, or with only tasks into spare banks or files in
        flight, loses nothing."""
        lost = {tid: p for tid, p in self._inflight.items() if tid not in self.client.results}
        torn = sorted({p.subgroup for p in lost.values() if self._in_place(p)})
        for tid in [t for t, p in lost.items() if p.subgroup in torn]:
            self.release_slot(self._inflight.pop(tid))
            del lost[tid]
        for sg in torn:
            self._forget(sg)
        try:
            self.client.restart()
        except Exception as e:
            if torn:  # what the first death tore is said even when no new worker starts
                raise TornState(f"{err}; then a new worker failed to start: {e}", torn) from e
            raise
        self._counts["worker_restarts"] += 1
        # every other task reads state nobody writes until commit (a committed bank, a committed
        # file slot, a read bank) and writes a buffer only it writes: sending it again is exact;
        # a remainder step's high half stepped in place in a copy slot is read again first
        for tid, piece in lost.items():
            del self._inflight[tid]
            t = piece.task
            if t.op == proto.OP_STEP and t.remainder and t.in_copy >= 0 and t.in_copy == t.out_copy:
                # its high half stepped in place in a copy slot: read from the model's param again
                self._refill_high(t.subgroup, t.in_copy, t.elem_offset, t.numel)
            self._inflight[self.client.send(piece.task, piece.gather)] = piece
        if torn:
            raise TornState(str(err), torn) from err

    def poll(self) -> int:
        """Collect the results that have arrived, without waiting (frees slots and banks);
        returns how many staging slots are free then."""
        # with nothing in flight nothing can come back: a worker gone meanwhile is met (and
        # replaced) at the next send or wait, as it is here
        if self._inflight:
            try:
                self.client.poll()  # nothing to read from a worker already gone
            except WorkerDied as e:
                self._recover(e)
            self._collect()
        self._send_copied()
        return len(self._free_slots)

    def poll_if_copying(self) -> None:
        """poll() while pieces wait for their staging copies (a grad hook's: those that landed
        go to the worker); nothing otherwise."""
        if self._copies:
            self.poll()

    def close(self) -> None:
        """The tier closes: staging copies still in flight land, the pieces in flight are
        forgotten and the slots (views of the arena, about to be unmapped) dropped."""
        self._settle_copies()
        self._inflight.clear()
        self._slots = []
