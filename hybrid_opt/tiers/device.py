"""The device tier: subgroups whose fp32 master and moments stay where the model is.

On CUDA one `gpu_kernels.fused_adam_` launch per step count steps every device subgroup (q8
subgroups: `q8_adam_`); on a CPU-only host the CPU kernel steps them in the trainer. Invariant:
nothing here reads the device back except `read_scalars`, the step's one copy to the host. An fp32
model's params are their own master. Design notes: docs/internals.md."""

from __future__ import annotations

import collections
import math

import torch

from hybrid_opt.state.state_format import ABSMAX, Q8_BLOCK, Q8_ZERO_CODE, StateFormat, q8_blocks, stored_numel
from hybrid_opt.tiers.device_memory import cpu_state_arena

# prepared CUDA launches kept (_launch_for): one per launch group in the steady state; a few
# more where the grads' memory alternates between steps
_PREPARED_LAUNCHES = 8

# what both kernels step (cpu_kernels.adam_step_, gpu_kernels.fused_adam_)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def read_scalars(values) -> list:
    """Python floats of `values` (1-element tensors, numbers or None, passed through as
    float / None), the tensors of each device read in one small device-to-host copy: the
    values a step must know on the host (found_inf, the loss scale, the grads' norm²) cost
    one host synchronisation together instead of one each."""
    out: list[float | None] = [None] * len(values)
    by_device: dict = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"read_scalars: value {i} has {v.numel()} elements, expected 1")
            by_device.setdefault(v.device, []).append(i)
        elif v is not None:
            out[i] = float(v)
    for indices in by_device.values():
        packed = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in indices])
        for i, x in zip(indices, packed.tolist()):
            out[i] = x
    return out


def _tensors_of(sg, state_format: StateFormat, amsgrad: bool) -> dict:
    """{name: dtype} of the tensors DeviceTier allocates for subgroup `sg`, in that order:
    "remainder" or "master" where the subgroup has one, then the moments (its `state` keys)."""
    out = {}
    if state_format.remainders_for(sg.dtype):
        out["remainder"] = torch.int16
    elif sg.dtype != torch.float32:
        out["master"] = torch.float32
    out.update(state_format.for_subgroup(sg.quantized).stored_moments(amsgrad))
    return out


def encode_remainder_on(master: torch.Tensor, device) -> tuple:
    """(bf16 high half, int16 remainder) of `master` (any float dtype) as fp32 on `device`, by
    that device's kernel."""
    m = master.to(device=device, dtype=torch.float32).contiguous()
    if m.device.type == "cpu":
        import cpu_kernels

        return cpu_kernels.encode_remainder(m)
    import gpu_kernels

    return gpu_kernels.encode_remainder(m)


# torch's CUDA caching allocator takes a block from the device rounded up to 2 MiB (20 MiB for
# a tensor under 10 MiB) and splits the rest off only when it is more than 1 MiB: a smaller
# rest goes out with the tensor and counts as allocated (max_memory_allocated). A tensor split
# from a larger cached block costs its own size, rounded to 512 B. Subgroups cut into equal
# parts are seldom a multiple of 2 MiB: on an H200 (201M fp32 params, subgroup_numel 4Mi), 98
# moments of 15.7 MiB each held 0.32 MiB more, and peak device memory at offload 0 was 3,170
# MiB against torch.optim.AdamW(fused=True)'s 3,139 (which allocates per parameter)
_LARGE_TENSOR = 1 << 20  # larger tensors come from the allocator's large pool; smaller ones cost their size
_ROUND = 512


