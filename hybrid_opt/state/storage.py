"""Parameter storage: each param keeps its own memory, which the tiers read and write in place
through its subgroups' slices (layout.py), and step() checks that it is still there.

The optimizer's ParamGuard part. Memory replaced after construction (`p.data = t`) is re-adopted;
values written outside step() are seen by the version counter and restart those elements' masters;
a param moved or cast raises, naming it. The checks compare ints only, nothing allocated. Design
notes: docs/internals.md."""

from __future__ import annotations

import torch

from hybrid_opt.distributed.local_shards import local_of, moved_or_written, write_count, write_counts
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.state.layout import own_contiguous


def _written_as(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Per element: whether `param` holds what a step writes from `master` — torch's cast
    (nearest even), or for bf16 also the remainder encoding's high half (ties away)."""
    same = master.to(param.dtype).view(_BITS[param.dtype]) == param.view(_BITS[param.dtype])
    if param.dtype == torch.bfloat16:
        from cpu_kernels.reference import encode_remainder_reference

        high = encode_remainder_reference(master.contiguous())[0]
        same |= high.view(torch.int16) == param.view(torch.int16)
    return same


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class ParamGuard:
    """Records where each param's elements live and which version each param is at,
    re-adopts a param whose memory changed and restarts the masters of params written
    outside step() (module docstring)."""

    def __init__(self, layout, placement, state_format, owner: str, drop_speculation, rehook):
        self.layout = layout
        self.placement = placement
        self.state_format = state_format
        self.owner = owner  # the optimizer's class name, for messages
        self.drop_speculation = drop_speculation  # () -> None: pending host steps read old masters
        self.rehook = rehook  # (host subgroups) -> None: a swapped param lost its hooks
        self.params: list = []  # the params, in the layout's order (Layout.params)
        self.views: list = []  # per param: its memory at layout (a detached view)
        self.ptrs: list = []  # per param: that memory's data_ptr
        self.versions: list = []  # per param: its version when step() last wrote it
        self.held: dict = {}  # param index -> a loaded fp32 master (hold_masters)

    def remember(self, first: int, params: list) -> None:
        """Params [first, first + len(params)) were just laid out: where their memory is."""
        views, ptrs, versions = self.views, self.ptrs, self.versions
        del self.params[first:], views[first:], ptrs[first:], versions[first:]
        self.params.extend(params)
        for p in params:
            view = local_of(p).detach()  # the param's memory, not the Parameter
            views.append(view)
            ptrs.append(view.data_ptr())
            versions.append(write_count(p))

    def forget(self, first: int) -> None:
        """Params from `first` on were taken out of the layout again (a failed add_param_group)."""
        del self.params[first:], self.views[first:], self.ptrs[first:], self.versions[first:]

    def record(self) -> None:
        """Every param's version now: what step() and the tiers wrote is not the user's."""
        self.versions = write_counts(self.params)
        self.held = {}

    def hold_masters(self, masters: dict) -> None:
        """{param index: 1-D fp32 master} a load_state_dict found its 16-bit param not (yet) a
        rounding of: the model's weights loaded after the optimizer's. Until the next record()
        (a step, a load), an element written to that rounding takes the saved master back
        rather than restarting from the param: the load order does not matter, as in torch."""
        self.held = dict(masters)

    def check(self) -> None:
        """Re-adopts every param whose memory was replaced since the last step (module
        docstring); raises when one was moved or cast."""
        moved, written = moved_or_written(self.params, self.ptrs, self.versions)
        if moved:
            self._adopt()
        if moved or written:
            self.check_written()

    def check_written(self) -> None:
        """Restarts the masters of the param elements written since the versions were
        recorded (module docstring); params whose memory was replaced are left to check()."""
        params = self.params
        written = {
            i
            for i, p in enumerate(params)
            if write_count(p) != self.versions[i] and local_of(p).data_ptr() == self.ptrs[i]
        }
        if not written:
            return
        tiers = self.placement.plan.tiers
        if any(
            tiers[sg.index] != DEVICE
            for sg in self.layout.subgroups
            for sl in sg.slices
            if sl.param_index in written
        ):
            # a pending speculation read the old master (and the host tier's state must be idle)
            self.drop_speculation()
        for sg in self.layout.subgroups:
            slices = [sl for sl in sg.slices if sl.param_index in written]
            if slices:
                self.restart_masters(sg, slices, only_changed=True)
        self.record()

    def restart_masters(self, sg, slices: list, only_changed: bool, previous: dict | None = None) -> None:
        """The fp32 master of `slices` of subgroup `sg` restarts from the params' values (all of
        them, or with `only_changed` those that differ from what the last step wrote); the
        tier gets it back (encoded with remainders; loaded on the host / nvme tier). With
        remainders the last step's high half is gone once the param is written, unless
        `previous` ({param index: its values before, flat}) has it: then only the elements
        whose bits changed restart (a re-adopted param's old memory)."""
        pl = self.placement
        if pl.plan.tiers[sg.index] == DEVICE and sg.dtype == torch.float32:
            return  # an fp32 device subgroup is its own master
        st = pl.state_of(sg)  # views on the device and host tiers, copies on nvme
        master = st["master"]
        remainders = self.state_format.remainders_for(sg.dtype)
        changed = False
        with torch.no_grad():
            for sl in slices:
                a, b = sl.sub_offset, sl.sub_offset + sl.numel
                # compared where the master is: a host/nvme master is on the CPU, a CUDA
                # model's param not (mixed-device elementwise ops raise)
                now = sl.view.to(master.device)
                before = None if previous is None else previous.get(sl.param_index)
                if only_changed and (not remainders or before is not None):
                    if remainders:  # the decoded master's high half is `now`: compare it with the old one
                        assert before is not None  # the condition above: remainders need the old memory
                        before = before.reshape(-1)[sl.param_offset : sl.param_offset + sl.numel].to(
                            master.device
                        )
                        diff = before.view(torch.int16) != now.view(torch.int16)
                    else:
                        diff = _written_as(master[a:b], now).logical_not_()
                    if not bool(diff.any()):
                        continue
                    # merged in place: neither an fp32 copy of the param nor the merged result
                    # is made (each a slice's fp32 temporary; on the model's device when the
                    # master is there, and state_dict() runs this)
                    torch.where(diff, now, master[a:b], out=master[a:b])
                else:
                    master[a:b].copy_(now)
                held = self.held.get(sl.param_index)
                if held is not None and held.dtype == torch.int16:
                    # a loaded remainder: the weights written are the high half it was saved with
                    from cpu_kernels.reference import decode_remainder_reference

                    rem = held[sl.param_offset : sl.param_offset + sl.numel].to(master.device)
                    master[a:b].copy_(decode_remainder_reference(now.to(torch.bfloat16), rem))
                elif held is not None:  # written to a loaded master's rounding: that master stands
                    saved = held[sl.param_offset : sl.param_offset + sl.numel].to(
                        master.device, torch.float32
                    )
                    torch.where(_written_as(saved, now), saved, master[a:b], out=master[a:b])
                changed = True
        if changed:
            pl.load(sg, st)

    def _adopt(self) -> None:
        params = self.params
        changed = [i for i, p in enumerate(params) if local_of(p).data_ptr() != self.ptrs[i]]
        for i in changed:
            p, view = local_of(params[i]), self.views[i]
            if (p.dtype, p.device, p.shape) != (view.dtype, view.device, view.shape):
                raise RuntimeError(self._moved_message(i, p, view))
        # a pending speculation read the old master: drop it (step() steps those subgroups)
        self.drop_speculation()
        # what each param held before (its old memory, still alive in `views`): an element
        # given the value it had keeps its master, as a write in place does — new memory with
        # the same values (a swap_tensors load of the same weights, FSDP2 re-padding a shard)
        # is no user write
        previous = {}
        for i in changed:
            previous[i] = self.views[i]
            self._repoint(i, params[i])
        changed_set = set(changed)
        for sg in self.layout.subgroups:
            slices = [sl for sl in sg.slices if sl.param_index in changed_set]
            if slices:
                self.restart_masters(sg, slices, only_changed=True, previous=previous)
        for i in changed_set:  # rebound: the new memory's version is the one to watch
            self.versions[i] = write_count(params[i])
        # swapping a Parameter's contents (load_state_dict with swap_tensors) drops its hooks
        self.rehook(self.placement.host_subgroups())

    def _repoint(self, i: int, p) -> None:
        """Param i has new memory: its slices view that instead (the param is never rebound:
        FSDP2 all-gathers from a DTensor's own buffer; a plain param's new memory is the
        user's). A tier reading the params (an fp32 device master, a host tier keeping
        remainders) reads them through the slices, so it follows."""
        own_contiguous(p)
        for sg in self.layout.subgroups:
            for sl in sg.slices:
                if sl.param_index == i:
                    sg.repoint(sl)
        self.views[i] = local_of(p).detach()
        self.ptrs[i] = self.views[i].data_ptr()

    def _moved_message(self, i: int, p, view) -> str:
        cls = self.owner
        return (
            f"{self.layout.param_label(i)} was moved or cast after {cls} was built: its memory changed "
            f"from {view.dtype} {tuple(view.shape)} on {view.device} to {p.dtype} "
            f"{tuple(p.shape)} on {p.device}. {cls} keeps each parameter in a buffer of the "
            f"dtype and device it had at construction, so it cannot step this one. Build the "
            f"optimizer after moving or casting the model (model.to(...) / .cuda() / .half() "
            f"first), or save this optimizer's state_dict() and load it into a new {cls} "
            f"built on the moved model."
        )
