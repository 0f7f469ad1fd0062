"""The world this process runs in: torch.distributed when it is initialised, and its size.

Nothing here imports torch at module level (torch.distributed is imported on first use).
"""

from __future__ import annotations


def torch_dist():
    """torch.distributed when it is available and initialised, else None (one process)."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    dist = torch_dist()
    return dist.get_world_size() if dist is not None else 1
