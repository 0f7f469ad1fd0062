"""Placement: which tier steps each subgroup, from the offload and nvme fractions.

Subgroups whose grads are complete earliest in backward go to the host tiers, so their
steps can hide under the rest of backward; those ready last stay on the device. Of the
host share, the earliest-ready go to nvme (their I/O has the most time to hide).
Fractions are shares of all elements, so the plan is the same whatever the subgroup size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEVICE, HOST, NVME = "device", "host", "nvme"
DEFAULT_SPARE_BANKS = 4


@dataclass
class Plan:
    tiers: list                      # tier name per subgroup index
    numels: list
    speculation_order: list = field(default_factory=list)  # host/nvme subgroups, ready order
    spare_banks: int = 0
    prediction: object = None        # cost_model.Prediction when the scheduler chose the plan
    reason: str = ""                 # why the scheduler chose it
    shard: str = ""                  # under FSDP2 / process_group: whose share this plan lays out

    def subgroups(self, tier: str) -> list:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    def elements(self, tier: str) -> int:
        return sum(n for n, t in zip(self.numels, self.tiers) if t == tier)

    def summary(self) -> dict:
        total = sum(self.numels) or 1
        return {t: {"subgroups": len(self.subgroups(t)), "elements": self.elements(t),
                    "share": self.elements(t) / total} for t in (DEVICE, HOST, NVME)}

    def __repr__(self) -> str:
        parts = [f"{t}: {v['subgroups']} subgroups, {v['share']:.0%}" for t, v in self.summary().items()]
        if self.prediction is not None:
            p = self.prediction
            parts.append(f"predicted step {p.step_seconds * 1e3:.1f} ms, iteration "
                         f"{p.iteration_seconds * 1e3:.1f} ms ({self.reason})")
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
        raise ValueError(f"nvme_fraction ({nv}) must not exceed offload_fraction ({off}): nvme "
                         f"subgroups are part of the offloaded share")
    return off, nv


def fraction_plan(numels: list, ready_ranks: list, offload_fraction, nvme_fraction,
                  spare_banks: int | None = None) -> Plan:
    """Host tiers take the earliest-ready subgroups until `offload_fraction` of all elements
    is off the device (nearest subgroup boundary); nvme the first `nvme_fraction` of them."""
    off = _check_fraction("offload_fraction", offload_fraction)
    nv = _check_fraction("nvme_fraction", nvme_fraction)
    if nv > off:
        raise ValueError(f"nvme_fraction ({nv}) must not exceed offload_fraction ({off}): nvme "
                         f"subgroups are part of the offloaded share")
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
