"""process_group mode: grads changed in place after backward, seen at step() and refused on every
rank at the same step.

Each reduction reads p.grad during backward, so a later edit (a framework's clipping, unscale_)
cannot reach the step; it is refused rather than ignored, seen by each grad's `_version` (or, for
unscale_, by the missing `grad_scale`). A DDP wrapper's write that equals our average passes.
Design notes: docs/internals.md."""

from __future__ import annotations

import warnings

import torch

from hybrid_opt.distributed.local_shards import zero_chunk

RECIPE = (
    "Under process_group= clip and unscale inside the optimizer: HybridAdamW(..., "
    "max_grad_norm=1.0) clips by the global norm of the averaged grads (as DDP + "
    "clip_grad_norm_ does), and opt.attach_grad_scaler(scaler) with scaler.step(opt) "
    "replaces scaler.unscale_(opt). In the frameworks, turn their clipping off: HF Trainer "
    "TrainingArguments(max_grad_norm=0) (its default 1.0 clips after backward), Lightning "
    "Trainer(gradient_clip_val=None), and no accelerator.clip_grad_norm_ call "
    "(docs/frameworks.md)"
)

DDP_NOTE = (
    "If the model is also wrapped in DistributedDataParallel (accelerate's prepare() and "
    "HF Trainer add one in a multi-process launch): with process_group= the optimizer "
    "averages the grads itself, so drop the DDP wrapper where you can "
    "(docs/frameworks.md), and clip in the optimizer; if you keep it, leave its "
    "gradient_as_bucket_view at False (with True its grads are views of its buckets, "
    "divided by the world size before the optimizer reads them: refused). "
)


class GradsEditedError(RuntimeError):
    """step() under process_group= found grads changed after backward had reduced them (module
    docstring). Nothing was stepped, on any rank."""


class GradReads:
    """Which grad object each param's reduction last read, and that grad's `_version` then
    (owned by ZeroSharding, noted by the parts that hand a reduction or a step a grad): a grad
    replaced by a new object since, or changed in place, is refused (GradEdits; one replaced by
    its average, DDP's write, is adopted: zero.py finish). release_grads replaces the grad read
    by a placeholder once its reduction completes (`released`): what that grad's version had
    moved by since the read — an edit made while the reduction was in flight, by a grad hook
    registered after the optimizer's — is carried over to the placeholder, so the step refuses
    it as it would the full grad's."""

    def __init__(self):
        self._grad: dict = {}  # param id -> the grad tensor object its last reduction read
        self._at: dict = {}  # param id -> version of the grad object its reduction read
        self._carried: dict = {}  # param id -> versions the released full grad had moved by

    def note(self, p) -> None:
        """p.grad, as it is now, is what p's reduction read."""
        self._grad[id(p)] = p.grad
        self._carried.pop(id(p), None)
        if p.grad is not None:
            self._at[id(p)] = p.grad._version

    def released(self, p, placeholder) -> None:
        """p.grad, still the grad p's reduction read, is being replaced by `placeholder`
        (zero_release.py): the step reads the placeholder, with the read grad's moves since."""
        g, then = self._grad.get(id(p)), self._at.get(id(p))
        moved = g._version - then if g is not None and g is p.grad and then is not None else 0
        self._grad[id(p)], self._at[id(p)] = placeholder, placeholder._version
        if moved:
            self._carried[id(p)] = moved

    def carried(self, p) -> bool:
        """Whether p's moves include its released full grad's (`released`)."""
        return id(p) in self._carried

    def saw(self, p) -> bool:
        """p.grad is the object p's last reduction read (for a p.grad that is not None)."""
        return self._grad.get(id(p)) is p.grad

    def moved(self, params) -> list:
        """[(param, versions moved)] for each grad still the object its reduction read whose
        version has moved since (a grad replaced by a new object: zero.py finish)."""
        out = []
        for p in params:
            g = p.grad
            if g is None or not self.saw(p) or id(p) not in self._at:
                continue
            delta = g._version - self._at[id(p)] + self._carried.get(id(p), 0)
            if delta:
                out.append((p, delta))
        return out

    def clear(self) -> None:
        self._grad.clear()
        self._at.clear()
        self._carried.clear()


# DDP's average (each rank's grad divided by the world, then summed in its own order) and ours
# (summed in rank order, then divided) differ by rounding from 3 ranks on (bitwise equal at
# 2): a few ulps of the terms per rank, so the tolerance scales with the world and with the
# param's largest averaged element (an element where the terms nearly cancel has the terms'
# error, not its own magnitude's). A clip that bites moves every element by (1 - coefficient).
_ULPS_PER_RANK = 4.0


def equals_average(p, average: torch.Tensor, rank: int, world: int):
    """Whether this rank's chunk of p.grad holds `average` (p's averaged chunk) — what DDP
    leaves there — within the rounding of another summation order: a 0-dim bool tensor on
    the grads' device (not read here: the caller reads every param's at once), or None when
    this rank's chunk is empty."""
    if p.grad is None or average.numel() == 0:
        return None
    mine = zero_chunk(p.grad, rank, world).reshape(-1).float()
    avg = average.float()
    eps = torch.finfo(torch.float32).eps * _ULPS_PER_RANK * world
    size = avg.abs().nan_to_num(0.0, 0.0, 0.0)  # an overflow's inf or nan sets no tolerance
    tol = eps * (size + size.max())
    # an inf or nan in some rank's grad (GradScaler's overflow) is DDP's average there too
    same = (mine == avg) | (mine.isnan() & avg.isnan())
    return ((mine - avg).abs() <= tol).logical_or_(same).all()


