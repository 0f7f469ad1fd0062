"""The host tier: subgroups' fp32 master and moments in trainer-owned shared memory, stepped by the
worker process, speculatively during backward, with exact or inverse rollback.

`HostTier` owns construction (arena, worker, nvme files), views of the committed state,
state()/load_state() and close(), and the parts it is made of, which callers reach as its
read-only attributes: `banks` StateBanks (compressed.py), `io` HostIO (host_io.py), `stepping`
HostStepping (host_step.py), `held` NvmeHeld (nvme_held.py: nvme state in memory between steps),
`views` HostViews (host_views.py), `files` NvmeFiles and `file_slots` FileSlots (nvme_files.py),
`pool` BankPool (banks.py), `client` WorkerClient."""

from __future__ import annotations

import torch

from hybrid_opt.banks import BankPool
from hybrid_opt.shm import PAGE, SharedArena, align_up
from hybrid_opt.state.state_format import ABSMAX, Q8, StateFormat
from hybrid_opt.swap import SwapDir, check_nvme_path

# re-exported: the optimizer, calibration, tests and benchmarks import these from here
from hybrid_opt.tiers.arena_plan import (  # noqa: F401
    DEFAULT_SLOT_NUMEL,
    MAX_STAGING_SLOTS,
    STAGING_SLOTS,
    plan_arena,
    staging_slots_for,
)
from hybrid_opt.tiers.compressed import StateBanks, _independent_moment_dtypes, check_params
from hybrid_opt.tiers.host_io import _DT_CODE, REMOTE_GATHER_QUEUE, HostIO, _Piece  # noqa: F401
from hybrid_opt.tiers.host_step import HostStepping, _Speculation  # noqa: F401
from hybrid_opt.tiers.host_views import HostViews
from hybrid_opt.tiers.inline_steps import InlineSteps
from hybrid_opt.tiers.inputs import AdamInputs, _with_step  # noqa: F401
from hybrid_opt.tiers.nvme_files import FileSlots, NvmeFiles
from hybrid_opt.tiers.nvme_held import NvmeHeld
from hybrid_opt.worker.client import DEFAULT_WORKER_SHARE, CoreSplit, WorkerClient


def _moment_code(dtype) -> int:
    """A moment dtype's code for the worker: _DT_CODE's, or the C library's DT_Q8 for "q8"."""
    if dtype == Q8:
        from cpu_kernels._q8_lib import DT_Q8

        return DT_Q8
    return _DT_CODE[dtype]


