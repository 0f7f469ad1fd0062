"""The parts an optimizer is composed of (docs/code-map.md), and their wiring: each part owns
its state and talks to the others through their public methods; what a change of the tiers
asks of the other parts (placement.TierEvents) is wired here, between the parts — never back
to the optimizer, so an optimizer nothing else holds is freed (and closed) at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybrid_opt.distributed.local_shards import local_of
from hybrid_opt.placement.cost_model import DEFAULT_SUBGROUP_NUMEL
from hybrid_opt.placement.placement import Placement, TierEvents, restated
from hybrid_opt.seams import Sharding
from hybrid_opt.speculation import SpeculationConfig, Speculator, speculates
from hybrid_opt.state import layout as L
from hybrid_opt.state.ledger import StepLedger
from hybrid_opt.state.storage import ParamGuard
from hybrid_opt.step_failures import StepChecks
from hybrid_opt.step_stats import StepStats


class Parts(NamedTuple):
    """What an optimizer is composed of; each part owns its state."""

    layout: L.Layout  # subgroups, the param index, per-param step counts
    placement: Placement  # the plan, the tiers, "auto"'s planner, moves
    speculator: Speculator  # grad hooks and speculative host steps during backward
    guard: ParamGuard  # replaced and written params
    checks: StepChecks  # input a tier would refuse part-way
    ledger: StepLedger  # steps taken, scale, norm, skip, rank failure, torch's state
    stats: StepStats  # `stats`, the clock, "auto"'s samples
    sharding: Sharding  # zero.ZeroSharding (process_group=), or sharding.NoSharding

    def install_hooks(self, host: list) -> None:
        """Speculation's grad hooks on the host subgroups `host`, and "auto"'s timing hooks."""
        timing = self.stats.time_backward if self.placement.auto is not None else None
        self.speculator.install(host, timing)

    def zero_grad(self, set_to_none: bool) -> None:
        """The optimizer's zero_grad, after torch's: speculation's ready grads dropped, an
        attached GradScaler's scale copied ahead for the hooks, and the sharding told
        (release_grads keeps the released grads as zeros: zero_release.py)."""
        self.speculator.forget_ready()
        self.speculator.prefetch_scale()
        self.sharding.zero_grad(set_to_none)


def compose(
    param_groups: list,
    *,
    owner: str,
    decoupled: bool,
    state_format,
    placement_config,
    max_grad_norm,
    sharding: Sharding,
    subgroup_numel,
) -> Parts:
    """The parts of an optimizer over `param_groups`, wired: every param group and the tiers laid
    out (the Placement lays the tiers out as it is made), no hooks yet (build())."""
    if subgroup_numel is None:  # automatic: >= 8 subgroups on this rank where it can (layout.py)
        subgroup_numel = L.auto_subgroup_numel(
            sum(local_of(p).numel() for g in param_groups for p in g["params"]), DEFAULT_SUBGROUP_NUMEL
        )
    layout = L.Layout(
        param_groups,
        subgroup_numel,
        any(g["amsgrad"] for g in param_groups),
        quantize=state_format.quantized_moments,
    )
    ledger = StepLedger(layout)
    stats = StepStats(layout, state_format)
    devices = {p.device for p in layout.params()}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    # speculative="auto" becomes True or False here, once the params' device is known
    device = next(iter(devices), torch.device("cpu"))
    c = placement_config._replace(
        speculative=speculates(placement_config.speculative, device, placement_config.worker_share)
    )
    firsts = []  # per param group: the index of its first param in the layout
    for gi in range(len(layout.param_groups)):
        firsts.append(len(layout.steps))
        layout.add_group(gi)

    # the callbacks below name parts made after them (spec, guard, parts): closures, bound at call
    spec: Speculator
    guard: ParamGuard
    parts: Parts

    def laid_out() -> None:  # a move wrote the params (versions) and made a new host tier (its times)
        stats.new_host_tier()
        guard.record()

    placement = Placement(
        layout,
        c,
        state_format,
        TierEvents(
            lambda: spec.drop(), sharding.wait_gathered, lambda host: parts.install_hooks(host), laid_out
        ),
    )
    spec = Speculator(
        layout,
        placement,
        ledger,
        SpeculationConfig(c.speculative, c.rollback, max_grad_norm is not None, decoupled),
        sharding,
    )
    guard = ParamGuard(
        layout, placement, state_format, owner, spec.drop, lambda host: parts.install_hooks(host)
    )
    checks = StepChecks(layout, placement, owner, decoupled)
    for first, group in zip(firsts, layout.param_groups):
        guard.remember(first, group["params"])  # step() checks the params keep it
    parts = Parts(layout, placement, spec, guard, checks, ledger, stats, sharding)
    return parts


def build(parts: Parts) -> None:
    """The end of construction: the hooks on the host subgroups, the params' versions recorded."""
    parts.install_hooks(parts.placement.host_subgroups())
    parts.guard.record()  # with remainders the host tier writes the params' high halves


def extend(parts: Parts, gi: int) -> None:
    """add_param_group after construction: group `gi` (the last) laid out and placed
    (Placement.extend). A failure there (the new group's device state cannot be allocated,
    ...) takes the group out of `param_groups` again — the layout, the tiers and the scheduler
    as before the call — and says so; only the new params keep memory of their own."""
    layout, placement = parts.layout, parts.placement
    before = placement.extension_point()
    try:
        sgs = layout.add_group(gi)
        parts.guard.remember(before.params, layout.param_groups[gi]["params"])
        placement.extend(sgs)
    except BaseException as e:
        if placement.plan is not before.plan:
            raise  # interrupted after the move switched over: the group is laid out
        placement.unextend(before)
        layout.drop_group(gi, before.params, before.subgroups)
        del layout.param_groups[gi]
        parts.guard.forget(before.params)
        parts.install_hooks(placement.host_subgroups())
        if not isinstance(e, Exception):
            raise
        raise restated(
            e,
            f"add_param_group: laying out the new group failed, so it was not "
            f"added (param_groups, the optimizer's state and its tiers are as "
            f"before the call, and training goes on): {type(e).__name__}: {e}. "
            f"Fix the cause and add the group again",
        ) from e
