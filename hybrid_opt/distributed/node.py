"""Who this process is on its node: its local rank, the ranks sharing the node, its global rank.

Ranks on one node share its cores, host memory and nvme bandwidth, so the worker's cores, the
default budgets and the nvme rates are divided by `local_world_size()`. Read from a node group given
to `set_node_group`, else torchrun's variables, else derived once from torch.distributed, else one
rank. Nothing here imports torch at module level. Design notes: docs/internals.md."""

from __future__ import annotations

import os
import socket
import warnings

_node_group = None
_derived = None  # (the default group it was derived over, NodeInfo): derive_from_dist()
_warned_shared_cores = False


class NodeInfo:
    """(local_rank, local_world_size) of this process on its node."""

    __slots__ = ("local_rank", "local_world_size")

    def __init__(self, local_rank: int, local_world_size: int):
        if local_world_size < 1 or not 0 <= local_rank < local_world_size:
            raise ValueError(
                f"local rank {local_rank} of {local_world_size} ranks per node: need "
                f"0 <= LOCAL_RANK < LOCAL_WORLD_SIZE (as torchrun sets them)"
            )
        self.local_rank, self.local_world_size = int(local_rank), int(local_world_size)

    def __repr__(self) -> str:
        return f"NodeInfo(local_rank={self.local_rank}, local_world_size={self.local_world_size})"


def set_node_group(group) -> None:
    """Declares the torch.distributed group of the ranks on this node (e.g. from
    `dist.new_subgroups()`); `None` goes back to the environment variables."""
    global _node_group
    _node_group = group


def _env_int(name: str):
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={text!r} is not an integer; torchrun sets "
            f"it to one (unset it, or set a number)"
        ) from None


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def info() -> NodeInfo:
    """This process's place on its node (module docstring: where it is read from)."""
    if _node_group is not None and _dist() is not None:
        dist = _dist()
        return NodeInfo(dist.get_rank(_node_group), dist.get_world_size(_node_group))
    size, rank = _env_int("LOCAL_WORLD_SIZE"), _env_int("LOCAL_RANK")
    if size is None:
        derived = _derived_info()
        if derived is not None:
            return derived
        if rank not in (None, 0):
            raise ValueError(
                f"LOCAL_RANK={rank} but LOCAL_WORLD_SIZE is not set: set both (the "
                f"ranks on this node), as torchrun does"
            )
        return NodeInfo(0, 1)
    return NodeInfo(0 if rank is None else rank, size)


def node_key() -> str:
    """This node's name among the ranks: hostname and boot id (one per booted kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def derive_from_dist(device=None) -> None:
    """Where neither a node group nor LOCAL_WORLD_SIZE says who shares this node and
    torch.distributed runs more than one rank: finds out (module docstring), once per default
    group. Collective: every rank of the default group must call it (the optimizer's
    constructor does). `device`: the params' (a pure nccl group gathers there, not on the
    current device: ranks.collective_device)."""
    global _derived
    dist = _dist()
    if dist is None or _node_group is not None or _env_int("LOCAL_WORLD_SIZE") is not None:
        return
    world = dist.get_world_size()
    if world == 1 or (_derived is not None and _derived[0] is dist.group.WORLD):
        return
    import hashlib

    import torch

    from hybrid_opt.distributed.ranks import collective_device

    # each rank's node key as 8 bytes of its hash, gathered in one tensor (all_gather_object
    # would stage through the current CUDA device on a pure nccl group)
    digest = hashlib.blake2b(node_key().encode(), digest_size=8).digest()
    at = collective_device(dist, device)
    mine_t = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=at)
    gathered = [torch.empty_like(mine_t) for _ in range(world)]
    dist.all_gather(gathered, mine_t)
    keys = [int(t.item()) for t in gathered]
    rank = dist.get_rank()
    mine = [r for r, k in enumerate(keys) if k == keys[rank]]
    _derived = (dist.group.WORLD, NodeInfo(mine.index(rank), len(mine)))


def _derived_info():
    dist = _dist()
    if _derived is None or dist is None or _derived[0] is not dist.group.WORLD:
        return None
    return _derived[1]


def local_rank() -> int:
    return info().local_rank


def local_world_size() -> int:
    return info().local_world_size


def global_rank():
    """This process's rank in the default group, or None when not distributed."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return _env_int("RANK")


def core_slice(cpus: list, node: NodeInfo | None = None) -> list:
    """This rank's share of `cpus` (the cores the process may use, the same for every rank of
    the node): contiguous slices of len(cpus) // ranks, the first len(cpus) % ranks one core
    longer, by local rank, so the ranks' slices are disjoint. With fewer cores than ranks each
    rank gets one core, shared round-robin (warned once: the ranks' workers then contend)."""
    node = info() if node is None else node
    cpus = sorted(cpus)
    n, k, r = len(cpus), node.local_world_size, node.local_rank
    if k <= 1 or n == 0:
        return cpus
    if n < k:
        global _warned_shared_cores
        if not _warned_shared_cores:
            _warned_shared_cores = True
            warnings.warn(
                f"{k} ranks on this node share {n} core{'s' if n != 1 else ''}: each "
                f"rank's trainer and worker get one core that other ranks use too, so "
                f"they contend; run fewer ranks per node or give the job more cores",
                RuntimeWarning,
                stacklevel=3,
            )
        return [cpus[r % n]]
    base, extra = divmod(n, k)
    start = r * base + min(r, extra)
    return cpus[start : start + base + (1 if r < extra else 0)]


def share(amount: float, node: NodeInfo | None = None) -> float:
    """This rank's even share of a node-wide amount (free host memory, nvme bandwidth)."""
    node = info() if node is None else node
    return float(amount) / node.local_world_size