def all_true(flags: list) -> bool:
    """Whether every flag (0-dim bool tensors, or None: no chunk here) holds: one read."""
    flags = [f for f in flags if f is not None]
    return bool(torch.stack(flags).all()) if flags else True


def edit_error(moved: list, ddp_like: bool, unscaled: bool) -> GradsEditedError | None:
    """The refusal for this step, or None. `moved`: [(param, versions moved)] (ReadVersions);
    `ddp_like`: every moved grad equals its average (DDP's write); `unscaled`: GradScaler.step
    found the grads unscaled already (scaler.unscale_ after backward)."""
    if unscaled:
        return GradsEditedError(
            "process_group: scaler.unscale_(optimizer) was called after backward, but the grads "
            "had already been reduce-scattered, scaled, during backward: the unscaled p.grad "
            "would be silently ignored (and the step's scale lost). Nothing was stepped, on any "
            "rank. Under HF Trainer with fp16, accelerate's clip_grad_norm_ unscales even at "
            "TrainingArguments(max_grad_norm=0) (Trainer calls it for its logged grad norm): "
            "override Trainer._get_grad_norm to return its grad_norm argument "
            "(docs/frameworks.md). " + RECIPE
        )
    if not moved or ddp_like:
        return None  # DDP's write of the averages, and edits that changed nothing (docstring)
    p, delta = moved[0]
    what = (
        f"{len(moved)} grad{'s' if len(moved) != 1 else ''} (the first of shape "
        f"{tuple(p.shape)}, version moved by {delta})"
    )
    return GradsEditedError(
        f"process_group: {what} changed in place after backward (clip_grad_norm_, a "
        f"framework's gradient clipping, an edit of p.grad), but HybridAdamW had already "
        f"reduce-scattered them during backward: the change would be silently ignored. "
        f"Nothing was stepped, on any rank. " + DDP_NOTE + RECIPE
    )


def replaced_error(replaced: list) -> GradsEditedError:
    """The refusal of grads replaced after their reduction read the ones before (zero.py)."""
    p = replaced[0]
    n = len(replaced)
    what = f"{n} grad{'s' if n != 1 else ''} (the first of shape {tuple(p.shape)})"
    return GradsEditedError(
        f"process_group: {what} replaced after backward had reduce-scattered the grad before "
        f"(`p.grad = ...` after backward, or in a grad hook that ran once its bucket's reduction "
        f"had started: one registered after HybridAdamW's), "
        f"but the step reads the averaged chunk of the grad reduced, so the new one would be "
        f"silently ignored. Nothing was stepped, on any rank. To step grads set by hand, run "
        f"the backward(s) before with opt.set_gradient_accumulation_boundary(False) (nothing "
        f"is reduced then: step() reduces p.grad as it is) and set it back to True after "
        f"step(). " + DDP_NOTE + RECIPE
    )


class GradEdits:
    """ZeroSharding's part (zero.py) that checks this step's grads against what its reductions
    read (GradReads), and that sees a DDP wrapper's averaged grads (once)."""

    def __init__(self, params: list, buckets: list, rank: int, world: int, reads: GradReads):
        self._params = params
        self._place_of = {id(p): (b, k) for b in buckets for k, p in enumerate(b.params)}
        self._rank, self._world = rank, world
        self._reads = reads
        self._ddp_checked = False

    def check_ddp(self, b) -> None:
        """Once, in step(): grads equal to their average on every element look like DDP's (it
        writes the averages into p.grad at the end of backward, after our hooks copied the local
        grads out; checked before that, the local grads would be compared): correct, but
        communicated twice."""
        if self._ddp_checked:
            return
        self._ddp_checked = True
        same = [self._equals_average(p) for p in b.params]
        grads = [p.grad for p in b.params if p.grad is not None]
        any_nonzero = bool(torch.stack([g.any() for g in grads]).any()) if grads else False
        if any(f is not None for f in same) and all_true(same) and any_nonzero and self._world > 1:
            warnings.warn(
                "process_group: the grads arrived already averaged over the ranks (the "
                "model looks wrapped in DistributedDataParallel): the result is correct, "
                "but grads are communicated twice. With process_group= the optimizer "
                "averages them itself: drop the DDP wrapper",
                stacklevel=4,
            )

    def _equals_average(self, p):
        """Whether this rank's chunk of p.grad is p's averaged chunk (what DDP writes there): a
        0-dim bool tensor, not read (zero_edits.equals_average), or None (no chunk here)."""
        b, k = self._place_of[id(p)]
        a, n = b.offsets[k][self._rank], b.numels[k][self._rank]
        return equals_average(p, b.out[a : a + n], self._rank, self._world)

    def hold_averages(self, params: list) -> bool:
        """Whether each param's grad holds its averaged chunk on this rank (what DDP writes):
        one read for all of them."""
        return all_true([self._equals_average(p) for p in params])

    def error(self, unscaled: bool, replaced: list | tuple[()] = ()):
        """After finish(): the refusal of this step (module docstring) — a grad changed in place
        since its reduction read it, a grad replaced since (`replaced`: those holding no
        average, zero.py finish), or (`unscaled`) GradScaler.step found it unscaled — or None.
        A step with no moved grad reads nothing; under DDP (every grad moved) one read in all."""
        if replaced and not unscaled:
            return replaced_error(replaced)
        moved = self._reads.moved(self._params)
        # a released grad's edit (GradReads.released) is never DDP's write: DDP writes at the end
        # of backward, and its averages were not there to compare when the grad was dropped
        ddp_like = (
            bool(moved)
            and not any(self._reads.carried(p) for p, _ in moved)
            and self.hold_averages([p for p, _ in moved])
        )
        return edit_error(moved, ddp_like, unscaled)
