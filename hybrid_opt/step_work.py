"""The work of one step, as named records: what step() hands the tiers and what a failed step's
bookkeeping reads back (step_failures.py), instead of tuples unpacked by position."""
from __future__ import annotations

from typing import NamedTuple


class HostWork(NamedTuple):
    """A host or nvme subgroup's share of the step: the subgroup (layout.Subgroup), its slices
    whose params have a grad, and its param group's hyperparameters (tiers.inputs.StepInputs)."""
    sg: object
    live: list
    hp: object


class DeviceWork(NamedTuple):
    """One param slice the device tier steps: its subgroup's index, the slice (layout.ParamSlice),
    its group's hyperparameters and the param's step count."""
    index: int
    slice: object
    hp: object
    step: int