class HostTier:
    """Subgroups' optimizer state in shared memory, stepped by a worker process (module
    docstring); it owns its parts, each a read-only attribute its callers use directly:
    `stepping` (HostStepping: speculate, finish, step, drop, piece_stats), `io` (HostIO: staging
    and worker traffic, poll, worker_seconds), `banks` (StateBanks, tiers/compressed.py: the
    banks' layout, views and remainders), `pool` (BankPool), `views` (HostViews), `file_slots`
    (FileSlots: the nvme files' committed slots), `files` (NvmeFiles, or None without nvme) and
    `client` (the WorkerClient). What stays here works across parts: construction, the state
    (state, load_state, fill_state, master, moments, param_copy), moves of nvme state, counters
    (stats) and close().

    exp_avg_dtype / exp_avg_sq_dtype: each torch.float32 or torch.bfloat16 (`moment_dtype`:
    the older name, setting both). remainders=True: each subgroup whose `params` entry is bf16
    (the tier's copy_dtype must then be bf16) keeps its fp32 master as that param (the high
    half, also the bank's copy region) plus an int16 remainder; other subgroups keep an fp32
    master. `params`: the model's flat tensor of every subgroup, in numels' order; the caller
    copies each committed param_copy into it (on_commit), as the optimizer does.
    state()/master() give the master in fp32.

    exp_avg_dtype / exp_avg_sq_dtype may be "q8" (issue 38): `quantized` (a flag per subgroup:
    its params have at least Q8_MIN_NUMEL elements, layout.py) says which subgroups keep q8
    moments — codes and absmaxes in their banks (compressed.py), stepped by the q8 kernel; the
    others keep fp32 moments. None: none is quantized.

    `ids`: each subgroup's id (the layout's `Subgroup.index`), in numels' order; every method
    takes a subgroup by its id and everything the tier hands back (outcomes, errors, counters,
    flags) names it by its id (default: 0..n-1). The per-subgroup lists (`nvme`, `quantized`,
    `params`) are in numels' order.

    `inline`: whether the steps the trainer waits for (finish()'s) run in the trainer itself
    (inline_steps.py) rather than at the worker. None: where the trainer and the worker share
    every core (a CPU-only host, CoreSplit.shared, or one with one core) and the params are not
    on a GPU (`pin`). Speculated steps and the nvme subgroups' swaps stay the worker's."""

    def __init__(
        self,
        numels: list[int],
        *,
        grad_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        remainders: bool = False,
        params: list | None = None,
        moment_dtype=None,
        copy_dtype=None,
        amsgrad: bool = False,
        rollback: str = "exact",
        spare_banks: int | None = None,
        spares_awake: int | None = None,
        staging_slots: int = STAGING_SLOTS,
        slot_numel: int | None = None,
        worker_share: float | None = None,
        worker_cores: list[int] | None = None,
        timeout_s: float = 120.0,
        nvme: list | None = None,
        nvme_path=None,
        io_banks: int = 4,
        nvme_threads: int = 4,
        pin: bool | torch.device = False,
        quantized: list | None = None,
        ids: list | None = None,
        inline: bool | None = None,
    ):
        if rollback not in ("exact", "inverse"):
            raise ValueError(f"rollback must be 'exact' or 'inverse', got {rollback!r}")
        # amsgrad=True lays out the running max of v; each step's AdamInputs.amsgrad says
        # whether it is used (param groups may differ)
        if rollback == "inverse" and amsgrad:
            raise ValueError(
                "rollback='inverse' cannot undo amsgrad (its running max of v is not "
                "invertible); use rollback='exact' with amsgrad=True"
            )
        if moment_dtype is not None:  # the older name: both moments
            exp_avg_dtype = exp_avg_sq_dtype = moment_dtype
        fmt = StateFormat(exp_avg_dtype, exp_avg_sq_dtype, bool(remainders))
        fmt.check_rollback(rollback)
        if grad_dtype not in _DT_CODE:
            raise TypeError(f"grad_dtype must be one of {list(_DT_CODE)}, got {grad_dtype}")
        quantized = [bool(q) for q in quantized] if quantized is not None else [False] * len(numels)
        if len(quantized) != len(numels):
            raise ValueError(f"quantized has {len(quantized)} flags for {len(numels)} subgroups")
        if not fmt.quantized_moments:
            quantized = [False] * len(numels)
        if exp_avg_dtype != exp_avg_sq_dtype and not _independent_moment_dtypes():
            raise TypeError(
                "this build of cpu_kernels steps exp_avg and exp_avg_sq of one dtype "
                f"only (got {exp_avg_dtype} and {exp_avg_sq_dtype}); rebuild it "
                "(python setup.py build_ext --inplace) or give both one dtype"
            )
        if copy_dtype not in (None, torch.bfloat16, torch.float16):
            raise TypeError(f"copy_dtype must be None, torch.bfloat16 or torch.float16, got {copy_dtype}")
        if not numels or min(numels) < 1:
            raise ValueError("the host tier needs at least one subgroup of at least one element")
        if (
            rollback == "exact" and spare_banks is not None and spare_banks < 1 and not all(nvme or [False])
        ):  # an nvme step borrows the io banks instead
            raise ValueError(f"rollback='exact' needs at least one spare bank, got spare_banks={spare_banks}")
        if staging_slots < 1:
            raise ValueError(f"staging_slots must be >= 1, got {staging_slots}")
        ids = list(range(len(numels))) if ids is None else [int(i) for i in ids]
        if len(ids) != len(numels) or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"ids must be {len(numels)} distinct subgroup ids >= 0, got {ids}")
        # per subgroup, by its id: every part of the tier keys its subgroups so
        self.numels = dict(zip(ids, numels))
        flags, checked = check_params(params, list(numels), fmt, copy_dtype)
        sg_remainders = dict(zip(ids, flags))
        sg_params = dict(zip(ids, checked)) if checked is not None else None
        sg_quantized = dict(zip(ids, quantized))
        if rollback == "inverse" and any(sg_remainders.values()):
            raise ValueError(
                "rollback='inverse' needs an fp32 master (its fp64 inverse reads and "
                "writes fp32 params); use rollback='exact' with remainders=True"
            )
        self.state_format = fmt
        self.grad_dtype, self.copy_dtype = grad_dtype, copy_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.amsgrad, self.rollback = amsgrad, rollback
        n = len(numels)
        nvme = [bool(x) for x in nvme] if nvme is not None else [False] * n
        if len(nvme) != n:
            raise ValueError(f"nvme has {len(nvme)} flags for {n} subgroups")
        self.nvme = dict(zip(ids, nvme))
        has_nvme = any(nvme)
        if has_nvme and io_banks < 1:
            raise ValueError(f"the nvme tier needs io_banks >= 1, got {io_banks}")
        if has_nvme:
            check_nvme_path(nvme_path)  # path errors before any work
        # argument errors before anything is made (shared memory, swap directory)
        # worker_share None: a GPU host splits the cores (the trainer's one or two drive the GPU,
        # the worker steps on the rest); a CPU-only host shares them all (its forward and
        # backward need every core; the host step fills their idle moments)
        if worker_share is None and pin:
            worker_share = DEFAULT_WORKER_SHARE
        self.cores = CoreSplit(worker_share, worker_cores)
        self.swap = None
        lay = plan_arena(
            list(numels),
            nvme,
            fmt=fmt,
            amsgrad=amsgrad,
            copy_dtype=copy_dtype,
            remainders=flags,
            grad_dtype=grad_dtype,
            rollback=rollback,
            spare_banks=spare_banks,
            io_banks=io_banks,
            staging_slots=staging_slots,
            slot_numel=slot_numel,
            quantized=list(sg_quantized.values()),
            ids=ids,
        )
        resident = lay.resident
        # an nvme step holds two banks (read, result) until it is committed or dropped
        self.io_banks = lay.io_banks
        # spares_awake: the spare banks the pool hands out from the start; the others stay
        # dormant (no memory) until wake_spares() takes them into use
        awake = lay.spares if spares_awake is None else min(lay.spares, max(1, spares_awake))
        dormant_banks = list(range(len(resident) + awake, len(resident) + lay.spares))
        self.pool = BankPool(
            resident, lay.spares + 2 * self.io_banks, copy_slots=lay.copy_slots, dormant=dormant_banks
        )
        self._lay = lay
        self.capacity, self.slot_numel, self.io_bytes = lay.capacity, lay.slot_numel, lay.io_bytes
        regions, bank_stride, slot_stride = lay.regions, lay.bank_stride, lay.slot_stride
        bank_offset, slot_offset = lay.bank_offset, lay.slot_offset
        self.bank_bytes, self.spare_bytes, self.staging_bytes = (
            lay.bank_bytes,
            lay.spare_bytes,
            lay.staging_bytes,
        )
        self.nvme_bytes = 2 * self.io_bytes * sum(nvme)

        # populated now: what construction writes (the committed masters: load_state) and the
        # staging slots; behind the first forward/backward, in this order: the committed banks'
        # moments (zero: nothing writes them before a step), then the spare and io banks, in
        # the order the pool hands them out. A step waits for the banks it uses (_take_banks).
        # A pinned arena is populated whole: cudaHostRegister locks every page anyway.
        later = (
            []
            if pin
            else [
                (
                    align_up(bank_offset + k * bank_stride + regions["m"], PAGE),
                    bank_offset
                    + (k + 1) * bank_stride
                    - align_up(bank_offset + k * bank_stride + regions["m"], PAGE),
                )
                for k in range(len(resident))
            ]
        )
        if not pin and self.pool.n_banks > len(resident):
            first, end = len(resident), len(resident) + awake  # the awake spares, then the io banks
            later += [
                (bank_offset + bank_stride * a, bank_stride * (b - a))
                for a, b in ((first, end), (len(resident) + lay.spares, self.pool.n_banks))
                if b > a
            ]
        dormant = [r for b in dormant_banks for r in self._bank_ranges(b)]
        # its pages reserved and populated below, once the worker is starting (fill())
        self.arena = SharedArena(lay.nbytes, "hybrid_opt-host", later=later, defer=True, dormant=dormant)
        self.banks = StateBanks(
            self.arena,
            numels=self.numels,
            fmt=fmt,
            amsgrad=amsgrad,
            copy_dtype=copy_dtype,
            remainders=sg_remainders,
            params=sg_params,
            regions=regions,
            bank_offset=bank_offset,
            bank_stride=bank_stride,
            io_bytes=self.io_bytes,
            n_banks=self.pool.n_banks,
            quantized=sg_quantized,
            copy_of=self.pool.copy_of,
            copy_offset=lay.copy_offset,
            copy_stride=lay.copy_stride,
        )
        slots = [
            self.arena.tensor(slot_offset + k * slot_stride, self.slot_numel, grad_dtype)
            for k in range(staging_slots)
        ]
        layout = dict(
            bank_offset=bank_offset,
            bank_stride=bank_stride,
            bank_regions=regions,
            slot_offset=slot_offset,
            slot_stride=slot_stride,
            exp_avg_dtype=_moment_code(exp_avg_dtype),
            exp_avg_sq_dtype=_moment_code(exp_avg_sq_dtype),
            # the subgroups whose q8 moments are codes (the others' are fp32)
            quantized=[sg for sg, q in sg_quantized.items() if q],
            populate_later=later,
            dormant=dormant,  # neither reserved nor populated (wake_spares)
        )  # the worker maps these in the background
        self.file_slots = FileSlots(ids)  # nvme: the committed slot of each subgroup's file
        self._aio = None  # the trainer's own engine (load_state / state)
        self.files = None  # nvme: the trainer's descriptors (nvme_files.py)
        if has_nvme:
            # made after the shared memory (sizing it can fail: RLIMIT_FSIZE, a full /dev/shm)
            # and filled inside the try below, so a failed constructor leaves no directory behind
            self.swap = SwapDir(nvme_path)
            self.files = NvmeFiles(self.swap)
            layout["nvme"] = dict(dir=self.swap.path, io_bytes=self.io_bytes, threads=nvme_threads)
        self.client = WorkerClient(
            self.arena,
            layout,
            cores=self.cores.worker or None,
            threads=self.cores.worker_threads or None,
            passive=self.cores.shared,
            waited_cores=self.cores.waited_cores if self.cores.widens else None,
            waited_threads=self.cores.waited_threads,
            timeout_s=timeout_s,
            files=self.files,
        )  # each worker inherits them
        # the io part tells the stepping part (made next: `stepping` is read at call time)
        # which torn speculations to forget
        stepping: HostStepping
        # a CPU-only host whose trainer and worker share every core (or have one core to take
        # turns on): the steps step() waits for run in the trainer, on its own mapping, with no
        # copy of the grads (inline_steps.py); the worker keeps the nvme subgroups' swaps
        if inline is None:
            inline = not pin and set(self.cores.worker) == set(self.cores.trainer)
        self.inline = InlineSteps(self.arena, layout) if inline else None
        self.io = HostIO(
            self.client,
            slots,
            slot_numel=self.slot_numel,
            grad_dtype=grad_dtype,
            copy_dtype=copy_dtype,
            remainders=sg_remainders,
            rollback=rollback,
            nvme=self.nvme,
            forget=lambda sg: stepping.forget(sg),
            waited_threads=self.cores.waited_threads,
            # asked only where copies are pooled: elsewhere every task reads the bank's region
            copy_addrs=self.banks.copy_addrs if self.banks.pools_copies else None,
            refill_high=self.banks.refill_high,
            inline=self.inline,
        )
        # nvme state in memory between steps: the reads ahead of a step, the writes behind it
        self.held = NvmeHeld(self.io, self.pool, self.file_slots, self.nvme)
        # the committed state as pieces state_dict() maps; told of every write into it first
        # (a bank the pool hands out, a bank or nvme slot written in place)
        self.views = HostViews(
            self.arena,
            self.banks,
            self.pool,
            self.file_slots,
            self.files,
            nvme=self.nvme,
            io_bytes=self.io_bytes,
            written_bank=self.held.written_bank,
        )
        stepping = HostStepping(
            self.io,
            self.banks,
            self.pool,
            self.file_slots,
            self.client,
            self.views,
            self.held,
            numels=self.numels,
            nvme=self.nvme,
            rollback=rollback,
            amsgrad=amsgrad,
            slot_numel=self.slot_numel,
            wake_spares=self.wake_spares,
            # the trainer only copies while the worker steps (inline: it steps, on every core)
            one_thread_waiting=self.cores.shared and self.inline is None,
        )
        self.stepping = stepping
        self.closed = False
        try:
            if has_nvme:  # RLIMIT_NOFILE: raised where short (the files: made where has_nvme)
                self.files.reserve(sum(nvme))  # type: ignore[union-attr]
            for sg in ids:
                if self.nvme[sg]:
                    self.swap.create(sg, 2 * self.io_bytes)  # type: ignore[union-attr]  # as above
                    self.files.open(sg)  # type: ignore[union-attr]
            # the worker's start-up (an interpreter, its imports) overlaps reserving the arena's
            # pages (fallocate: most of construction, ~0.2 s per GB here)
            self.client.launch()
            self.arena.fill()  # MemoryError where the memory is not there: closed below
            if pin:  # CUDA params: async D2H grads and H2D params need page-locked memory
                # registered in the params' device's context (pin: their device, or True)
                self.arena.pin(pin if isinstance(pin, torch.device) else None)
            self.client.wait_started()
            self.cores.apply()
            self.io.probe_remote_gather()
            if has_nvme:
                # a new file reads back as zeros: slot 0 already holds the all-zero state, so
                # only its CRC is needed (nothing is written before load_state sets real state)
                from cpu_kernels.aio import aligned_buffer, checksum

                zeros = aligned_buffer(self.io_bytes)
                zero_crc = checksum(zeros)
                zeros.close()
                for sg in ids:
                    if self.nvme[sg]:
                        self.file_slots.note_crc(sg, 0, zero_crc)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ state views
    def _resident(self, sg: int) -> int:
        if self.nvme[sg]:
            raise RuntimeError(
                f"subgroup {sg} lives on nvme: its state is in files, read it with "
                f"state({sg}) and set it with load_state({sg}, ...)"
            )
        return self.pool.committed[sg]

    def quantized(self, sg: int) -> bool:
        """Whether subgroup `sg` keeps q8 moments (codes and absmaxes in its banks)."""
        return self.banks.quantized(sg)

    def master(self, sg: int) -> torch.Tensor:
        """The committed fp32 master of a resident subgroup (a view: valid until the next commit;
        decoded into a new tensor for a subgroup that keeps remainders)."""
        return self.banks.bank_state(self._resident(sg), sg)["param"]

    def moments(self, sg: int) -> dict:
        st = self.banks.stored_state(self._resident(sg), sg, high=False)
        for k in ("param", "high", "remainder"):
            st.pop(k, None)
        return st

    def param_copy(self, sg: int) -> torch.Tensor:
        """The committed step's model-dtype copy of the master (written by the last step)."""
        if self.copy_dtype is None:
            raise RuntimeError("this tier writes no param copy (copy_dtype=None)")
        if self.pool.copy_of is not None:
            raise RuntimeError(
                "this tier keeps its param copies in copy slots until their commit: the committed "
                "copy is the model's param (on_commit wrote it there)"
            )
        return self.banks.view(self._resident(sg), "copy", self.numels[sg], self.copy_dtype)

    def _engine(self):
        if self._aio is None:
            from cpu_kernels.aio import AioEngine

            self._aio = AioEngine(threads=2, queue_depth=8)
            for sg, fd in self.files.items():
                self._aio.register(fd, self.swap.file(sg))  # its errors name the file
        return self._aio

    def _borrow_bank(self) -> int:
        banks = self.pool.acquire(1)
        if banks is None:  # the reads ahead of the next step hold the rest: they give way
            self.held.release_reads()
            banks = self.pool.acquire(1)
        if banks is None:  # then the writes behind the last step, once they landed
            self.held.settle_writes()
            banks = self.pool.acquire(1)
        if banks is None:
            raise RuntimeError(
                "no free bank to move nvme state through: every one is held by a "
                "step awaiting validation; call finish() first"
            )
        try:
            self.views.writing(banks=banks)
            self.banks.wait_populated(banks, self.client.timeout_s)
        except BaseException:
            self.pool.release(banks[0])
            raise
        return banks[0]

    def _swap_file(self, sg: int, bank: int | None, slot: int, write: bool, buf=None) -> int:
        """Trainer-side swap of one slot (load_state, state, checkpoints) through `bank` (or the
        aligned buffer `buf`); returns its CRC32C."""
        from cpu_kernels.aio import AioError

        fds = self.files
        assert fds is not None  # an nvme subgroup's: the tier has its files
        eng, fd = self._engine(), fds.fd(sg)
        fds.check(sg)
        # a bank is given where no buffer is
        addr = self.banks.state_block(bank).data_ptr() if buf is None else buf  # type: ignore[arg-type]
        try:
            rid = (eng.submit_write if write else eng.submit_read)(
                fd, addr, self.io_bytes, slot * self.io_bytes, checksum=True
            )
            (res,) = eng.wait([rid], timeout_s=self.client.timeout_s)
        except AioError as e:
            raise OSError(e.errno, f"nvme subgroup {sg}: {e}") from e
        return res.crc

    def file_marks(self) -> dict:
        """{nvme subgroup: (its committed slot, that slot's CRC32C)}: with restore_file_marks,
        how a load into the files is undone (load_state writes the other slot only)."""
        self.held.settle_writes()
        return {
            sg: (self.file_slots.slot(sg), self.file_slots.crc(sg, self.file_slots.slot(sg)))
            for sg in self.numels
            if self.nvme[sg]
        }

    def restore_file_marks(self, marks: dict) -> None:
        """Each nvme subgroup's committed slot as file_marks() found it: its state as it was
        then, provided only load_state wrote since (its write leaves that slot untouched)."""
        for sg, (slot, crc) in marks.items():
            self.file_slots.commit(sg, slot, crc)

    def unreadable(self, subgroups) -> dict:
        """{nvme subgroup: why} of each of `subgroups` whose committed slot does not read back
        whole and checksum-verified now (after a failed step: stepping again would fail the same
        way). Read into a buffer of its own: no bank, and a pending step only writes the other
        slot. A read that times out ends the scan (the disk is what failed, not a slot)."""
        from cpu_kernels.aio import aligned_buffer

        bad, buf = {}, aligned_buffer(self.io_bytes)
        try:
            for sg in sorted(subgroups):
                # a write-behind's subgroup: its committed state is in memory, not in a slot
                if self.nvme[sg] and not self.closed and self.held.written_bank(sg) is None:
                    slot = self.file_slots.slot(sg)
                    try:
                        crc = self._swap_file(sg, None, slot, write=False, buf=buf)
                    except OSError as e:
                        if isinstance(e, TimeoutError):  # OSError(ETIMEDOUT, ...) is one
                            return {}
                        bad[sg] = str(e)
                        continue
                    if crc != self.file_slots.crc(sg, slot):
                        bad[sg] = f"checksum mismatch in slot {slot}"
        finally:
            try:
                buf.close()
            except BufferError:
                pass  # a read still holds it: the gc frees it once that ends
        return bad

    def state(self, sg: int, master: bool = True) -> dict:
        """The committed state of `sg`: views for a resident subgroup, copies read (and
        checksum-verified) from its file for an nvme one. Keys: param (the fp32 master; left
        out with `master=False`: a reader of fp32 params' moments need not copy it), exp_avg,
        exp_avg_sq[, max_exp_avg_sq]."""
        self.stepping.require_idle(sg)
        if not self.nvme[sg]:
            st = self.banks.bank_state(self._resident(sg), sg)
            if not master:
                del st["param"]
            return st
        bank = self._borrow_bank()
        try:
            slot, held = self.file_slots.slot(sg), self.held.written_bank(sg)
            if held is not None:  # a write-behind's: the bank it writes holds what the slot will
                self.banks.state_block(bank).copy_(self.banks.state_block(held))
            elif (crc := self._swap_file(sg, bank, slot, write=False)) != self.file_slots.crc(sg, slot):
                raise OSError(
                    f"checksum mismatch in {self.swap.file(sg)} slot {slot}: expected "  # type: ignore[union-attr]
                    f"CRC32C {self.file_slots.crc(sg, slot):08x}, read {crc:08x}; the file is "
                    f"corrupt — restore from a checkpoint"
                )
            if self.banks.keeps_remainders(
                sg
            ):  # the file holds the low halves; the high half is the model's param
                self.banks.read_high(sg, bank)
            return {
                k: v.clone() for k, v in self.banks.bank_state(bank, sg).items() if master or k != "param"
            }
        finally:
            self.pool.release(bank)

    def load_state(
        self, sg: int, param, exp_avg=None, exp_avg_sq=None, max_exp_avg_sq=None, **absmax
    ) -> None:
        """Sets subgroup `sg`'s committed state (moments default to zero). `param`: the fp32
        master, or the model's elements (a layout.Subgroup: read into the bank); moments are
        rounded to the tier's dtypes (to nearest even). A subgroup that keeps remainders
        stores the master encoded, and its model param (`params[sg]`) takes the high half once
        the state stands. A quantized subgroup's q8 moments are given as stored: uint8 codes,
        with their absmaxes as `exp_avg_absmax=` etc. (state()'s keys; moves carry them so)."""
        given = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq, **absmax}

        def fill(bank: int, stored: dict, fresh: bool) -> None:
            self.banks.store_master(bank, sg, param, stored)
            if self.banks.quantized(sg):
                # the given moments may be views of this very bank (a master restarted in place:
                # storage.py): copied, never zeroed first
                missing = {
                    k: t
                    for k, t in stored.items()
                    if k in given
                    and given[k] is None
                    or k.endswith(ABSMAX)
                    and given.get(k[: -len(ABSMAX)]) is None
                }
                self.banks.zero_moments(missing, sg)
                for name, src in given.items():
                    if src is not None and name in stored and src.data_ptr() != stored[name].data_ptr():
                        stored[name].copy_(src.reshape(-1))
                return
            for name, src in given.items():
                if name not in stored:
                    continue
                if src is not None:
                    stored[name].copy_(src.reshape(-1))
                elif not fresh:  # a fresh bank is zero already (and maybe not populated yet)
                    stored[name].zero_()

        self.fill_state(sg, fill)

    def fill_state(self, sg: int, fill) -> None:
        """Sets subgroup `sg`'s committed state by `fill(bank, stored, fresh)`, which writes all
        of `stored`: the bank's regions as StateBanks.stored_state names them (the fp32 master
        "param", or "high" + "remainder"; the moments, in the tier's dtypes). `fresh`: the bank
        was never written (all zero). Resident: the committed bank, in place; nvme: a borrowed
        bank, written to the file's other slot, which is then committed. A subgroup that keeps
        remainders: its model param takes the bank's high half once the state stands."""
        self.stepping.require_idle(sg)
        if self.nvme[sg]:
            self.held.release_reads()  # one of them may read the slot this replaces
            self.held.land_write(sg)  # a write still landing writes the slot this would
        bank = self._borrow_bank() if self.nvme[sg] else self._resident(sg)
        # copy slots: a resident remainder subgroup's high half is written in a free bank's slot
        # (none free: a tensor of its own), then into the model
        scratch: int | None = None
        if not self.nvme[sg] and self.pool.copy_of is not None and self.banks.keeps_remainders(sg):
            got = self.pool.acquire(1)
            scratch = got[0] if got else None
        try:
            self.views.writing(
                banks=[bank], slots=[(sg, 1 - self.file_slots.slot(sg))] if self.nvme[sg] else []
            )
            if self.nvme[sg]:  # the whole block is written: no stale bytes in the checksum
                self.banks.state_block(bank).zero_()
            fresh = self.banks.take_fresh(bank)
            stored = self.banks.stored_state(bank, sg, high_bank=scratch)
            fill(bank, stored, fresh)
            if self.nvme[sg]:
                slot = 1 - self.file_slots.slot(sg)  # the committed slot stays valid until this lands
                self.file_slots.commit(sg, slot, self._swap_file(sg, bank, slot, write=True))
                self.held.replaced(sg)  # a failed write-behind's state, in memory, is replaced
            if self.banks.keeps_remainders(sg):
                self.banks.write_param(sg, stored["high"])
        finally:
            if self.nvme[sg]:
                self.pool.release(bank)
            if scratch is not None:
                self.pool.release(scratch)

    # ------------------------------------------------------------------ the spare pool
    def _bank_ranges(self, bank: int) -> list:
        """The arena's (offset, nbytes) ranges that spare `bank` alone uses: the bank, and its
        copy slot where copies are pooled (BankPool.copy_of: spare k has slot k at first)."""
        lay = self._lay
        out = [(lay.bank_offset + bank * lay.bank_stride, lay.bank_stride)]
        if lay.copy_slots and lay.copy_stride:
            out.append((lay.copy_offset + (bank - len(lay.resident)) * lay.copy_stride, lay.copy_stride))
        return out

    @property
    def spare_bank_bytes(self) -> int:
        """The arena bytes one spare bank uses (its bank, and its copy slot where copies are
        pooled): what waking one allocates."""
        return sum(n for _, n in self._bank_ranges(len(self._lay.resident)))

    @property
    def spares_awake(self) -> int:
        """Spare banks the pool may hand out now (dormant ones excluded)."""
        return self._lay.spares - len(self.pool.dormant)

    def wake_spares(self, k: int) -> int:
        """Takes up to `k` dormant spare banks into use (their memory reserved, populated and,
        in a pinned arena, registered) and gives them to the pool; returns how many. Memory
        that is not there (or cannot be pinned) wakes none and leaves the pool as it was: a
        larger pool only lets speculation run further ahead."""
        banks = self.pool.dormant[:k]
        if not banks:
            return 0
        try:
            self.arena.wake([r for b in banks for r in self._bank_ranges(b)])
        except (MemoryError, RuntimeError):
            return 0
        self.pool.wake(banks)
        return len(banks)

    def describe(self) -> str:
        """The arrangement in words (the demo's summary says it): the cores', and who runs the
        steps step() waits for."""
        return self.cores.describe(trainer_steps=self.inline is not None)

    # ------------------------------------------------------------------ counters (HostStepping + HostIO)
    @property
    def stats(self) -> dict:
        """Counters (a new dict each read): committed, redone, dropped, stepped (HostStepping),
        worker_restarts, worker_seconds, remote_gathered (HostIO)."""
        return {**self.stepping.counts, **self.io.counts}

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Idempotent: stops the worker, restores the trainer's cores, frees shared memory,
        removes the nvme swap directory."""
        if self.closed:
            return
        self.closed = True
        self.views.close()  # held state_dict() tensors take copies: the arena and files go below
        self.stepping.forget_all()
        self.held.forget_all()
        self.io.close()  # staging copies land before the arena is unmapped under them
        try:
            self.client.close()
        finally:
            self.cores.restore()
            if self._aio is not None:
                self._aio.close()
            if self.files is not None:
                self.files.close()
            if self.swap is not None:
                self.swap.remove()
            self.arena.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
