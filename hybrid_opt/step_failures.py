"""A step that fails: its inputs refused before anything changes (`StepChecks`, an optimizer
part), and the accounting of a failure part-way (`failure_of`, from the step's plan and outcome).
Invariant: after a failed step() each parameter is stepped (all its elements, its count
advanced), untouched (state and count as before), or named torn in the error; with nothing
stepped, calling step() again continues bitwise. The cases: docs/internals.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hybrid_opt import distributed as D
from hybrid_opt.distributed import rank_faults as RF
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.step_work import group_inputs

if TYPE_CHECKING:
    from hybrid_opt.step_plan import StepOutcome, StepPlan

_CPU = torch.device("cpu")
NOTHING_STEPPED = (
    "Nothing was stepped (state and step counts are the previous step's): fix the "
    "cause and call step() again."
)


class StepChecks:
    """Refuses, before anything changes, what a tier would fail on part-way (module docstring)."""

    def __init__(self, layout, placement, owner: str, decoupled: bool):
        self.layout = layout
        self.placement = placement
        self.owner = owner  # the optimizer's class name, for messages
        self.decoupled = decoupled
        self._cache: tuple | None = (
            None  # (plan, its tiers, params, {on device}, {off it}, {sharded}) of the layout now
        )

    def check_inputs(self, torch_state) -> list:
        """Before the ranks' decision; returns each param group's hyperparameters as the tiers
        take them (step_work.group_inputs), checked. A param sharded by FSDP2 / process_group
        has its grad checked by `device_scale_error` instead (its local grad is known only
        after the reductions). `torch_state`: the optimizer's `state` (the step counts' mirror)."""
        steps = self.layout.steps
        if len(torch_state) < len(steps) - steps.count(0):
            self._state_lost(torch_state)
        cls = self.owner
        device_tier = self.placement.device
        on_device, off_device, sharded = self._layout_sets()
        subgroups = self.layout.subgroups
        device = subgroups[0].device if subgroups else None
        i, hps = 0, []
        laid_out = self.layout.laid_out
        for gi, group in enumerate(self.layout.param_groups):
            live_off_device = live_on_device = False
            for p in group["params"]:
                if i >= len(laid_out) or p is not laid_out[i]:
                    self._params_edited(gi, i)
                g = p.grad
                if g is not None:
                    if g.is_sparse:
                        raise RuntimeError(f"{cls} does not support sparse gradients")
                    if i not in sharded:
                        if g.numel() != p.numel():
                            self._refuse_grad(
                                i,
                                f"has shape {tuple(g.shape)} ({g.numel()} elements) "
                                f"but the parameter has {tuple(p.shape)} ({p.numel()}): "
                                f"give it a grad of its own shape",
                                ValueError,
                            )
                        # the usual grad (the param's dtype and device) needs no more checks
                        if i in on_device and (g.dtype is not p.dtype or g.get_device() != p.get_device()):
                            self._refuse_grad(i, device_tier.refuse_grad(g, p), TypeError)
                    live_on_device = live_on_device or i in on_device
                    live_off_device = live_off_device or i in off_device
                i += 1
            hp = group_inputs(
                group, self.decoupled
            )  # a Tensor lr of several elements raises here, not mid-step
            hps.append(hp)
            # the host tier's CPU kernel takes what the device tier's kernels refuse (a NaN lr
            # set after construction): refused alike, wherever the group's live params are
            for tier, on, dev in (("device", live_on_device, device), ("host", live_off_device, _CPU)):
                why = device_tier.refuse_hyper(hp, dev) if on else None
                if why is not None:
                    raise ValueError(
                        f"{cls}.step(): param group {gi}: {why} (the {tier} tier's "
                        f"kernel refuses it). {NOTHING_STEPPED}"
                    )
        if i != len(laid_out):  # params removed (or every group: param_groups.clear())
            self._params_edited(max(len(self.layout.param_groups) - 1, 0), i)
        return hps

    def _state_lost(self, torch_state) -> None:
        """`opt.state` lost stepped params' entries (cleared, replaced, `del opt.state[p]`):
        torch restarts their moments then; here they stay in the tiers, and a step would
        silently keep them."""
        steps = self.layout.steps
        lost = [
            i for i, p in enumerate(self.layout.laid_out) if steps[i] and "step" not in torch_state.get(p, {})
        ]
        if lost:
            raise ValueError(
                f"{self.owner}.step(): opt.state lost the entries of stepped parameters "
                f"{lost} (cleared, replaced or deleted). torch restarts their moments then; "
                f"this optimizer keeps them in its tiers (opt.state mirrors the step "
                f"counts only). To restart them: sd = opt.state_dict(), delete their "
                f"entries from sd['state'] (sd['state'].clear() for all), "
                f"opt.load_state_dict(sd). To keep them: opt.load_state_dict("
                f"opt.state_dict()). {NOTHING_STEPPED}"
            )

    def _params_edited(self, gi: int, i: int) -> None:
        """param_groups[gi]["params"] no longer holds the params laid out (parameter i is
        another, or there are more or fewer): torch steps what the list holds now, this
        optimizer's state belongs to the params it laid out when they joined."""
        raise ValueError(
            f"{self.owner}.step(): param_groups[{gi}]['params'] was edited after the "
            f"params joined the optimizer (parameter {i} is not the one laid out "
            f"there, or params were added or removed): this optimizer lays out each "
            f"param's state when it joins. Add params with add_param_group(), or "
            f"build a new optimizer for another set of params; put the list back "
            f"to step this one. {NOTHING_STEPPED}"
        )

    def _layout_sets(self) -> tuple:
        """({params with a slice on the device tier}, {... on the host or nvme tier}, {sharded
        params}) for the layout now, made again only when the layout changed (a move,
        add_param_group)."""
        plan, n = self.placement.plan, len(self.layout.steps)
        cache = self._cache
        if cache is None or cache[0] is not plan or cache[1] != plan.tiers or cache[2] != n:
            on: set[int] = set()
            off: set[int] = set()
            for sg in self.layout.subgroups:
                (on if plan.tiers[sg.index] == DEVICE else off).update(sl.param_index for sl in sg.slices)
            sharded = {i for i, p in enumerate(self.layout.params()) if D.is_sharded(p)}
            cache = self._cache = (plan, list(plan.tiers), n, on, off, sharded)
        return cache[3], cache[4], cache[5]

    def _refuse_grad(self, i: int, why: str | None, kind: type) -> None:
        if why is not None:
            raise kind(f"{self.owner}.step(): {self.layout.param_label(i)}'s grad {why}. {NOTHING_STEPPED}")

    def device_scale_error(self, device_work: list, scale: float) -> str | None:
        """After the decision: the combined grad scale, and the grads of sharded params, as
        the device tier's kernel would refuse them (None: nothing refused)."""
        if not device_work:
            return None
        device_tier = self.placement.device
        device = self.layout.subgroups[device_work[0].index].device
        why = device_tier.refuse_scale(scale, device)
        for sl in (w.slice for w in device_work) if why is None else ():
            if not D.is_sharded(sl.param):
                continue
            g, p = D.local_of(sl.param.grad), D.local_of(sl.param)
            if g.numel() != p.numel():
                why = f"its local grad has {g.numel()} elements, its local shard {p.numel()}"
            why = why or device_tier.refuse_grad(g, p)
            if why is not None:
                return f"{self.layout.param_label(sl.param_index)}'s grad {why}"
        return why


