"""Moves: laying the tiers out again at another plan (a refit of "auto", replan(), add_param_group
after construction, a checkpoint that needs amsgrad's running max).

Invariant: a failure at any point leaves the old tiers and their state as they were. Room is
checked first, the new host tier is built beside the old one, the device tier allocates only the
arriving subgroups, and the switch allocates nothing. Functions of the Placement part, which does
the switch itself. The order step by step: docs/internals.md."""

from __future__ import annotations

import traceback

import torch

from hybrid_opt.placement.footprint import plan_bytes
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.state.state_format import absmaxes_of
from hybrid_opt.tiers.device import DeviceTier

GB = 1e9


# ------------------------------------------------------------------ room
def _state_bytes_per_element(pl) -> int:
    """A subgroup's state as a move copies it out: fp32 master (decoded) and moments."""
    return 4 + pl.state_format.moment_bytes(pl.layout.amsgrad)


def _leaving_arriving(pl, plan) -> tuple:
    sgs, before = pl.layout.subgroups, pl.plan.tiers
    leaving = [s for s in sgs if before[s.index] == DEVICE and plan.tiers[s.index] != DEVICE]
    arriving = [s for s in sgs if before[s.index] != DEVICE and plan.tiers[s.index] == DEVICE]
    return leaving, arriving


def move_memory(pl, plan) -> dict:
    """Bytes a move of Placement `pl` to `plan` needs and has, on the device and on the host
    (module docstring, step 1). On a CPU-only host the device tier is host memory: it counts there."""
    from hybrid_opt.placement import scheduler

    leaving, arriving = _leaving_arriving(pl, plan)
    # the new host tier's arena, exactly (footprint.py; the device tier is counted below)
    new_host = plan_bytes(
        pl.layout.subgroups,
        plan,
        pl.state_format,
        pl.layout.amsgrad,
        pl.config.rollback,
        pl.config.io_banks,
        cuda=True,
    )["host"]
    copies = sum(s.numel for s in leaving) * _state_bytes_per_element(pl)
    out = {
        "leaving": pl.device_bytes(leaving),
        "arriving": pl.device_bytes(arriving),
        "host_need": float(new_host + copies),
        "host_free": scheduler._free_host_bytes(),
    }
    if pl.layout.cuda():
        m = scheduler.cuda_memory(pl.layout.subgroups[0].device)
        out["device_free"] = scheduler.available_device_bytes(m["free"], m["reserved"], m["allocated"])
    else:
        out["host_need"] += out["arriving"]
        out["device_free"] = None
    return out


def room_shortfall(m: dict) -> str | None:
    """None when a move with move_memory() `m` fits (module docstring, step 1), else what does not."""
    from hybrid_opt.placement.scheduler import HEADROOM

    if m["device_free"] is not None and m["arriving"] > m["device_free"] + m["leaving"]:
        return (
            f"the subgroups moving to the device need {m['arriving'] / GB:.2f} GB of device "
            f"memory and {m['device_free'] / GB:.2f} GB is free (torch's cached blocks "
            f"included) plus {m['leaving'] / GB:.2f} GB the subgroups leaving it free"
        )
    if m["host_need"] > (1 - HEADROOM) * m["host_free"]:
        return (
            f"laying the tiers out again needs {m['host_need'] / GB:.2f} GB of host memory (the "
            f"state leaving the device copied out, the new host tier beside the old one) "
            f"and {m['host_free'] / GB:.2f} GB is free (less 10 %)"
        )
    return None


# ------------------------------------------------------------------ the move
def build_tiers(pl, plan) -> tuple:
    """Steps 1-3 of a move of Placement `pl` to `plan` (module docstring), with the committed
    state now; also lays out state the layout now needs and the old tiers lack (amsgrad's
    running max after load_state_dict turned it on): zeros. Returns (new host tier or None,
    the device tier of the arriving subgroups, the leaving subgroups) for the switch; a failure
    leaves the old tiers as they were."""
    leaving, arriving = _leaving_arriving(pl, plan)
    # 1. the leaving state copied out to host memory (a device tier's tensors are views
    # the tier owns; a copy on the device would need the room the move is making)
    saved = {
        s.index: {k: v.detach().to("cpu", copy=True) for k, v in pl.state_of(s).items()} for s in leaving
    }
    # 2. the new host tier beside the old one
    host = [s for s in pl.layout.subgroups if plan.tiers[s.index] != DEVICE]
    new_host = pl.make_host_tier(host, plan) if host else None
    try:
        for s in host:
            st = saved[s.index] if s.index in saved else pl.state_of(s)
            new_host.load_state(  # type: ignore[union-attr]  # host is not empty here: nor is new_host
                s.index,
                st["master"],
                st["exp_avg"],
                st["exp_avg_sq"],
                st.get("max_exp_avg_sq"),
                **absmaxes_of(st),
            )
    except BaseException:
        new_host.close()  # type: ignore[union-attr]  # as above
        raise
    # 3. the device tier: staying subgroups kept, arriving ones allocated
    try:
        extra = _device_arrivals(pl, arriving, leaving, saved)
    except BaseException as e:
        # the frames of the failed allocation hold what it allocated: let it go first
        traceback.clear_frames(e.__traceback__)
        if new_host is not None:
            new_host.close()
        raise
    return new_host, extra, leaving


def _device_arrivals(pl, arriving: list, leaving: list, saved: dict) -> DeviceTier:
    """The device tier of the arriving subgroups, filled from the old host tier (and the
    running max added where the layout now needs one). The leaving subgroups are let go
    first only when the arriving would not fit beside them; if the allocation fails after
    that, they are put back from `saved` before the error is raised."""
    from hybrid_opt.placement import scheduler

    dev, amsgrad, fmt = pl.device, pl.layout.amsgrad, pl.state_format
    gone = {s.index for s in leaving}
    released = []
    if pl.layout.cuda() and arriving and leaving:
        m = scheduler.cuda_memory(arriving[0].device)
        if pl.device_bytes(arriving) > scheduler.available_device_bytes(
            m["free"], m["reserved"], m["allocated"]
        ):
            for s in leaving:
                dev.drop(s.index, keep_subgroup=True)
                released.append(s)
    extra = None
    try:
        extra = DeviceTier(arriving, amsgrad, fmt)
        for s in arriving:
            st = pl.state_of(s)  # the old plan's host tier
            # fp32 master decoded there, encoded here: a remainder moves bitwise
            extra.set_master(s.index, st["master"])
            for k, t in extra.state[s.index].items():
                if k in st:
                    t.copy_(st[k])
        if amsgrad:
            for i, st in dev.state.items():
                if i not in gone and "max_exp_avg_sq" not in st:
                    extra.state[i] = dict(st, max_exp_avg_sq=torch.zeros_like(st["exp_avg_sq"]))
                    if "exp_avg_sq_absmax" in st:  # q8: zero codes (the unsigned map's 0) and absmaxes
                        extra.state[i]["max_exp_avg_sq_absmax"] = torch.zeros_like(st["exp_avg_sq_absmax"])
        return extra
    except BaseException as e:
        extra = None  # noqa: F841 - what it allocated goes before the leaving state comes back
        if released:
            traceback.clear_frames(e.__traceback__)
            back = DeviceTier(released, amsgrad, fmt)
            for s in released:
                back.set_master(s.index, saved[s.index]["master"])
                for k, t in back.state[s.index].items():
                    t.copy_(saved[s.index][k])
            dev.absorb(back)
        raise
