"""Distributed helpers: DTensor params (FSDP2) seen through their local shards, the one
reduction per step that makes every rank take the same decision, and DTensor state for
checkpoints.

How DTensor params are laid out (state/layout.py): each rank lays out and steps its *local
shards*. A DTensor param is never rebound to optimizer memory (FSDP2 keeps each sharded param's
local tensor as a view of its own padded buffer, `_sharded_param_data`, which it all-gathers
from and re-pads at lazy init; rebinding it would cut FSDP2 off from the updates). Instead
its subgroups' slices view `p.to_local()`, so the tiers write the new params straight into
FSDP2's storage, no copy and no extra memory — the same way torch.optim steps `p` in place.
The user's Parameter objects stay in param_groups (DCP maps state by identity), and
storage.py's check compares the local shard's address, re-pointing the slices (never the
param) when a load gave the shard new memory.

One decision for all ranks: the grads' norm² (clipping) and the GradScaler's found_inf are
summed in one all_reduce (found_inf is >= 0, so a sum > 0 means an overflow somewhere), each
element counted once: a shard's partial is weighted 1 / (ranks holding a replica of it) —
the product of the mesh dims whose placement is Replicate (HSDP's replicate dim); a plain
param under a world > 1 without process_group is replicated on every rank (weight 1/world).
No collective runs on a step that needs neither clipping nor a scaler.
"""

from __future__ import annotations

import warnings

import torch


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


_DTENSOR: list = []  # [DTensor class or None], imported once


def is_dtensor(t) -> bool:
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor

            _DTENSOR.append(DTensor)
        except ImportError:  # torch without DTensor (or without distributed): nothing is one
            _DTENSOR.append(None)
    return _DTENSOR[0] is not None and isinstance(t, _DTENSOR[0])


# process_group mode (zero.py): plain params whose state this rank keeps for a dim-0 chunk
# only, and the grads whose averaged chunk a reduce-scatter delivered (grad -> that chunk)
_ZERO_PARAMS: list = []  # [WeakIdKeyDictionary param -> ZeroSpec], made on first use
_ZERO_GRADS: list = []  # [WeakIdKeyDictionary grad -> reduced chunk]


def _zero_maps():
    if not _ZERO_PARAMS:
        from torch.utils.weak import WeakIdKeyDictionary

        _ZERO_PARAMS.append(WeakIdKeyDictionary())
        _ZERO_GRADS.append(WeakIdKeyDictionary())
    return _ZERO_PARAMS[0], _ZERO_GRADS[0]


def zero_spec(t):
    """The ZeroSpec (zero.py) of a plain param sharded by process_group, or None."""
    return _zero_maps()[0].get(t) if t is not None and _ZERO_PARAMS else None


