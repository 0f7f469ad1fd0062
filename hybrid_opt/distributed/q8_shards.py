"""q8 moments (issue 38) of sharded params — FSDP2's DTensors and process_group's chunks: where a
rank's blocks of 256 lie, and the absmax of a rank's part as a DTensor.

A rank's blocks are blocks of 256 along its local flat part (the layout starts every part on a
block: layout.py), and they are the param's own blocks because construction refuses a q8 param
whose dim-0 cut falls inside one of the param's blocks (`check_q8_shards`). So a sharded run steps
the very blocks one process steps, and the state a rank gives is a slice of the param's: codes a
DTensor shaped like the param, the absmax a DTensor of `q8_absmax_shape(p.shape)` cut on dim 0
exactly where the param is (checked too) — DCP saves and reshards both as it does any state, and a
checkpoint loads at any world size whose cuts are block cuts (one process's always are).
Design notes: docs/distributed.md#q8-moments."""

from __future__ import annotations

import math

import torch

from hybrid_opt.distributed.dtensor_state import dtensor_over
from hybrid_opt.distributed.local_shards import chunk_rows, is_dtensor, local_of, zero_spec
from hybrid_opt.state.state_format import Q8_BLOCK, q8_absmax_shape, q8_blocks, q8_quantized


def _shard_count(p, process_group) -> int:
    """How many parts dim 0 of `p` is cut into: FSDP2's Shard(0) mesh dims, process_group's
    world; 1 for a plain param. A DTensor sharded on another dim is refused (its parts would not
    be ranges of the flat index)."""
    if is_dtensor(p):
        from torch.distributed.tensor import Shard

        n = 1
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, Shard):
                if placement.dim != 0:
                    raise ValueError(
                        f"q8 moments (exp_avg_dtype / exp_avg_sq_dtype='q8') need DTensor "
                        f"params sharded on dim 0 (FSDP2's default), got placements "
                        f"{tuple(p.placements)} for a parameter of shape {tuple(p.shape)}: "
                        f"its parts would not be ranges of its flat index; shard it on dim 0 "
                        f"or use torch.float32 / torch.bfloat16 moments"
                    )
                n *= p.device_mesh.size(dim)
        return n
    if process_group is None:
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1  # ZeroSharding refuses it, saying so
    return dist.get_world_size(process_group)


