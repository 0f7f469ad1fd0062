"""This rank's part of a tensor: a DTensor param's local shard (FSDP2), a process_group
param's dim-0 chunk (zero.py), or the tensor itself — and the addresses and write counts by
which the step tells whether that memory moved or was written. Invariant: a DTensor param is
never rebound to optimizer memory; its slices view `p.to_local()` (docs/internals.md).
"""

from __future__ import annotations

import sys
import warnings

import torch

from hybrid_opt.distributed.ranks import world_size

_DTENSOR: list = []  # [the DTensor class], once torch.distributed.tensor is loaded


def _dtensor_class():
    # No tensor is a DTensor before torch.distributed.tensor is loaded (FSDP2 and DTensor's users
    # load it), so a process without one does not pay its import: 1.2-1.7 s, sympy through torch.fx.
    if not _DTENSOR:
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if dtensor is None:  # not loaded (or still loading, or a torch without it)
            return None
        _DTENSOR.append(dtensor)
    return _DTENSOR[0]


def is_dtensor(t) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(t, dtensor)


def has_public_dtensor() -> bool:
    """torch.distributed.tensor's DTensor, Shard, Replicate (torch >= 2.5), without importing it
    (a second and more)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.5"


def is_pre_public_dtensor(t) -> bool:
    """A DTensor of a torch that keeps the class only under torch.distributed._tensor (2.4),
    which is_dtensor does not see: the optimizer refuses it rather than step its local shard
    as a whole param."""
    if _dtensor_class() is not None:
        return False
    legacy = getattr(sys.modules.get("torch.distributed._tensor"), "DTensor", None)
    return legacy is not None and isinstance(t, legacy)


# process_group mode (zero.py): plain params whose state this rank keeps for a dim-0 chunk
# only, and the grads whose averaged chunk a reduce-scatter delivered (grad -> that chunk)
_ZERO_PARAMS: list = []  # [WeakIdKeyDictionary param -> ZeroSpec], made on first use
_ZERO_GRADS: list = []  # [WeakIdKeyDictionary grad -> reduced chunk]


def zero_maps():
    """(param -> ZeroSpec, grad -> its reduced chunk): zero.py registers the params, zero_counts.py
    each delivered grad."""
    if not _ZERO_PARAMS:
        from torch.utils.weak import WeakIdKeyDictionary

        _ZERO_PARAMS.append(WeakIdKeyDictionary())
        _ZERO_GRADS.append(WeakIdKeyDictionary())
    return _ZERO_PARAMS[0], _ZERO_GRADS[0]


def zero_spec(t):
    """The ZeroSpec (zero.py) of a plain param sharded by process_group, or None."""
    return zero_maps()[0].get(t) if t is not None and _ZERO_PARAMS else None


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
        params, grads = zero_maps()
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


def _all_plain() -> bool:
    """No tensor can be a DTensor (torch.distributed.tensor is not loaded) and no param is
    sharded by process_group: every tensor is its own local memory, its write count its version."""
    return not (_ZERO_PARAMS and len(_ZERO_PARAMS[0])) and _dtensor_class() is None


def moved_or_written(params, ptrs: list, counts: list) -> tuple:
    """(some param's local memory is not at `ptrs` any more, some param's write_count is not
    `counts`'s) — int comparisons only, nothing allocated (storage.ParamGuard.check runs it
    every step)."""
    written = False
    if _all_plain():  # the same answer without local_of's and write_count's calls per param
        for k, p in enumerate(params):
            if p.data_ptr() != ptrs[k]:
                return True, written
            written = written or p._version != counts[k]
        return False, written
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
    return [p._version for p in params] if _all_plain() else [write_count(p) for p in params]
