"""The host tier: subgroups' fp32 master and moments in trainer-owned shared memory, stepped
by the worker process, speculatively during backward, with exact or inverse rollback.

Speculation protocol (used by the optimizer):
    tier.speculate(sg, grad, inputs)   # when sg's grads are complete; False if no room now
    outcome = tier.finish({sg: (grad, final_inputs)}, overflow=...)
finish() drops every speculated step on overflow; otherwise it commits a speculated step
whose recorded inputs equal the final ones and redoes the rest from the committed bank.
In exact mode a step always reads the committed bank and writes a spare one, so a
speculated step, a redo and a plain step are the same kernel on the same inputs: the same
bits whichever path ran. In inverse mode steps run in place and are undone with the fp64
inverse kernel (no spare memory; not bitwise, and not available with amsgrad).

Faults: a worker that dies is replaced; in exact mode its unfinished tasks are sent again
(their grads are still in the trainer's staging slots and the committed banks were never
written), so training continues on the same trajectory. In inverse mode a step that died
mid-write may have torn its subgroup: the error names those subgroups.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from hybrid_opt.banks import BankPool
from hybrid_opt.shm import PAGE, ArenaLayout, SharedArena, align_up
from hybrid_opt.worker import protocol as P
from hybrid_opt.worker.client import CoreSplit, WorkerClient, WorkerDied, WorkerError

_DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ALIGN_ELEMS = 64  # bank capacity and slot sizes in whole cache lines of fp32


@dataclass(frozen=True)
class StepInputs:
    """Everything a step's result depends on besides the state and the grads' values.

    grad_version identifies the grads (their tensors' `_version`), so a grad modified after
    it was staged makes a speculated step stale.
    """
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool = True
    grad_scale: float = 1.0
    grad_version: tuple = ()
    amsgrad: bool = False
    # (offset, numel, step) ranges to step, each with its own step count; empty = the whole
    # subgroup at `step`. Elements outside every range keep their state (params that got no
    # grad this iteration are not touched, as in torch).
    runs: tuple = ()

    def ranges(self, numel: int) -> tuple:
        return self.runs or ((0, numel, self.step),)


def _with_step(inputs: StepInputs, step: int) -> StepInputs:
    return replace(inputs, step=step, runs=())


@dataclass
class _Piece:
    subgroup: int
    offset: int
    numel: int
    slot: int
    task: P.Task
    result: P.Result | None = None
    freed: bool = False           # its staging slot is back in the ring


@dataclass
class _Speculation:
    inputs: StepInputs
    bank: int | None                 # spare bank (exact); None in inverse mode
    pieces: list = field(default_factory=list)
    stepped: bool = True             # False when its grads were non-finite (nothing written)

    def done(self) -> bool:
        return all(p.result is not None for p in self.pieces)


class HostTier:
    def __init__(self, numels: list[int], *, grad_dtype=torch.float32, moment_dtype=torch.float32,
                 copy_dtype=None, amsgrad: bool = False, rollback: str = "exact",
                 spare_banks: int | None = None, staging_slots: int = 4,
                 slot_numel: int | None = None, worker_share: float = 0.5,
                 worker_cores: list[int] | None = None, timeout_s: float = 120.0):
        if rollback not in ("exact", "inverse"):
            raise ValueError(f"rollback must be 'exact' or 'inverse', got {rollback!r}")
        # amsgrad=True lays out the running max of v; each step's StepInputs.amsgrad says
        # whether it is used (param groups may differ)
        if rollback == "inverse" and amsgrad:
            raise ValueError("rollback='inverse' cannot undo amsgrad (its running max of v is not "
                             "invertible); use rollback='exact' with amsgrad=True")
        if rollback == "inverse" and moment_dtype != torch.float32:
            raise ValueError("rollback='inverse' needs fp32 moments")
        for name, dt, allowed in (("grad_dtype", grad_dtype, _DT_CODE), ("moment_dtype", moment_dtype,
                                  (torch.float32, torch.bfloat16))):
            if dt not in allowed:
                raise TypeError(f"{name} must be one of {list(allowed)}, got {dt}")
        if copy_dtype not in (None, torch.bfloat16, torch.float16):
            raise TypeError(f"copy_dtype must be None, torch.bfloat16 or torch.float16, got {copy_dtype}")
        if not numels or min(numels) < 1:
            raise ValueError("the host tier needs at least one subgroup of at least one element")
        if rollback == "exact" and spare_banks is not None and spare_banks < 1:
            raise ValueError(f"rollback='exact' needs at least one spare bank, got spare_banks={spare_banks}")
        if staging_slots < 1:
            raise ValueError(f"staging_slots must be >= 1, got {staging_slots}")
        self.numels = list(numels)
        self.grad_dtype, self.moment_dtype, self.copy_dtype = grad_dtype, moment_dtype, copy_dtype
        self.amsgrad, self.rollback = amsgrad, rollback
        n = len(numels)
        spares = (n if spare_banks is None else spare_banks) if rollback == "exact" else 0
        self.pool = BankPool(n, spares)
        self.capacity = align_up(max(numels), _ALIGN_ELEMS)
        self.slot_numel = align_up(min(slot_numel or self.capacity, self.capacity), _ALIGN_ELEMS)

        ms = torch.empty((), dtype=moment_dtype).element_size()
        bank = ArenaLayout()
        regions = {"p": bank.add("p", self.capacity * 4), "m": bank.add("m", self.capacity * ms),
                   "v": bank.add("v", self.capacity * ms)}
        regions["vmax"] = bank.add("vmax", self.capacity * ms) if amsgrad else 0
        regions["copy"] = bank.add("copy", self.capacity * 2) if copy_dtype is not None else 0
        bank_stride = align_up(bank.nbytes, PAGE)
        gs = torch.empty((), dtype=grad_dtype).element_size()
        slot_stride = align_up(self.slot_numel * gs, PAGE)
        arena = ArenaLayout()
        bank_offset = arena.add("banks", bank_stride * self.pool.n_banks, PAGE)
        slot_offset = arena.add("slots", slot_stride * staging_slots, PAGE)
        self.bank_bytes = bank_stride * n
        self.spare_bytes = bank_stride * spares
        self.staging_bytes = slot_stride * staging_slots

        self.arena = SharedArena(arena.nbytes, "hybrid_opt-host")
        self.arena.pin()
        self._regions, self._bank_offset, self._bank_stride = regions, bank_offset, bank_stride
        self._slots = [self.arena.tensor(slot_offset + k * slot_stride, self.slot_numel, grad_dtype)
                       for k in range(staging_slots)]
        self._free_slots = list(range(staging_slots))[::-1]
        self.cores = CoreSplit(worker_share, worker_cores)
        self.client = WorkerClient(self.arena, dict(
            bank_offset=bank_offset, bank_stride=bank_stride, bank_regions=regions,
            slot_offset=slot_offset, slot_stride=slot_stride, moment_dtype=_DT_CODE[moment_dtype]),
            cores=self.cores.worker or None, timeout_s=timeout_s)
        self._inflight: dict[int, _Piece] = {}
        self._spec: dict[int, _Speculation] = {}
        self._error: WorkerError | None = None
        self.closed = False
        try:
            self.client.start()
            self.cores.apply()
        except BaseException:
            self.close()
            raise
        self.stats = {"committed": 0, "redone": 0, "dropped": 0, "stepped": 0,
                      "worker_restarts": 0, "worker_seconds": 0.0}

    # ------------------------------------------------------------------ state views
    def _view(self, bank: int, region: str, numel: int, dtype) -> torch.Tensor:
        return self.arena.tensor(self._bank_offset + bank * self._bank_stride + self._regions[region],
                                 numel, dtype)

    def master(self, sg: int) -> torch.Tensor:
        """The committed fp32 master of subgroup `sg` (a view: valid until the next commit)."""
        return self._view(self.pool.committed[sg], "p", self.numels[sg], torch.float32)

    def moments(self, sg: int) -> dict:
        b, n, dt = self.pool.committed[sg], self.numels[sg], self.moment_dtype
        out = {"exp_avg": self._view(b, "m", n, dt), "exp_avg_sq": self._view(b, "v", n, dt)}
        if self.amsgrad:
            out["max_exp_avg_sq"] = self._view(b, "vmax", n, dt)
        return out

    def param_copy(self, sg: int) -> torch.Tensor:
        """The committed step's model-dtype copy of the master (written by the last step)."""
        if self.copy_dtype is None:
            raise RuntimeError("this tier writes no param copy (copy_dtype=None)")
        return self._view(self.pool.committed[sg], "copy", self.numels[sg], self.copy_dtype)

    def load_state(self, sg: int, param, exp_avg=None, exp_avg_sq=None, max_exp_avg_sq=None) -> None:
        """Sets subgroup `sg`'s committed state (moments default to zero)."""
        self._require_idle(sg)
        self.master(sg).copy_(param.reshape(-1))
        for name, src in self.moments(sg).items():
            given = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq}[name]
            if given is None:
                src.zero_()
            else:
                src.copy_(given.reshape(-1))

    def _require_idle(self, sg: int) -> None:
        if sg in self._spec:
            raise RuntimeError(f"subgroup {sg} has a speculative step pending; call finish() first")

    # ------------------------------------------------------------------ tasks and slots
    def _task(self, op, sg, inputs: StepInputs, in_bank, out_bank, offset, numel, slot, skip_nonfinite):
        return P.Task(op, 0, sg, numel, in_bank, P.NO_BANK if out_bank is None else out_bank,
                      offset, slot, _DT_CODE[self.grad_dtype],
                      _DT_CODE[self.copy_dtype] if self.copy_dtype is not None else P.NO_COPY,
                      int(inputs.amsgrad), int(inputs.decoupled), int(skip_nonfinite), inputs.step,
                      float(inputs.lr), float(inputs.beta1), float(inputs.beta2), float(inputs.eps),
                      float(inputs.weight_decay), float(inputs.grad_scale))

    def _acquire_slot(self) -> int:
        while not self._free_slots:
            if not self._inflight:
                raise RuntimeError("every staging slot is held by a speculated step awaiting "
                                   "validation; call finish() (or use more staging_slots)")
            self._wait(lambda: bool(self._free_slots))
        return self._free_slots.pop()

    def _stage(self, slot: int, grad, offset: int, numel: int) -> None:
        dst = self._slots[slot][:numel]
        if callable(grad):  # a provider that gathers the subgroup's grads itself
            grad(dst, offset, numel)
            return
        src = grad.reshape(-1)[offset:offset + numel]
        if src.is_cuda:
            dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream(src.device).synchronize()  # the worker reads it next
        else:
            dst.copy_(src)

    def _send(self, piece: _Piece) -> None:
        tid = self._send_task(piece.task)
        self._inflight[tid] = piece

    def _send_task(self, task: P.Task) -> int:
        try:
            return self.client.send(task)
        except WorkerDied as e:
            self._recover(e)
            return self.client.send(task)

    def _free_slot(self, piece: _Piece) -> None:
        """Returns a piece's staging slot to the ring, once (every path may call it)."""
        if not piece.freed:
            piece.freed = True
            self._free_slots.append(piece.slot)

    def _release_piece(self, piece: _Piece) -> None:
        # in inverse mode a speculated piece keeps its grads until validation (the undo needs them)
        spec = self._spec.get(piece.subgroup)
        if self.rollback == "inverse" and spec is not None and piece in spec.pieces:
            return
        self._free_slot(piece)

    def _collect(self) -> None:
        for tid in [t for t in self._inflight if t in self.client.results]:
            piece = self._inflight.pop(tid)
            piece.result = r = self.client.results.pop(tid)
            self.stats["worker_seconds"] += r.elapsed_ns * 1e-9
            self._release_piece(piece)
            if r.status == P.STATUS_ERROR and self._error is None:
                self._error = WorkerError(f"hybrid_opt worker failed on subgroup {r.subgroup}: "
                                          f"{r.message}")

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _quiesce(self) -> None:
        """After a failure: let every in-flight task end before its buffers are reused."""
        try:
            self._wait(lambda: not self._inflight, raise_errors=False)
        except Exception:
            pass
        self._error = None

    def _wait(self, done, raise_errors: bool = True) -> None:
        """Wait (bounded) until done() holds, collecting results and surviving worker deaths."""
        deadline = time.monotonic() + self.client.timeout_s
        while True:
            self._collect()
            if raise_errors:
                self._raise_error()
            if done():
                return
            if time.monotonic() > deadline:
                subgroups = sorted({p.subgroup for p in self._inflight.values()})
                raise TimeoutError(f"hybrid_opt host tier: subgroups {subgroups} not stepped within "
                                   f"{self.client.timeout_s:.0f} s")
            try:
                if self.client._resp is None:
                    raise self.client._dead()
                self.client._drain(0.1)
            except WorkerDied as e:
                self._recover(e)

    def _recover(self, err: WorkerDied) -> None:
        """A new worker; exact mode resends the unfinished tasks, inverse mode cannot."""
        lost = {tid: p for tid, p in self._inflight.items() if tid not in self.client.results}
        if self.rollback == "inverse":
            torn = sorted({p.subgroup for p in lost.values() if p.task.op == P.OP_STEP})
            self._inflight = {t: p for t, p in self._inflight.items() if t not in lost}
            for p in lost.values():
                self._free_slot(p)
            for sg in torn:
                spec = self._spec.pop(sg, None)
                for p in spec.pieces if spec is not None else ():
                    self._free_slot(p)
            self.client.restart()
            self.stats["worker_restarts"] += 1
            raise RuntimeError(f"{err}. rollback='inverse' steps in place, so the state of "
                               f"subgroups {torn} may be torn; restore them from a checkpoint "
                               f"(rollback='exact' survives this)") from err
        self.client.restart()
        self.stats["worker_restarts"] += 1
        for tid, piece in lost.items():
            del self._inflight[tid]
            self._inflight[self.client.send(piece.task)] = piece

    # ------------------------------------------------------------------ stepping
    def _carry_over(self, sg: int, out_bank: int, runs: tuple) -> None:
        """Exact mode: elements no run steps keep their committed state in the new bank."""
        n, src = self.numels[sg], self.pool.committed[sg]
        regions = [("p", torch.float32), ("m", self.moment_dtype), ("v", self.moment_dtype)]
        if self.amsgrad:
            regions.append(("vmax", self.moment_dtype))
        pos = 0
        for off, k, _ in sorted(runs) + [(n, 0, 0)]:
            if off > pos:
                for region, dt in regions:
                    self._view(out_bank, region, n, dt)[pos:off].copy_(self._view(src, region, n, dt)[pos:off])
            pos = max(pos, off + k)

    def _launch(self, sg: int, grad, inputs: StepInputs, out_bank, skip_nonfinite, pieces: list,
                whole_subgroup_check: bool = False) -> None:
        n = self.numels[sg]
        runs = inputs.ranges(n)
        if inputs.runs and out_bank is not None:
            self._carry_over(sg, out_bank, runs)
        for run_off, run_n, step in runs:
            run_inputs = inputs if step == inputs.step else _with_step(inputs, step)
            for off in range(run_off, run_off + run_n, self.slot_numel):
                k = min(self.slot_numel, run_off + run_n - off)
                slot = self._acquire_slot()
                piece = _Piece(sg, off, k, slot, self._task(P.OP_STEP, sg, run_inputs,
                                                            self.pool.committed[sg], out_bank, off,
                                                            k, slot, skip_nonfinite))
                pieces.append(piece)  # owns the slot from here: every failure path frees it
                self._stage(slot, grad, off, k)
                if not whole_subgroup_check:
                    self._send(piece)
        if whole_subgroup_check:
            # inverse mode: a subgroup whose grads are not all finite is not stepped at all (an
            # in-place step and its undo would cost a few ulps); every piece is staged, so check
            # them all before sending any
            import cpu_kernels
            if all(cpu_kernels.grad_stats(self._slots[p.slot][:p.numel])[1] for p in pieces):
                for p in pieces:
                    self._send(p)
            else:
                for p in pieces:
                    p.result = P.Result(P.OP_STEP, 0, P.STATUS_NONFINITE, sg, float("inf"), 0)

    def _check(self, sg: int, grad, inputs: StepInputs) -> None:
        """Rejects a bad step before any bank, slot or task is taken: a step that failed half
        launched would leave a spare bank partly written, and a speculation finish() could commit."""
        if not 0 <= sg < len(self.numels):
            raise IndexError(f"subgroup {sg} does not exist: this host tier has "
                             f"{len(self.numels)} subgroups")
        n = self.numels[sg]
        if not callable(grad) and grad.numel() != n:
            raise ValueError(f"subgroup {sg} has {n} elements, its grad {grad.numel()}")
        if inputs.amsgrad and not self.amsgrad:
            raise ValueError("StepInputs.amsgrad=True on a host tier built with amsgrad=False, which "
                             "lays out no running max of v; build the tier with amsgrad=True")
        for run_off, run_n, _ in inputs.ranges(n):
            if run_off < 0 or run_n < 0 or run_off + run_n > n:
                raise ValueError(f"run ({run_off}, {run_n}) is outside subgroup {sg} of {n} elements")

    def speculate(self, sg: int, grad: torch.Tensor, inputs: StepInputs) -> bool:
        """Step `sg` now, into a spare bank (exact) or in place (inverse), to be validated by
        finish(). Returns False, doing nothing, when no spare bank (or, in inverse mode, no
        staging slot) is free: the subgroup is then stepped at finish()."""
        self._check(sg, grad, inputs)
        self._require_idle(sg)
        if self.rollback == "exact":
            bank = self.pool.acquire()
            if bank is None:
                return False
        else:
            # its slots stay held until validation (the undo needs the grads): all at once
            if len(self._free_slots) < -(-self.numels[sg] // self.slot_numel):
                return False
            bank = None
        spec = _Speculation(inputs, bank)
        self._spec[sg] = spec
        try:
            self._launch(sg, grad, inputs, bank, True, spec.pieces,
                         whole_subgroup_check=self.rollback == "inverse")
        except BaseException:
            self._abandon(sg)  # a half-launched speculation must never be committed
            raise
        return True

    def _abandon(self, sg: int) -> None:
        """Forget a speculation that failed while launching: its finished in-place pieces are
        undone (inverse), its spare bank and slots go back once nothing writes them."""
        spec = self._spec.pop(sg, None)
        if spec is None:
            return
        self._quiesce()
        if self.rollback == "inverse" and any(p.result is not None and p.result.status == P.STATUS_OK
                                              for p in spec.pieces):
            try:
                self._undo(sg, spec)
            except Exception:
                pass  # the error being raised already names this subgroup's trouble
        for p in spec.pieces:
            self._free_slot(p)
        if spec.bank is not None:
            self.pool.release(spec.bank)

    def speculated(self) -> list[int]:
        return sorted(self._spec)

    def grad_stats(self, sg: int):
        """(sum of squares, all finite) of the grads `sg` was speculated with, in piece order;
        None when it was not speculated. Waits for its pieces."""
        spec = self._spec.get(sg)
        if spec is None:
            return None
        self._wait(spec.done)
        total, finite = 0.0, True
        for p in spec.pieces:
            total += p.result.sum_sq
            finite = finite and bool(p.result.finite)
        return total, finite

    def _undo(self, sg: int, spec: _Speculation) -> None:
        """Inverse mode: undo a speculated in-place step with the grads it used."""
        ids = []
        for p in spec.pieces:
            if p.result is not None and p.result.status == P.STATUS_OK:
                t = P.Task(**{**p.task.__dict__, "op": P.OP_INVERSE, "task_id": 0})
                ids.append(self._send_task(t))
        try:
            self._wait(lambda: all(i in self.client.results for i in ids))
            self.client.wait(ids)
        finally:
            for p in spec.pieces:
                self._free_slot(p)

    def _drop(self, sg: int) -> None:
        spec = self._spec.pop(sg)
        if self.rollback == "exact":
            self.pool.release(spec.bank)
        else:
            self._undo(sg, spec)

    def finish(self, steps: dict, overflow: bool = False) -> dict[int, str]:
        """Validate and complete this iteration's host steps.

        steps: {sg: (grad, final StepInputs)} for every subgroup to be stepped now.
        overflow: the step is skipped — every speculated step is dropped, nothing changes.
        Returns {sg: "committed" | "redone" | "stepped" | "dropped"}.
        """
        for sg, (grad, final) in steps.items():
            self._check(sg, grad, final)
        self._wait(lambda: all(s.done() for s in self._spec.values()))
        outcome = {}
        if overflow:
            for sg in list(self._spec):
                self._drop(sg)
                outcome[sg] = "dropped"
            self.stats["dropped"] += len(outcome)
            return outcome
        for sg in [s for s in self._spec if s not in steps]:
            self._drop(sg)
            outcome[sg] = "dropped"
        todo = []
        for sg in sorted(steps):
            grad, final = steps[sg]
            spec = self._spec.get(sg)
            if spec is not None and spec.inputs == final and all(
                    p.result.status == P.STATUS_OK for p in spec.pieces):
                del self._spec[sg]
                if spec.bank is not None:
                    self.pool.commit(sg, spec.bank)
                else:
                    self._free_pieces(spec)
                outcome[sg] = "committed"
            else:
                if spec is not None:
                    self._drop(sg)
                    outcome[sg] = "redone"
                else:
                    outcome[sg] = "stepped"
                todo.append(sg)
        # steps after validation: each into a spare bank (exact) or in place, then committed
        waiting: dict[int, tuple[int | None, list]] = {}
        try:
            self._step_all(todo, steps, waiting)
        except BaseException:
            # the committed state stands: let in-flight work end, then return its spare banks
            self._quiesce()
            for bank, pieces in waiting.values():
                for p in pieces:
                    self._free_slot(p)
                if bank is not None:
                    self.pool.release(bank)
            raise
        for v in outcome.values():
            self.stats[v] += 1
        return outcome

    def _step_all(self, todo: list, steps: dict, waiting: dict) -> None:
        for sg in todo:
            grad, final = steps[sg]
            bank = None
            if self.rollback == "exact":
                bank = self.pool.acquire()
                while bank is None:  # every spare is in flight: commit what has finished
                    self._wait(lambda: any(all(p.result is not None for p in w[1]) for w in waiting.values()))
                    self._commit_finished(waiting)
                    bank = self.pool.acquire()
            pieces: list = []
            waiting[sg] = (bank, pieces)
            self._launch(sg, grad, final, bank, False, pieces)
        self._wait(lambda: all(all(p.result is not None for p in w[1]) for w in waiting.values()))
        self._commit_finished(waiting)

    def _free_pieces(self, spec: _Speculation) -> None:
        for p in spec.pieces:
            self._free_slot(p)

    def _commit_finished(self, waiting: dict) -> None:
        for sg in [s for s, (b, ps) in waiting.items() if all(p.result is not None for p in ps)]:
            bank, _ = waiting.pop(sg)
            if bank is not None:
                self.pool.commit(sg, bank)

    def step(self, sg: int, grad: torch.Tensor, inputs: StepInputs) -> str:
        """A plain (non-speculative) step of one subgroup."""
        return self.finish({sg: (grad, inputs)})[sg]

    # ------------------------------------------------------------------ lifecycle
    @property
    def worker_pid(self):
        return self.client.pid

    def close(self) -> None:
        """Idempotent: stops the worker, restores the trainer's cores, frees shared memory."""
        if self.closed:
            return
        self.closed = True
        self._spec.clear()
        self._inflight.clear()
        try:
            self.client.close()
        finally:
            self.cores.restore()
            self._slots = []
            self.arena.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
