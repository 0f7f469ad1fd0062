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

NVMe subgroups (nvme=[...]) keep no state in memory: a step borrows two banks, swaps the
committed file slot into one (OP_SWAP_IN, CRC32C verified), steps it into the other and
writes that to the other file slot (OP_SWAP_OUT); commit flips the slot map, rollback
forgets the written slot. The worker starts each read as soon as the task arrives, so
reads, compute and writes of consecutive subgroups overlap.

Faults: a worker that dies is replaced; in exact mode its unfinished tasks are sent again
(their grads are still in the trainer's staging slots and the committed banks were never
written), so training continues on the same trajectory. In inverse mode a step that died
mid-write may have torn its subgroup: the error names those subgroups.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch

from hybrid_opt.banks import BankPool
from hybrid_opt.shm import PAGE, ArenaLayout, SharedArena, align_up
from hybrid_opt.swap import SwapDir, check_nvme_path
from hybrid_opt.worker import protocol as P
from hybrid_opt.worker.client import CoreSplit, WorkerClient, WorkerDied, WorkerError

_DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ALIGN_ELEMS = 64  # bank capacity and slot sizes in whole cache lines of fp32
DEFAULT_SLOT_NUMEL = 1 << 20


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


REMOTE_GATHER_QUEUE = 2   # pieces in flight below which the worker gathers grads itself
STAGING_SLOTS = 8         # default staging slots (two 4Mi subgroups of 1Mi pieces)
MAX_STAGING_SLOTS = 32    # staging_slots_for(): at most 128 MB of fp32 grads


def _slot_numel(numels: list, slot_numel: int | None) -> int:
    """Elements per staging slot: `slot_numel` (default 1Mi: 4 MB of fp32 grads — a task that
    long costs the worker ~1 ms, its messaging overhead ~50 us; larger only costs memory),
    at most the largest subgroup, in whole cache lines."""
    return align_up(min(slot_numel or DEFAULT_SLOT_NUMEL, align_up(max(numels), _ALIGN_ELEMS)), _ALIGN_ELEMS)