def _cut_problem(shape: tuple, parts: int) -> str | None:
    """Why a param of `shape` cut on dim 0 into `parts` chunks (torch.chunk's rows) has a part
    whose blocks are not the param's, or whose absmax is not torch.chunk's cut of the
    absmax's dim 0 (DCP places a DTensor's chunks so); None when every part is a block cut."""
    rows, row = shape[0], math.prod(shape[1:])
    ashape = q8_absmax_shape(shape)
    arow = math.prod(ashape[1:])
    cuts = [(s, chunk_rows(rows, s, parts)) for s in range(parts)]
    for s, (a, b) in cuts:
        if a < b and (a * row) % Q8_BLOCK:
            return f"part {s} of {parts} starts at element {a * row}, inside block {a * row // Q8_BLOCK}"
    for s, (a, b) in cuts:
        start, end = a * row, b * row
        aa, ab = chunk_rows(ashape[0], s, parts)
        if start != end and (aa * arow, ab * arow) != (start // Q8_BLOCK, q8_blocks(end)):
            return (
                f"part {s} of {parts} holds blocks [{start // Q8_BLOCK}, {q8_blocks(end)}) "
                f"but a dim-0 cut of its absmax (shape {ashape}) would give it "
                f"[{aa * arow}, {ab * arow})"
            )
    return None


def check_q8_shards(params: list, process_group, state_format, label) -> None:
    """Construction, before anything is laid out, on every rank alike (each checks every
    part): a q8 param (`quantizes`) sharded on dim 0 whose cut falls inside one of its
    blocks of 256 is refused, naming it (`label(i)`) and what to do (module docstring)."""
    if not state_format.quantized_moments:
        return
    for i, p in enumerate(params):
        if not q8_quantized(p, state_format.quantized_moments) or p.dim() == 0:
            continue
        parts = _shard_count(p, process_group)
        if parts == 1:
            continue
        problem = _cut_problem(tuple(p.shape), parts)
        if problem is not None:
            row = p.numel() // p.shape[0] if p.shape[0] else 0
            raise ValueError(
                f"q8 moments under {'FSDP2' if is_dtensor(p) else 'process_group='}: "
                f"{label(i)} of shape {tuple(p.shape)} is cut on dim 0 into {parts} parts "
                f"and {problem}: that rank's blocks of {Q8_BLOCK} would not be the "
                f"parameter's, and its q8 state would not reshard. A dim-0 cut is a block cut "
                f"when each part's rows hold a multiple of {Q8_BLOCK} elements (a row here "
                f"holds {row}; any last dim that is a multiple of {Q8_BLOCK} does); reshape or "
                f"pad the parameter, shard over another number of ranks, or use torch.float32 "
                f"/ torch.bfloat16 moments"
            )


def absmax_local_shape(p) -> tuple:
    """The shape of this rank's absmax of q8 param `p` (sharded or not): its part of
    `q8_absmax_shape(p.shape)` — the rows of its dim-0 part, or its blocks."""
    ashape = q8_absmax_shape(p.shape)
    local = local_of(p)
    if len(ashape) == len(tuple(p.shape)) and len(ashape) > 1:
        return tuple(local.shape[:-1]) + ashape[-1:]
    return (q8_blocks(local.numel()),)


def _placed_as(p) -> tuple:
    """(mesh, placements) of sharded param `p`'s parts: process_group's dim-0 chunks (Shard(0)
    over its mesh) or the DTensor's own."""
    from torch.distributed.tensor import Shard

    spec = zero_spec(p)
    if spec is not None:
        return spec.mesh, [Shard(0)]
    return p.device_mesh, list(p.placements)


def absmax_dtensor(local: torch.Tensor, p):
    """This rank's absmax `local` of sharded q8 param `p` as a DTensor of the absmax's global
    shape, placed as p's part is (Shard(0) where p is cut), so DCP saves and reshards it."""
    shape = q8_absmax_shape(p.shape)
    stride = torch.empty(shape, device="meta").stride()
    mesh, placements = _placed_as(p)
    return dtensor_over(local.view(absmax_local_shape(p)), mesh, placements, shape, stride)


def local_absmax_of(value, p) -> torch.Tensor:
    """This rank's blocks (1-D) of a saved absmax `value` of sharded q8 param `p`: a DTensor
    redistributed to p's cut, or the rank's blocks of a full tensor (the param's blocks, in any
    shape of their count)."""
    if is_dtensor(value):
        mesh, placements = _placed_as(p)
        if tuple(value.shape) != q8_absmax_shape(p.shape):
            return local_absmax_of(value.full_tensor(), p)
        if tuple(value.placements) != tuple(placements) or value.device_mesh != mesh:
            value = value.redistribute(mesh, placements)
        return value.to_local().reshape(-1)
    start = _local_start(p)
    return value.reshape(-1)[start // Q8_BLOCK : q8_blocks(start + local_of(p).numel())]


def local_codes_of(value, p) -> torch.Tensor:
    """This rank's codes (1-D) of a saved q8 moment `value` (shaped like `p`, or of its
    element count) of sharded param `p`."""
    from hybrid_opt.distributed.dtensor_state import local_shard_of

    if not is_dtensor(value) and tuple(value.shape) != tuple(p.shape):
        start = _local_start(p)
        return value.reshape(-1)[start : start + local_of(p).numel()]
    return local_shard_of(value, p).reshape(-1)


def _local_start(p) -> int:
    """The flat index in `p` of this rank's first element (its dim-0 part's first row)."""
    local = local_of(p)
    if local.numel() == 0:
        return 0
    row = p.numel() // p.shape[0]
    spec = zero_spec(p)
    if spec is not None:
        return chunk_rows(p.shape[0], spec.rank, spec.world)[0] * row
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * row
