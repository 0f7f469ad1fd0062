"""A step task's kernels on one mapping of the arena: where the task's bank regions, staging slot and
copy slots lie, and the Adam, q8 and inverse kernels run over them. Torch-free.

The worker process steps on its mapping of the trainer's arena (worker/main.py). The trainer steps
on its own mapping where it runs a host step itself: a step it waits for on a CPU-only host, where
the worker would only take the same cores and add two copies (tiers/host_io.py, HostIO's inline
steps). Both go through this one class, so the two give the same bits."""

from __future__ import annotations

import ctypes
import math

from hybrid_opt.worker import protocol as proto

DT_Q8 = 3  # a q8 moment's dtype code (cpu_kernels' DT_Q8)
Q8_BLOCK = 256  # elements per absmax (state_format.Q8_BLOCK)


def _run_all(call, argv: list) -> None:
    call(argv)


class ArenaSteps:
    """The kernels of step and inverse tasks at the mapping that starts at `base`, laid out as
    `cfg` says (HostTier's layout: bank and slot offsets, regions, moment dtypes, quantized
    subgroups). `run_kernel(call, argv)` runs a task's kernel calls, `call(argv)` over the list of
    argument structs (each with its count of elements); the worker's fault injection puts its own
    there."""

    def __init__(self, cfg: dict, base: int, run_kernel=None):
        from cpu_kernels import _lib  # noqa: PLC0415  (the worker sets its affinity first)

        self._lib = _lib  # the C library's torch-free bindings
        self.AdamArgs, self.InverseArgs = _lib.AdamArgs, _lib.InverseArgs
        self.base = base
        self.bank_offset, self.bank_stride = cfg["bank_offset"], cfg["bank_stride"]
        self.regions = cfg["bank_regions"]
        self.slot_offset, self.slot_stride = cfg["slot_offset"], cfg["slot_stride"]
        self.m_dtype, self.v_dtype = cfg["exp_avg_dtype"], cfg["exp_avg_sq_dtype"]
        self.quantized = {int(sg) for sg in cfg.get("quantized") or ()}  # subgroup ids
        self.q8_lib = None
        if self.quantized:
            from cpu_kernels import _q8_lib  # noqa: PLC0415  (torch-free, as _lib)

            self.q8_lib = _q8_lib
        # a cpu_kernels build without exp_avg_sq_dtype steps both moments in exp_avg's dtype
        self.sq_dtype_field = any(f[0] == "exp_avg_sq_dtype" for f in self.AdamArgs._fields_)
        if (
            self.m_dtype != self.v_dtype
            and not self.sq_dtype_field
            and DT_Q8 not in (self.m_dtype, self.v_dtype)
        ):
            raise ValueError("this build of cpu_kernels steps exp_avg and exp_avg_sq of one dtype only")
        self._run_kernel = run_kernel or _run_all

    # ------------------------------------------------------------------ addresses
    def bank_start(self, bank: int) -> int:
        """The address of a whole bank (an nvme swap reads or writes it all)."""
        return self.base + self.bank_offset + bank * self.bank_stride

    def bank(self, bank: int, region: str, elem_offset: int, elem_size: int) -> int:
        """The address of element `elem_offset` of a bank's region."""
        return self.bank_start(bank) + self.regions[region] + elem_offset * elem_size

    def slot(self, slot: int) -> int:
        """The address of a staging slot."""
        return self.base + self.slot_offset + slot * self.slot_stride

    def _copy(self, t: proto.Task, out_bank: int, elem_offset: int) -> int:
        """The address of a step's model-dtype copy: its copy slot, or its out bank's region."""
        if t.out_copy >= 0:
            return self.base + t.out_copy + elem_offset * 2
        return self.bank(out_bank, "copy", elem_offset, 2)

    def _high(self, t: proto.Task, elem_offset: int) -> int:
        """The address of the committed high half a remainder step reads: its copy slot (the
        out one, stepped in place, where the in bank is a committed one), or the in bank's region."""
        if t.in_copy >= 0:
            return self.base + t.in_copy + elem_offset * 2
        return self.bank(t.in_bank, "copy", elem_offset, 2)

    def _master(self, t: proto.Task, out_bank: int, off: int) -> tuple:
        """A step's master as (param, param_out, param_copy, copy_dtype, remainder, remainder_out),
        the Adam and the q8 kernel's fields alike: the bf16 high half and the remainder with
        remainders (decoded by the kernel), else the fp32 master and the model-dtype copy it
        writes."""
        if t.remainder:
            return (
                self._high(t, off),
                self._copy(t, out_bank, off),
                None,
                0,
                self.bank(t.in_bank, "rem", off, 2),
                self.bank(out_bank, "rem", off, 2),
            )
        copy = t.copy_dtype != proto.NO_COPY
        return (
            self.bank(t.in_bank, "p", off, 4),
            self.bank(out_bank, "p", off, 4),
            self._copy(t, out_bank, off) if copy else None,
            t.copy_dtype if copy else 0,
            None,
            None,
        )

    # ------------------------------------------------------------------ kernels
    def step(self, t: proto.Task, runs=None) -> proto.Result:
        """Step task `t`. runs: [(byte offset in the piece, address, bytes)] where its grads lie,
        all stepped in one kernel call (elementwise: bit for bit as the whole piece); None: its
        staging slot, whole. Where t.skip_nonfinite says so (a speculation) the grads' stats are
        measured first, and a piece whose grads are not all finite is not stepped at all;
        elsewhere (a step the trainer waits for) nothing reads them, and they are not measured:
        sum_sq NaN (a pass over the grads saved, a seventh of the step's traffic in fp32)."""
        es = proto.DTYPE_SIZES[t.grad_dtype]
        if runs is None:
            runs = [(0, self.slot(t.slot), t.numel * es)]
        total, finite = float("nan"), True
        if t.skip_nonfinite:
            total = 0.0
            for s in self._lib.grad_sums([(addr, t.grad_dtype, nbytes // es) for _, addr, nbytes in runs]):
                total, finite = total + s, finite and math.isfinite(s)
            if not finite:
                return proto.Result(t.op, t.task_id, proto.STATUS_NONFINITE, t.subgroup, total, 0)
        self.adam(t, [(addr, t.elem_offset + off // es, nbytes // es) for off, addr, nbytes in runs])
        return proto.Result(t.op, t.task_id, proto.STATUS_OK, t.subgroup, total, int(finite))

    def adam(self, t: proto.Task, runs: list) -> None:
        """The Adam (or q8) kernel over task `t`'s `runs`, each (address of its grads, subgroup
        element it starts at, elements): the runs of its piece, or all of it as one, unchecked.
        The Adam runs go as one call (hybrid_adam_step_many: one parallel region, the threads
        splitting the runs' elements end to end); q8 runs one call each."""
        out_bank = t.in_bank if t.out_bank == proto.NO_BANK else t.out_bank
        q8 = t.subgroup in self.quantized
        # a q8 moment of a subgroup too small to quantize is fp32
        m_dtype, v_dtype = ((code if q8 or code != DT_Q8 else 0) for code in (self.m_dtype, self.v_dtype))
        if q8:
            argv = [
                self._q8_args(t, grad, out_bank, m_dtype, v_dtype, off, numel) for grad, off, numel in runs
            ]
            self._run_kernel(self._q8_calls, argv)
        else:
            self._run_kernel(self._lib.adam_steps, self._adam_argv(t, runs, out_bank, m_dtype, v_dtype))

    def _q8_calls(self, argv: list) -> None:
        assert self.q8_lib is not None  # loaded where any subgroup is quantized
        for a in argv:
            self.q8_lib.q8_adam_step_raw(a)

    def _adam_args(
        self, t: proto.Task, grad: int, out_bank: int, m_dtype: int, v_dtype: int, off: int, numel: int
    ) -> tuple:
        """One Adam call's fields, in AdamArgs' order: `numel` elements from subgroup element `off`,
        their grads at `grad`."""
        ms, vs = proto.DTYPE_SIZES[m_dtype], proto.DTYPE_SIZES[v_dtype]
        p, p_out, copy, copy_dtype, rem, rem_out = self._master(t, out_bank, off)
        vmax = self.bank(t.in_bank, "vmax", off, vs) if t.amsgrad else None
        vmax_out = self.bank(out_bank, "vmax", off, vs) if t.amsgrad else None
        fields = (
            numel, p, grad, self.bank(t.in_bank, "m", off, ms), self.bank(t.in_bank, "v", off, vs), vmax,
            p_out, self.bank(out_bank, "m", off, ms), self.bank(out_bank, "v", off, vs), vmax_out, copy,
            t.grad_dtype, m_dtype, copy_dtype, t.decoupled, t.step,
            t.lr, t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_scale, rem, rem_out,
        )  # fmt: skip
        return fields + (v_dtype,) if self.sq_dtype_field else fields

    def _adam_argv(self, t: proto.Task, runs: list, out_bank: int, m_dtype: int, v_dtype: int):
        """The Adam calls of `runs` ((grads' address, subgroup element, elements) each) as one
        AdamArgs array. Every address of a run is its subgroup's at element 0 plus the run's first
        element times that field's element size, so the fields are worked out once a call, at
        elements 0 and 1, and the C library makes each run's struct from them
        (_lib.expand_runs): a model of a thousand small tensors builds its thousand structs
        without a Python step each (one kernel call, bit for bit the same arguments)."""
        at0 = self._adam_args(t, 0, out_bank, m_dtype, v_dtype, 0, 0)
        at1 = self._adam_args(t, 0, out_bank, m_dtype, v_dtype, 1, 0)
        names = [f[0] for f in self.AdamArgs._fields_]
        # the count and the grads' address come from each run; the pointers move with its offset
        strides = {names[k]: b - a for k, (a, b) in enumerate(zip(at0, at1)) if a != b}
        assert strides.keys() <= set(self._lib.EXPAND_FIELDS), strides  # only addresses move
        base = self.AdamArgs(*(0 if v is None else v for v in at0))  # a NULL pointer as 0
        return self._lib.expand_runs(base, strides, runs)

    def _q8_args(
        self, t: proto.Task, grad: int, out_bank: int, m_dtype: int, v_dtype: int, off: int, numel: int
    ):
        """The q8 call's arguments for `numel` elements from `off` of a quantized subgroup's piece
        (cpu_kernels' q8 entry), bank mode: codes and absmaxes read from the in bank, written to
        the out bank (in place without one)."""
        if off % Q8_BLOCK:
            raise ValueError(
                f"a q8 piece of subgroup {t.subgroup} starts at element {off}, inside a "
                f"block of {Q8_BLOCK} (a bug in hybrid_opt, please report it)"
            )
        lib = self.q8_lib
        assert lib is not None  # loaded where any subgroup is quantized, as this one is
        a = lib.Q8AdamArgs()
        a.n = numel
        a.param, a.param_out, a.param_copy, a.copy_dtype, a.remainder, a.remainder_out = self._master(
            t, out_bank, off
        )
        a.grad = grad
        moments = [("exp_avg", "m", m_dtype), ("exp_avg_sq", "v", v_dtype)]
        if t.amsgrad:
            moments.append(("max_exp_avg_sq", "vmax", v_dtype))
        for name, region, code in moments:
            size = proto.DTYPE_SIZES[code]
            setattr(a, name, self.bank(t.in_bank, region, off, size))
            setattr(a, name + "_out", self.bank(out_bank, region, off, size))
            if code == DT_Q8:
                setattr(a, name + "_absmax", self.bank(t.in_bank, region + "_absmax", off // Q8_BLOCK, 4))
                setattr(a, name + "_absmax_out", self.bank(out_bank, region + "_absmax", off // Q8_BLOCK, 4))
        a.grad_dtype, a.exp_avg_dtype, a.exp_avg_sq_dtype = t.grad_dtype, m_dtype, v_dtype
        _set_hyperparameters(a, t)
        return a

    def inverse(self, t: proto.Task) -> proto.Result:
        if self.m_dtype != 0 or self.v_dtype != 0 or t.remainder:
            raise ValueError("the inverse step needs fp32 moments and an fp32 master")
        a = self.InverseArgs()
        off = t.elem_offset
        a.n = t.numel
        a.param = self.bank(t.in_bank, "p", off, 4)
        a.exp_avg = self.bank(t.in_bank, "m", off, 4)
        a.exp_avg_sq = self.bank(t.in_bank, "v", off, 4)
        a.grad = self.slot(t.slot)
        a.grad_dtype = t.grad_dtype
        _set_hyperparameters(a, t)
        self._lib.lib.hybrid_adam_inverse(ctypes.byref(a))
        return proto.Result(t.op, t.task_id, proto.STATUS_OK, t.subgroup)


def _set_hyperparameters(a, t: proto.Task) -> None:
    """A step task's hyperparameters and step count in its kernel's argument struct."""
    a.decoupled, a.step = t.decoupled, t.step
    a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale = (
        t.lr,
        t.beta1,
        t.beta2,
        t.eps,
        t.weight_decay,
        t.grad_scale,
    )
