"""process_group mode's `release_grads=True` (zero.py): ZeRO-2's gradient partitioning. Once a bucket
is reduced, each param's full p.grad is dropped and only this rank's chunk is kept for the step.

p.grad reads None after backward; step() puts placeholders back while it runs, so the step sees
the same grads, versions and chunks as with release_grads=False: the same bits. What that changes
for users (clipping, GradScaler, accumulation): docs/internals.md."""

from __future__ import annotations

import torch

from hybrid_opt.distributed.zero_edits import GradsEditedError

RELEASE_ACCUMULATE = (
    "process_group with release_grads=True: a second backward reduced grads before step(), but "
    "the last backward's full grads were already released (only each rank's averaged chunk is "
    "kept), so the sum cannot be reduced. Call step() after each reducing backward, and on "
    "accumulation micro-batches call opt.set_gradient_accumulation_boundary(False) before their "
    "backward (True again before the last): they reduce nothing and keep their full grads"
)


class GradRelease:
    """ZeroSharding's part (zero.py) for `release_grads` (module docstring): the placeholders
    of released grads, and the grads given to released buckets since (refused)."""

    def __init__(self, buckets: list, reads, release_grads: bool):
        self.enabled = bool(release_grads)
        self._buckets = buckets
        self._reads = reads  # GradReads (zero_edits.py): a placeholder is what the step reads
        self._released: dict = {}  # param id -> (param, placeholder): released since the last step
        self._foreign: list = []  # params of released buckets given a grad after backward
        self._held: set = set()  # ids of the params the last step released (their grads hidden)
        self._kept: set = set()  # ids of the params whose grads zero_grad(set_to_none=False) kept
        self.lost = False  # a failed step released grads, and no grad came since (zero.py)

    def placeholder(self, p) -> torch.Tensor:
        """p's shape over one element: what p.grad reads in its place (module docstring)."""
        return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)

    def release(self, p) -> torch.Tensor:
        """p.grad (reduced, its chunk about to be mapped) replaced by a placeholder; the full
        grad is referenced nowhere else any more, so it is freed."""
        ph = self.placeholder(p)
        self._reads.released(p, ph)  # an edit of the full grad since its read is kept (zero_edits.py)
        p.grad = ph
        self._released[id(p)] = (p, ph)
        return ph

    def check_rereduce(self) -> None:
        """A reducing backward's first grad: with grads released since the last step, refused."""
        if self.enabled and self._released:
            raise RuntimeError(RELEASE_ACCUMULATE)

    def hide(self) -> None:
        """End of backward and of step(): the released params read p.grad None."""
        for p, ph in self._released.values():
            if p.grad is ph:
                p.grad = None

    def restore(self) -> None:
        """step(): the placeholders back for the step to read; a grad given since is foreign
        (refused: error()), and so is one given to a param without a grad in a bucket whose
        grads were released (it can no longer be reduced with them)."""
        self._foreign = []
        if not self._released:
            return
        for p, ph in self._released.values():
            if p.grad is None:
                p.grad = ph
            elif p.grad is not ph:
                self._foreign.append(p)
        for b in self._buckets:
            if any(id(p) in self._released for p in b.params):
                self._foreign += [
                    p
                    for p in b.params
                    if id(p) not in self._released and p.grad is not None and not self._reads.saw(p)
                ]

    def zero_grad(self, set_to_none: bool) -> None:
        """The optimizer's zero_grad: set_to_none=False keeps the released grads as zeros (as
        torch keeps its zero grads), counted by every reduction until a zero_grad() drops them."""
        if not self.enabled:
            return
        self.lost = False
        if set_to_none:
            self._kept.clear()
            self._held.clear()
        else:
            self._kept |= self._held | set(self._released)

    def counted(self, params: list, grads: list) -> list:
        """Per param, whether a reduction counts it as having a grad here (its has-grad count
        1): a grad, or one zero_grad(set_to_none=False) kept as zeros (its p.grad reads None)."""
        return [g is not None or id(p) in self._kept for p, g in zip(params, grads)]

    def has_released(self, b) -> bool:
        return any(id(p) in self._released for p in b.params)

    def end_step(self, stepped: bool) -> None:
        """After step() (taken or skipped: `stepped`; or failed): hidden again, and nothing
        released; a failed step's released grads are remembered as lost."""
        self.hide()
        self.lost = not stepped and (bool(self._released) or self.lost)
        self._held = set(self._released)
        self._released.clear()
        self._foreign = []

    def grad_arrived(self) -> None:
        """A grad hook ran (any backward, reducing or not): a failed step's grads are not missed."""
        self.lost = False

    def error(self):
        """The refusal of a grad given to a released bucket after backward (above), or of a
        step() again after a failed one with no backward since (its grads were released), or
        None."""
        if self.lost:  # read in the step after the failed one (restore ran; no hook runs in step())
            return RuntimeError(
                "process_group with release_grads=True: step() was called again after a step "
                "that failed, with no backward since, but that step had released its grads (only "
                "each rank's averaged chunk is kept, and the failed step dropped them): there is "
                "nothing left to step. Run the backward again first. Nothing was stepped, on any rank"
            )
        if not self._foreign:
            return None
        p = self._foreign[0]
        return GradsEditedError(
            f"process_group with release_grads=True: {len(self._foreign)} param(s) (the first of "
            f"shape {tuple(p.shape)}) were given a grad after backward had reduced their bucket "
            f"and released its full grads (p.grad = ..., or a DistributedDataParallel wrapper "
            f"writing its averages: drop it, the optimizer averages the grads itself); it cannot "
            f"be reduced any more. Nothing was stepped, on any rank"
        )

    def scaler_found_inf(self, found, scaler, key):
        """step(), release_grads with a GradScaler (its inf check saw no p.grad): `found` (the
        optimizer's found_inf) with this rank's chunks' non-finite flag added, and the attached
        `scaler` given a per-device found_inf for optimizer `key` (its id; the decision fills it
        in: distributed.globalize_scaler_found_inf). Returns (found_inf, a refusal or None)."""
        if not self.enabled or found is None or not self._buckets:
            return found, None
        if scaler is None:
            return found, RuntimeError(
                "process_group with release_grads=True and a GradScaler: attach it with "
                "opt.attach_grad_scaler(scaler) (its inf check sees no p.grad in this mode, so "
                "the optimizer checks the reduced chunks and hands the scaler the result). "
                "Nothing was stepped, on any rank"
            )
        flags = [torch.isfinite(b.out).all() for b in self._buckets]
        device = found.device if isinstance(found, torch.Tensor) else flags[0].device
        mine = torch.stack(flags).logical_not().any().to(device=device, dtype=torch.float32)
        found = mine + found
        state = getattr(scaler, "_per_optimizer_states", {}).get(key)
        if state is not None and not state.get("found_inf_per_device"):
            state["found_inf_per_device"] = {device: found.clone().reshape(())}
        return found, None
