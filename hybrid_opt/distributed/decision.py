"""One decision for all ranks: the grads' global norm² (clipping) and the GradScaler's found_inf.

The norm² and found_inf are summed in one all_reduce (found_inf is >= 0, so a sum > 0 means an
overflow somewhere; rank_faults.agree carries them with each rank's failure flag), each element
counted once: a shard's partial is weighted 1 / (ranks holding a replica of it) — the product of
the mesh dims whose placement is Replicate (HSDP's replicate dim); a plain param under a
world > 1 without process_group is replicated on every rank (weight 1/world). No collective runs
on a step that needs neither clipping nor a scaler.
"""

from __future__ import annotations

import torch

from hybrid_opt.distributed.local_shards import local_of, replicas
from hybrid_opt.distributed.ranks import world_size


def weighted_norm_sq(partials) -> float:
    """Σ norm² / replicas over [(norm², replicas)], in the order given (fixed: subgroup order)."""
    return sum(s / r if r != 1 else s for s, r in partials)


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
        for s, _ in cpu_kernels.grad_stats_many([g.contiguous() for g in grads]):  # one call, all cores
            total += s
        partials.append((total, r))
    return weighted_norm_sq(partials)
