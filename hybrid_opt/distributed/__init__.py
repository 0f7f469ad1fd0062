"""Distributed: each rank steps its own share of the state; torch.distributed carries the rest.

`ranks` (the world), `local_shards` (this rank's part of a tensor, and its write counts),
`decision` (one norm² and found_inf for all ranks), `dtensor_state` (state as DTensors for
checkpoints), `sharding` (the distributed part and its no-op twin), `zero*` (process_group=),
`node` (a node's resources split between its ranks), `rank_faults`, `grad_edits`.
"""

from hybrid_opt.distributed.decision import globalize_scaler_found_inf, grad_norm_sq
from hybrid_opt.distributed.dtensor_state import dtensor_like, local_shard_of
from hybrid_opt.distributed.local_shards import (
    any_dtensor,
    grad_locals,
    is_dtensor,
    is_sharded,
    local_of,
    moved_or_written,
    warn_replicated,
    write_count,
    write_counts,
)
from hybrid_opt.distributed.ranks import world_size

__all__ = [
    "any_dtensor",
    "dtensor_like",
    "globalize_scaler_found_inf",
    "grad_locals",
    "grad_norm_sq",
    "is_dtensor",
    "is_sharded",
    "local_of",
    "local_shard_of",
    "moved_or_written",
    "warn_replicated",
    "world_size",
    "write_count",
    "write_counts",
]