def staging_slots_for(bursts: list, numels: list, slot_numel: int | None = None) -> int:
    """Staging slots for a host tier whose subgroups become ready in `bursts` (lists of
    subgroup indices into `numels` that one grad hook completes together: a parameter that
    spans several subgroups completes them all at once). A speculated step takes all its
    slots when it is launched, and backward never waits for the worker, so a burst larger
    than the free slots is deferred to the next hook — the worker idles meanwhile. Enough
    slots for the two largest bursts (one may arrive while the worker still holds the slots
    of the one before), within [STAGING_SLOTS, MAX_STAGING_SLOTS]."""
    slot = _slot_numel(numels, slot_numel)
    sizes = sorted(sum(-(-numels[i] // slot) for i in b) for b in bursts)
    return max(STAGING_SLOTS, min(MAX_STAGING_SLOTS, sum(sizes[-2:])))


@dataclass
class _Piece:
    subgroup: int
    offset: int
    numel: int
    slot: int
    task: P.Task
    result: P.Result | None = None
    freed: bool = False           # its staging slot is back in the ring
    keep: list | None = None      # remote gather: the grads the worker reads, alive until it has


@dataclass
class _Speculation:
    """One launched step of one subgroup (speculative, or after validation)."""
    inputs: StepInputs
    bank: int | None                 # output bank: a spare (exact, nvme); None in place (inverse)
    pieces: list = field(default_factory=list)
    aux_bank: int | None = None      # nvme: the bank the committed slot is read into
    swap_in: _Piece | None = None    # nvme: the read of the committed slot (sent ahead: prefetch)
    swap_out: _Piece | None = None   # nvme: the write of the new state (its result has the CRC)
    file_slot: int = 0               # nvme: the slot it writes

    def done(self) -> bool:
        return all(p.result is not None for p in self.pieces)

    def ok(self) -> bool:
        return all(p.result is not None and p.result.status == P.STATUS_OK for p in self.pieces)


class HostTier:
    def __init__(self, numels: list[int], *, grad_dtype=torch.float32, moment_dtype=torch.float32,
                 copy_dtype=None, amsgrad: bool = False, rollback: str = "exact",
                 spare_banks: int | None = None, staging_slots: int = STAGING_SLOTS,
                 slot_numel: int | None = None, worker_share: float = 0.5,
                 worker_cores: list[int] | None = None, timeout_s: float = 120.0,
                 nvme: list | None = None, nvme_path=None, io_banks: int = 4,
                 nvme_threads: int = 4):
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
        self.nvme = [bool(x) for x in nvme] if nvme is not None else [False] * n
        if len(self.nvme) != n:
            raise ValueError(f"nvme has {len(self.nvme)} flags for {n} subgroups")
        has_nvme = any(self.nvme)
        if has_nvme and io_banks < 1:
            raise ValueError(f"the nvme tier needs io_banks >= 1, got {io_banks}")
        if has_nvme:
            check_nvme_path(nvme_path)  # path errors before any work
        # argument errors before anything is made (shared memory, swap directory)
        self.cores = CoreSplit(worker_share, worker_cores)
        self.swap = None
        resident = [i for i in range(n) if not self.nvme[i]]
        spares = (len(resident) if spare_banks is None else spare_banks) if rollback == "exact" else 0
        # an nvme step holds two banks (read, result) until it is committed or dropped
        self.io_banks = io_banks if has_nvme else 0
        self.pool = BankPool(resident, spares + 2 * self.io_banks)
        self.capacity = align_up(max(numels), _ALIGN_ELEMS)
        self.slot_numel = _slot_numel(numels, slot_numel)

        ms = torch.empty((), dtype=moment_dtype).element_size()
        bank = ArenaLayout()
        regions = {"p": bank.add("p", self.capacity * 4), "m": bank.add("m", self.capacity * ms),
                   "v": bank.add("v", self.capacity * ms)}
        regions["vmax"] = bank.add("vmax", self.capacity * ms) if amsgrad else 0
        # the state block (p..vmax) is what a swap moves: page-aligned for O_DIRECT
        self.io_bytes = align_up(bank.nbytes, PAGE)
        bank.nbytes = self.io_bytes
        regions["copy"] = bank.add("copy", self.capacity * 2) if copy_dtype is not None else 0
        bank_stride = align_up(bank.nbytes, PAGE)
        gs = torch.empty((), dtype=grad_dtype).element_size()
        slot_stride = align_up(self.slot_numel * gs, PAGE)
        arena = ArenaLayout()
        bank_offset = arena.add("banks", bank_stride * self.pool.n_banks, PAGE)
        slot_offset = arena.add("slots", slot_stride * staging_slots, PAGE)
        self.bank_bytes = bank_stride * len(resident)
        self.spare_bytes = bank_stride * (spares + 2 * self.io_banks)
        self.nvme_bytes = 2 * self.io_bytes * sum(self.nvme)
        self.staging_bytes = slot_stride * staging_slots

        self.arena = SharedArena(arena.nbytes, "hybrid_opt-host")
        self.arena.pin()
        self._regions, self._bank_offset, self._bank_stride = regions, bank_offset, bank_stride
        self._slots = [self.arena.tensor(slot_offset + k * slot_stride, self.slot_numel, grad_dtype)
                       for k in range(staging_slots)]
        self._free_slots = list(range(staging_slots))[::-1]
        layout = dict(bank_offset=bank_offset, bank_stride=bank_stride, bank_regions=regions,
                      slot_offset=slot_offset, slot_stride=slot_stride,
                      moment_dtype=_DT_CODE[moment_dtype])
        self._file_slot = [0] * n           # nvme: the committed slot of each subgroup's file
        self._crc = [[0, 0] for _ in range(n)]
        self._aio = None                    # the trainer's own engine (load_state / state)
        if has_nvme:
            # made after the shared memory (sizing it can fail: RLIMIT_FSIZE, a full /dev/shm)
            # and filled inside the try below, so a failed constructor leaves no directory behind
            self.swap = SwapDir(nvme_path)
            layout["nvme"] = dict(dir=self.swap.path, io_bytes=self.io_bytes, threads=nvme_threads)
        self.client = WorkerClient(self.arena, layout, cores=self.cores.worker or None,
                                   timeout_s=timeout_s)
        self._inflight: dict[int, _Piece] = {}
        self._spec: dict[int, _Speculation] = {}
        self._error: WorkerError | None = None
        self._on_progress = None
        self.worker_seconds = [0.0] * n  # per subgroup, cumulative: compute and I/O in the worker
        self.closed = False
        self.remote_gather = False
        self.stats = {"committed": 0, "redone": 0, "dropped": 0, "stepped": 0,
                      "worker_restarts": 0, "worker_seconds": 0.0, "remote_gathered": 0}
        try:
            for sg in range(n):
                if self.nvme[sg]:
                    self.swap.create(sg, 2 * self.io_bytes)
            self.client.start()
            self.cores.apply()
            self.remote_gather = self._probe_remote_gather()
            if has_nvme:
                # a new file reads back as zeros: slot 0 already holds the all-zero state, so
                # only its CRC is needed (nothing is written before load_state sets real state)
                from cpu_kernels.aio import aligned_buffer, checksum
                zeros = aligned_buffer(self.io_bytes)
                zero_crc = checksum(zeros)
                zeros.close()
                for sg in range(n):
                    if self.nvme[sg]:
                        self._crc[sg][0] = zero_crc
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ state views
    def _view(self, bank: int, region: str, numel: int, dtype) -> torch.Tensor:
        return self.arena.tensor(self._bank_offset + bank * self._bank_stride + self._regions[region],
                                 numel, dtype)

    def _bank_state(self, bank: int, n: int) -> dict:
        dt = self.moment_dtype
        out = {"param": self._view(bank, "p", n, torch.float32), "exp_avg": self._view(bank, "m", n, dt),
               "exp_avg_sq": self._view(bank, "v", n, dt)}
        if self.amsgrad:
            out["max_exp_avg_sq"] = self._view(bank, "vmax", n, dt)
        return out

    def _resident(self, sg: int) -> int:
        if self.nvme[sg]:
            raise RuntimeError(f"subgroup {sg} lives on nvme: its state is in files, read it with "
                               f"state({sg}) and set it with load_state({sg}, ...)")
        return self.pool.committed[sg]

    def master(self, sg: int) -> torch.Tensor:
        """The committed fp32 master of a resident subgroup (a view: valid until the next commit)."""
        return self._view(self._resident(sg), "p", self.numels[sg], torch.float32)

    def moments(self, sg: int) -> dict:
        st = self._bank_state(self._resident(sg), self.numels[sg])
        del st["param"]
        return st

    def param_copy(self, sg: int) -> torch.Tensor:
        """The committed step's model-dtype copy of the master (written by the last step)."""
        if self.copy_dtype is None:
            raise RuntimeError("this tier writes no param copy (copy_dtype=None)")
        return self._view(self._resident(sg), "copy", self.numels[sg], self.copy_dtype)

    def _engine(self):
        if self._aio is None:
            from cpu_kernels.aio import AioEngine
            self._aio = AioEngine(threads=2, queue_depth=8)
        return self._aio

    def _borrow_bank(self) -> int:
        banks = self.pool.acquire(1)
        if banks is None:
            raise RuntimeError("no free bank to move nvme state through: every one is held by a "
                               "step awaiting validation; call finish() first")
        return banks[0]

    def _swap_file(self, sg: int, bank: int, slot: int, write: bool) -> int:
        """Trainer-side swap of one slot (load_state, state, checkpoints); returns its CRC32C."""
        from cpu_kernels.aio import AioError
        eng = self._engine()
        fd = eng.open(self.swap.file(sg), "r+")
        addr = self._view(bank, "p", 1, torch.float32).data_ptr()
        try:
            rid = (eng.submit_write if write else eng.submit_read)(fd, addr, self.io_bytes,
                                                                   slot * self.io_bytes, checksum=True)
            (res,) = eng.wait([rid], timeout_s=self.client.timeout_s)
        except AioError as e:
            raise OSError(e.errno, f"nvme subgroup {sg}: {e}") from e
        finally:
            eng.close_fd(fd)
        return res.crc

    def state(self, sg: int) -> dict:
        """The committed state of `sg`: views for a resident subgroup, copies read (and
        checksum-verified) from its file for an nvme one. Keys: param, exp_avg, exp_avg_sq
        [, max_exp_avg_sq]."""
        self._require_idle(sg)
        if not self.nvme[sg]:
            return self._bank_state(self._resident(sg), self.numels[sg])
        bank = self._borrow_bank()
        try:
            slot = self._file_slot[sg]
            crc = self._swap_file(sg, bank, slot, write=False)
            if crc != self._crc[sg][slot]:
                raise OSError(f"checksum mismatch in {self.swap.file(sg)} slot {slot}: expected "
                              f"CRC32C {self._crc[sg][slot]:08x}, read {crc:08x}; the file is "
                              f"corrupt — restore from a checkpoint")
            return {k: v.clone() for k, v in self._bank_state(bank, self.numels[sg]).items()}
        finally:
            self.pool.release(bank)

    def load_state(self, sg: int, param, exp_avg=None, exp_avg_sq=None, max_exp_avg_sq=None) -> None:
        """Sets subgroup `sg`'s committed state (moments default to zero)."""
        self._require_idle(sg)
        given = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                 "max_exp_avg_sq": max_exp_avg_sq}
        bank = self._borrow_bank() if self.nvme[sg] else self._resident(sg)
        try:
            if self.nvme[sg]:  # the whole block is written: no stale bytes in the checksum
                self._view(bank, "p", self.io_bytes // 4, torch.float32).zero_()
            for name, dst in self._bank_state(bank, self.numels[sg]).items():
                src = given[name]
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src.reshape(-1))
            if self.nvme[sg]:
                slot = 1 - self._file_slot[sg]  # the committed slot stays valid until this lands
                self._crc[sg][slot] = self._swap_file(sg, bank, slot, write=True)
                self._file_slot[sg] = slot
        finally:
            if self.nvme[sg]:
                self.pool.release(bank)

    def _require_idle(self, sg: int) -> None:
        if sg in self._spec:
            raise RuntimeError(f"subgroup {sg} has a speculative step pending; call finish() first")

    # ------------------------------------------------------------------ remote gather
    def _probe_remote_gather(self) -> bool:
        """Whether the worker can read grads straight from this process's memory
        (process_vm_readv): speculation then costs backward no copy. HYBRID_OPT_REMOTE_GATHER=0
        turns it off; a kernel that forbids it (Yama ptrace scope 2-3, seccomp) is detected
        here and the trainer stages grads itself, as before."""
        if os.environ.get("HYBRID_OPT_REMOTE_GATHER", "1") == "0" or not self._free_slots:
            return False
        probe = torch.arange(1, 65, dtype=torch.float32)
        slot = self._free_slots[-1]
        dst = self._slots[slot].view(torch.uint8)[:probe.numel() * 4]
        dst.zero_()
        task = P.Task(P.OP_PING, 0, slot=slot, gather=P.pack_gather([(0, probe.data_ptr(), probe.numel() * 4)]))
        try:
            r = self.client.wait([self._send_task(task)])[0]
        except Exception:
            return False
        ok = r.status == P.STATUS_OK and torch.equal(dst.view(torch.float32), probe)
        dst.zero_()
        return ok

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
            return P.pack_gather((o * es, a, n * es) for o, a, n in entries), keep
        if grad.is_cuda or grad.dtype != self.grad_dtype or not grad.is_contiguous():
            return None
        return P.pack_gather([(0, grad.data_ptr() + offset * es, numel * es)]), [grad]

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
            self._wait(lambda: self._progress() or bool(self._free_slots))
        return self._free_slots.pop()

    def _progress(self) -> None:
        """Work the trainer does while it waits for a staging slot (set by finish())."""
        if self._on_progress is not None:
            self._on_progress()

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
        if not piece.freed and piece.slot >= 0:
            piece.freed = True
            self._free_slots.append(piece.slot)

    def _release_piece(self, piece: _Piece) -> None:
        # a speculated in-place piece keeps its grads until validation (the undo needs them)
        spec = self._spec.get(piece.subgroup)
        if spec is not None and spec.bank is None and piece in spec.pieces:
            return
        self._free_slot(piece)

    def _collect(self) -> None:
        for tid in [t for t in self._inflight if t in self.client.results]:
            piece = self._inflight.pop(tid)
            piece.result = r = self.client.results.pop(tid)
            self.stats["worker_seconds"] += r.elapsed_ns * 1e-9
            self.worker_seconds[piece.subgroup] += r.elapsed_ns * 1e-9
            piece.keep = None  # the worker has read its grads
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
            torn = sorted({p.subgroup for p in lost.values()
                           if p.task.op == P.OP_STEP and not self.nvme[p.subgroup]})
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
        # every task reads state nobody writes until commit (a committed bank, a committed file
        # slot, a read bank) and writes a buffer only it writes: sending it again is exact
        for tid, piece in lost.items():
            del self._inflight[tid]
            self._inflight[self.client.send(piece.task)] = piece

    # ------------------------------------------------------------------ stepping
    def _carry_over(self, sg: int, src: int, out_bank: int, runs: tuple) -> None:
        """Elements no run steps keep their committed state in the new bank."""
        n = self.numels[sg]
        src_state, dst_state = self._bank_state(src, n), self._bank_state(out_bank, n)
        pos = 0
        for off, k, _ in sorted(runs) + [(n, 0, 0)]:
            if off > pos:
                for name, dst in dst_state.items():
                    dst[pos:off].copy_(src_state[name][pos:off])
            pos = max(pos, off + k)

    def _swap_piece(self, op: int, sg: int, bank: int, file_slot: int, crc: int = 0) -> _Piece:
        task = P.Task(op, 0, sg, in_bank=bank, file_slot=file_slot, crc=crc)
        return _Piece(sg, 0, 0, -1, task, freed=True)  # no staging slot

    def _launch(self, sg: int, grad, inputs: StepInputs, spec: _Speculation, skip_nonfinite: bool,
                whole_subgroup_check: bool = False, remote: bool = False) -> None:
        """Stage and send every task of one subgroup's step; spec.bank (and, for nvme,
        spec.aux_bank) are already taken. remote: the worker reads the grads itself where it
        can (during backward, the trainer's core is busy)."""
        remote = remote and self.remote_gather and not whole_subgroup_check
        n = self.numels[sg]
        runs = inputs.ranges(n)
        pieces = spec.pieces
        swap_in = None
        if self.nvme[sg]:
            in_bank = spec.aux_bank
            swap_in = spec.swap_in or self._send_swap_in(sg, spec)
        else:
            in_bank = self.pool.committed[sg]
        if inputs.runs and spec.bank is not None:
            if swap_in is not None:
                self._wait(lambda: swap_in.result is not None)
            self._carry_over(sg, in_bank, spec.bank, runs)
        for run_off, run_n, step in runs:
            run_inputs = inputs if step == inputs.step else _with_step(inputs, step)
            for off in range(run_off, run_off + run_n, self.slot_numel):
                k = min(self.slot_numel, run_off + run_n - off)
                slot = self._acquire_slot()
                piece = _Piece(sg, off, k, slot, self._task(P.OP_STEP, sg, run_inputs, in_bank,
                                                            spec.bank, off, k, slot, skip_nonfinite))
                pieces.append(piece)  # owns the slot from here: every failure path frees it
                # the worker reads the grads itself only while it has little else queued: a
                # busy worker would finish later, so then the trainer copies them (its copy
                # overlaps the worker's compute) — the copying is shared by whichever core is free
                seg = (self._remote_segments(grad, off, k)
                       if remote and len(self._inflight) < REMOTE_GATHER_QUEUE else None)
                if seg is not None:
                    piece.task.gather, piece.keep = seg
                    self.stats["remote_gathered"] += 1
                else:
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
        if self.nvme[sg]:
            spec.file_slot = 1 - self._file_slot[sg]
            spec.swap_out = self._swap_piece(P.OP_SWAP_OUT, sg, spec.bank, spec.file_slot)
            pieces.append(spec.swap_out)
            self._send(spec.swap_out)

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

    def _send_swap_in(self, sg: int, spec: _Speculation) -> _Piece:
        """The worker starts reading the committed slot into spec.aux_bank at once."""
        slot = self._file_slot[sg]
        spec.swap_in = self._swap_piece(P.OP_SWAP_IN, sg, spec.aux_bank, slot, self._crc[sg][slot])
        spec.pieces.append(spec.swap_in)
        self._send(spec.swap_in)
        return spec.swap_in

    def _take_banks(self, sg: int) -> _Speculation | None:
        """The banks one step of `sg` needs, or None when the pool cannot give them now:
        nvme two (read, result), exact one (result), inverse none (in place)."""
        if self.nvme[sg]:
            banks = self.pool.acquire(2)
            return None if banks is None else _Speculation(None, banks[1], aux_bank=banks[0])
        if self.rollback == "exact":
            banks = self.pool.acquire(1)
            return None if banks is None else _Speculation(None, banks[0])
        return _Speculation(None, None)

    def _release_banks(self, spec: _Speculation) -> None:
        for b in (spec.bank, spec.aux_bank):
            if b is not None:
                self.pool.release(b)
        spec.bank = spec.aux_bank = None

    def speculate(self, sg: int, grad, inputs: StepInputs, wait: bool = True) -> bool:
        """Step `sg` now, into spare banks (exact, nvme) or in place (inverse), to be validated
        by finish(). Returns False, doing nothing, when no bank is free (or, in inverse mode
        or with wait=False, not every staging slot it needs): the subgroup is then stepped at
        finish(). With wait=True it may wait for the worker to free staging slots."""
        self._check(sg, grad, inputs)
        self._require_idle(sg)
        in_place = self.rollback == "inverse" and not self.nvme[sg]
        # wait=False (inside backward) never waits for the worker: every slot the step needs
        # must be free now; in place, they also stay held until validation (the undo needs
        # the grads), so they must all be free at once anyway
        pieces = sum(-(-k // self.slot_numel) for _, k, _ in inputs.ranges(self.numels[sg]))
        if (in_place or not wait) and len(self._free_slots) < pieces:
            return False
        spec = self._take_banks(sg)
        if spec is None:
            return False
        spec.inputs = inputs
        self._spec[sg] = spec
        try:
            self._launch(sg, grad, inputs, spec, True, whole_subgroup_check=in_place, remote=True)
        except BaseException:
            self._abandon(sg)  # a half-launched speculation must never be committed
            raise
        return True

    def _abandon(self, sg: int) -> None:
        """Forget a speculation that failed while launching: its finished in-place pieces are
        undone (inverse), its banks and slots go back once nothing writes them."""
        spec = self._spec.pop(sg, None)
        if spec is None:
            return
        self._quiesce()
        if spec.bank is None and any(p.result is not None and p.result.status == P.STATUS_OK
                                     for p in spec.pieces):
            try:
                self._undo(sg, spec)
            except Exception:
                pass  # the error being raised already names this subgroup's trouble
        for p in spec.pieces:
            self._free_slot(p)
        self._release_banks(spec)

    def poll(self) -> None:
        """Collect the results that have arrived, without waiting (frees slots and banks)."""
        if self.client._resp is not None:
            try:
                self.client.poll()
            except WorkerDied as e:
                self._recover(e)
        self._collect()

    def speculated(self) -> list[int]:
        return sorted(self._spec)

    def cancel(self, sg: int) -> None:
        """Drop a pending speculation of `sg` (its grads changed: a new one follows)."""
        spec = self._spec.get(sg)
        if spec is None:
            return
        self._wait(spec.done)
        self._drop(self._spec.pop(sg), sg)

    def grad_stats(self, sg: int):
        """(sum of squares, all finite) of the grads `sg` was speculated with, in piece order;
        None when it was not speculated. Waits for its pieces."""
        spec = self._spec.get(sg)
        if spec is None:
            return None
        self._wait(spec.done)
        total, finite = 0.0, True
        for p in spec.pieces:
            if p.task.op == P.OP_STEP:
                total += p.result.sum_sq
                finite = finite and bool(p.result.finite)
        return total, finite

    def _undo(self, sg: int, spec: _Speculation) -> None:
        """Inverse mode: undo a speculated in-place step with the grads it used."""
        ids = []
        for p in spec.pieces:
            if p.task.op == P.OP_STEP and p.result is not None and p.result.status == P.STATUS_OK:
                # the grads are in the slot already (held until validation): no gather
                t = P.Task(**{**p.task.__dict__, "op": P.OP_INVERSE, "task_id": 0, "gather": b""})
                ids.append(self._send_task(t))
        try:
            self._wait(lambda: all(i in self.client.results for i in ids))
            self.client.wait(ids)
        finally:
            for p in spec.pieces:
                self._free_slot(p)

    def _drop(self, spec: _Speculation, sg: int) -> None:
        """The step does not stand: spare banks go back (the committed state was never
        written); an in-place step is undone."""
        if spec.bank is None and not self.nvme[sg]:
            self._undo(sg, spec)
        for p in spec.pieces:
            self._free_slot(p)
        self._release_banks(spec)

    def _commit(self, sg: int, spec: _Speculation, on_commit) -> None:
        """The step stands: flip the subgroup's bank (exact) or file slot (nvme), let the
        caller read the new state, and return what the step borrowed."""
        for p in spec.pieces:
            self._free_slot(p)
        if self.nvme[sg]:
            self._crc[sg][spec.file_slot] = spec.swap_out.result.crc
            self._file_slot[sg] = spec.file_slot
            if on_commit is not None:
                on_commit(sg, self._bank_views(spec.bank, sg))
            self._release_banks(spec)
            return
        if spec.bank is not None:
            self.pool.commit(sg, spec.bank)
            spec.bank = None
        if on_commit is not None:
            on_commit(sg, self._bank_views(self.pool.committed[sg], sg))

    def _bank_views(self, bank: int, sg: int) -> dict:
        """What on_commit sees: the new fp32 master, and the model-dtype copy when written."""
        out = {"param": self._view(bank, "p", self.numels[sg], torch.float32)}
        if self.copy_dtype is not None:
            out["param_copy"] = self._view(bank, "copy", self.numels[sg], self.copy_dtype)
        return out

    def finish(self, steps: dict, overflow: bool = False, on_commit=None) -> dict[int, str]:
        """Validate and complete this iteration's host steps.

        steps: {sg: (grad, final StepInputs)} for every subgroup to be stepped now.
        overflow: the step is skipped — every speculated step is dropped, nothing changes.
        on_commit(sg, {"param": fp32 view[, "param_copy": model-dtype view]}): called as each
        subgroup's new state is committed, while its views are valid (an nvme subgroup's
        buffers are reused right after).
        Returns {sg: "committed" | "redone" | "stepped" | "dropped"}.
        """
        for sg, (grad, final) in steps.items():
            self._check(sg, grad, final)
        self._wait(lambda: all(s.done() for s in self._spec.values()))
        outcome = {}
        if overflow:
            for sg in list(self._spec):
                self._drop(self._spec.pop(sg), sg)
                outcome[sg] = "dropped"
            self.stats["dropped"] += len(outcome)
            return outcome
        for sg in [s for s in self._spec if s not in steps]:
            self._drop(self._spec.pop(sg), sg)
            outcome[sg] = "dropped"
        todo = []
        for sg in sorted(steps):
            spec = self._spec.pop(sg, None)
            if spec is not None and spec.inputs == steps[sg][1] and spec.ok():
                self._commit(sg, spec, on_commit)
                outcome[sg] = "committed"
            else:
                if spec is not None:
                    self._drop(spec, sg)
                outcome[sg] = "redone" if spec is not None else "stepped"
                todo.append(sg)
        # steps after validation, pipelined within the bank pool, each committed when done
        waiting: dict[int, _Speculation] = {}
        try:
            self._step_all(todo, steps, waiting, on_commit)
        except BaseException:
            # every committed state stands: let in-flight work end, then return what it held
            self._quiesce()
            for spec in waiting.values():
                for p in spec.pieces:
                    self._free_slot(p)
                self._release_banks(spec)
            raise
        for v in outcome.values():
            self.stats[v] += 1
        return outcome

    def _step_all(self, todo: list, steps: dict, waiting: dict, on_commit) -> None:
        # resident subgroups first (no I/O): their compute hides the first nvme reads; the
        # nvme reads are sent ahead of their steps as far as the bank pool allows (prefetch)
        todo = [sg for sg in todo if not self.nvme[sg]] + [sg for sg in todo if self.nvme[sg]]
        prefetched: dict = {}
        position = [0]

        def prefetch(k: int) -> None:
            # keep one bank for the next resident step; the rest may start nvme reads
            reserve = 1 if self.rollback == "exact" and k + 1 < len(todo) and not self.nvme[todo[k + 1]] else 0
            for nxt in todo[k + 1:]:
                if not self.nvme[nxt] or nxt in prefetched:
                    continue
                if len(self.pool.free) < 2 + reserve:
                    break
                ahead = self._take_banks(nxt)
                waiting[nxt] = ahead  # tracked with the in-flight work, for the error path
                self._send_swap_in(nxt, ahead)
                prefetched[nxt] = waiting.pop(nxt)

        def progress() -> None:
            # while staging waits for a slot: commit what has finished and read further ahead,
            # so the disk never idles for want of a free buffer
            current = todo[position[0]]
            finished = [s for s, w in waiting.items() if s != current and w.ok()]
            for s in finished:
                self._commit(s, waiting.pop(s), on_commit)
            if finished:
                prefetch(position[0])

        self._on_progress = progress
        try:
            self._step_loop(todo, steps, waiting, on_commit, prefetched, prefetch, position)
        finally:
            self._on_progress = None

    def _step_loop(self, todo, steps, waiting, on_commit, prefetched, prefetch, position) -> None:
        for k, sg in enumerate(todo):
            position[0] = k
            grad, final = steps[sg]
            spec = prefetched.pop(sg, None) or self._take_banks(sg)
            while spec is None:  # the pool is spent: commit what has finished, then go on
                if not waiting:
                    raise RuntimeError(f"subgroup {sg} needs more banks than the pool has "
                                       f"({self.pool.n_banks}); raise spare_banks/io_banks")
                self._wait(lambda: any(w.done() for w in waiting.values()))
                self._commit_finished(waiting, on_commit)
                spec = self._take_banks(sg)
            spec.inputs = final
            waiting[sg] = spec
            if self.nvme[sg] and spec.swap_in is None:
                self._send_swap_in(sg, spec)  # its own read goes ahead of any prefetch
            prefetch(k)
            try:
                self._launch(sg, grad, final, spec, False)
            except BaseException:
                for sgp, sp in prefetched.items():
                    waiting.setdefault(sgp, sp)  # the handler waits for their reads, frees banks
                raise
        self._wait(lambda: all(w.done() for w in waiting.values()))
        self._commit_finished(waiting, on_commit)

    def _commit_finished(self, waiting: dict, on_commit) -> None:
        for sg in [s for s, w in waiting.items() if w.done()]:
            if not waiting[sg].ok():
                self._raise_error()  # the worker's own error names the subgroup and cause
                raise RuntimeError(f"hybrid_opt host tier: subgroup {sg}'s step did not complete")
            self._commit(sg, waiting.pop(sg), on_commit)

    def step(self, sg: int, grad, inputs: StepInputs, on_commit=None) -> str:
        """A plain (non-speculative) step of one subgroup."""
        return self.finish({sg: (grad, inputs)}, on_commit=on_commit)[sg]

    # ------------------------------------------------------------------ lifecycle
    @property
    def worker_pid(self):
        return self.client.pid

    def close(self) -> None:
        """Idempotent: stops the worker, restores the trainer's cores, frees shared memory,
        removes the nvme swap directory."""
        if self.closed:
            return
        self.closed = True
        self._spec.clear()
        self._inflight.clear()
        try:
            self.client.close()
        finally:
            self.cores.restore()
            if self._aio is not None:
                self._aio.close()
            if self.swap is not None:
                self.swap.remove()
            self._slots = []
            self.arena.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
