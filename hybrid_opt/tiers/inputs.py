"""What a host step is given: `AdamInputs`, everything its result depends on besides the
state and the grads' values (imported from `hybrid_opt.tiers.host` too)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AdamInputs:
    """Everything a step's result depends on besides the state and the grads' values.

    grad_version identifies the grads (their tensors' `_version`), so a grad modified after
    it was staged makes a speculated step stale.
    """

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool = True
    grad_scale: float = 1.0
    grad_version: tuple = ()
    amsgrad: bool = False
    # (offset, numel, step) ranges to step, each with its own step count; empty = the whole
    # subgroup at `step`. Elements outside every range keep their state (params that got no
    # grad this iteration are not touched, as in torch).
    runs: tuple = ()

    def ranges(self, numel: int) -> tuple:
        return self.runs or ((0, numel, self.step),)


def _with_step(inputs: AdamInputs, step: int) -> AdamInputs:
    return replace(inputs, step=step, runs=())