class Failure(NamedTuple):
    """What a failed step left (module docstring): the params untouched (their counts go back),
    and whether nothing at all was stepped."""

    untouched: list
    nothing_stepped: bool
    error: Exception
    others_stepped: bool  # other ranks took the step: this one is out of step with them


def failure_of(
    owner: str, plan: StepPlan, outcome: StepOutcome, e: BaseException, where: str | None, unreadable=None
) -> Failure:
    """The accounting of a step that failed with `e` (module docstring), and the error to
    raise, explained: what the plan gave the tiers against what they did (`outcome`: the host
    subgroups committed, the device tier's work positions written / maybe written, the host
    subgroups whose in-place steps (rollback="inverse") were cut short: their params may be
    torn, and count as stepped — their counts advance; only a checkpoint restores them).
    where: the failing tier, None for input refused. unreadable: () -> the subgroups and params
    whose committed nvme slot no longer reads back (a label, or None), asked only when nothing
    was stepped: then stepping again would fail the same way."""
    host_work, device_work = plan.host_work, plan.device_work
    committed, cut = outcome.committed, outcome.torn
    total: dict = {}
    stepped: dict = {}
    cut_params = set()
    for w in host_work.values():
        for sl in w.live:
            total[sl.param_index] = total.get(sl.param_index, 0) + 1
            stepped[sl.param_index] = stepped.get(sl.param_index, 0) + (w.sg.index in committed)
            if w.sg.index in cut:
                cut_params.add(sl.param_index)
    for d in device_work:
        total[d.slice.param_index] = total.get(d.slice.param_index, 0) + 1
    for k in outcome.device_done:
        idx = device_work[k].slice.param_index
        stepped[idx] = stepped.get(idx, 0) + 1
    maybe = {device_work[k].slice.param_index for k in outcome.device_unsure}
    unsure_params = maybe | cut_params  # maybe written: neither whole nor untouched
    whole = sorted(i for i, n in total.items() if stepped.get(i, 0) == n and i not in unsure_params)
    torn = sorted(
        i
        for i, n in total.items()
        if (0 < stepped.get(i, 0) < n or i in maybe) and i not in whole and i not in cut_params
    )
    # untouched: its count as before the call; with nothing stepped (an empty param, no
    # subgroup, too) every count and the step's scalars
    untouched = [i for i in total if not stepped.get(i, 0) and i not in unsure_params]
    nothing = not whole and not torn and not cut_params
    bad = unreadable() if nothing and where is not None and unreadable is not None else None
    if bad:
        what = (
            f"Nothing was stepped (state and step counts are the previous step's), but the "
            f"committed state of {bad} no longer reads back from its nvme file, so step() would "
            f"fail the same way: load a checkpoint with load_state_dict() (it rewrites those "
            f"files without reading them), then step again."
        )
    elif nothing:
        what = NOTHING_STEPPED
    else:
        what = (
            "The step was partly applied: "
            + (f"parameters {whole} were stepped (their step counts advanced), " if whole else "")
            + (f"parameters {torn} only in part (torn), " if torn else "")
            + (
                f"parameters {sorted(cut_params)} may be torn (their in-place steps were cut "
                f"short; their step counts advanced), "
                if cut_params
                else ""
            )
            + "the others not (state and step counts as before). Reload a checkpoint: "
            "stepping again would step the stepped ones twice."
        )
    world = D.world_size()
    notes = RF.OUT_OF_STEP_NOTE * (world > 1) + RF.ZERO_PARAMS_NOTE * plan.sharded
    err: Exception
    if where is None:  # refused input (after the decision: the other ranks stepped)
        err = ValueError(f"{owner}.step(): {e}. {what}{notes}")
    else:
        err = RuntimeError(f"{owner}.step() failed in {where}: {e}\n{what}{notes}")
    return Failure(untouched, nothing, err, world > 1)
