"""Subgroup layout: parameters flattened into contiguous buffers and cut into subgroups.

Each param group's parameters of one (device, dtype) are copied into flat buffers and
become views of them (as apex and DeepSpeed flatten), so a subgroup's model params are one
contiguous range: one copy moves a whole subgroup's new params. A parameter larger than a
subgroup spans several; many small parameters share one. Subgroups never span param groups
(hyperparameters are per group) nor flat buffers.

Flattening copies the model, so the flat buffers are made in pieces of about
FLATTEN_PIECE_BYTES (whole subgroups, cut at parameter boundaries; a larger parameter gets a
piece of its own), each parameter's old storage released as soon as it is copied: the peak
is the model plus one piece, not twice the model — on a GPU the difference between a model
that fits and one that does not.

A DTensor param (FSDP2) is never copied nor rebound: its flat buffer is its own local shard
(distributed.py says why); slices read the local shard of its grad.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid_opt.distributed import is_sharded, local_of

# the extra memory flattening holds at once: one piece of the flat buffers (module docstring)
FLATTEN_PIECE_BYTES = 256 << 20


@dataclass
class ParamSlice:
    """Elements [param_offset, param_offset + numel) of a parameter, at sub_offset in its subgroup."""
    param_index: int          # torch's state_dict numbering: position over all groups
    param: torch.Tensor
    param_offset: int
    sub_offset: int
    numel: int

    def grad_view(self) -> torch.Tensor | None:
        g = local_of(self.param.grad)
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
                  first_subgroup: int, piece_bytes: int | None = None) -> tuple[list, list]:
    """Flattens one param group; returns (subgroups, flat buffers). Params become views; each
    one's old storage is let go as soon as it is copied (module docstring), so a caller that
    holds no other reference to it gets it back before the next piece is allocated."""
    buckets: dict = {}
    subgroups, flats = [], []
    for k, p in enumerate(params):
        if is_sharded(p):  # FSDP2 / process_group: its own part, never copied
            flat = dtensor_flat(p)
            flats.append(flat)
            subgroups.extend(_cut(flat, [(first_index + k, p, 0)], group, subgroup_numel,
                                  first_subgroup + len(subgroups)))
            continue
        buckets.setdefault((p.device, p.dtype), []).append((first_index + k, p))
    for (device, dtype), members in buckets.items():
        size = torch.empty((), dtype=dtype).element_size()
        for piece in flat_pieces([p.numel() for _, p in members], subgroup_numel,
                                 (FLATTEN_PIECE_BYTES if piece_bytes is None else piece_bytes) // size):
            flat, placed = _flatten_piece([members[k] for k in piece], device, dtype)
            flats.append(flat)
            subgroups.extend(_cut(flat, placed, group, subgroup_numel, first_subgroup + len(subgroups)))
    return subgroups, flats


def dtensor_flat(p) -> torch.Tensor:
    """A DTensor param's flat buffer: a 1-D view of its local shard (its own memory)."""
    local = local_of(p)
    if not local.is_contiguous():
        raise ValueError(f"a DTensor parameter's local shard must be contiguous (FSDP2's Shard(0) "
                         f"shards are), got shape {tuple(local.shape)} stride {local.stride()} with "
                         f"placements {tuple(p.placements)}: shard it on dim 0")
    return local.view(-1)


def flat_pieces(numels: list, subgroup_numel: int, piece_numel: int) -> list:
    """Runs of consecutive parameters (indices into `numels`), each one flat buffer: at most
    `piece_numel` elements rounded down to whole subgroups (at least one subgroup), unless one
    parameter alone is larger."""
    cap = max(subgroup_numel, piece_numel // subgroup_numel * subgroup_numel)
    pieces, run, acc = [], [], 0
    for k, n in enumerate(numels):
        if run and acc + n > cap:
            pieces.append(run)
            run, acc = [], 0
        run.append(k)
        acc += n
    if run:
        pieces.append(run)
    return pieces


def _flatten_piece(members: list, device, dtype) -> tuple[torch.Tensor, list]:
    """One flat buffer holding `members` [(param index, param)]; each param becomes a view of
    it and its old storage is dropped at once (the loop holds no reference to it)."""
    flat = torch.empty(sum(p.numel() for _, p in members), dtype=dtype, device=device)
    placed, off = [], 0
    with torch.no_grad():
        for idx, p in members:
            n = p.numel()
            view = flat[off:off + n].view(p.shape)
            view.copy_(p)
            p.data = view  # the model param is now a view of the flat buffer
            placed.append((idx, p, off))
            off += n
    return flat, placed


def _cut(flat: torch.Tensor, placed: list, group: int, subgroup_numel: int, first: int) -> list:
    """Subgroups of `subgroup_numel` elements over one flat buffer; a parameter may span several."""
    subgroups, total = [], flat.numel()
    start = 0
    cursor = 0  # index into placed
    while start < total:
        end = min(total, start + subgroup_numel)
        sg = Subgroup(first + len(subgroups), group, flat[start:end])
        while cursor < len(placed):
            idx, p, p_start = placed[cursor]
            p_end = p_start + local_of(p).numel()
            lo, hi = max(start, p_start), min(end, p_end)
            if lo < hi:
                sg.slices.append(ParamSlice(idx, p, lo - p_start, lo - start, hi - lo))
            if p_end <= end:
                cursor += 1
            else:
                break
        subgroups.append(sg)
        start = end
    return subgroups


def assign_ready_ranks(subgroups: list) -> None:
    """Grads complete in about reverse parameter order: the last subgroup is ready first."""
    for rank, sg in enumerate(sorted(subgroups, key=lambda s: -s.index)):
        sg.ready_rank = rank
