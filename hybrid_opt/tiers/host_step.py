"""Speculation, validation, commit and rollback of host steps: `speculate()` launches a subgroup's
step into the banks, `finish()` commits it, redoes it from the committed bank, or drops it.

Invariant (exact mode): a step always reads the committed bank and writes a spare one, so a
speculated step, a redo and a plain step are the same kernel on the same inputs: the same bits.
nvme subgroups borrow two banks and flip the file slot on commit. The protocol and the inverse
mode: docs/internals.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

import cpu_kernels
from hybrid_opt.state.state_format import ABSMAX, Q8_BLOCK, q8_blocks
from hybrid_opt.tiers.host_io import TornState, _Piece
from hybrid_opt.tiers.inputs import AdamInputs
from hybrid_opt.tiers.nvme_held import HeldRead, NvmeHeld, swap_piece
from hybrid_opt.worker import protocol as proto
from hybrid_opt.worker.client import TornInterrupt

if TYPE_CHECKING:
    from hybrid_opt.tiers.nvme_files import FileSlots


@dataclass
class _Speculation:
    """One launched step of one subgroup (speculative, or after validation)."""

    inputs: AdamInputs | None  # None until _launch sets them
    bank: int | None  # output bank: a spare (exact, nvme); None in place (inverse)
    pieces: list = field(default_factory=list)
    aux_bank: int | None = None  # nvme: the bank the committed slot is read into
    swap_in: _Piece | None = None  # nvme: the read of the committed slot (sent ahead: prefetch)
    swap_out: _Piece | None = None  # nvme: the write of the new state (its result has the CRC)
    file_slot: int = 0  # nvme: the slot it writes
    launched: bool = False  # every task of it was handed to HostIO (_launch returned)
    # nvme: aux_bank holds the committed state already (the bank the subgroup's last step
    # wrote, kept: write-behind), so nothing is read from the file
    in_memory: bool = False

    @classmethod
    def reading(cls, held: HeldRead, bank: int | None = None) -> _Speculation:
        """A step of an nvme subgroup whose state is held in memory, or being read there
        (`held`, NvmeHeld's), writing `bank`."""
        pieces = [] if held.piece is None else [held.piece]
        return cls(None, bank, pieces, aux_bank=held.bank, swap_in=held.piece, in_memory=held.piece is None)

    def done(self) -> bool:
        """Every piece has its result but the write of an nvme step (a plain step commits
        before its write lands: write-behind)."""
        return all(p.result is not None for p in self.pieces if p is not self.swap_out)

    def ok(self) -> bool:
        """done(), and each of those pieces succeeded."""
        return all(
            p.result is not None and p.result.status == proto.STATUS_OK
            for p in self.pieces
            if p is not self.swap_out
        )


class HostStepping:
    """Speculation, validation, commit and rollback of a HostTier's steps: it owns the pending
    speculations and the step counters, and works through the tier's bank pool, its StateBanks
    (compressed.py), its FileSlots, its HostIO (staging slots and the worker) and its NvmeHeld
    (nvme state held in memory between steps). `client`, the WorkerClient, is read for its
    timeout_s only (every wait's bound, read at each use)."""

    def __init__(
        self,
        io,
        banks,
        pool,
        files: FileSlots,
        client,
        views,
        held: NvmeHeld,
        *,
        numels: dict,
        nvme: dict,
        rollback: str,
        amsgrad: bool,
        slot_numel: int,
        wake_spares: Callable[[int], int] | None = None,
        one_thread_waiting: bool = False,
    ):
        self._io, self._banks, self._pool, self._files = io, banks, pool, files
        # the worker steps on cores it shares with the trainer (CoreSplit.shared, HostTier's
        # inline=False): finish() runs the trainer's torch on one thread (_one_thread)
        self._one_thread_waiting = one_thread_waiting
        self._held = held  # the nvme reads ahead of a step and the writes behind it
        # HostTier.wake_spares: dormant spare banks into the pool (their memory allocated then)
        self._wake_spares = wake_spares
        # the subgroups whose speculation found no free bank while the worker idled (it had
        # sent back every result it was given), since the last finish()
        self._starved: set[int] = set()
        self._starved_before: int | None = None  # that count at the finish() before
        self._views = views  # HostViews: told of every bank and slot a step is about to write
        self._client = client
        self.numels, self.nvme = dict(numels), dict(nvme)  # by subgroup id (HostTier's)
        self.rollback, self.amsgrad, self.slot_numel = rollback, amsgrad, slot_numel
        self._spec: dict[int, _Speculation] = {}
        # inside finish(): work to do while a slot is awaited
        self._on_progress: Callable[[], None] | None = None
        self._counts = {"committed": 0, "redone": 0, "dropped": 0, "stepped": 0}
        # the subgroups the last finish() was given grads for: the ones read_ahead reads (a
        # subgroup without grads, a frozen layer's, is not read for a step it may never take)
        self._had_grads: set[int] = set()

    @property
    def counts(self) -> dict:
        """committed, redone, dropped, stepped: subgroup steps by outcome (a copy)."""
        return dict(self._counts)

    def forget(self, sg: int) -> None:
        """A speculation torn by a worker death (inverse mode: HostIO's recovery): dropped
        without an undo, its staging slots freed."""
        spec = self._spec.pop(sg, None)
        if spec is not None:
            self._io.release_slots(spec.pieces)

    def forget_all(self) -> None:
        """The tier closes: every pending speculation is forgotten."""
        self._spec.clear()

    def views_outlive_commit(self, sg: int) -> bool:
        """Whether the views finish() hands on_commit for `sg` keep their bytes until finish()
        returns: a resident subgroup's committed bank does (its next write comes with its next
        step); an nvme subgroup's bank does not (a later step of the same finish() may take it
        back: NvmeHeld.evict), nor a pooled copy slot (the commit hands it on to the pool)."""
        return not self.nvme[sg] and self._pool.copy_of is None

    # ------------------------------------------------------------------ banks, and reads ahead
    def read_ahead(self) -> None:
        """Without speculation, after a step: the nvme subgroups' committed slots are read into
        banks now (NvmeHeld.read_ahead), under the next forward and backward, so that the next
        step() does not wait for the disk's reads (only for its writes). Each read holds the bank
        it reads into; its step takes the bank it writes when it starts, and banks stay free for
        that and for a resident step, so neither waits for a read. The committed slots change
        only at a step's commit, which the next step() itself does after these reads; whatever
        else writes them (load_state_dict, a move) drops the reads first (NvmeHeld.release_reads).
        Only the subgroups the last step had grads for are read: the next step gives the others
        their banks back unread (a frozen layer's were read, and dropped, at every step)."""
        resident = not all(self.nvme.values())
        skip = set(self._spec) | {sg for sg in self.nvme if sg not in self._had_grads}
        self._held.read_ahead(self._take_one_bank, skip=skip, keep_free=1 + resident)

    def _take_one_bank(self, slots: tuple = ()) -> int | None:
        """A free bank, once populated, with the nvme `slots` a step will write announced to
        held state_dict() tensors (they keep their values); None when the pool has none free."""
        banks = self._pool.acquire(1)
        if banks is None:
            return None
        try:
            if self._views.held.by_key:
                self._views.writing(banks=banks, slots=slots)
            self._banks.wait_populated(banks, self._client.timeout_s)
        except BaseException:
            self._pool.release(banks[0])
            raise
        return banks[0]

    def _take_write_bank(self, sg: int, spec: _Speculation) -> bool:
        """A read-ahead nvme step (`spec`, its read bank taken) gets the bank it writes; False
        when the pool has none free now."""
        spec.bank = self._take_one_bank(((sg, 1 - self._files.slot(sg)),))
        return spec.bank is not None

    # ------------------------------------------------------------------ launching
    def _carry_over(self, sg: int, src: int, out_bank: int, runs: tuple) -> None:
        """Elements no run steps keep their committed state in the new bank (an nvme subgroup's
        high half is the model's param, never saved from a bank: not copied)."""
        n = self.numels[sg]
        # the high half of an nvme subgroup, or in copy slots, was filled whole (fill_high)
        high = not (self.nvme[sg] or self._pool.copy_of is not None)
        src_state = self._banks.stored_state(src, sg, high=high)
        dst_state = self._banks.stored_state(out_bank, sg, high=high)
        pos = 0
        for off, k, _ in sorted(runs) + [(n, 0, 0)]:
            if off > pos:
                for name, dst in dst_state.items():
                    if name.endswith(ABSMAX):  # q8: runs start and end on blocks (layout.py)
                        dst[pos // Q8_BLOCK : q8_blocks(off)].copy_(
                            src_state[name][pos // Q8_BLOCK : q8_blocks(off)]
                        )
                    else:
                        dst[pos:off].copy_(src_state[name][pos:off])
            pos = max(pos, off + k)

    def _launch(
        self,
        sg: int,
        grad,
        inputs: AdamInputs,
        runs: tuple,
        spec: _Speculation,
        skip_nonfinite: bool,
        whole_subgroup_check: bool = False,
        remote: bool = False,
        need: int | None = None,
        waited: bool = False,
    ) -> bool:
        """Stage and send every task of one subgroup's step (`runs`: inputs.ranges, as _check
        gave them); spec.bank (and, for nvme, spec.aux_bank) are already taken. remote: the
        worker reads the grads itself where it can (during backward, the trainer's core is
        busy). whole_subgroup_check: a speculated in-place step (inverse mode). need: the
        staging slots that must be free at once (HostIO.stage_steps); False when they were
        not, nothing sent. waited: the trainer waits for it (finish(), not a speculation)."""
        remote = remote and self._io.remote_gather and not whole_subgroup_check
        pieces = spec.pieces
        swap_in = None
        if self.nvme[sg]:
            in_bank = spec.aux_bank
            swap_in = None if spec.in_memory else (spec.swap_in or self._send_swap_in(sg, spec))
            if self._banks.keeps_remainders(sg):
                if spec.in_memory and self._views.held.by_key:  # a state_dict() tensor may map it
                    self._views.writing(banks=[in_bank])
                self._send_high_half(sg, spec, in_bank)  # type: ignore[arg-type]  # nvme: aux_bank is taken
        else:
            in_bank = self._pool.committed[sg]
            if self._pool.copy_of is not None and self._banks.keeps_remainders(sg):
                # copy slots: the committed high half is the model's param, into the out bank's
                # slot (the step reads and writes it there)
                self._send_high_half(sg, spec, spec.bank)  # type: ignore[arg-type]  # exact: a bank
        carries = inputs.runs and spec.bank is not None
        # the read lands first where the trainer touches the bank before the worker would: the
        # state it carries over, or a step it runs itself (inline_steps.py), as the worker's step
        # waits for it
        if swap_in is not None and (carries or (waited and self._io.inline is not None)):
            self._io.wait_for([swap_in])
        if carries:
            self._carry_over(sg, in_bank, spec.bank, runs)  # type: ignore[arg-type]  # nvme: aux_bank too
        # inverse mode: stepped only if every grad is finite (checked), the grads held for the undo
        if not self._io.stage_steps(
            pieces,
            sg,
            inputs,
            runs,
            in_bank,
            spec.bank,
            skip_nonfinite,
            grad,
            remote=remote,
            checked=whole_subgroup_check,
            hold=whole_subgroup_check,
            progress=self._on_progress,
            need=need,
            waited=waited,
        ):
            return False
        if self.nvme[sg]:
            spec.file_slot = 1 - self._files.slot(sg)
            spec.swap_out = swap_piece(proto.OP_SWAP_OUT, sg, spec.bank, spec.file_slot)  # type: ignore[arg-type]  # nvme: a bank
            pieces.append(spec.swap_out)
            self._io.send(spec.swap_out)
        spec.launched = True
        return True

    def _send_high_half(self, sg: int, spec: _Speculation, bank: int) -> None:
        """The committed high half (the model's param) into the read bank; a copy still in
        flight (CUDA) holds the step's tasks back behind a no-op task that waits for it."""
        landed = self._banks.fill_high(sg, bank, self._io.stager_for)
        if landed is not None:
            piece = _Piece(sg, 0, 0, -1, proto.Task(proto.OP_PING, 0, sg), freed=True, copy_done=landed)
            spec.pieces.append(piece)
            self._io.send(piece)

    def _check(self, sg: int, grad, inputs: AdamInputs) -> tuple:
        """Rejects a bad step before any bank, slot or task is taken: a step that failed half
        launched would leave a spare bank partly written, and a speculation finish() could commit.
        Returns the step's runs (inputs.ranges: (offset, numel, step)), checked."""
        if sg not in self.numels:
            raise IndexError(
                f"subgroup {sg} does not exist: this host tier has subgroups {sorted(self.numels)}"
            )
        n = self.numels[sg]
        if not callable(grad) and grad.numel() != n:
            raise ValueError(f"subgroup {sg} has {n} elements, its grad {grad.numel()}")
        if inputs.amsgrad and not self.amsgrad:
            raise ValueError(
                "AdamInputs.amsgrad=True on a host tier built with amsgrad=False, which "
                "lays out no running max of v; build the tier with amsgrad=True"
            )
        runs = inputs.ranges(n)
        for run_off, run_n, _ in runs:
            if run_off < 0 or run_n < 0 or run_off + run_n > n:
                raise ValueError(f"run ({run_off}, {run_n}) is outside subgroup {sg} of {n} elements")
        return runs

    def _send_swap_in(self, sg: int, spec: _Speculation) -> _Piece:
        """The worker starts reading the committed slot into spec.aux_bank at once."""
        spec.swap_in = self._held.read(sg, spec.aux_bank)  # type: ignore[arg-type]  # nvme: a bank
        spec.pieces.append(spec.swap_in)
        return spec.swap_in

    def _take_banks(self, sg: int) -> _Speculation | None:
        """The banks one step of `sg` needs, or None when the pool cannot give them now:
        nvme two (read, result), exact one (result), inverse none (in place); once the banks
        the step reads and writes are populated."""
        spec = self._bank_spec(sg)
        if spec is not None:
            used = [b for b in (spec.bank, spec.aux_bank) if b is not None]
            # what the step writes: the banks the pool handed out, or the committed one in place
            # (inverse), and an nvme file's other slot
            in_place = [self._pool.committed[sg]] if not self.nvme[sg] and self.rollback != "exact" else []
            try:
                if self._views.held.by_key:  # a state_dict() tensor is held: it keeps its values
                    self._views.writing(
                        banks=used + in_place, slots=[(sg, 1 - self._files.slot(sg))] if self.nvme[sg] else []
                    )
                self._banks.wait_populated(
                    used if self.nvme[sg] else [self._pool.committed[sg]] + used, self._client.timeout_s
                )
            except BaseException:
                self._release_banks(spec)
                raise
        return spec

    def _bank_spec(self, sg: int) -> _Speculation | None:
        if self.nvme[sg] and self._held.holds_read(sg):  # its state is in memory, or being read there
            out = self._pool.acquire(1)
            if out is None:
                return None
            return _Speculation.reading(self._held.take(sg), out[0])  # type: ignore[arg-type]  # held
        if self.nvme[sg]:
            banks = self._pool.acquire(2)
            return None if banks is None else _Speculation(None, banks[1], aux_bank=banks[0])
        if self.rollback == "exact":
            banks = self._pool.acquire(1)
            return None if banks is None else _Speculation(None, banks[0])
        return _Speculation(None, None)

    def _release_banks(self, spec: _Speculation) -> None:
        for b in (spec.bank, spec.aux_bank):
            if b is not None:
                self._pool.release(b)
        spec.bank = spec.aux_bank = None

    # ------------------------------------------------------------------ speculation
    def speculate(self, sg: int, grad, inputs: AdamInputs, wait: bool = True, replace: bool = False) -> bool:
        """Step `sg` now, into spare banks (exact, nvme) or in place (inverse), to be validated
        by finish(). Returns False, doing nothing, when no bank is free (or, in inverse mode
        or with wait=False, not every staging slot it needs): the subgroup is then stepped at
        finish(). With wait=True it may wait for the worker to free staging slots, and for the
        write behind `sg`'s last step to land (with wait=False that write still landing refuses
        it, as one that failed always does). replace:
        a pending speculation of `sg` is cancelled first (else it raises: require_idle). The
        results that came back are collected first: they free slots and banks."""
        if replace:
            self.drop(sg)
        runs = self._check(sg, grad, inputs)
        self.require_idle(sg)
        in_place = self.rollback == "inverse" and not self.nvme[sg]
        # wait=False (inside backward) never waits for the worker: every slot the step needs
        # must be free now; in place, they also stay held until validation (the undo needs
        # the grads), so they must all be free at once anyway. The results that came back are
        # collected and the slots counted before the step's first task goes out: an nvme
        # step's swap-in here, else the staging's (HostIO.stage_steps)
        need = sum(-(-k // self.slot_numel) for _, k, _ in runs) if (in_place or not wait) else 0
        if self.nvme[sg] and self._io.poll() < need:
            return False
        # the write behind its last step: this step reads the bank it came from
        if self.nvme[sg] and self._held.written_bank(sg) is not None:
            if not self._held.write_landed(sg, wait=wait):  # wait=True may wait for the worker
                return False  # still landing (wait=False) or failed: stepped at finish(), which settles it
            self._held.keep(sg, self._held.settle(sg))
        spec = self._take_banks(sg)
        # a write behind the last step that landed gives its bank back (its state is in the slot)
        while spec is None and self._held.evict(wait=False):
            spec = self._take_banks(sg)
        if spec is None:
            self._io.poll()  # refused all the same: the results that came back are collected
            if self._pool.dormant and self.worker_idle():
                self._starved.add(sg)
            return False
        spec.inputs = inputs
        self._spec[sg] = spec
        try:
            staged = self._launch(
                sg,
                grad,
                inputs,
                runs,
                spec,
                True,
                whole_subgroup_check=in_place,
                remote=True,
                need=None if self.nvme[sg] else need,
            )
        except BaseException:
            self._abandon(sg)  # a half-launched speculation must never be committed
            raise
        if not staged:  # too few free slots: nothing was sent
            self._release_banks(self._spec.pop(sg))
        return staged

    def _abandon(self, sg: int) -> None:
        """Forget a speculation that failed while launching: its finished in-place pieces are
        undone (inverse), its banks and slots go back once nothing writes them."""
        spec = self._spec.pop(sg, None)
        if spec is None:
            return
        if spec.pieces:  # something was sent (or queued): it ends before its buffers go back
            self._io.quiesce()
        if spec.bank is None and any(
            p.result is not None and p.result.status == proto.STATUS_OK for p in spec.pieces
        ):
            try:
                self._undo(sg, spec)
            except Exception:
                pass  # the error being raised already names this subgroup's trouble
        self._io.release_slots(spec.pieces)
        self._release_banks(spec)

    def speculated(self) -> list[int]:
        return sorted(self._spec)

    def drop(self, sg: int) -> None:
        """Drop a pending speculation of `sg` (its grads changed: a new one follows)."""
        spec = self._spec.get(sg)
        if spec is None:
            return
        self._io.wait_for(spec.pieces)
        self._drop(self._spec.pop(sg), sg)

    def grad_stats(self, sg: int):
        """(sum of squares, all finite) of the grads `sg` was speculated with, in piece order;
        None when it was not speculated. Waits for its pieces."""
        spec = self._spec.get(sg)
        if spec is None:
            return None
        self._io.wait_for(spec.pieces)
        total, finite = 0.0, True
        for p in spec.pieces:
            if p.task.op == proto.OP_STEP:
                total += p.result.sum_sq
                finite = finite and bool(p.result.finite)
        return total, finite

    def piece_stats(self, sg: int, wait: bool = True):
        """[(offset, numel, sum of squares)] of each grad piece `sg`'s pending speculation
        stepped, in launch order: the worker's grad_stats of the very bytes it stepped (the
        fingerprint grad_edits.py compares); None when `sg` was not speculated. Waits for them;
        wait=False: the layout now, a sum None where the piece has no result yet."""
        spec = self._spec.get(sg)
        if spec is None:
            return None
        if wait:
            self._io.wait_for(spec.pieces)
        return [
            (p.offset, p.numel, None if p.result is None else p.result.sum_sq)
            for p in spec.pieces
            if p.task.op == proto.OP_STEP
        ]

    def require_idle(self, sg: int) -> None:
        """Raises when `sg` has a speculative step pending (its state is not settled)."""
        if sg in self._spec:
            raise RuntimeError(f"subgroup {sg} has a speculative step pending; call finish() first")

    # ------------------------------------------------------------------ validation
    def _undo(self, sg: int, spec: _Speculation) -> None:
        """Inverse mode: undo a speculated in-place step with the grads it used. The undo's
        pieces are tracked as any step's, so a worker that dies under them names the subgroup
        torn (HostIO._recover) rather than leaving a wait no result ends."""
        # the grads are in the slots already (held until validation): no gather; the slots
        # stay the step's pieces' (freed=True: the undo's results free nothing)
        undo = [
            _Piece(
                sg,
                p.offset,
                p.numel,
                p.slot,
                freed=True,
                task=dataclasses.replace(
                    p.task, op=proto.OP_INVERSE, task_id=0, threads=self._io.waited_threads
                ),
            )
            for p in spec.pieces
            if p.task.op == proto.OP_STEP and p.result is not None and p.result.status == proto.STATUS_OK
        ]
        try:
            for u in undo:
                self._io.send(u)
            self._io.wait_for(undo)
        finally:
            self._io.release_slots(spec.pieces)

    def _drop(self, spec: _Speculation, sg: int) -> None:
        """The step does not stand: spare banks go back (the committed state was never
        written); an in-place step is undone."""
        if spec.bank is None and not self.nvme[sg]:
            self._undo(sg, spec)
        self._io.release_slots(spec.pieces)
        self._release_banks(spec)

    def _commit(self, sg: int, spec: _Speculation, on_commit) -> None:
        """The step stands: flip the subgroup's bank (exact) or file slot (nvme), let the
        caller read the new state, and return what the step borrowed. Its pieces' slots came
        back with their results (HostIO), but a speculated in-place step's: held for the undo."""
        if spec.bank is None and not self.nvme[sg]:
            self._io.release_slots(spec.pieces)
        if self.nvme[sg]:
            if on_commit is not None:
                on_commit(sg, self._banks.commit_views(spec.bank, sg))
            # write-behind: the bank it wrote holds the committed state until its write lands
            # (NvmeHeld.settle flips the slot then); the bank it read goes back now
            if spec.aux_bank is not None:
                self._pool.release(spec.aux_bank)
                spec.aux_bank = None
            self._held.hold_write(sg, spec.bank, spec.file_slot, spec.swap_out)  # type: ignore[arg-type]  # nvme: a bank, a write
            spec.bank = None
            return
        # the views before the pool's commit, which hands the new bank's copy slot on (copy slots)
        views = self._banks.commit_views(self._pool.committed[sg] if spec.bank is None else spec.bank, sg)
        if spec.bank is not None:
            self._pool.commit(sg, spec.bank)
            spec.bank = None
        if on_commit is not None:
            on_commit(sg, views)

    def finish(self, steps: dict, overflow: bool = False, on_commit=None) -> dict[int, str]:
        """Validate and complete this iteration's host steps.

        steps: {sg: (grad, final AdamInputs)} for every subgroup to be stepped now.
        overflow: the step is skipped — every speculated step is dropped, nothing changes.
        on_commit(sg, {"param": fp32 view[, "param_copy": model-dtype view]}; only param_copy for
        a subgroup that keeps remainders): called as each
        subgroup's new state is committed, while its views are valid (an nvme subgroup's
        buffers are reused right after).
        Returns {sg: "committed" | "redone" | "stepped" | "dropped"}.
        """
        runs = {sg: self._check(sg, grad, final) for sg, (grad, final) in steps.items()}
        if not overflow:  # a skipped step (an overflow) says nothing of what the next one steps
            self._had_grads = set(steps)
        grow = self._spares_wanted()
        saved = self._one_thread()
        try:
            # step(): the staging copies still landing may be waited for; every speculation ends first
            with self._io.finishing([p for s in self._spec.values() for p in s.pieces]):
                outcome = self._finish(steps, runs, overflow, on_commit)
        finally:
            self._threads_back(saved)
        if grow and self._wake_spares is not None:
            self._wake_spares(grow)
        return outcome

    def _one_thread(self) -> tuple | None:
        """Sharing every core with the worker, the trainer's torch (and cpu_kernels: one libgomp)
        on one thread for finish(); returns the counts to put back (None: nothing changed). The
        trainer then only stages grads and copies params back, which one thread does at memory
        speed; a second one took a core from the worker's and left the first spinning at each
        copy's barrier (Intel Xeon, 2 cores, bench GPT, offload 1: step() 60-64 -> 44-47 ms;
        docs/benchmarks.md). Split cores (a GPU host) keep their counts."""
        if not self._one_thread_waiting:
            return None
        saved = torch.get_num_threads(), cpu_kernels.get_num_threads()
        cpu_kernels.set_num_threads(1)  # cpu_kernels first, torch last, as CoreSplit sets them
        torch.set_num_threads(1)
        return saved

    @staticmethod
    def _threads_back(saved: tuple | None) -> None:
        if saved is not None:
            cpu_kernels.set_num_threads(saved[1])
            torch.set_num_threads(saved[0])

    def _spares_wanted(self) -> int:
        """Dormant spare banks the pool should wake after this step: one for each subgroup
        whose speculation found no free bank while the worker idled, having finished every step
        it was given (more banks would have hidden those steps under backward), counted in
        this iteration and the one before, whichever count is smaller: a first iteration's
        backward (allocations, warm-up) can be many times the next ones', and the memory, once
        woken, stays. A refusal while the worker is busy counts for nothing: more banks would
        only hold queued steps."""
        now, before = len(self._starved), self._starved_before
        self._starved, self._starved_before = set(), now
        return min(now, before) if before is not None and self._pool.dormant else 0

    def worker_idle(self) -> bool:
        """Every speculated piece's result is back (as last polled): the worker has nothing of
        this iteration's left to do."""
        return all(p.result is not None for spec in self._spec.values() for p in spec.pieces)

    def _finish(self, steps: dict, runs: dict, overflow: bool, on_commit) -> dict[int, str]:
        outcome = {}
        if overflow:
            for sg in list(self._spec):
                self._drop(self._spec.pop(sg), sg)
                outcome[sg] = "dropped"
            self._counts["dropped"] += len(outcome)
            return outcome
        # the last step's writes behind land (they had the forward and backward; one that
        # failed is sent again, and fails this step, changing nothing, if it fails again): their
        # banks stay, this step's reads of those subgroups
        if any(self.nvme.values()):
            self._held.settle_writes(keep=True)
        for sg in [s for s in self._spec if s not in steps]:
            self._drop(self._spec.pop(sg), sg)
            outcome[sg] = "dropped"
        todo = []
        for sg in sorted(steps):
            spec = self._spec.pop(sg, None)
            final = steps[sg][1]
            if spec is not None and (spec.inputs is final or spec.inputs == final) and spec.ok():
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
            self._step_all(todo, steps, runs, waiting, on_commit)
        except BaseException as e:
            # every committed state stands: let in-flight work end, then return what it held
            self._io.quiesce()
            torn = self._settle_in_place(waiting, on_commit)
            for spec in waiting.values():
                self._io.release_slots(spec.pieces)
                self._release_banks(spec)
            if isinstance(e, TornState):
                torn = sorted(set(torn) | set(e.subgroups))
            if torn and isinstance(e, Exception):
                raise TornState(e.why if isinstance(e, TornState) else str(e), torn) from e
            if torn:  # KeyboardInterrupt and the like stay one (Ctrl-C still stops), the tear named
                raise TornInterrupt(
                    f"hybrid_opt host tier (rollback='inverse'): interrupted; the state "
                    f"of subgroups {torn} may be torn; restore them from a checkpoint",
                    torn,
                ) from e
            raise
        for v in outcome.values():
            self._counts[v] += 1
        return outcome

    def _settle_in_place(self, waiting: dict, on_commit) -> list:
        """A failed finish(), inverse mode: an in-place step that completed has changed its
        subgroup whatever comes next, so it is committed (the caller learns it was stepped);
        returns the subgroups whose in-place step was only partly done (torn: some pieces
        stepped, the others lost, failed or never sent)."""
        torn = []
        for sg in [s for s, w in waiting.items() if w.bank is None and not self.nvme[s]]:
            spec = waiting[sg]
            if spec.launched and spec.ok():
                try:
                    self._commit(sg, waiting.pop(sg), on_commit)
                except BaseException:  # on_commit's copy into the model failed: the others still settle
                    self._io.release_slots(spec.pieces)
                    self._release_banks(spec)
                    torn.append(sg)  # stepped in place, its params not written: only a checkpoint mends it
            elif any(p.result is not None and p.result.status == proto.STATUS_OK for p in spec.pieces):
                torn.append(sg)
        return torn

    def _step_all(self, todo: list, steps: dict, runs: dict, waiting: dict, on_commit) -> None:
        # resident subgroups first (no I/O): their compute hides the first nvme reads; then the
        # nvme subgroups whose state is in memory or being read (read ahead), then the rest,
        # whose reads are sent ahead of their steps as far as the bank pool allows (prefetch)
        nvme = [sg for sg in todo if self.nvme[sg]]
        todo = (
            [sg for sg in todo if not self.nvme[sg]]
            + [sg for sg in nvme if self._held.holds_read(sg)]
            + [sg for sg in nvme if not self._held.holds_read(sg)]
        )
        # the reads read_ahead started after the last step are this step's (the slots stand)
        prefetched: dict = {
            sg: _Speculation.reading(self._held.take(sg))  # type: ignore[arg-type]  # held
            for sg in todo
            if self._held.holds_read(sg)
        }
        self._held.release_reads()  # those of subgroups this step leaves alone hold banks it may need
        position = [0]

        def prefetch(k: int) -> None:
            # nvme reads start into free banks, one each (its step takes the bank it writes at
            # its turn), always leaving one bank for the next step's result
            for nxt in todo[k + 1 :]:
                if not self.nvme[nxt] or nxt in prefetched:
                    continue
                # a write-behind of this step that landed gives its bank to a read
                while len(self._pool.free) < 2 and self._held.evict(wait=False):
                    pass
                if len(self._pool.free) < 2:
                    break
                read = self._take_one_bank()
                ahead = waiting[nxt] = _Speculation(None, None, aux_bank=read)  # the error path's
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
            self._step_loop(todo, steps, runs, waiting, on_commit, prefetched, prefetch, position)
        finally:
            self._on_progress = None

    def _step_loop(self, todo, steps, runs, waiting, on_commit, prefetched, prefetch, position) -> None:
        for k, sg in enumerate(todo):
            position[0] = k
            grad, final = steps[sg]
            spec = prefetched.pop(sg, None) or self._take_banks(sg)
            # the pool is spent: commit what has finished, then go on (a step read ahead holds
            # its read bank: it waits for the bank it writes)
            while spec is None or (
                spec.bank is None and self.nvme[sg] and not self._take_write_bank(sg, spec)
            ):
                # a bank comes back: a write-behind's that landed, a step's that finished (or,
                # with neither in flight, a write-behind's once it lands, a later subgroup's read)
                if not self._held.evict(wait=False):
                    if waiting:
                        self._io.wait(
                            lambda: any(w.done() for w in waiting.values()) or self._held.any_write_landed()
                        )
                        self._commit_finished(waiting, on_commit)
                    elif not (self._held.evict(wait=True) or self._give_up_read(prefetched)):
                        if spec is not None:
                            waiting[sg] = spec  # the caller's handler waits for its read, frees its bank
                        raise RuntimeError(
                            f"subgroup {sg} needs more banks than the pool has "
                            f"({self._pool.n_banks}); raise spare_banks/io_banks"
                        )
                if spec is None:
                    spec = self._take_banks(sg)
            spec.inputs = final
            waiting[sg] = spec
            if self.nvme[sg] and spec.swap_in is None and not spec.in_memory:
                self._send_swap_in(sg, spec)  # its own read goes ahead of any prefetch
            prefetch(k)
            try:
                self._launch(sg, grad, final, runs[sg], spec, False, waited=True)
            except BaseException:
                for sgp, sp in prefetched.items():
                    waiting.setdefault(sgp, sp)  # the handler waits for their reads, frees banks
                raise
        # the steps, not the writes: those land behind (settled at the next step, or sooner)
        self._io.wait(lambda: all(w.done() for w in waiting.values()))
        self._commit_finished(waiting, on_commit)

    def _give_up_read(self, prefetched: dict) -> bool:
        """The pool is spent: the read of the subgroup this step reaches last gives its bank
        back (it is read again at its turn); False when no read is held."""
        if not prefetched:
            return False
        sg = list(prefetched)[-1]
        spec = prefetched.pop(sg)
        self._io.wait_for(spec.pieces)
        self._drop(spec, sg)
        return True

    def _commit_finished(self, waiting: dict, on_commit) -> None:
        for sg in [s for s, w in waiting.items() if w.done()]:
            if not waiting[sg].ok():
                self._io.raise_error()  # the worker's own error names the subgroup and cause
                raise RuntimeError(f"hybrid_opt host tier: subgroup {sg}'s step did not complete")
            self._commit(sg, waiting.pop(sg), on_commit)

    def step(self, sg: int, grad, inputs: AdamInputs, on_commit=None) -> str:
        """A plain (non-speculative) step of one subgroup."""
        return self.finish({sg: (grad, inputs)}, on_commit=on_commit)[sg]