def _carve_from_one_block(kinds: list) -> None:
    """`kinds`: [(subgroup, {name: dtype})] about to be allocated, in order. Allocates and frees
    one block of their total on each device first, so that the caching allocator splits each
    tensor off it at its own size (comment above); each stays a tensor of its own, freed by
    itself when its subgroup leaves. An optimisation only: where one block does not fit, they
    are allocated one by one. On a CPU host it costs a malloc and free of untouched memory,
    and keeps the allocations the CPU tests see in CUDA's order."""
    totals: dict = {}
    for sg, tensors in kinds:
        for dt in tensors.values():
            n = sg.numel * dt.itemsize  # an absmax is small: counted as large as its codes, harmless
            if n > _LARGE_TENSOR:
                totals[sg.device] = totals.get(sg.device, 0) + -(-n // _ROUND) * _ROUND
    for device, total in totals.items():
        try:
            block = torch.empty(total, dtype=torch.uint8, device=device)
        except RuntimeError:  # torch.OutOfMemoryError too: no room for one block
            continue
        del block


_CPU_CALLS = 1 << 16  # DeviceTier._cpu_fields' entries at most


def _kernel_args(hp, step: int, grad_scale: float, vmax, copy, rem) -> dict:
    """The CPU kernels' keyword arguments for a slice of a param group (`hp`) at `step`."""
    return dict(
        step=step,
        lr=hp.lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        eps=hp.eps,
        weight_decay=hp.weight_decay,
        decoupled=hp.decoupled,
        grad_scale=grad_scale * hp.grad_scale,
        max_exp_avg_sq=vmax if hp.amsgrad else None,
        param_copy=copy,
        remainder=rem,
    )


def _fields_of(call) -> tuple:
    """An AdamArgs' fields in order (a NULL pointer as 0): what cpu_kernels' packer packs."""
    return tuple(getattr(call, name) or 0 for name, _ in call._fields_)


class DeviceTier:
    """`master[i]`: the fp32 master of a bf16/fp16 subgroup i (an fp32 subgroup's is its params
    themselves: none here); `remainder[i]`: the int16 low halves of a bf16 subgroup with
    remainders (its params are the high halves); `state[i]`: its moments in the format's
    dtypes."""

    def __init__(self, subgroups: list, amsgrad: bool, state_format: StateFormat = StateFormat()):
        self.format, self.amsgrad = state_format, amsgrad
        self.progress: tuple = ([], [])  # (done, unsure) of the last step (step())
        self._launches: collections.OrderedDict = collections.OrderedDict()  # _launch_for's, LRU
        self._cpu_calls: dict = {}  # _cpu_fields', per CPU slice
        self.subgroups, self.master, self.remainder, self.state = {}, {}, {}, {}
        self._cpu: dict = {}  # subgroup index -> the CpuStateArena of its tensors (a CPU-only host)
        self.formats: dict = {}  # subgroup index -> its StateFormat (q8 moments fp32 for small params)
        kinds = [(sg, _tensors_of(sg, state_format, amsgrad)) for sg in subgroups]
        _carve_from_one_block([(sg, t) for sg, t in kinds if sg.device.type != "cpu"])
        arena = cpu_state_arena(kinds)
        for sg, tensors in kinds:
            self.subgroups[sg.index] = sg
            if sg.device.type == "cpu":
                assert arena is not None  # made where any subgroup is on the CPU, as this one
                st = arena.tensors(sg.index)
                self._cpu[sg.index] = arena
            else:
                st = {
                    k: torch.zeros(stored_numel(k, sg.numel), dtype=dt, device=sg.device)
                    for k, dt in tensors.items()
                }
            self.formats[sg.index] = state_format.for_subgroup(sg.quantized)
            if "exp_avg" + ABSMAX in st:  # a zero q8 exp_avg is the signed map's zero code, not code 0
                st["exp_avg"].fill_(Q8_ZERO_CODE["exp_avg"])
            if "remainder" in st:
                # the param's own fp32 value: high half the param, low half 0
                self.remainder[sg.index] = st.pop("remainder")
            elif "master" in st:
                self.master[sg.index] = st.pop("master")
                sg.read_into(self.master[sg.index])
            self.state[sg.index] = st

    # ------------------------------------------------------------------ bookkeeping
    def absorb(self, other: "DeviceTier") -> None:
        """Takes `other`'s subgroups, their tensors as they are (a move's arrivals)."""
        for d, o in (
            (self.subgroups, other.subgroups),
            (self.master, other.master),
            (self.remainder, other.remainder),
            (self.state, other.state),
            (self._cpu, other._cpu),
            (self.formats, other.formats),
        ):
            d.update(o)
        self._forget_prepared()  # they read tensors of the subgroups as they were

    def _forget_prepared(self) -> None:
        """The prepared launches and CPU structs read the tier's tensors as they were."""
        self._launches.clear()
        self._cpu_calls.clear()

    def drop(self, index: int, keep_subgroup: bool = False) -> None:
        """Lets subgroup `index`'s state go (it left the tier, or is about to be put back)."""
        for d in (
            (self.master, self.remainder, self.state)
            if keep_subgroup
            else (self.subgroups, self.master, self.remainder, self.state, self.formats)
        ):
            d.pop(index, None)
        arena = self._cpu.pop(index, None)
        if arena is not None:
            arena.release(index)  # its pages go back now, as a tensor of its own would
        self._forget_prepared()  # a prepared launch may read the state just let go

    def close(self) -> None:
        """The CPU arenas' descriptors close; the memory goes with the tier's last tensor (held
        state_dict() tensors took copies of their own first)."""
        for arena in set(self._cpu.values()):
            arena.close()
        self._cpu.clear()

    def piece(self, index: int, name: str, a: int, b: int):
        """Elements [a, b) of subgroup `index`'s state tensor `name` ("master", "remainder" or
        a moment) as a file piece state_dict() can map (mapped.py), or None where it has none
        (on an accelerator, or a tensor made outside the arena)."""
        arena = self._cpu.get(index)
        t = self.tensor(index, name)
        return None if arena is None or t is None else arena.piece(index, name, t, a, b)

    def stored(self, index: int) -> dict:
        """Subgroup `index`'s own state tensors, as a load fills them (checkpoint._fill): its
        fp32 "master" or its "remainder" (the params are the high halves), and the moments;
        an fp32 subgroup has no master here (its params are)."""
        out = {}
        if index in self.master:
            out["master"] = self.master[index]
        if index in self.remainder:
            out["remainder"] = self.remainder[index]
        return {**out, **self.state[index]}

    def tensor(self, index: int, name: str):
        """Subgroup `index`'s state tensor `name` ("master", "remainder" or a moment), or None."""
        if name == "master":
            return self.master.get(index)
        if name == "remainder":
            return self.remainder.get(index)
        return self.state.get(index, {}).get(name)

    def __contains__(self, index: int) -> bool:
        return index in self.state

    def has_remainders(self, index: int) -> bool:
        return index in self.remainder

    def master_of(self, index: int) -> torch.Tensor:
        """Subgroup `index`'s fp32 master: the tier's own tensor (a view, written through); for
        an fp32 subgroup its params (a view where one param holds them all, else a copy); for
        a subgroup with remainders a new tensor decoded from its params and remainder. Write
        a copy back with set_master."""
        if index in self.master:
            return self.master[index]
        sg = self.subgroups[index]
        if index not in self.remainder:
            return sg.read()
        flat, rem = sg.read(), self.remainder[index]
        if flat.device.type == "cpu":
            import cpu_kernels

            return cpu_kernels.decode_remainder(flat.detach().contiguous(), rem)
        import gpu_kernels

        return gpu_kernels.decode_remainder(flat.detach(), rem)

    def set_master(self, index: int, master: torch.Tensor, a: int = 0, b: int | None = None) -> None:
        """Writes elements [a, b) of subgroup `index`'s fp32 master (`master`: those elements,
        any float dtype). With remainders the param is written too (its high half): decode of
        the stored pair gives `master` back bitwise."""
        sg = self.subgroups[index]
        b = sg.numel if b is None else b
        if index in self.master:
            dst = self.master[index][a:b]
            if dst.data_ptr() != master.data_ptr() or dst.dtype != master.dtype:
                dst.copy_(master.reshape(-1))
            return
        if index not in self.remainder:  # an fp32 subgroup: its params are the master
            parts = list(sg.pieces(a, b))
            if len(parts) != 1 or parts[0][0].data_ptr() != master.data_ptr():
                sg.write(master, a, b)
            return
        high, low = encode_remainder_on(master.detach().reshape(-1), self.remainder[index].device)
        sg.write(high, a, b)
        self.remainder[index][a:b].copy_(low)

    def state_of(self, index: int, master: bool = True) -> dict:
        """{"master", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}: views, but the master of a
        subgroup with remainders (decoded: write it back with set_master). `master=False`
        leaves the master out: an fp32 subgroup's master is its params, a new tensor where
        several params share it, which a reader of its fp32 params' moments has no use for."""
        st = {"master": self.master_of(index)} if master else {}
        st.update(self.state[index])
        return st

    def numel(self) -> int:
        return sum(sg.numel for sg in self.subgroups.values() if sg.index in self.state)

    def nbytes(self) -> int:
        """The bytes this tier allocated: fp32 masters beside low-precision params, remainders,
        moments (an fp32 subgroup's master is its param: nothing)."""
        own = sum(m.numel() * 4 for m in self.master.values())
        own += sum(r.numel() * 2 for r in self.remainder.values())
        return own + sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())

    # ------------------------------------------------------------------ what the kernels refuse
    def refuse_grad(self, grad: torch.Tensor, param: torch.Tensor) -> str | None:
        """Why this tier's kernel would refuse `grad` for `param` (None: it steps it). step()
        asks before anything changes, so bad input never leaves a step half applied."""
        if grad.dtype not in _GRAD_DTYPES:
            return (
                f"is {grad.dtype}; the device tier steps float32, bfloat16 or float16 grads: "
                f"give it a grad of its parameter's dtype ({param.dtype})"
            )
        if grad.device != param.device:
            return f"is on {grad.device} and its parameter on {param.device}: move the grad there"
        if grad.layout != torch.strided:
            return f"has layout {grad.layout}; the device tier steps dense (strided) grads"
        return None

    @staticmethod
    def refuse_hyper(hp, device: torch.device) -> str | None:
        """Why the kernel would refuse a group's hyperparameters (`hp`: AdamInputs-like), with
        torch's constructor messages; the CPU kernel also refuses non-finite values."""
        values = (
            ("lr", hp.lr),
            ("betas[0]", hp.beta1),
            ("betas[1]", hp.beta2),
            ("eps", hp.eps),
            ("weight_decay", hp.weight_decay),
        )
        if device.type != "cuda":
            for name, v in values:
                if not math.isfinite(v):
                    return f"{name} must be finite, got {v}"
        for ok, what, v in (
            (0.0 <= hp.lr, "learning rate", hp.lr),
            (0.0 <= hp.eps, "epsilon value", hp.eps),
            (0.0 <= hp.weight_decay, "weight_decay value", hp.weight_decay),
        ):
            if not ok:
                return f"Invalid {what}: {v}"
        for k, b in enumerate((hp.beta1, hp.beta2)):
            if not 0.0 <= b < 1.0:
                return f"Invalid beta parameter at index {k}: {b}"
        return None

    @staticmethod
    def refuse_scale(grad_scale, device: torch.device) -> str | None:
        """The CPU kernel refuses a non-finite combined grad scale (1/loss scale x clip
        coefficient); on CUDA it is a kernel argument that is not checked."""
        if (
            device.type != "cuda"
            and not isinstance(grad_scale, torch.Tensor)
            and not math.isfinite(grad_scale)
        ):
            return (
                f"the combined grad scale (1/loss scale x clip coefficient) is {grad_scale}: "
                f"the grads' norm is not finite (inf/nan grads without a GradScaler to skip "
                f"the step); the device tier's kernel refuses it"
            )
        return None

    # ------------------------------------------------------------------ the step
    def step(self, work: list, grad_scale, found_inf=None) -> None:
        """work: [(subgroup index, slice, AdamInputs-like hyperparameters, step)] (step_work.
        DeviceWork, or a plain tuple of its fields) — one entry per parameter slice to step.
        grad_scale: float (CPU) or 1-element device tensor.
        Steps are in place, so a failure part-way says what it wrote: `progress` is (done,
        unsure) of the last step — the positions in `work` of the entries stepped, as each
        kernel call returns, and those of the call that raised where it may have written some
        of them (a fused_adam_ call launches once per alignment group). A cpu_kernels call
        that raises wrote nothing (it checks its arguments first; its loop cannot fail)."""
        self.progress = ([], [])  # nothing written yet, whatever raises below
        if not work:
            return
        device = self.subgroups[work[0][0]].device
        if device.type == "cuda":
            self._step_cuda(work, grad_scale, found_inf)
        else:
            self._step_cpu(work, float(grad_scale))

    def quantized(self, index: int) -> bool:
        """Whether subgroup `index` keeps a q8 moment (stepped by the q8 kernels)."""
        return self.formats[index].quantized_moments

    def _moment(self, index: int, name: str, a: int, b: int):
        """Elements [a, b) of moment `name`: a tensor slice, or for a q8 moment its codes and the
        absmax of their blocks (a Q8Blocks; `a` starts a block: layout.py)."""
        st = self.state[index]
        if name not in st:
            return None
        if name + ABSMAX not in st:
            return st[name][a:b]
        from cpu_kernels.q8_reference import Q8Blocks

        if a % Q8_BLOCK:
            raise AssertionError(f"a q8 slice of subgroup {index} starts at element {a}, inside a block")
        return Q8Blocks(st[name][a:b], st[name + ABSMAX][a // Q8_BLOCK : q8_blocks(b)])

    def _views(self, index: int, sl):
        """(param, exp_avg, exp_avg_sq, max_exp_avg_sq, param_copy, remainder) of one slice:
        param is the fp32 master, or with remainders the bf16 model param (then no copy); a q8
        moment is a Q8Blocks."""
        a, b = sl.sub_offset, sl.sub_offset + sl.numel
        m, v, vmax = (self._moment(index, k, a, b) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        if index in self.remainder:
            return sl.view, m, v, vmax, None, self.remainder[index][a:b]
        if index not in self.master:  # fp32: the param is its own master
            return sl.view, m, v, vmax, None, None
        return self.master[index][a:b], m, v, vmax, sl.view, None

    def _step_cpu(self, work: list, grad_scale: float) -> None:
        import cpu_kernels
        from cpu_kernels import _lib

        done, _ = self.progress = ([], [])
        # the Adam slices go as one call (adam_steps_), their structs packed into one array
        pack, size = _lib.packer(_lib.AdamArgs)
        at_field = {name: i for i, (name, _) in enumerate(_lib.AdamArgs._fields_)}
        dynamic = [at_field[f] for f in ("grad", "step", "lr", "beta1", "beta2", "eps", "weight_decay")]
        dynamic += [at_field["grad_scale"], at_field["decoupled"]]
        buf = bytearray(size * len(work))
        count, positions, keep = 0, [], []
        for k, (index, sl, hp, step) in enumerate(work):
            quantized = self.quantized(index)
            at = None if quantized else sl.grad_address()
            if at is not None:  # a contiguous grad: the slice's struct from its cached fields
                fields = list(self._cpu_fields(index, sl, hp, at[1]))
                values = [at[0], step, float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.eps)]
                values += [
                    float(hp.weight_decay),
                    float(grad_scale * hp.grad_scale),
                    1 if hp.decoupled else 0,
                ]
                for i, value in zip(dynamic, values):
                    fields[i] = value
                pack(buf, count * size, *fields)
                count += 1
                positions.append(k)
                continue
            p, m, v, vmax, copy, rem = self._views(index, sl)
            grad = sl.grad_view()
            if not grad.is_contiguous():
                grad = grad.contiguous()
                keep.append(grad)  # the call holds its address
            args = _kernel_args(hp, step, grad_scale, vmax, copy, rem)
            if quantized:
                cpu_kernels.q8_adam_step_(p, grad, m, v, **args)
                done.append(k)
                continue
            # the tier's own tensors; the grads checked by the optimizer (step_failures)
            call = cpu_kernels.adam_call(p, grad, m, v, check=False, **args)
            pack(buf, count * size, *_fields_of(call))
            count += 1
            positions.append(k)
        if count:
            cpu_kernels.adam_steps_((_lib.AdamArgs * count).from_buffer(buf))
        done.extend(positions)

    def _cpu_fields(self, index: int, sl, hp, grad_dtype) -> tuple:
        """A slice's Adam struct fields as adam_call makes them (its tensors from _views), made
        once per slice, param memory, amsgrad and grad dtype: the tier's tensors are fixed while
        its subgroups are (forgotten with the prepared launches). The caller sets the grad's
        address and the step's hyperparameters."""
        key = (index, sl.sub_offset, sl.numel, sl.view.data_ptr(), hp.amsgrad, grad_dtype)
        fields = self._cpu_calls.get(key)
        if fields is None:
            import cpu_kernels

            if len(self._cpu_calls) >= _CPU_CALLS:  # params replaced step after step: start again
                self._cpu_calls.clear()
            p, m, v, vmax, copy, rem = self._views(index, sl)
            args = _kernel_args(hp, 1, 1.0, vmax, copy, rem)
            fields = _fields_of(cpu_kernels.adam_call(p, sl.grad_view(), m, v, check=False, **args))
            self._cpu_calls[key] = fields
        return fields

    def _launch_key(self, items: list, amsgrad: bool, rem: bool):
        """What a prepared launch over `items`' slices reads, read every step without making a
        tensor: the tier's own tensors (fixed while its subgroups are: the cache is emptied when
        they change), each slice's param view address and grad address and dtype. None where a
        grad is not contiguous (or missing): the launch then reads a contiguous copy."""
        key: list = [amsgrad, rem]
        for _, index, sl in items:
            grad = sl.grad_address()
            if grad is None:
                return None
            key.append((index, sl.sub_offset, sl.numel, sl.view.data_ptr(), grad))
        return tuple(key)

    def _launch_for(self, items: list, amsgrad: bool, rem: bool):
        """The gpu_kernels.FusedAdam that steps `items`' slices: prepared once and found again
        by `_launch_key` (holding no grad: the key checks the grads' addresses every step), or,
        without a key, made for this step over contiguous copies of the grads."""
        import gpu_kernels

        key = self._launch_key(items, amsgrad, rem)
        launch = self._launches.get(key) if key is not None else None
        if launch is not None:
            self._launches.move_to_end(key)
            return launch
        lists: tuple[list, ...] = ([], [], [], [], [], [], [])
        ps, gs, ms, vs, xs, cs, rs = lists
        for _, index, sl in items:
            p, m, v, vmax, copy, r = self._views(index, sl)
            grad = sl.grad_view() if key is not None else sl.grad_view().contiguous()
            for lst, t in ((ps, p), (gs, grad), (ms, m), (vs, v), (xs, vmax), (cs, copy), (rs, r)):
                if t is not None:
                    lst.append(t)
        launch = gpu_kernels.FusedAdam(
            ps,
            gs,
            ms,
            vs,
            max_exp_avg_sqs=xs if amsgrad else None,
            param_copies=cs if len(cs) == len(ps) and not rem else None,
            remainders=rs if rem else None,
            hold_grads=key is None,
        )
        if key is not None:
            self._launches[key] = launch
            while len(self._launches) > _PREPARED_LAUNCHES:
                self._launches.popitem(last=False)
        return launch

    def _launch_q8(self, items: list, amsgrad: bool, rem: bool, **scalars) -> None:
        """One gpu_kernels.q8_adam_ over `items`' slices (q8 subgroups: not prepared, its tables
        are cached by the launcher)."""
        import gpu_kernels.q8 as q8

        lists: tuple[list, ...] = ([], [], [], [], [], [], [])
        ps, gs, ms, vs, xs, cs, rs = lists
        for _, index, sl in items:
            p, m, v, vmax, copy, r = self._views(index, sl)
            m, v, vmax = (q8.Q8Blocks(*x) if isinstance(x, tuple) else x for x in (m, v, vmax))
            grad = sl.grad_view()
            for lst, t in (
                (ps, p),
                (gs, grad if grad.is_contiguous() else grad.contiguous()),
                (ms, m),
                (vs, v),
                (xs, vmax),
                (cs, copy),
                (rs, r),
            ):
                if t is not None:
                    lst.append(t)
        q8.q8_adam_(
            ps,
            gs,
            ms,
            vs,
            max_exp_avg_sqs=xs if amsgrad else None,
            param_copies=cs if len(cs) == len(ps) and not rem else None,
            remainders=rs if rem else None,
            **scalars,
        )

    def _step_cuda(self, work: list, grad_scale, found_inf) -> None:
        done, unsure = self.progress = ([], [])
        # one launch per distinct (hyperparameters, step, param dtype): usually exactly one
        # (remainders are all or none in a launch: they follow the param dtype). A param's
        # slices share all of these: they are stepped by one call
        launches: dict = {}
        for k, (index, sl, hp, step) in enumerate(work):
            launches.setdefault(
                (
                    hp.lr,
                    hp.beta1,
                    hp.beta2,
                    hp.eps,
                    hp.weight_decay,
                    hp.decoupled,
                    hp.amsgrad,
                    hp.grad_scale,
                    step,
                    self.subgroups[index].dtype,
                    index in self.remainder,
                    self.quantized(index),
                ),
                [],
            ).append((k, index, sl))
        for (lr, b1, b2, eps, wd, decoupled, amsgrad, sign, step, _, rem, q8), items in launches.items():
            # a float scale is a kernel argument (fp32 inside the kernel, as a 1-element fp32
            # tensor would be): no per-step tensor, no host-to-device copy
            scale = (
                (grad_scale * sign).reshape(1)
                if isinstance(grad_scale, torch.Tensor)
                else float(grad_scale) * sign
            )
            unsure[:] = [k for k, _, _ in items]
            if q8:
                self._launch_q8(
                    items,
                    amsgrad,
                    rem,
                    step=step,
                    lr=lr,
                    beta1=b1,
                    beta2=b2,
                    eps=eps,
                    weight_decay=wd,
                    decoupled=decoupled,
                    grad_scale=scale,
                    found_inf=found_inf,
                )
                done.extend(unsure)
                unsure.clear()
                continue
            # in the steady state a prepared launch: no per-slice tensor, no check
            self._launch_for(items, amsgrad, rem).step(
                step=step,
                lr=lr,
                beta1=b1,
                beta2=b2,
                eps=eps,
                weight_decay=wd,
                decoupled=decoupled,
                grad_scale=scale,
                found_inf=found_inf,
            )
            done.extend(unsure)
            unsure.clear()
