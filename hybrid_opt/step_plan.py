"""The step as data: what step() was called with (`StepInputs`), what it decided once for every
subgroup (`StepPlan`), and what the tiers did with that (`StepOutcome`). All three are
immutable: stepping.py reads the inputs once, decides once, lets the tiers execute the plan,
and hands the plan and the outcome to the stats and, on a failure, to the accounting
(step_failures.failure_of). Subgroups are named by their layout index everywhere here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from hybrid_opt.step_work import DeviceWork, HostWork

# what a plan does with the whole step
TAKE = "take"  # the tiers step the subgroups below
SKIP = "skip"  # GradScaler found inf/nan: nothing steps, every speculation is dropped
STATE_INIT = "state_init"  # torch.distributed.checkpoint's lr-0 step: the counts advance only

# what a plan does with one host subgroup
VALIDATE = "validate"  # a speculation is pending: committed if it holds, redone if not
STEP = "step"  # no speculation: stepped now


@dataclass(frozen=True)
class StepInputs:
    """What one step() is called with: the optimizer's settings, torch's `state` mirror and
    GradScaler's protocol values (set on the optimizer for the call: `found_inf`, `grad_scale`)."""

    owner: str  # the class name errors speak of
    decoupled: bool  # AdamW's decoupled weight decay (Adam's L2 otherwise)
    max_grad_norm: float | None  # None: no clipping
    overlap: bool  # overlap_param_gather
    torch_state: Any  # the optimizer's `state` (a defaultdict keyed by param)
    found_inf: Any  # GradScaler's tensor, or None
    grad_scale: Any  # GradScaler's tensor, or None
    key: int  # id(optimizer): GradScaler's per-optimizer state
    # GradScaler.step handed found_inf without grad_scale: the user's unscale_ rewrote every grad
    # in place after backward, which bumps no version, so every speculation is stale
    unscaled: bool = False

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm is not None


@dataclass(frozen=True)
class StepPlan:
    """The step decided, once, for all ranks: whether it is taken, the global grad norm, the clip
    coefficient and the loss scale, and for every subgroup with a grad the tier's work — the
    device tier's slices, and per host/nvme subgroup whether a pending speculation is validated
    or the subgroup is stepped now. `world` and `sharded` say what a failure must tell the user."""

    kind: str  # TAKE, SKIP or STATE_INIT
    world: int = 1
    sharded: bool = False
    norm: float | None = None  # the global grad norm, unscaled (None without clipping)
    clip: float = 1.0  # the clip coefficient (<= 1; NaN stays NaN, as torch's)
    inv_scale: float = 1.0  # 1 / the loss scale (1.0 without a GradScaler)
    scaled: bool = False  # a GradScaler's loss scale was handed in
    device_work: tuple[DeviceWork, ...] = ()
    host_work: Mapping[int, HostWork] = field(default_factory=lambda: MappingProxyType({}))
    host_actions: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    edited: tuple = ()  # the DTensor grad-edit flags read with the step's scalars (grad_edits.py)

    @property
    def scale(self) -> float:
        """What every grad is multiplied by: the loss scale's inverse times the clip coefficient."""
        return self.inv_scale * self.clip

    @property
    def taken(self) -> bool:
        return self.kind == TAKE


@dataclass(frozen=True)
class StepOutcome:
    """What the tiers did with a plan, as far as they got: each host subgroup's result
    ("committed", "redone", "stepped"; "dropped" for a speculation no step wanted), the host
    subgroups whose new params reached the model, the device tier's work positions written and
    maybe written, and the host subgroups that in-place steps cut short may have torn."""

    host: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    committed: frozenset[int] = frozenset()
    device_done: tuple[int, ...] = ()
    device_unsure: tuple[int, ...] = ()
    torn: frozenset[int] = frozenset()
    # perf_counter at step() entered, host step started, device step started, the end; and the
    # device clock's marks around the device step (None without "auto")
    times: tuple = ()
    device_marks: tuple = (None, None)
