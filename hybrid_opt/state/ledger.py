"""The step ledger: what the steps so far leave beside the tiers — how many were taken, the
last loss scale and grad norm, whether the last was skipped, a failure that puts this rank
out of step with the others (rank_faults.py), and torch's `state` mirror of the per-param
step counts — and the undo of a step that fails with nothing stepped (step_failures.py).

The per-param step counts themselves are the layout's (layout.Layout.steps): the ledger
advances them, puts them back, and mirrors them into torch's `state`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from hybrid_opt.step_plan import StepPlan


class StepUndo(NamedTuple):
    """What step() changes before the tiers step, to put back when nothing was stepped."""

    steps: list
    steps_taken: int
    last_inv_scale: float
    last_grad_norm: float | None
    last_clipped: bool
    step_was_skipped: bool


class StepLedger:
    """The scalars and counts of the steps taken (module docstring)."""

    def __init__(self, layout):
        self.layout = layout
        self.steps_taken = 0  # training steps taken (speculation's warm-up, refits)
        self.last_inv_scale = 1.0  # the last step's 1 / loss scale: what speculation assumes
        self.last_grad_norm = None
        self.last_clipped = False  # the last step's clip coefficient was below 1 (clipping bit)
        self.step_was_skipped = False
        self.amp_seen = False  # a GradScaler has handed a step found_inf
        self.rank_failure = None  # a step that failed after the ranks' decision (rank_faults.py)
        self._step_counts = None  # the buffer torch's `state[p]["step"]` tensors view
        self._stepped_params = None
        self._undo: StepUndo | None = None  # what puts back the step begun last

    # ------------------------------------------------------------------ a step
    def saw_amp(self, found_inf) -> None:
        self.amp_seen = self.amp_seen or found_inf is not None

    def skipped(self) -> None:
        """An overflow skipped the whole step, as torch does."""
        self.step_was_skipped = True

    def begin(self, torch_state, plan: StepPlan) -> None:
        """A step is taken (`plan`: its loss scale, norm and clip coefficient): its scalars
        recorded and the step counts of the params with a grad advanced; what puts it back is
        kept until the next step begins (put_back)."""
        self._undo = StepUndo(
            list(self.layout.steps),
            self.steps_taken,
            self.last_inv_scale,
            self.last_grad_norm,
            self.last_clipped,
            self.step_was_skipped,
        )
        self.step_was_skipped = False
        self.steps_taken += 1
        if plan.scaled:
            self.last_inv_scale = plan.inv_scale
        self.last_grad_norm, self.last_clipped = plan.norm, plan.clip < 1.0
        self.layout.advance_steps()
        self.sync_torch_state(torch_state)

    def put_back(self, untouched: list, nothing_stepped: bool) -> None:
        """The step begun last failed: the params `untouched` get their counts back; with
        nothing stepped, every count and the step's scalars too."""
        undo, steps = self._undo, self.layout.steps
        assert undo is not None, "put_back() before any step began"
        for i in untouched:
            steps[i] = undo.steps[i]
        if nothing_stepped:
            steps[:] = undo.steps
            self.steps_taken, self.last_inv_scale = undo.steps_taken, undo.last_inv_scale
            self.last_grad_norm, self.step_was_skipped = undo.last_grad_norm, undo.step_was_skipped
            self.last_clipped = undo.last_clipped

    def state_init_step(self, torch_state, clipping: bool) -> None:
        """torch.distributed.checkpoint's lr-0 state-init step (checkpoint.py): the step counts
        advance, nothing else ran — not counted as a training step."""
        self.layout.advance_steps()
        self.sync_torch_state(torch_state)
        self.step_was_skipped = False
        self.last_grad_norm = 0.0 if clipping else None

    # ------------------------------------------------------------------ rank faults
    def out_of_step(self, err) -> None:
        """This rank failed after the others stepped: its next step() stops them all."""
        from hybrid_opt.distributed import rank_faults as RF

        self.rank_failure = RF.out_of_step(err)

    def back_in_step(self) -> None:
        """A completed reload (load_state_dict) puts this rank back in step."""
        self.rank_failure = None

    # ------------------------------------------------------------------ torch's self.state
    def loaded(self, torch_state, saved_steps: dict) -> None:
        """load_state_dict: each param's count from the checkpoint ({index: count}; 0 absent)."""
        steps = self.layout.steps
        for idx in range(len(steps)):
            steps[idx] = saved_steps.get(idx, 0)
        self.sync_torch_state(torch_state, rebuild=True)
        self.back_in_step()

    def sync_torch_state(self, torch_state, rebuild: bool = False) -> None:
        """torch's per-param `state` holds {"step": 0-dim float32 tensor} for each param that
        has stepped, as torch's own does, so tools that read `optimizer.state` (torch.
        distributed.checkpoint decides by it whether an optimizer is fresh) see a trained one;
        the moments and masters stay in the tiers and state_dict() gathers them. The step
        tensors are views of one buffer: a step costs one copy, not one op per param."""
        steps = self.layout.steps
        n = len(steps)
        counts = self._step_counts
        if counts is None or counts.numel() != n:  # add_param_group grew the model
            counts = self._step_counts = torch.zeros(n, dtype=torch.float32)
            rebuild = True
        counts.copy_(torch.tensor(steps, dtype=torch.float32))
        stepped = n - steps.count(0)
        # between two calls counts only rise (a step) or only fall (its rollback): the same
        # number of stepped params means the same params
        if not rebuild and stepped == self._stepped_params:
            return
        self._stepped_params = stepped
        for idx, p in enumerate(self.layout.params()):
            if steps[idx]:
                entry = torch_state[p]
                if rebuild or "step" not in entry:
                    entry["step"] = counts[idx]
            else:
                torch_state.pop(p, None)
