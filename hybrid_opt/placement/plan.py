"""Placement: which tier steps each subgroup, from the offload and nvme fractions.

Subgroups whose grads are complete earliest in backward go to the host tiers, so their
steps can hide under the rest of backward; those ready last stay on the device. Of the
host share, the earliest-ready go to nvme (their I/O has the most time to hide).
Fractions are shares of all elements, so the plan is the same whatever the subgroup size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybrid_opt.placement.cost_model import Prediction

DEVICE, HOST, NVME = "device", "host", "nvme"
DEFAULT_SPARE_BANKS = 4


@dataclass
class Plan:
    tiers: list  # tier name per subgroup index
    numels: list
    speculation_order: list = field(default_factory=list)  # host/nvme subgroups, ready order
    spare_banks: int = 0
    # the spare banks handed out from the start (None: all); the others stay dormant, costing
    # no memory, until speculation shows backward could fill them (HostStepping.finish)
    spares_awake: int | None = None
    prediction: Prediction | None = None  # when the scheduler chose the plan
    reason: str = ""  # why the scheduler chose it
    shard: str = ""  # under FSDP2 / process_group: whose share this plan lays out

    def subgroups(self, tier: str) -> list:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    def elements(self, tier: str) -> int:
        return sum(n for n, t in zip(self.numels, self.tiers) if t == tier)

    def summary(self) -> dict:
        total = sum(self.numels) or 1
        return {
            t: {
                "subgroups": len(self.subgroups(t)),
                "elements": self.elements(t),
                "share": self.elements(t) / total,
            }
            for t in (DEVICE, HOST, NVME)
        }

    def __repr__(self) -> str:
        parts = [f"{t}: {v['subgroups']} subgroups, {v['share']:.0%}" for t, v in self.summary().items()]
        if self.prediction is not None:
            p = self.prediction
            parts.append(
                f"predicted step {p.step_seconds * 1e3:.1f} ms, iteration "
                f"{p.iteration_seconds * 1e3:.1f} ms ({self.reason})"
            )
        return f"Plan({'; '.join(([self.shard] if self.shard else []) + parts)})"


def _check_fraction(name: str, value, auto: bool = False):
    if auto and value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f'{name} must be a number in [0, 1] or "auto", got {value!r}')
    return float(value)


def check_fractions(offload_fraction, nvme_fraction) -> tuple:
    """The constructor's check: numbers in [0, 1] or "auto", nvme not above offload."""
    off = _check_fraction("offload_fraction", offload_fraction, auto=True)
    nv = _check_fraction("nvme_fraction", nvme_fraction, auto=True)
    if "auto" not in (off, nv) and nv > off:
        raise ValueError(
            f"nvme_fraction ({nv}) must not exceed offload_fraction ({off}): nvme "
            f"subgroups are part of the offloaded share"
        )
    return off, nv


def fraction_plan(
    numels: list, ready_ranks: list, offload_fraction, nvme_fraction, spare_banks: int | None = None
) -> Plan:
    """Host tiers take the earliest-ready subgroups until `offload_fraction` of all elements
    is off the device (nearest subgroup boundary); nvme the first `nvme_fraction` of them."""
    off = _check_fraction("offload_fraction", offload_fraction)
    nv = _check_fraction("nvme_fraction", nvme_fraction)
    if nv > off:
        raise ValueError(
            f"nvme_fraction ({nv}) must not exceed offload_fraction ({off}): nvme "
            f"subgroups are part of the offloaded share"
        )
    total = sum(numels)
    order = sorted(range(len(numels)), key=lambda i: ready_ranks[i])
    tiers = [DEVICE] * len(numels)
    placed = 0
    for i in order:
        # a subgroup goes off the device while that brings the share closer to the target
        if abs(placed + numels[i] - off * total) <= abs(placed - off * total) and off > 0:
            tiers[i] = NVME if placed + numels[i] / 2 <= nv * total and nv > 0 else HOST
            placed += numels[i]
        else:
            break
    if off == 1.0:
        tiers = [NVME if t == NVME else HOST for t in tiers]
    spec = [i for i in order if tiers[i] != DEVICE]
    n_host = sum(1 for t in tiers if t != DEVICE)
    if spare_banks is None:
        # a few spares keep the worker busy after backward; each costs a subgroup's state,
        # so the default stays small (the scheduler sizes it from the memory budget)
        spare_banks = DEFAULT_SPARE_BANKS
    return Plan(tiers, list(numels), spec, max(1, min(spare_banks, n_host)))


MISS_SHARE = 0.05  # the realised placement may differ from the request by this share of elements


def fraction_miss(plan: Plan, offload_fraction: float, nvme_fraction: float, subgroup_numel: int):
    """Why `plan` (placed by whole subgroups) misses the fractions asked for, or None: more
    than MISS_SHARE of the elements off from the request, or a tier asked for a non-zero share
    that got nothing. fraction_plan rounds to the nearest subgroup, so "one subgroup off"
    would never say anything for a model of few subgroups: the threshold is in elements."""
    total = sum(plan.numels)
    if not total:
        return None
    off = (plan.elements(HOST) + plan.elements(NVME)) / total
    nv = plan.elements(NVME) / total
    asked = {DEVICE: 1.0 - offload_fraction, HOST: offload_fraction - nvme_fraction, NVME: nvme_fraction}
    empty = [t for t, share in asked.items() if share > 0 and plan.elements(t) == 0]
    if not empty and abs(off - offload_fraction) <= MISS_SHARE and abs(nv - nvme_fraction) <= MISS_SHARE:
        return None
    n = len(plan.numels)
    # a power of two no larger than half the smallest share asked for (so whole subgroups can
    # come within half a subgroup of it) and than total / 8 (about 8 subgroups or more), and
    # smaller than today's: subgroups of uneven size (cut at param ends) can miss at that size too
    smallest = min(share for share in asked.values() if share > 0)
    finer = max(1, int(min(total / 8, smallest * total / 2)))
    finer = min(1 << (finer.bit_length() - 1), 1 << max(0, (subgroup_numel - 1).bit_length() - 1))
    return (
        f"offload_fraction={offload_fraction:g}, nvme_fraction={nvme_fraction:g} asked for "
        f"{offload_fraction:.0%} of the elements off the device ({nvme_fraction:.0%} on nvme), but "
        f"a subgroup is placed whole and the {total:,} elements make {n} subgroup"
        f"{'s' if n != 1 else ''} at subgroup_numel={subgroup_numel:,}: the plan has "
        f"{off:.0%} off the device ({nv:.0%} on nvme)"
        + (f", and nothing on the {' or '.join(empty)} tier" if empty else "")
        + f". For a placement closer to the fractions pass a smaller subgroup_numel "
        f"(e.g. subgroup_numel={finer:,}); opt.plan shows the placement"
    )
