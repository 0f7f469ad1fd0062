"""`opt.allocated_bytes`: the bytes the optimizer holds now, per kind (host, nvme, comm, device),
read from what the OS and the allocator report, never from element counts.

Host is the arena's allocated pages (`os.fstat`'s st_blocks: dormant spare banks have none),
nvme the swap files' sizes, comm and device the storages' sizes. The model's params and grads are
not counted: they are the model's. Design notes:
docs/internals.md."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybrid_opt.seams import Sharding
    from hybrid_opt.tiers.device import DeviceTier
    from hybrid_opt.tiers.host import HostTier

KINDS = ("device", "host", "nvme", "comm")


def _storages_nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts its whole storage once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _device_tensors(device) -> list:
    out = [t for st in device.state.values() for t in st.values()]
    out += list(device.master.values())  # an fp32 subgroup's master is its params: the model's
    return out + list(device.remainder.values())


def _arena_bytes(host) -> int:
    """The arena's allocated pages (dormant spare banks have none until woken)."""
    return os.fstat(host.arena.fd).st_blocks * 512


def _swap_bytes(host) -> int:
    if host.swap is None or not os.path.isdir(host.swap.path):
        return 0
    total = 0
    for name in os.listdir(host.swap.path):
        try:
            total += os.stat(os.path.join(host.swap.path, name)).st_size
        except FileNotFoundError:
            pass  # removed meanwhile (close())
    return total


def allocated_bytes(device: DeviceTier | None, host: HostTier | None, sharding: Sharding) -> dict:
    """{"device", "host", "nvme", "comm"}: bytes held now (module docstring); parts absent
    (no host tier, not process_group: NoSharding has no comm tensors, closed) count 0."""
    out = dict.fromkeys(KINDS, 0)
    if device is not None:
        out["device"] = _storages_nbytes(_device_tensors(device))
    if host is not None and not host.closed:
        out["host"] = _arena_bytes(host)
        out["nvme"] = _swap_bytes(host)
    # the comm window's slots, each bucket's averaged chunks and counts
    out["comm"] = _storages_nbytes(sharding.comm_tensors())
    return out
