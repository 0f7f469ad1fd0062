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


def collective_device(dist, device=None):
    """Where a small tensor of ours goes for a collective of the default group: gloo reduces CPU
    tensors; a pure nccl group needs them on this rank's GPU, the params' (`device`) where it is
    one: a script that moves its model to f"cuda:{local_rank}" without torch.cuda.set_device
    leaves every rank's current device at 0 (NCCL's duplicate-GPU error, or a hang)."""
    import torch

    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        if device is not None and torch.device(device).type == "cuda":
            return torch.device(device)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
