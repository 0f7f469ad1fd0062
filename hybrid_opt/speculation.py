"""Speculation: grad hooks that step a host/nvme subgroup in the worker as soon as its grads
are complete during backward, and the inputs such a step records so that validation can
commit, redo or drop it.

A mixin of the optimizer class; `GradGatherer` writes a subgroup's grads into a staging
buffer (or names their memory for the worker to read itself).

A speculated step stands only if its grads were not modified since they were staged. Plain
grads are named by (data_ptr, _version): every in-place op, foreach included, bumps the
version. DTensor grads (FSDP2) also record the DTensor's own version (`dtensor.mul_` bumps
only that one), and — because torch's foreach in-place ops (clip_grad_norm_, a GradScaler's
unscale_) bump neither — a content fingerprint, their sum of squares, compared at step()
(grad_edits.py): a mismatch redoes the step from the live grads.
"""
from __future__ import annotations

import torch

from hybrid_opt.distributed import is_dtensor, local_of
from hybrid_opt.grad_edits import GradFingerprints
from hybrid_opt.lifetime import acts_on_owner, weak_call, weak_method
from hybrid_opt.tiers.host import StepInputs
from hybrid_opt.tiers.staging import copy_async


class SpeculationMixin:
    """Grad hooks, speculative host steps during backward, and the inputs they record."""

    def _install_hooks(self, host: list) -> None:
        """Grad hooks mark host/nvme subgroups ready during backward; a subgroup whose every
        trainable parameter has its grad accumulated is stepped speculatively at once."""
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []
        self._members: dict = {}   # host subgroup index -> trainable param indices in it
        self._param_sgs: dict = {}  # param index -> host subgroup indices it spans
        self._ready: dict = {}
        self._staged: dict = {}     # host subgroup index -> the grad tensors its pending speculation read
        self._fingerprints = GradFingerprints()  # DTensor grads: edits no version sees (grad_edits.py)
        zero = getattr(self, "_zero", None)
        if zero is not None:
            # process_group (zero.py): speculation starts once a param's averaged chunk is in
            # place, from zero.py's reduce hooks, not from the raw local grad
            # hooks and callbacks hold the optimizer weakly: only the user keeps it alive (lifetime.py)
            zero.install(weak_method(self._on_chunk_reduced), weak_call(self, lambda o: o._accumulation_boundary))
        if self._placement.auto is not None:
            self._step_stats.time_backward()  # before the speculation hooks: run first
        if not self.speculative or not host:
            return
        for sg in host:
            members = {sl.param_index for sl in sg.slices if sl.param.requires_grad}
            if not members:
                continue
            self._members[sg.index] = members
            self._ready[sg.index] = set()
            for idx in members:
                self._param_sgs.setdefault(idx, []).append(sg.index)
        hooked = set()
        for sg in host:
            for sl in sg.slices:
                p = sl.param
                if p.requires_grad and p not in hooked and zero is None:
                    hooked.add(p)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(weak_method(self._on_grad_ready)))

    def _on_chunk_reduced(self, p) -> None:
        if self._layout.index.get(p) in getattr(self, "_param_sgs", {}):
            self._on_grad_ready(p)

    def _may_speculate(self) -> bool:
        """In exact mode always. rollback="inverse" undoes a wrong guess algebraically, and
        that undo is ill-conditioned when the guess was far off (grads still scaled by 2**16,
        or clipped hard: the step's g**2 swamps v): speculate there only when the guess is
        safe — not before the first step shows whether a GradScaler is in play, not with
        clipping, not with a GradScaler whose scale speculation cannot read."""
        if self.rollback != "inverse":
            return True
        if self._ledger.steps_taken == 0 or self.max_grad_norm is not None:
            return False
        return not self._ledger.amp_seen or self._grad_scaler is not None

    def _on_grad_ready(self, p) -> None:
        if self._closed or not self._accumulation_boundary or not self._may_speculate():
            return
        if self._placement.host.copies_in_flight():
            try:
                self._placement.host.poll()  # hands the worker the pieces whose CUDA copies have landed
            except Exception as e:  # never break the user's backward: step() reports it
                self._speculation_error = self._speculation_error or e
        idx = self._layout.index.get(p)
        for sgi in self._param_sgs.get(idx, ()):
            ready = self._ready[sgi]
            ready.add(idx)
            if len(ready) == len(self._members[sgi]):
                ready.clear()  # a further backward before step() makes it ready again
                try:
                    if sgi in self._deferred:
                        self._deferred.remove(sgi)
                    self._retry_deferred()
                    if not self._speculate(sgi):
                        self._deferred.append(sgi)
                except Exception as e:  # never break the user's backward: step() reports it
                    self._speculation_error = self._speculation_error or e

    def _predicted_inv_scale(self) -> float:
        """The loss scale speculation assumes. An attached GradScaler's is read once per step:
        get_scale() copies a CUDA scale to the host (a sync), so the first hook of a backward
        reads it and later hooks reuse it until the scaler updates its scale (the scale
        tensor's version moves; where the scaler has no scale tensor yet it is a plain float)."""
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return self._ledger.last_inv_scale
        scale_t = getattr(scaler, "_scale", None)
        key = (id(scaler), id(scale_t), scale_t._version) if isinstance(scale_t, torch.Tensor) else None
        cached = getattr(self, "_inv_scale_cache", None)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        inv = 1.0 / float(scaler.get_scale())
        self._inv_scale_cache = (key, inv)
        return inv

    def _host_inputs(self, sg, live: list, hp: StepInputs, scale: float, ahead: int) -> StepInputs:
        """The inputs a host subgroup's step depends on (ahead=1 during backward: the step
        counts it will have), including which grads, so a changed grad makes it stale."""
        runs = self._layout.runs(sg, live, ahead)
        step = runs[0][2] if runs else self._layout.steps[live[0].param_index] + ahead
        # a DTensor grad (FSDP2) is named by its local shard (the memory the step reads) and
        # the versions of both: `dtensor.mul_` bumps only the DTensor's
        versions = tuple(self._grad_id(sl.param.grad) for sl in live)
        if not ahead and self._grads_edited(sg, live):
            versions += ("edited since staged",)  # a foreach edit of DTensor grads: redone
        return StepInputs(step, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled,
                          scale * hp.grad_scale, versions, hp.amsgrad, runs)

    @staticmethod
    def _grad_id(g) -> tuple:
        local = local_of(g)
        ident = (local.data_ptr(), local._version)
        return ident + (g._version,) if is_dtensor(g) else ident

    def _grads_edited(self, sg, live: list) -> bool:
        """At step(): whether a speculated subgroup's DTensor grads changed since it was
        staged in a way no version counter shows (grad_edits.py)."""
        fp = getattr(self, "_fingerprints", None)
        if fp is None or sg.index not in self._staged:
            return False
        local = self._placement.host_local[sg.index]
        return fp.is_edited(sg.index, GradGatherer(sg), lambda: self._placement.host.piece_stats(local),
                            self._placement.host.grad_dtype)

    def _grad_edit_checks(self) -> list:
        """Start of step(), speculated subgroups with DTensor grads (grad_edits.py): on CUDA a
        0-dim device flag each (grads edited since staged), queued now for step()'s one read of
        its scalars (read_scalars; `_note_grad_edits` takes the values read); on CPU their
        live piece sums, computed now while the worker may still be stepping."""
        fp = getattr(self, "_fingerprints", None)
        if fp is None or not self._staged:
            return []

        def live_of(sgi):
            return [sl for sl in self._layout.subgroups[sgi].slices if sl.param.grad is not None]
        return fp.checks(live_of, lambda sgi: GradGatherer(self._layout.subgroups[sgi]),
                         lambda sgi: self._placement.host.piece_stats(self._placement.host_local[sgi], wait=False),
                         self._placement.host.grad_dtype)

    def _note_grad_edits(self, values) -> None:
        if getattr(self, "_fingerprints", None) is not None:
            self._fingerprints.note(values)

    def _speculate(self, sgi: int) -> bool:
        sg = self._layout.subgroups[sgi]
        live = [sl for sl in sg.slices if sl.param.grad is not None]
        if not live:
            return True
        group = self.param_groups[sg.group]
        hp = self._hyper(group, -1.0 if group["maximize"] else 1.0)
        # clipping is assumed not to bite (coefficient 1): validation redoes it when it does
        inputs = self._host_inputs(sg, live, hp, self._predicted_inv_scale(), 1)
        local = self._placement.host_local[sgi]
        self._placement.host.cancel(local)
        self._staged.pop(sgi, None)
        self._fingerprints.forget(sgi)
        if self._placement.host.speculate(local, GradGatherer(sg), inputs, wait=False):
            # the grads it read stay referenced until it is validated: a grad tensor made after
            # one was discarded (zero_grad, `p.grad = None`) can then never take its address, so
            # (data_ptr, _version) names the same grad for as long as the speculation is pending
            self._staged[sgi] = [sl.param.grad for sl in live]
            self._fingerprints.record(sgi, live)
            return True
        return False

    def _retry_deferred(self) -> None:
        """Subgroups that found no free bank or staging slot when they became ready are tried
        again as the worker frees them (backward never waits for the worker); those still
        waiting at step() are stepped there."""
        self._placement.host.poll()
        while self._deferred:
            if not self._speculate(self._deferred[0]):
                return
            self._deferred.pop(0)

    def _clear_ready(self) -> None:
        """Forgets which subgroups' grads were ready: the step they were for is over."""
        for ready in self._ready.values():
            ready.clear()

    def _drop_pending(self) -> dict:
        """Drops every pending speculation and the ready sets (a step skipped or taken without
        host work); returns finish()'s outcome."""
        outcome = self._drop_speculation()
        self._clear_ready()
        return outcome

    def _drop_speculation(self) -> dict:
        """Drops every pending speculation (the committed state is untouched); returns finish()'s
        outcome."""
        outcome = {}
        if self._placement.host is not None and self._placement.host.speculated():
            outcome = self._placement.host.finish({}, overflow=True)
        self._forget_staged()
        self._deferred.clear()
        return outcome

    def _forget_staged(self) -> None:
        pending = set(self._placement.host.speculated()) if self._placement.host is not None else set()
        self._staged = {k: v for k, v in getattr(self, "_staged", {}).items()
                        if self._placement.host_local[k] in pending}
        if getattr(self, "_fingerprints", None) is not None:
            self._fingerprints.keep_only(self._staged)

    @acts_on_owner
    def attach_grad_scaler(self, scaler) -> None:
        """Lets speculation read the loss scale that will apply (torch.amp.GradScaler);
        without it, speculation assumes the last step's scale and validation redoes what
        does not match."""
        self._grad_scaler = scaler

    @acts_on_owner
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's vocabulary: False on micro-batches that are not the last before step()
        suppresses speculation on them (their grads are not final). Unannotated accumulation
        stays correct — a grad changed after speculation makes it stale — only slower."""
        self._accumulation_boundary = bool(is_boundary)

    @acts_on_owner
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for ready in getattr(self, "_ready", {}).values():
            ready.clear()

class GradGatherer:
    """Writes a subgroup's grads [offset, offset + numel) into a staging buffer; params without
    a grad contribute zeros (their elements are outside every run, so never stepped). CUDA
    grads are copied non-blocking, on the host tier's side stream (tiers/staging.py)."""

    def __init__(self, sg):
        self.sg = sg

    def overlaps(self, offset: int, numel: int):
        """(slice, a, b) for each slice overlapping [offset, offset + numel), [a, b) in
        subgroup elements."""
        end = offset + numel
        for sl in self.sg.slices:
            a, b = max(offset, sl.sub_offset), min(end, sl.sub_offset + sl.numel)
            if a < b:
                yield sl, a, b

    def cuda_device(self):
        """The CUDA device of this subgroup's grads, or None (CPU grads: staged synchronously)."""
        for sl in self.sg.slices:
            g = sl.param.grad
            if g is not None and g.is_cuda:
                return g.device
        return None

    def __call__(self, dst: torch.Tensor, offset: int, numel: int, non_blocking: bool = False) -> None:
        for sl, a, b in self.overlaps(offset, numel):
            g = sl.grad_view()
            if g is None:
                dst[a - offset:b - offset].zero_()
                continue
            src = g[a - sl.sub_offset:b - sl.sub_offset]
            if non_blocking:  # on the side stream; the grad's memory is kept until the copy ran
                copy_async(dst[a - offset:b - offset], src)
            else:
                dst[a - offset:b - offset].copy_(src, non_blocking=False)

    def segments(self, offset: int, numel: int, dtype):
        """Remote gather: [(element offset in the piece, address, elements)] (address 0: zeros)
        and the grad tensors to keep alive, for the worker to read itself; None when a grad
        is on a GPU, non-contiguous or of another dtype (then __call__ stages it here)."""
        entries, keep = [], []
        for sl, a, b in self.overlaps(offset, numel):
            g = local_of(sl.param.grad)
            if g is None:
                entries.append((a - offset, 0, b - a))
                continue
            if g.is_cuda or g.dtype != dtype or not g.is_contiguous():
                return None
            start = sl.param_offset + (a - sl.sub_offset)
            entries.append((a - offset, g.data_ptr() + start * g.element_size(), b - a))
            keep.append(g)
        return entries, keep
