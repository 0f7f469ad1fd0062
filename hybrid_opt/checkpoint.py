"""Checkpoints: state_dict() gathers every tier's state into torch.optim.AdamW's format, and
load_state_dict() scatters such a state dict back into the tiers.

A mixin of the optimizer class. The fp32 master of a bf16/fp16 param travels under the
extra key `master_param`, which torch ignores.
"""
from __future__ import annotations

import torch

from hybrid_opt.plan import DEVICE


class CheckpointMixin:
    """torch's state_dict format in and out of the tiers."""

    def _subgroup_state(self, sg) -> dict:
        """A subgroup's fp32 master and moments, wherever it lives: views on the device and
        host tiers, copies read from its file on nvme."""
        if self.plan.tiers[sg.index] == DEVICE:
            st = {"master": self._device.master[sg.index]}
            st.update(self._device.state[sg.index])
            return st
        st = self._host.state(self._host_local[sg.index])
        st["master"] = st.pop("param")
        return st

    def state_dict(self) -> dict:
        self._check_open()
        # called between backward and step(): the committed state is what a checkpoint holds;
        # pending speculations are dropped (step() then steps those subgroups itself)
        self._drop_speculation()
        base = super().state_dict()  # param_groups in torch's format (params as indices)
        state = {}
        buffers: dict = {}
        for sg in self._subgroups:
            for sl in sg.slices:
                buffers.setdefault(sl.param_index, []).append((sg, sl))
        params = list(self._all_params())
        sub_state = {}  # each subgroup's state read once (an nvme read is a whole file slot)
        for idx, p in enumerate(params):
            if self._steps[idx] == 0:
                continue  # never stepped: torch has no state for it either
            entry = {"step": torch.tensor(float(self._steps[idx]), dtype=torch.float32)}
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self._group_of(idx)["amsgrad"] else [])
            if p.dtype != torch.float32:
                keys.append("master")
            flat = {k: torch.empty(p.numel(), dtype=torch.float32, device=p.device) for k in keys}
            for sg, sl in buffers.get(idx, []):
                if sg.index not in sub_state:
                    sub_state[sg.index] = self._subgroup_state(sg)
                a, b = sl.sub_offset, sl.sub_offset + sl.numel
                for k in keys:
                    flat[k][sl.param_offset:sl.param_offset + sl.numel].copy_(sub_state[sg.index][k][a:b])
            for k in keys:
                entry["master_param" if k == "master" else k] = flat[k].view(p.shape)
            state[idx] = entry
        base["state"] = state
        return base

    def _group_of(self, idx: int) -> dict:
        for g in self.param_groups:
            n = len(g["params"])
            if idx < n:
                return g
            idx -= n
        raise IndexError(idx)

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_open()
        self._drop_speculation()
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        if any(s.get("amsgrad", False) for s in saved_groups) and not self._amsgrad_layout:
            # the checkpoint needs a running max of v that this optimizer never laid out: lay
            # the tiers out again with it (the state is loaded into them right below)
            self._amsgrad_layout = True
            self._rebuild_tiers()
        for g, s in zip(groups, saved_groups):
            for k, v in s.items():
                if k not in ("params", "param_names", "decoupled_weight_decay"):
                    g[k] = v
        # saved ids map to our positions in order (as torch does)
        id_map = {}
        for s in saved_groups:
            for pid in s["params"]:
                id_map[pid] = len(id_map)
        saved_state = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
        params = list(self._all_params())
        with torch.no_grad():
            for sg in self._subgroups:
                st = self._subgroup_state(sg)
                for sl in sg.slices:
                    entry = saved_state.get(sl.param_index, {})
                    p = params[sl.param_index]
                    a, b = sl.sub_offset, sl.sub_offset + sl.numel
                    for k, view in st.items():
                        if k == "master":
                            src = p.detach()
                            saved = entry.get("master_param")
                            # a master stands only while the param is still its rounding: torch
                            # carries our extra key along without updating it, so after training
                            # elsewhere the param itself is the truth (and a load never writes params)
                            if saved is not None and torch.equal(saved.to(p.dtype), p.detach()):
                                src = saved
                        elif k in entry:
                            src = entry[k]
                        else:
                            view[a:b].zero_()
                            continue
                        view[a:b].copy_(src.reshape(-1)[sl.param_offset:sl.param_offset + sl.numel])
                if self.plan.tiers[sg.index] != DEVICE:
                    local = self._host_local[sg.index]
                    self._host.load_state(local, st["master"], st["exp_avg"], st["exp_avg_sq"],
                                          st.get("max_exp_avg_sq"))
        for idx in range(len(self._steps)):
            st = saved_state.get(idx)
            self._steps[idx] = int(float(st["step"])) if st is not None and "step" in st else 0
