"""The bytes a placement will allocate, computed before anything is: what a fixed
placement's budgets are checked against, and what sizes the spare pool within a host budget.

The same functions the tiers are built from do the counting: the host tier's arena from
tiers/arena_plan.plan_arena (its size is what `os.fstat` on the arena reports, and what
`opt.allocated_bytes["host"]` reads back), the device tier's tensors from its subgroups'
element counts and the state format. So a fixed placement that `allocated_bytes` would show
over a budget raises before the first byte of it is allocated. ("auto" chooses with the cost
model, whose estimate is at least these bytes: tests/test_allocated_bytes.py.)
"""

from __future__ import annotations

import torch

from hybrid_opt.placement.plan import DEVICE, NVME
from hybrid_opt.state.state_format import stored_numel
from hybrid_opt.tiers.arena_plan import plan_arena
from hybrid_opt.tiers.host import staging_slots_for


def device_tier_bytes(sgs, fmt, amsgrad: bool) -> int:
    """What DeviceTier allocates for `sgs`: the moments in the format's dtypes (a q8 one: codes
    and absmaxes; fp32 for a subgroup of small params), and an fp32 master for a bf16/fp16
    subgroup (2 bytes of remainder with remainders; an fp32 model's params are their own master)."""
    total = 0
    for s in sgs:  # a q8 moment: its codes and one absmax per block (the last may be partial)
        moments = fmt.for_subgroup(s.quantized).stored_moments(amsgrad)
        total += s.numel * fmt.master_bytes(s.dtype, own_master=True)
        total += sum(stored_numel(name, s.numel) * dt.itemsize for name, dt in moments.items())
    return total


def host_tier_layout(host: list, plan, fmt, amsgrad: bool, rollback: str, io_banks: int) -> dict:
    """HostTier's layout arguments for the subgroups `host` of `plan` (numels and the keywords
    that size its arena and choose its regions)."""
    dtypes = {s.dtype for s in host}
    copy_dtype = next(iter(sorted(dtypes - {torch.float32}, key=str)), None)  # HostTier refuses two
    # remainders on a bf16 host tier: each subgroup's params are its masters' high halves
    remainders = fmt.store_param_remainders and copy_dtype == torch.bfloat16
    # grads arrive about in reverse parameter order: a subgroup is complete when its first
    # parameter's grad is, and every subgroup that parameter completes is ready in the same hook
    bursts: dict = {}
    for k, s in enumerate(host):
        bursts.setdefault(min(sl.param_index for sl in s.slices), []).append(k)
    numels = [s.numel for s in host]
    quantized = [s.quantized and fmt.quantized_moments for s in host]
    return dict(
        numels=numels,
        grad_dtype=torch.float32 if len(dtypes) > 1 else next(iter(dtypes)),
        staging_slots=staging_slots_for(list(bursts.values()), numels, quantized=any(quantized)),
        quantized=quantized,
        copy_dtype=copy_dtype,
        amsgrad=amsgrad,
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        remainders=remainders,
        params=host if remainders else None,
        rollback=rollback,
        spare_banks=plan.spare_banks,
        spares_awake=plan.spares_awake,
        nvme=[plan.tiers[s.index] == NVME for s in host],
        io_banks=io_banks,
    )


def host_arena_bytes(layout: dict, fmt) -> int:
    """The arena a HostTier built with `layout` (host_tier_layout) maps, in bytes."""
    flags = [layout["remainders"] and fmt.remainders_for(s.dtype) for s in (layout["params"] or [])]
    return plan_arena(
        layout["numels"],
        layout["nvme"],
        fmt=fmt,
        amsgrad=layout["amsgrad"],
        copy_dtype=layout["copy_dtype"],
        remainders=flags,
        grad_dtype=layout["grad_dtype"],
        rollback=layout["rollback"],
        spare_banks=layout["spare_banks"],
        io_banks=layout["io_banks"],
        staging_slots=layout["staging_slots"],
        slot_numel=None,
        quantized=layout["quantized"],
    ).nbytes


def plan_bytes(subgroups: list, plan, fmt, amsgrad: bool, rollback: str, io_banks: int, cuda: bool) -> dict:
    """{"device", "host"}: the bytes the tiers of `plan` allocate (on a CPU-only host the
    device tier is host memory too: counted in both, as the budgets of such a host are one)."""
    dev = device_tier_bytes([s for s in subgroups if plan.tiers[s.index] == DEVICE], fmt, amsgrad)
    host = [s for s in subgroups if plan.tiers[s.index] != DEVICE]
    arena = (
        host_arena_bytes(host_tier_layout(host, plan, fmt, amsgrad, rollback, io_banks), fmt) if host else 0
    )
    return {"device": float(dev), "host": float(arena + (0 if cuda else dev))}
