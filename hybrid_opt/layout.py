"""Subgroup layout: parameters flattened into contiguous buffers and cut into subgroups.

Each param group's parameters of one (device, dtype) are copied into one flat buffer and
become views of it (as apex and DeepSpeed flatten), so a subgroup's model params are one
contiguous range: one copy moves a whole subgroup's new params. A parameter larger than a
subgroup spans several; many small parameters share one. Subgroups never span param groups
(hyperparameters are per group) nor flat buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ParamSlice:
    """Elements [param_offset, param_offset + numel) of a parameter, at sub_offset in its subgroup."""
    param_index: int          # torch's state_dict numbering: position over all groups
    param: torch.Tensor
    param_offset: int
    sub_offset: int
    numel: int

    def grad_view(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is None:
            return None
        return g.reshape(-1)[self.param_offset:self.param_offset + self.numel]


@dataclass
class Subgroup:
    index: int
    group: int                # param group index
    flat: torch.Tensor        # the model params' elements of this subgroup (a view, model dtype)
    slices: list = field(default_factory=list)
    ready_rank: int = 0       # 0 = grads complete first in backward (about reverse param order)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def dtype(self):
        return self.flat.dtype

    @property
    def device(self):
        return self.flat.device


def flatten_group(params: list, group: int, first_index: int, subgroup_numel: int,
                  first_subgroup: int) -> tuple[list, list]:
    """Flattens one param group; returns (subgroups, flat buffers). Params become views."""
    buckets: dict = {}
    for k, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append((first_index + k, p))
    subgroups, flats = [], []
    for (device, dtype), members in buckets.items():
        total = sum(p.numel() for _, p in members)
        flat = torch.empty(total, dtype=dtype, device=device)
        off = 0
        placed = []
        with torch.no_grad():
            for idx, p in members:
                n = p.numel()
                view = flat[off:off + n].view(p.shape)
                view.copy_(p)
                p.data = view  # the model param is now a view of the flat buffer
                placed.append((idx, p, off))
                off += n
        flats.append(flat)
        # cut into subgroups; a parameter may span several
        start = 0
        cursor = 0  # index into placed
        while start < total:
            end = min(total, start + subgroup_numel)
            sg = Subgroup(first_subgroup + len(subgroups), group, flat[start:end])
            while cursor < len(placed):
                idx, p, p_start = placed[cursor]
                p_end = p_start + p.numel()
                lo, hi = max(start, p_start), min(end, p_end)
                if lo < hi:
                    sg.slices.append(ParamSlice(idx, p, lo - p_start, lo - start, hi - lo))
                if p_end <= end:
                    cursor += 1
                else:
                    break
            subgroups.append(sg)
            start = end
    return subgroups, flats


def assign_ready_ranks(subgroups: list) -> None:
    """Grads complete in about reverse parameter order: the last subgroup is ready first."""
    for rank, sg in enumerate(sorted(subgroups, key=lambda s: -s.index)):
        sg.ready_rank = rank