def chunk_rows(n: int, rank: int, world: int) -> tuple:
    """[start, end) of rank's dim-0 chunk of n rows: torch.chunk / FSDP2 semantics (chunks of
    ceil(n / world) rows; the last ones may be smaller or empty)."""
    size = -(-n // world) if n else 0
    return min(n, rank * size), min(n, (rank + 1) * size)


def zero_chunk(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's dim-0 chunk of `t` as a view (contiguous when t is)."""
    a, b = chunk_rows(t.shape[0], rank, world)
    return t.detach()[a:b]


def is_sharded(p) -> bool:
    """A DTensor param (FSDP2) or a plain param sharded by process_group (zero.py): its flat
    buffer is this rank's part of it, never a copy, and its state is a DTensor."""
    return is_dtensor(p) or zero_spec(p) is not None


def local_of(t):
    """The tensor whose memory holds this rank's elements of `t`: a DTensor's local shard
    (detached, no autograd); in process_group mode a param's dim-0 chunk or a grad's averaged
    chunk (zero.py); else `t` itself."""
    if t is None:
        return t
    if _ZERO_PARAMS:
        params, grads = _zero_maps()
        spec = params.get(t)
        if spec is not None:
            return zero_chunk(t, spec.rank, spec.world)
        reduced = grads.get(t)
        if reduced is not None:
            return reduced
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def replicas(p) -> int:
    """How many ranks hold each element of `p`'s grad: the Replicate dims of a DTensor's
    mesh; every rank for a plain param (replicated when a world runs without process_group)."""
    if zero_spec(p) is not None:
        return 1  # after the reduce-scatter each rank holds its own chunk's average only
    if not is_dtensor(p):
        return world_size()
    from torch.distributed.tensor import Replicate

    n = 1
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            n *= p.device_mesh.size(dim)
    return n


def weighted_norm_sq(partials) -> float:
    """Σ norm² / replicas over [(norm², replicas)], in the order given (fixed: subgroup order)."""
    return sum(s / r if r != 1 else s for s, r in partials)


def needs_reduction(params) -> bool:
    """True when the grads of `params` live on more than one rank (a world > 1)."""
    return world_size() > 1 and any(True for _ in params)


def reduce_decision(norm_sq, found, group=None):
    """(global norm², global found_inf) — one all_reduce(SUM) of both over `group` (default: the
    default group),
    so every rank clips by the same coefficient and skips the same steps. Either may be None
    (not needed this step); found may be a tensor (the scaler's), returned as a float."""
    dist = _dist()
    values = [0.0 if norm_sq is None else float(norm_sq), 0.0 if found is None else float(found)]
    if dist is None or dist.get_world_size(group) == 1:
        return norm_sq, found
    # gloo reduces CPU tensors; nccl needs them on the rank's device
    backend = dist.get_backend(group)
    device = torch.device("cpu")
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    total_sq, total_found = buf.tolist()
    return (None if norm_sq is None else total_sq), (None if found is None else total_found)


def globalize_scaler_found_inf(scaler, key: int, found: float) -> None:
    """Makes an attached torch.amp.GradScaler's per-device found_inf for optimizer `key` (its
    id) the global one, so its update() changes the scale identically on every rank
    (ShardedGradScaler does that itself)."""
    if scaler is None:
        return
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(key) if isinstance(states, dict) else None
    if not state:
        return
    for t in state.get("found_inf_per_device", {}).values():
        t.fill_(1.0 if found else 0.0)


def warn_replicated(params, process_group) -> None:
    """Plain params in a world > 1 without process_group: every rank holds and steps the
    whole state (replicated, as one process would). Said once per optimizer."""
    if process_group is not None or world_size() <= 1:
        return
    plain = [p for p in params if not is_dtensor(p)]
    if plain:
        warnings.warn(
            f"torch.distributed is initialised with {world_size()} ranks and "
            f"{len(plain)} parameters are plain tensors (not FSDP2 DTensors): every rank "
            f"keeps and steps their whole optimizer state (replicated). Shard them with "
            f"FSDP2's fully_shard, or pass process_group=torch.distributed.group.WORLD "
            f"to shard the state ZeRO-style across ranks",
            stacklevel=4,
        )


def dtensor_like(local: torch.Tensor, p):
    """`local` (this rank's state of DTensor param `p`, shaped like p's local shard) as a
    DTensor with p's mesh, placements, global shape and stride — how torch.optim.AdamW's
    state looks under FSDP2 (zeros_like(p)), so DCP saves and reshards it."""
    from torch.distributed.tensor import DTensor

    spec = zero_spec(p)
    if spec is not None:  # process_group: laid out as FSDP2 would shard p (Shard(0) chunks)
        from torch.distributed.tensor import Shard

        return DTensor.from_local(
            local, spec.mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
        )
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


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


def grad_norm_sq(params: list):
    """The grads' squared global norm: a float summed here on a CPU host; on CUDA a 0-dim
    fp64 device tensor, queued and not read (step() reads it with found_inf and the scale).
    This rank's grads (a DTensor's local shard), grouped by how many ranks hold a replica of
    them: under torch.distributed each element counts once."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    world = world_size()
    by_replicas: dict = {}
    for p in params:
        by_replicas.setdefault(replicas(p) if world > 1 else 1, []).append(local_of(p.grad))
    if params[0].is_cuda:
        import gpu_kernels

        total = None
        for r, grads in by_replicas.items():
            s, _ = gpu_kernels.grad_stats([g.contiguous() for g in grads], sum_dtype=torch.float64)
            s = s / r if r != 1 else s
            total = s if total is None else total + s
        return total
    import cpu_kernels

    partials = []
    for r, grads in by_replicas.items():
        total = 0.0
        for g in grads:
            s, _ = cpu_kernels.grad_stats(g.contiguous())
            total += s
        partials.append((total, r))
    return weighted_norm_sq(partials)


# ------------------------------------------------------------------ batched, for the step's hot path
def any_dtensor(tensors) -> bool:
    return any(is_dtensor(t) for t in tensors)


def write_count(p, local=None) -> int:
    """Param `p`'s write count: its local memory's version counter plus, for a DTensor param
    (FSDP2), the DTensor's own. Writes through the DTensor (model.load_state_dict's copy_,
    `p.mul_` under no_grad) bump only the DTensor's counter; writes through `p.to_local()`
    only the local tensor's; FSDP2's all-gathers and the tiers' writes (through the flat
    buffers) neither (measured, torch 2.13)."""
    local = local_of(p) if local is None else local
    return local._version + (p._version if is_dtensor(p) else 0)


def moved_or_written(params, ptrs: list, counts: list) -> tuple:
    """(some param's local memory is not at `ptrs` any more, some param's write_count is not
    `counts`'s) — int comparisons only, nothing allocated (storage.ParamGuard.check runs it
    every step)."""
    written = False
    for k, p in enumerate(params):
        local = local_of(p)
        if local.data_ptr() != ptrs[k]:
            return True, written
        written = written or write_count(p, local) != counts[k]
    return False, written


def grad_locals(grads) -> tuple:
    """(the ids of the grads that are not None, local_of of each grad): one pass over a
    subgroup's grads, whose step reads the memory it names. A grad is named by
    (data_ptr, _version) of its local memory, and a DTensor grad also by the DTensor's own
    version (`dtensor.mul_` bumps only that one)."""
    out = [local_of(g) for g in grads]
    ids = [
        (local.data_ptr(), local._version, g._version)
        if is_dtensor(g)
        else (local.data_ptr(), local._version)
        for g, local in zip(grads, out)
        if local is not None
    ]
    return tuple(ids), out


def write_counts(params) -> list:
    return [write_count(p) for p in params]
