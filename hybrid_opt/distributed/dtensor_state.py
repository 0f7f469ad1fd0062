"""The optimizer state of a sharded param as DTensors, for checkpoints: shaped as
torch.optim.AdamW's would be under FSDP2, so DCP saves and reshards it; and this rank's shard of
a saved state tensor, whatever layout it was saved in.
"""

from __future__ import annotations

import torch

from hybrid_opt.distributed.local_shards import is_dtensor, local_of, zero_chunk, zero_spec


def dtensor_over(local: torch.Tensor, mesh, placements, shape, stride):
    """`local` as this rank's part of a DTensor of global `shape` and `stride`, where it lies.
    DTensor.from_local moves a local tensor of another device type than the mesh's onto the
    mesh's device: a host or nvme tier's state (CPU) under a CUDA mesh would be copied back
    onto the GPU it was offloaded from. FSDP2's CPU offload builds its DTensors this way too
    (its params' CPU shards under a CUDA mesh), and DCP saves and loads them as they lie."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError:  # torch 2.4
        from torch.distributed._tensor.placement_types import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def dtensor_like(local: torch.Tensor, p):
    """`local` (this rank's state of DTensor param `p`, shaped like p's local shard) as a
    DTensor with p's mesh, placements, global shape and stride — how torch.optim.AdamW's
    state looks under FSDP2 (zeros_like(p)), so DCP saves and reshards it. It stays where it
    lies (dtensor_over): a CPU tier's state is not copied to the GPU."""
    spec = zero_spec(p)
    if spec is not None:  # process_group: laid out as FSDP2 would shard p (Shard(0) chunks)
        from torch.distributed.tensor import Shard

        return dtensor_over(local, spec.mesh, [Shard(0)], p.shape, p.stride())
    return dtensor_over(local, p.device_mesh, p.placements, p.shape, p.stride())


def local_shard_of(value, p):
    """This rank's shard of a saved state tensor `value` for DTensor param `p`: the local
    tensor of a DTensor laid out like p, a DTensor of another layout redistributed to p's,
    or the matching slice of a full (plain) tensor of p's global shape."""
    if value is None:
        return None
    spec = zero_spec(p)
    if spec is not None:
        if is_dtensor(value):
            from torch.distributed.tensor import Shard

            if tuple(value.placements) != (Shard(0),) or value.device_mesh != spec.mesh:
                value = value.redistribute(spec.mesh, [Shard(0)])
            return value.to_local()
        local = local_of(p)
        if tuple(value.shape) != tuple(p.shape):
            if tuple(value.shape) == tuple(local.shape):
                return value  # already this rank's chunk
            raise ValueError(
                f"load_state_dict: a state tensor of shape {tuple(value.shape)} does "
                f"not fit a parameter of shape {tuple(p.shape)} sharded by "
                f"process_group (chunk {tuple(local.shape)}): load a state_dict "
                f"saved for this model"
            )
        return zero_chunk(value, spec.rank, spec.world)
    if is_dtensor(value):
        if tuple(value.placements) != tuple(p.placements) or value.device_mesh != p.device_mesh:
            value = value.redistribute(p.device_mesh, p.placements)
        return value.to_local()
    local = local_of(p)
    if tuple(value.shape) == tuple(local.shape) and tuple(p.shape) != tuple(local.shape):
        return value  # already this rank's shard
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(
            f"load_state_dict: a state tensor of shape {tuple(value.shape)} does not "
            f"fit a DTensor parameter of global shape {tuple(p.shape)} (local shard "
            f"{tuple(local.shape)}): load a state_dict saved for this model"
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    out = value
    for dim, (n, o) in enumerate(zip(shape, offset)):
        out = out.narrow(dim, o, n)
    return out
