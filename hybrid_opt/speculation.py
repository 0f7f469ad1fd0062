"""Speculation: grad hooks that step a host/nvme subgroup in the worker as soon as its grads are
complete during backward, and the inputs such a step records so that validation can commit, redo
or drop it.

The optimizer's Speculator part. Invariant: a speculated step stands only if its grads were not
modified since they were staged, seen by (data_ptr, _version), and for DTensor grads also by a
fingerprint (grad_edits.py). Design notes: docs/internals.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hybrid_opt.distributed.grad_edits import GradFingerprints
from hybrid_opt.distributed.local_shards import any_dtensor, grad_locals
from hybrid_opt.lifetime import weak_call, weak_method
from hybrid_opt.step_plan import COMMIT, REDO, STEP
from hybrid_opt.step_work import group_inputs
from hybrid_opt.tiers.grads import GradGatherer
from hybrid_opt.tiers.host import AdamInputs

if TYPE_CHECKING:
    from hybrid_opt.seams import Sharding


def speculates(speculative: bool | str, device: torch.device, worker_share: float | None) -> bool:
    """Whether host steps start during backward. `speculative="auto"` (the default) speculates
    where the worker has cores of its own: the params live on a device (a GPU host splits its
    cores), or `worker_share=` gave it some. Where the params live on the CPU, the worker shares
    every core with the trainer (worker.client.CoreSplit): a host step during backward runs on
    the backward's cores, so nothing hides, and its hooks and grad reads cost the trainer; the
    steps run in step() instead, on every core (the demo on 2 cores: 1.10-1.12x torch's wall
    time without speculation, 1.15-1.21x with it). True or False says it outright."""
    if speculative != "auto":
        return bool(speculative)
    return device.type != "cpu" or worker_share is not None


class SpeculationConfig(NamedTuple):
    speculative: bool
    rollback: str
    clipping: bool  # max_grad_norm is set
    decoupled: bool  # AdamW's decoupled weight decay (Adam's L2 otherwise)


class Speculator:
    """Grad hooks, speculative host steps during backward, and the inputs they record: the
    ready and staged sets, the grad fingerprints of DTensor grads, the subgroups deferred for
    a free bank, the attached GradScaler and the accumulation boundary."""

    def __init__(self, layout, placement, ledger, config: SpeculationConfig, sharding: Sharding):
        self.layout = layout
        self.placement = placement
        self.ledger = ledger
        self.config = config
        self.sharding = sharding  # NoSharding (its install does nothing) or process_group's
        self.grad_scaler = None  # attach_grad_scaler's
        self.boundary = True  # set_gradient_accumulation_boundary's
        # a speculative step that failed during backward: step() raises it
        self.error: Exception | None = None
        self.closed = False
        self._hooks: list = []
        self._members: dict = {}  # host subgroup index -> trainable param indices in it
        self._param_sgs: dict = {}  # param index -> host subgroup indices it spans
        self._ready: dict = {}
        # subgroup index -> (the grad tensors its pending speculation read, the inputs it stepped with)
        self._staged: dict = {}
        self.fingerprints: GradFingerprints | None = None  # where a host param is a DTensor (install)
        self._grad_locals = grad_locals  # how the host grads are named: install's
        self._deferred: list = []
        self._inv_scale_cache = None
        # (the scale's key, the host copy, its event): the loss scale copied ahead (prefetch_scale)
        self._scale_prefetch: tuple | None = None
        self._scale_host: torch.Tensor | None = None
        # param group index -> (its hyperparameters' key, the values it names, AdamInputs)
        self._hp_cache: dict = {}

    # ------------------------------------------------------------------ hooks
    def install(self, host: list, timing=None) -> None:
        """Grad hooks mark host/nvme subgroups ready during backward; a subgroup whose every
        trainable parameter has its grad accumulated is stepped speculatively at once.
        `timing()`, where given, installs "auto"'s timing hooks between process_group's
        reduce hooks and these (each param's hooks run in that order)."""
        self.remove_hooks()
        self._members, self._param_sgs, self._ready, self._staged = {}, {}, {}, {}
        # DTensor grads (FSDP2): edits no version counter sees are caught by their fingerprints
        # (grad_edits.py); plain grads need none, and nothing is computed for them
        dtensors = any_dtensor(sl.param for sg in host for sl in sg.slices)
        self.fingerprints = GradFingerprints() if dtensors else None
        reduced = self.sharding.active
        # one process, no process_group: each grad is its own memory (distributed.local_of)
        self._grad_locals = grad_locals if dtensors or reduced else _own_memory
        # process_group (zero.py): speculation starts once a param's averaged chunk is in
        # place, from zero.py's reduce hooks, not from the raw local grad (NoSharding: no hooks)
        # hooks and callbacks hold the speculator weakly: only the optimizer keeps it (lifetime.py)
        self.sharding.install(weak_method(self._on_chunk_reduced), weak_call(self, lambda o: o.boundary))
        if timing is not None:
            timing()
        if not self.config.speculative or not host:
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
                if p.requires_grad and p not in hooked and not reduced:
                    hooked.add(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(weak_method(self._on_grad_ready)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        self.closed = True
        self.remove_hooks()

    def _on_chunk_reduced(self, p) -> None:
        if self.layout.index.get(p) in self._param_sgs:
            self._on_grad_ready(p)

    def may_speculate(self) -> bool:
        """In exact mode always, except where a wrong guess costs the trainer: a worker that
        shares the trainer's cores (a CPU-only host) speculates nothing while clipping bites
        (the last step's coefficient was below 1). Each speculated step would be redone at
        step(), and it ran on cores the backward needed: on 2 cores it made an iteration of
        the bench GPT 1.16x torch's instead of 1.0x. It speculates again after a step that
        clipping left alone. rollback="inverse" undoes a wrong guess algebraically, and
        that undo is ill-conditioned when the guess was far off (grads still scaled by 2**16,
        or clipped hard: the step's g**2 swamps v): speculate there only when the guess is
        safe — not before the first step shows whether a GradScaler is in play, not with
        clipping, not with a GradScaler whose scale speculation cannot read."""
        if self.config.clipping and self.ledger.last_clipped and self._shares_cores():
            return False
        if self.config.rollback != "inverse":
            return True
        if self.ledger.steps_taken == 0 or self.config.clipping:
            return False
        return not self.ledger.amp_seen or self.grad_scaler is not None

    def _shares_cores(self) -> bool:
        host = self.placement.host
        return host is not None and host.cores.shared

    def _on_grad_ready(self, p) -> None:
        if self.closed or not self.boundary or not self.may_speculate():
            return
        idx = self.layout.index.get(p)
        now = []  # the subgroups this grad completes
        for sgi in self._param_sgs.get(idx, ()):
            ready = self._ready[sgi]
            ready.add(idx)
            if len(ready) == len(self._members[sgi]):
                ready.clear()  # a further backward before step() makes it ready again
                now.append(sgi)
        if not now:
            try:
                # the pieces whose CUDA copies have landed go to the worker (a speculation
                # below collects the results that came back itself: HostStepping.speculate)
                self.placement.host.io.poll_if_copying()
            except Exception as e:  # never break the user's backward: step() reports it
                self.error = self.error or e
            return
        for sgi in now:
            try:
                if sgi in self._deferred:
                    self._deferred.remove(sgi)
                self._retry_deferred()
                if not self._speculate(sgi):
                    self._deferred.append(sgi)
            except Exception as e:  # never break the user's backward: step() reports it
                self.error = self.error or e

    def take_error(self):
        """The error of a speculative step during backward, once (None without one)."""
        err, self.error = self.error, None
        return err

    # ------------------------------------------------------------------ a speculative step
    def _scale_key(self):
        """(the attached scaler's scale tensor, its key: whose it is and its version), or
        (None, None) where there is no enabled scaler or it has no scale tensor yet."""
        scaler = self.grad_scaler
        scale_t = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
        if not isinstance(scale_t, torch.Tensor):
            return None, None
        return scale_t, (id(scaler), id(scale_t), scale_t._version)

    def prefetch_scale(self) -> None:
        """zero_grad()'s: the attached GradScaler's scale, as its last update() left it, copied
        to the host without waiting (queued before the forward, it has landed when backward's
        first hook asks for it), so no grad hook syncs for it. A scale changed after this (a
        zero_grad() called before update()) is read as before, once. Nothing is copied where no
        hook is installed (no host subgroup to speculate): only a hook reads it."""
        if not self._hooks:
            return
        scale_t, key = self._scale_key()
        cached = self._inv_scale_cache
        if scale_t is None or (cached is not None and cached[0] == key):
            return
        if self._scale_host is None:
            self._scale_host = torch.empty(1, dtype=torch.float32, pin_memory=scale_t.is_cuda)
        self._scale_host.copy_(scale_t.reshape(-1)[:1], non_blocking=scale_t.is_cuda)
        landed = None  # a CPU scale's copy is done
        if scale_t.is_cuda:
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(scale_t.device))
        self._scale_prefetch = (key, landed)

    def predicted_inv_scale(self) -> float:
        """The loss scale speculation assumes. An attached GradScaler's is read once per step:
        get_scale() copies a CUDA scale to the host (a sync), so where zero_grad() has not
        copied it ahead (prefetch_scale), the first hook of a backward reads it, and later
        hooks reuse it until the scaler updates its scale (the scale tensor's version moves;
        where the scaler has no scale tensor yet it is a plain float)."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return self.ledger.last_inv_scale
        _, key = self._scale_key()
        cached = self._inv_scale_cache
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        ahead = self._scale_prefetch
        if key is not None and ahead is not None and ahead[0] == key:
            if ahead[1] is not None and not ahead[1].query():  # queued before the forward: landed
                ahead[1].synchronize()  # (a wait only for that copy, not for the backward)
            assert self._scale_host is not None  # with the prefetch
            inv = 1.0 / float(self._scale_host[0])
        else:
            inv = 1.0 / float(scaler.get_scale())
        self._scale_prefetch = None
        self._inv_scale_cache = (key, inv)
        return inv

    def _group_inputs(self, gi: int) -> AdamInputs:
        """A param group's hyperparameters for a hook's speculation, read once while they stay the
        same: a tensor lr or beta on a GPU is read by a host sync (`.item()`), so the first hook
        of a backward reads it and later hooks reuse it until the tensor changes in place (its
        version moves) or the group names other values. step() reads them afresh
        (step_failures), and a speculation that stepped with other inputs is redone."""
        group = self.layout.param_groups[gi]
        values = (
            group["lr"],
            *group["betas"],
            group["eps"],
            group["weight_decay"],
            group["maximize"],
            group["amsgrad"],
            group.get("decoupled_weight_decay"),
        )
        key = tuple((id(v), v._version) if isinstance(v, torch.Tensor) else v for v in values)
        cached = self._hp_cache.get(gi)
        if cached is not None and cached[0] == key:
            return cached[2]
        hp = group_inputs(group, self.config.decoupled)
        # the values stay referenced with their key: no other tensor can take their ids meanwhile
        self._hp_cache[gi] = (key, values, hp)
        return hp

    def step_of(
        self, sg, live: list, hp: AdamInputs, scale: float, at_step: bool = False, stale: bool = False
    ) -> tuple:
        """(the subgroup's GradGatherer, the inputs its step depends on), with the step counts
        the params will have once the step begins. The inputs name the grads, so a changed grad
        makes the step stale; their local memory is resolved once for both (the DTensor
        fingerprints resolve it again, at the same moment). `live`: the subgroup's slices whose
        param has a grad; `at_step`: step()'s final inputs (edits since staged then show)."""
        runs = _runs(self.layout.steps, sg, live, 1)
        step = runs[0][2] if runs else self.layout.steps[live[0].param_index] + 1
        # a DTensor grad (FSDP2) is named by its local shard (the memory the step reads) and
        # the versions of both: `dtensor.mul_` bumps only the DTensor's
        versions, grads = self._grad_locals([sl.param.grad for sl in sg.slices])
        gatherer = GradGatherer(sg, grads)
        if at_step and ((stale and sg.index in self._staged) or self._grads_edited(sg, gatherer)):
            versions += ("edited since staged",)  # unscale_, or a foreach edit of DTensor grads: redone
        return gatherer, AdamInputs(
            step,
            hp.lr,
            hp.beta1,
            hp.beta2,
            hp.eps,
            hp.weight_decay,
            hp.decoupled,
            scale * hp.grad_scale,
            versions,
            hp.amsgrad,
            runs,
        )

    def _grads_edited(self, sg, gatherer: GradGatherer) -> bool:
        """At step(): whether a speculated subgroup's DTensor grads changed since it was
        staged in a way no version counter shows (grad_edits.py)."""
        if sg.index not in self._staged or self.fingerprints is None:
            return False
        host = self.placement.host
        return self.fingerprints.is_edited(
            sg.index, gatherer, lambda: host.stepping.piece_stats(sg.index), host.grad_dtype
        )

    def grad_edit_checks(self) -> list:
        """At step(), once the reductions landed, speculated subgroups with DTensor grads
        (grad_edits.py; only where `fingerprints` is set, at install): on CUDA a
        0-dim device flag each (grads edited since staged), queued now for step()'s one read of
        its scalars (read_scalars; `host_work` takes the values read); on CPU their
        live piece sums, computed now while the worker may still be stepping."""
        if not self._staged or self.fingerprints is None:
            return []
        sgs, host = self.layout.subgroups, self.placement.host
        return self.fingerprints.checks(
            lambda sgi: [sl for sl in sgs[sgi].slices if sl.param.grad is not None],
            lambda sgi: gatherer_of(sgs[sgi]),
            lambda sgi: host.stepping.piece_stats(sgi, wait=False),
            host.grad_dtype,
        )

    def host_work(self, host_work, scale: float, edited: list, unscaled: bool = False) -> tuple:
        """step()'s decision for the host tiers, before the step counts advance: ({host-tier
        subgroup: (its GradGatherer, its final AdamInputs)}, {subgroup index: COMMIT | REDO |
        STEP}) for host_work {subgroup index: step_work.HostWork}. A speculation whose inputs
        are the final ones is committed (redone after all if it failed: the outcome says);
        one whose inputs differ (clipping bit, the scale changed, a grad was edited since
        staged: `edited`, the values read back of grad_edit_checks(), in the same order;
        `unscaled`: the user's scaler.unscale_ rewrote every grad in place, which no version
        shows) is redone from the live grads; a subgroup with none is stepped."""
        if self.fingerprints is not None:
            self.fingerprints.note(edited)
        steps, actions = {}, {}
        for i, w in host_work.items():
            gatherer, final = self.step_of(w.sg, w.live, w.hp, scale, True, unscaled)
            staged = self._staged.get(i)
            if staged is None:
                actions[i] = STEP
            elif staged[1] == final:
                # the very inputs it stepped with: finish() sees them as its own, compared once
                actions[i], final = COMMIT, staged[1]
            else:
                actions[i] = REDO
            steps[i] = (gatherer, final)
        return steps, actions

    def _speculate(self, sgi: int) -> bool:
        sg = self.layout.subgroups[sgi]
        live = [sl for sl in sg.slices if sl.param.grad is not None]
        if not live or any(sl.param.grad.layout != torch.strided for sl in live):
            return True  # a sparse grad: step() refuses it, in its own words (step_failures.py)
        hp = self._group_inputs(sg.group)
        # clipping is assumed not to bite (coefficient 1): validation redoes it when it does
        gatherer, inputs = self.step_of(sg, live, hp, self.predicted_inv_scale())
        host = self.placement.host
        self._staged.pop(sgi, None)
        if self.fingerprints is not None:
            self.fingerprints.forget(sgi)
        # any pending speculation of it cancelled first (replace=True)
        if host.stepping.speculate(sgi, gatherer, inputs, wait=False, replace=True):
            # the grads it read stay referenced until it is validated: a grad tensor made after
            # one was discarded (zero_grad, `p.grad = None`) can then never take its address, so
            # (data_ptr, _version) names the same grad for as long as the speculation is pending
            self._staged[sgi] = ([sl.param.grad for sl in live], inputs)
            if self.fingerprints is not None:
                self.fingerprints.record(sgi, live)
            return True
        return False

    def _retry_deferred(self) -> None:
        """Subgroups that found no free bank or staging slot when they became ready are tried
        again as the worker frees them (the hook polled it; backward never waits for the
        worker); those still waiting at step() are stepped there."""
        while self._deferred:
            if not self._speculate(self._deferred[0]):
                return
            self._deferred.pop(0)

    # ------------------------------------------------------------------ after a step
    def forget_ready(self) -> None:
        """Forgets which subgroups' grads were ready: the step they were for is over (or
        zero_grad() discarded them)."""
        for ready in self._ready.values():
            ready.clear()

    def stepped(self) -> None:
        """step()'s host step finished: nothing is staged, ready or deferred any more."""
        self.forget_staged()
        self.forget_ready()
        self._deferred.clear()

    def drop_pending(self) -> dict:
        """Drops every pending speculation and the ready sets (a step skipped or taken without
        host work); returns finish()'s outcome."""
        outcome = self.drop()
        self.forget_ready()
        return outcome

    def drop(self) -> dict:
        """Drops every pending speculation and read ahead (the committed state is untouched);
        returns finish()'s outcome."""
        outcome = {}
        host = self.placement.host
        if host is not None and host.stepping.speculated():
            outcome = host.stepping.finish({}, overflow=True)
        if host is not None:
            host.held.release_reads()  # reads ahead of the next step (read_ahead) too
        self.forget_staged()
        self._deferred.clear()
        return outcome

    def forget_staged(self) -> None:
        host = self.placement.host
        pending = set(host.stepping.speculated()) if host is not None else set()
        self._staged = {k: v for k, v in self._staged.items() if k in pending}
        if self.fingerprints is not None:
            self.fingerprints.keep_only(self._staged)

    # ------------------------------------------------------------------ the user's settings
    def attach_grad_scaler(self, scaler) -> None:
        self.grad_scaler = scaler

    def set_boundary(self, is_boundary: bool) -> None:
        self.boundary = bool(is_boundary)


def _runs(steps: list, sg, live: list, ahead: int) -> tuple:
    """(offset, numel, step) ranges of a subgroup's live slices (their step counts `steps`,
    plus `ahead`), merged where contiguous; () when one run covers the whole subgroup."""
    runs: list[tuple] = []
    for sl in live:
        step = steps[sl.param_index] + ahead
        if runs and runs[-1][0] + runs[-1][1] == sl.sub_offset and runs[-1][2] == step:
            runs[-1] = (runs[-1][0], runs[-1][1] + sl.numel, step)
        else:
            runs.append((sl.sub_offset, sl.numel, step))
    if len(runs) == 1 and runs[0][:2] == (0, sg.numel):
        return ()
    return tuple(runs)


def _own_memory(grads) -> tuple:
    """grad_locals of grads that are their own memory (plain tensors, no process_group)."""
    return tuple((g.data_ptr(), g._version) for g in grads if g is not None), grads


def gatherer_of(sg) -> GradGatherer:
    """A GradGatherer of subgroup `sg`'s grads as they are now."""
    return GradGatherer(sg, grad_locals([sl.param.grad for sl in sg.slices])[1])
