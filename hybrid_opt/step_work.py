"""The work of one step, as named records: what step() hands the tiers and what a failed step's
bookkeeping reads back (step_failures.py), instead of tuples unpacked by position."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hybrid_opt.tiers.inputs import AdamInputs

if TYPE_CHECKING:
    from hybrid_opt.state.layout import ParamSlice, Subgroup


class HostWork(NamedTuple):
    """A host or nvme subgroup's share of the step: the subgroup (layout.Subgroup), its slices
    whose params have a grad, and its param group's hyperparameters (tiers.inputs.AdamInputs)."""

    sg: Subgroup
    live: list
    hp: AdamInputs


class DeviceWork(NamedTuple):
    """One param slice the device tier steps: its subgroup's index, the slice (layout.ParamSlice),
    its group's hyperparameters and the param's step count."""

    # a field named as tuple's index() method (mypy: an override of another type); the name is
    # what stepping and step_failures read
    index: int  # type: ignore[assignment]
    slice: ParamSlice
    hp: AdamInputs
    step: int


def _float_hyper(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value.item())
    return float(value)


def group_inputs(group: dict, decoupled: bool, grad_sign: float | None = None) -> AdamInputs:
    """A param group's hyperparameters as the tiers take them (step and grads left out);
    grad_sign: -1 for a maximizing group (its default), else 1; `decoupled`: the optimizer's,
    where the group does not say (its "decoupled_weight_decay", as torch's Adam reads it)."""
    if grad_sign is None:
        grad_sign = -1.0 if group["maximize"] else 1.0
    b1, b2 = group["betas"]
    return AdamInputs(
        0,
        _float_hyper(group["lr"], "lr"),
        _float_hyper(b1, "betas[0]"),
        _float_hyper(b2, "betas[1]"),
        float(group["eps"]),
        float(group["weight_decay"]),
        bool(group.get("decoupled_weight_decay", decoupled)),
        grad_sign,
        (),
        bool(group["amsgrad"]),
    )
