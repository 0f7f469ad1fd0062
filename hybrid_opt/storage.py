"""Parameter storage: each param is a view of the optimizer's flat buffers (layout.py), and
step() checks that it still is.

A param whose memory is replaced after construction — `p.data = t`, or a module's
`load_state_dict(sd, assign=True)` with torch.__future__.set_swap_module_params_on_conversion
(True) — would otherwise silently stop training: the tiers step flat buffers the param no
longer views. torch.optim keeps training such a param with its moments, so we do too: when
the new tensor has the param's dtype, device and shape, its values are copied into the
param's slice of the flat buffer, the param is pointed back at that slice, and the fp32
master of the slice restarts from the new values (moments and step count kept, as torch
keeps them). A param moved or cast (`model.cuda()`, `.half()` after building the optimizer)
cannot be re-adopted — the tiers were laid out for its old dtype and device — and step()
raises saying which param changed and what to do.

The check compares each param's data_ptr with the one recorded at layout: no allocation
and one int comparison per param per step. A DTensor param (FSDP2) is checked by its local
shard, which is its subgroups' memory (distributed.py); one given new memory (a load with
swap_tensors, FSDP2 re-padding it) is never rebound: its subgroups are pointed at the new
shard instead, and their fp32 master restarts from it.

A mixin of the optimizer class.
"""
from __future__ import annotations

import torch

from hybrid_opt.distributed import is_sharded, local_of
from hybrid_opt.layout import dtensor_flat
from hybrid_opt.plan import DEVICE


class StorageMixin:
    """Records where each param's elements live and re-adopts a param whose memory changed."""

    def _remember_storage(self, first: int, params: list) -> None:
        """Params [first, first + len(params)) were just made views of the flat buffers."""
        views = self.__dict__.setdefault("_flat_views", [])
        ptrs = self.__dict__.setdefault("_flat_ptrs", [])
        del views[first:], ptrs[first:]
        for p in params:
            view = local_of(p).detach()  # aliases the flat buffer, not the Parameter
            views.append(view)
            ptrs.append(view.data_ptr())

    def _check_storage(self) -> None:
        """Re-adopts every param whose memory was replaced since the last step (module
        docstring); raises when one was moved or cast."""
        ptrs = self._flat_ptrs
        k = 0
        for group in self.param_groups:
            for p in group["params"]:
                if local_of(p).data_ptr() != ptrs[k]:
                    return self._adopt_storage()
                k += 1

    def _adopt_storage(self) -> None:
        params = list(self._all_params())
        changed = [i for i, p in enumerate(params) if local_of(p).data_ptr() != self._flat_ptrs[i]]
        for i in changed:
            p, view = local_of(params[i]), self._flat_views[i]
            if (p.dtype, p.device, p.shape) != (view.dtype, view.device, view.shape):
                raise RuntimeError(self._moved_message(i, p, view))
        # a pending speculation read the old master: drop it (step() steps those subgroups)
        self._drop_speculation()
        with torch.no_grad():
            for i in changed:
                if is_sharded(params[i]):
                    self._repoint_dtensor(i, params[i])
                    continue
                view = self._flat_views[i]
                view.copy_(params[i].data)
                params[i].data = view
        changed = set(changed)
        for sg in self._subgroups:
            slices = [sl for sl in sg.slices if sl.param_index in changed]
            if not slices:
                continue
            st = self._subgroup_state(sg)  # views on the device and host tiers, copies on nvme
            master = st["master"]
            for sl in slices:
                a, b = sl.sub_offset, sl.sub_offset + sl.numel
                if master.data_ptr() != sg.flat.data_ptr():  # an fp32 device subgroup is its own master
                    master[a:b].copy_(sg.flat[a:b])
            if self.plan.tiers[sg.index] != DEVICE:
                self._host.load_state(self._host_local[sg.index], master, st["exp_avg"],
                                      st["exp_avg_sq"], st.get("max_exp_avg_sq"))
        # swapping a Parameter's contents (load_state_dict with swap_tensors) drops its hooks
        self._install_hooks([sg for sg in self._subgroups if self.plan.tiers[sg.index] != DEVICE])

    def _repoint_dtensor(self, i: int, p) -> None:
        """DTensor param i's local shard has new memory: its subgroups view that instead (the
        param is never rebound: FSDP2 all-gathers from its own buffer)."""
        flat = dtensor_flat(p)
        for sg in self._subgroups:
            for sl in sg.slices:
                if sl.param_index == i:  # a DTensor param's subgroups hold it alone, from offset 0
                    sg.flat = flat[sl.param_offset:sl.param_offset + sg.numel]
                    if sg.index in self._device.master and sg.dtype == torch.float32:
                        self._device.master[sg.index] = sg.flat  # an fp32 device subgroup is its own master
        self._flat_views[i] = local_of(p).detach()
        self._flat_ptrs[i] = self._flat_views[i].data_ptr()

    def _moved_message(self, i: int, p, view) -> str:
        names = [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]
        name = f" ({names[i]})" if i < len(names) and names[i] is not None else ""
        cls = type(self).__name__
        return (f"parameter {i}{name} was moved or cast after {cls} was built: its memory changed "
                f"from {view.dtype} {tuple(view.shape)} on {view.device} to {p.dtype} "
                f"{tuple(p.shape)} on {p.device}. {cls} keeps each parameter in a buffer of the "
                f"dtype and device it had at construction, so it cannot step this one. Build the "
                f"optimizer after moving or casting the model (model.to(...) / .cuda() / .half() "
                f"first), or save this optimizer's state_dict() and load it into a new {cls} "
                f"built on the moved model.")
