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
COMMIT = "commit"  # its speculation stepped with the final inputs: committed (redone if it failed)
REDO = "redo"  # its speculation's inputs are not the final ones: dropped, stepped again
STEP = "step"  # no speculation: stepped now


def _empty() -> Mapping:
    return MappingProxyType({})


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


@dataclass(frozen=True)
class StepStart:
    """What step() finds before it decides: this rank's failure so far (where the ranks'
    decision all_reduce runs it joins it flagged, so every rank raises at this step together),
    whether that decision runs, each param group's hyperparameters (None where the checks
    refused them), and the grad-edit checks of speculated DTensor grads (grad_edits.py)."""

    failure: BaseException | None
    decides: bool
    groups: list | None
    edit_checks: tuple = ()


@dataclass(frozen=True)
class StepPlan:
    """The step decided, once, for all ranks: whether it is taken, the global grad norm, the clip
    coefficient and the loss scale, and for every subgroup with a grad the tier's work — the
    device tier's slices; per host/nvme subgroup its final inputs and whether its speculation
    is committed, redone, or it is stepped now. `sharded` says what a failure must tell the
    user."""

    kind: str  # TAKE, SKIP or STATE_INIT
    sharded: bool = False  # process_group / FSDP2: the params are shards
    norm: float | None = None  # the global grad norm, unscaled (None without clipping)
    clip: float = 1.0  # the clip coefficient (<= 1; NaN stays NaN, as torch's)
    inv_scale: float = 1.0  # 1 / the loss scale (1.0 without a GradScaler)
    scaled: bool = False  # a GradScaler's loss scale was handed in
    scale: float = 1.0  # what every grad is multiplied by: inv_scale * clip
    device_work: tuple[DeviceWork, ...] = ()
    host_work: Mapping[int, HostWork] = field(default_factory=_empty)  # subgroup index -> its work
    host_steps: Mapping = field(default_factory=_empty)  # the host tier's: (GradGatherer, final inputs)
    host_actions: Mapping[int, str] = field(default_factory=_empty)  # subgroup index -> COMMIT | REDO | STEP
    # deciding the host work failed (the worker, asked for a DTensor grad's staged sums): the
    # step fails in the host tier as it begins, accounted as any host failure
    host_error: BaseException | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What the tiers did with a plan, as far as they got: each host subgroup's result
    ("committed", "redone", "stepped"; "dropped" for a speculation no step wanted), the host
    subgroups whose new params reached the model, the device tier's work positions written and
    maybe written, and the host subgroups that in-place steps cut short may have torn."""

    host: Mapping[int, str] = field(default_factory=_empty)
    committed: frozenset[int] = frozenset()
    device_done: tuple[int, ...] = ()
    device_unsure: tuple[int, ...] = ()
    torn: frozenset[int] = frozenset()
    # perf_counter at step() entered, host step started, device step started, the end; and the
    # device clock's marks around the device step (None without "auto")
    times: tuple = ()
    device_marks: tuple = (None, None)
