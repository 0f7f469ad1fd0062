"""HybridAdamW / HybridAdam: drop-in torch.optim optimizers whose state is divided by subgroup
between the device, host and nvme tiers.

The classes are real torch.optim.Optimizer subclasses: param groups, named parameters,
lr schedulers and GradScaler work through torch's own protocols, and the numerics follow
torch.optim.AdamW(foreach=False) / Adam within fp32 rounding whatever the placement.
Per-parameter moments and masters live in the tiers; `self.state` holds, as torch's does,
each stepped param's `step` count (a 0-dim float32 tensor), so tools that read it (torch.
distributed.checkpoint) see a trained optimizer. `state_dict()` gathers the full state in
torch's format and `load_state_dict()` scatters it back.

The class is a facade over parts that own their state (docs/code-map.md): the Layout, the
Placement (tiers, planner, moves), the Speculator, the ParamGuard, the StepChecks, the
StepLedger, the StepStats and the distributed part (ZeroSharding or its no-op twin).
"""
from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from hybrid_opt import arguments as A
from hybrid_opt import checkpoint as C
from hybrid_opt import distributed as D
from hybrid_opt import layout as L
from hybrid_opt import lifetime
from hybrid_opt import node
from hybrid_opt import rank_faults as RF
from hybrid_opt.cost_model import DEFAULT_SUBGROUP_NUMEL
from hybrid_opt.ledger import StepLedger
from hybrid_opt.placement import Placement, PlacementConfig, TierEvents, restated
from hybrid_opt.plan import DEVICE
from hybrid_opt.sharding import sharding_for
from hybrid_opt.speculation import GradGatherer, SpeculationConfig, Speculator
from hybrid_opt.step_failures import StepChecks, failure_of
from hybrid_opt.step_stats import StepStats
from hybrid_opt.step_work import DeviceWork, HostWork, group_inputs
from hybrid_opt.storage import ParamGuard
from hybrid_opt.tiers.device import read_scalars
from hybrid_opt.zero_gather import SHARD_KEY, check_shard_owner


class Parts(NamedTuple):
    """What an optimizer is composed of; each part owns its state (docs/code-map.md)."""
    layout: L.Layout
    placement: Placement
    speculator: Speculator
    guard: ParamGuard
    checks: StepChecks
    ledger: StepLedger
    stats: StepStats
    sharding: object        # zero.ZeroSharding, or sharding.NoSharding


class _HybridBase(torch.optim.Optimizer):
    """The torch.optim facade: arguments, param groups, the step and the lifecycle."""
    _decoupled: bool = True
    # GradScaler hands us grad_scale / found_inf and lets step() skip on overflow itself
    _step_supports_amp_scaling = True

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, *, maximize, foreach,
                 capturable, differentiable, fused, max_grad_norm, offload_fraction, nvme_fraction,
                 nvme_path, subgroup_numel, speculative, rollback, device_memory_budget,
                 host_memory_budget, process_group, worker_share=0.5, spare_banks=None,
                 io_banks=4, refit_every=50, calibration=None, overlap_param_gather=False,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, store_param_remainders=False,
                 release_grads=False):
        lifetime.mark_owner(self)  # a forwarding wrapper's calls act on this object (lifetime.py)
        betas = A.check_hyperparameters(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable)
        A.check_constructor(type(self).__name__, amsgrad=amsgrad, capturable=capturable,
                            differentiable=differentiable, fused=fused, foreach=foreach,
                            max_grad_norm=max_grad_norm, rollback=rollback,
                            subgroup_numel=subgroup_numel, device_memory_budget=device_memory_budget,
                            host_memory_budget=host_memory_budget, offload_fraction=offload_fraction,
                            nvme_fraction=nvme_fraction, nvme_path=nvme_path, refit_every=refit_every)
        A.check_release_grads(release_grads, process_group)
        self.state_format = A.check_state_format(exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, rollback)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=self._decoupled)
        self._closed = True  # until the tiers exist
        self._built = False
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.offload_fraction, self.nvme_fraction, self.nvme_path = offload_fraction, nvme_fraction, nvme_path
        self.speculative, self.rollback = speculative, rollback
        self.device_memory_budget, self.host_memory_budget = device_memory_budget, host_memory_budget
        self.worker_share, self.spare_banks, self.io_banks = worker_share, spare_banks, io_banks
        self.refit_every = refit_every
        self.overlap_param_gather = bool(overlap_param_gather)
        node.derive_from_dist()  # the ranks on this node, where the launcher did not say (Lightning's DDP)
        params = [p for g in self.param_groups for p in g["params"]]
        D.warn_replicated(params, process_group)
        self._zero = sharding_for(params, process_group, release_grads)
        if subgroup_numel is None:  # automatic: >= 8 subgroups on this rank where it can (layout.py)
            subgroup_numel = L.auto_subgroup_numel(sum(D.local_of(p).numel() for p in params),
                                                   DEFAULT_SUBGROUP_NUMEL)
        self.subgroup_numel = subgroup_numel
        # the parts (docs/code-map.md); callbacks into this object hold it weakly (lifetime.py)
        weak = lifetime.weak_method
        self._layout = L.Layout(self.param_groups, subgroup_numel, any(g["amsgrad"] for g in self.param_groups))
        self._ledger = StepLedger(self._layout)
        self._step_stats = StepStats(self._layout, self.state_format)
        self._placement = Placement(
            self._layout, PlacementConfig(offload_fraction, nvme_fraction, nvme_path, speculative, rollback,
                                          device_memory_budget, host_memory_budget, worker_share,
                                          spare_banks, io_banks, refit_every, calibration),
            self.state_format, TierEvents(weak(self._drop_speculation), weak(self.wait_params),
                                          weak(self._install_hooks), weak(self._tiers_wrote)))
        self._spec = Speculator(self._layout, self._placement, self._ledger,
                                SpeculationConfig(bool(speculative), rollback, max_grad_norm is not None,
                                                  self._decoupled), self._zero if self._zero.active else None)
        self._guard = ParamGuard(self._layout, self._placement, self.state_format, type(self).__name__,
                                 weak(self._drop_speculation), weak(self._install_hooks))
        self._checks = StepChecks(self._layout, self._placement, type(self).__name__, self._decoupled)
        self._build()

    def _build(self) -> None:
        devices = {p.device for p in self._layout.params()}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        for gi in range(len(self.param_groups)):
            first = len(self._layout.steps)
            self._layout.add_group(gi)
            self._guard.remember(first, self.param_groups[gi]["params"])  # step() checks the params keep it
        self._placement.build()
        self._install_hooks(self._placement.host_subgroups())
        self._guard.record()  # with remainders the host tier writes the params' high halves
        self._built = True
        self._closed = False

    def _install_hooks(self, host: list) -> None:
        """Speculation's grad hooks on the host subgroups `host`, and "auto"'s timing hooks."""
        timing = self._step_stats.time_backward if self._placement.auto is not None else None
        self._spec.install(host, timing)

    def _drop_speculation(self) -> dict:
        return self._spec.drop()

    def _tiers_wrote(self) -> None:
        """A move laid the tiers out again: what they wrote into the params is not the user's
        (storage.py), and the new host tier's worker times start again."""
        self._step_stats.new_host_tier()
        self._guard.record()

    # ------------------------------------------------------------------ param groups
    @lifetime.acts_on_owner
    def add_param_group(self, param_group: dict) -> None:
        param_group = A.check_group_params(type(self).__name__, param_group)
        # a group's own values get the constructor's checks (torch checks only the defaults)
        if any(k in param_group for k in ("lr", "betas", "eps", "weight_decay")):
            get = lambda k: param_group.get(k, self.defaults[k])  # noqa: E731
            betas = A.check_hyperparameters(get("lr"), get("betas"), get("eps"), get("weight_decay"),
                                           foreach=get("foreach"), capturable=get("capturable"))
            if "betas" in param_group:
                param_group["betas"] = betas
        if self._built:
            self._check_open()
            self._layout.check_joining(param_group, self.defaults, self._zero.active)
        super().add_param_group(param_group)
        if self._built:
            self._extend(len(self.param_groups) - 1)

    def _extend(self, gi: int) -> None:
        """add_param_group after construction: the new group laid out and placed (Placement.
        extend). A failure there (the new group's device state cannot be allocated, ...) takes
        the group out again — param_groups, the layout, the tiers and the scheduler as before
        the call — and says so; only the new params keep memory of their own (same values)."""
        before = self._placement.extension_point()
        try:
            sgs = self._layout.add_group(gi)
            self._guard.remember(before.params, self.param_groups[gi]["params"])
            self._placement.extend(sgs)
        except BaseException as e:
            if self._placement.plan is not before.plan:
                raise  # interrupted after the move switched over: the group is laid out
            self._placement.unextend(before)
            self._layout.drop_group(gi, before.params, before.subgroups)
            del self.param_groups[gi]
            self._guard.forget(before.params)
            self._install_hooks(self._placement.host_subgroups())
            if not isinstance(e, Exception):
                raise
            raise restated(e, f"add_param_group: laying out the new group failed, so it was not "
                              f"added (param_groups, the optimizer's state and its tiers are as "
                              f"before the call, and training goes on): {type(e).__name__}: {e}. "
                              f"Fix the cause and add the group again") from e

    # ------------------------------------------------------------------ properties
    @property
    def parts(self) -> Parts:
        """The parts this optimizer is composed of (docs/code-map.md), for introspection and
        tests: each part's public attributes and methods are its interface."""
        return Parts(self._layout, self._placement, self._spec, self._guard, self._checks,
                     self._ledger, self._step_stats, self._zero)

    @property
    def plan(self):
        """The placement now: which tier holds each subgroup (plan.Plan)."""
        return self._placement.plan

    @property
    def stats(self) -> dict:
        """The last step's figures per tier (docs/usage.md)."""
        return self._step_stats.last

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() was skipped (a GradScaler's inf/nan: nothing stepped)."""
        return self._ledger.step_was_skipped

    @property
    def last_grad_norm(self):
        """The global grad norm the last step clipped by (unscaled); None without clipping."""
        return self._ledger.last_grad_norm

    @property
    def allocated_bytes(self) -> dict:
        """{"device", "host", "nvme", "comm"}: the bytes this optimizer holds now, as the OS
        and the allocator report them (allocated.py); all 0 once closed."""
        from hybrid_opt.allocated import allocated_bytes
        if self._closed:
            return allocated_bytes(None, None, None)
        return allocated_bytes(self._placement.device, self._placement.host, self._zero)

    @property
    def closed(self) -> bool:
        """Whether close() ran (or the end of its `with` block): a closed optimizer steps no more."""
        return self._closed

    @property
    def worker_pid(self):
        host = self._placement.host
        return host.worker_pid if host is not None and not self._closed else None

    def _check_open(self) -> None:
        # its host tier closed on its own (the worker's tier shut by anything but close())
        # says the same: a closed tier never steps again, so "call step() again" cannot help
        host = self._placement.host
        if self._closed or (host is not None and host.closed):
            raise RuntimeError(f"this {type(self).__name__} was closed (close(), or the end of its "
                               f"`with` block) and cannot step again: build a new one (its "
                               f"load_state_dict takes this one's last state_dict())")

    # ------------------------------------------------------------------ the user's calls
    @lifetime.acts_on_owner
    def attach_grad_scaler(self, scaler) -> None:
        """Lets speculation read the loss scale that will apply (torch.amp.GradScaler);
        without it, speculation assumes the last step's scale and validation redoes what
        does not match."""
        self._spec.attach_grad_scaler(scaler)

    @lifetime.acts_on_owner
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's vocabulary: False on micro-batches that are not the last before step()
        suppresses speculation on them (their grads are not final). Unannotated accumulation
        stays correct — a grad changed after speculation makes it stale — only slower."""
        self._spec.set_boundary(is_boundary)

    @lifetime.acts_on_owner
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._spec.clear_ready()

    @lifetime.acts_on_owner
    def wait_params(self) -> None:
        """process_group mode: makes every param current on this rank (lands the pending
        all-gathers of the last step, each wait bounded). Call it before reading params outside
        a module's forward — an EMA, model.state_dict(), a param used by another module; a
        module's own params land before its forward by themselves. No-op otherwise."""
        self._zero.wait_gathered()

    @lifetime.acts_on_owner
    def replan(self, offload_fraction: float, nvme_fraction: float = 0.0) -> None:
        """Moves state to another placement now (what a refit of "auto" does); numerics are
        unchanged. Call between steps."""
        self._check_open()
        self._placement.replan(offload_fraction, nvme_fraction)

    # ------------------------------------------------------------------ checkpoints
    @lifetime.acts_on_owner
    def state_dict(self) -> dict:
        """torch's format (checkpoint.gather_state says where each param's state lands)."""
        self.wait_params()
        self._check_open()
        # called between backward and step(): the committed state is what a checkpoint holds;
        # pending speculations are dropped (step() then steps those subgroups itself)
        self._spec.drop()
        self._guard.check_written()  # a param written since the last step: its master restarts first
        sd = super().state_dict()  # param_groups in torch's format (params as indices)
        sd["state"] = C.gather_state(self._layout, self._placement, self.state_format)
        if self._zero.shard() is not None:  # whose chunks these are (torch ignores the key; DCP drops it)
            sd[SHARD_KEY] = self._zero.shard()
        return sd

    @lifetime.acts_on_owner
    def load_state_dict(self, state_dict: dict) -> None:
        self.wait_params()
        check_shard_owner(state_dict.get(SHARD_KEY), self._zero if self._zero.active else None)
        self._check_open()
        # params given new memory since the last step are re-adopted first (storage.py): done
        # at the next step() instead, it would restart the masters this load sets
        self._guard.check()
        self._spec.drop()
        params = list(self._layout.params())
        saved = C.saved_state_of(self.param_groups, state_dict, params)
        if C.wants_amsgrad(state_dict) and not self._layout.amsgrad:
            # the checkpoint needs a running max of v that this optimizer never laid out: lay
            # the tiers out again with it (the state is loaded into them right below)
            self._layout.set_amsgrad(True)
            try:
                self._placement.rebuild()
            except BaseException:
                self._layout.set_amsgrad(False)  # the tiers are as they were (moves.py): so is the layout
                raise
        steps = C.scatter_state(self._layout, self._placement, self.param_groups, state_dict, saved, params)
        # each param's step count, torch's state mirror made again, this rank back in step
        self._ledger.loaded(self.state, steps)
        self._guard.record()  # with remainders a load writes the params' high halves

    # ------------------------------------------------------------------ the step
    @lifetime.acts_on_owner
    @torch.no_grad()
    def step(self, closure=None):
        try:
            return self._step(closure)
        except BaseException:
            # GradScaler.step sets these for one call and deletes them only after a return: a
            # step that raised (a refusal, a failure) would otherwise scale the next by them
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t_step = time.perf_counter()
        self._check_open()
        # a failure on this rank joins the decision all_reduce flagged, so every rank raises at
        # this step instead of waiting for this one in a collective (rank_faults.py)
        failure = self._ledger.rank_failure
        err = self._spec.take_error()
        if err is not None:
            failure = failure or RF.with_cause(f"a speculative host step during backward failed: {err}", err)
            RF.quietly(self._spec.drop, failure)  # still joins the others' collective
        # process_group: always, so that a grad edit one rank refuses (zero_edits.py) stops
        # every rank at this step (one 5-value all_reduce beside the step's reduce-scatters)
        decides = (RF.decision_runs(self.max_grad_norm, getattr(self, "found_inf", None))
                   or (self._zero.active and D.world_size() > 1))
        if failure is not None and not decides:
            raise failure
        try:
            self._guard.check()  # a param whose memory was replaced is re-adopted (storage.py)
            self._checks.check_inputs()  # what a tier would fail on part-way (step_failures.py)
        except Exception as e:
            if not decides:  # no collective of ours this step: raised here, as in one process
                raise
            # the step's collectives still run on this rank, the error in the decision's flag
            failure = failure or e
        try:  # process_group: the last step's params landed, every grad's averaged chunk in place
            self._zero.wait_gathered()
            self._zero.finish()
            given = getattr(self, "found_inf", None)
            found, refused = self._zero.scaler_found_inf(given, self._spec.grad_scaler, id(self))
            if found is not given:  # release_grads: this rank's chunks' flag added (zero_release.py)
                self.found_inf = found  # GradScaler's protocol attribute, read below
            failure = failure or refused
            # GradScaler.step hands no grad_scale for grads unscaled already (unscale_)
            unscaled = getattr(self, "found_inf", None) is not None and getattr(self, "grad_scale", None) is None
            failure = failure or self._zero.grad_edit_error(unscaled)
            if failure is not None and not decides:
                raise failure
            return self._step_taken(loss, t_step, failure, decides)
        finally:
            self._zero.end_step()

    def _step_taken(self, loss, t_step, failure, decides: bool):
        scale_t = getattr(self, "grad_scale", None)
        found_t = getattr(self, "found_inf", None)
        # torch.distributed.checkpoint's lr-0 step on a fresh optimizer: decided here from this
        # rank's grads when no decision all_reduce runs (no collective either way); else every
        # rank's vote rides it, so no rank skips the collective that another enters
        init = failure is None and C.looks_like_state_init_step(self._layout, self._decoupled)
        if init and not decides:
            return self._state_init_step(loss)
        self._ledger.saw_amp(found_t)  # GradScaler.step sets found_inf
        # on a GPU, clipping's norm² is queued first so that it, found_inf and the loss scale
        # reach the host in one small copy: at most one sync per step (docs/usage.md: host syncs)
        clipping = self.max_grad_norm is not None
        norm_sq = D.grad_norm_sq(self._layout.params()) if clipping and failure is None and self._layout.cuda() else None
        # with the flags of DTensor grads edited since speculation staged them (CUDA; grad_edits.py)
        found, scale_v, norm_sq, *edited = read_scalars((found_t, scale_t, norm_sq, *self._spec.grad_edit_checks()))
        self._spec.note_grad_edits(edited)
        if decides:
            # one decision for all ranks: norm² and found_inf summed in one all_reduce
            if clipping and norm_sq is None:
                norm_sq = D.grad_norm_sq(self._layout.params()) if failure is None else 0.0
            try:
                norm_sq, found, all_init = RF.agree(norm_sq, found, failure, init_vote=init)
            except Exception as e:  # a rank failed (or the collective did): nothing is stepped
                RF.quietly(self._spec.drop, e)
                self._spec.clear_ready()
                raise
            if all_init:
                return self._state_init_step(loss)
            if found is not None:
                D.globalize_scaler_found_inf(self._spec.grad_scaler, self, found)
        if found is not None and found != 0.0:
            # GradScaler saw inf/nan: the whole step is skipped, exactly as torch does
            self._ledger.skipped()
            self._step_stats.skipped(self._placement.host, len(self._spec.drop_pending()))
            return loss
        inv_scale = 1.0 / scale_v if scale_t is not None else 1.0
        # the global norm costs a pass over every grad: only clipping needs it
        norm, clip = None, 1.0
        if clipping:
            if norm_sq is None:  # a CPU host sums it here, once the step is known not skipped
                norm_sq = D.grad_norm_sq(self._layout.params())
            norm = math.sqrt(norm_sq) * inv_scale
            coef = self.max_grad_norm / (norm + 1e-6)
            clip = coef if (coef < 1.0 or coef != coef) else 1.0  # torch clamps at 1; NaN stays
        # put back if the step fails with nothing stepped; the params with a grad advance
        undo = self._ledger.begin(self.state, inv_scale if scale_t is not None else None, norm)
        scale = inv_scale * clip
        device_work, host_steps = self._collect_work()
        why = self._checks.device_scale_error(device_work, scale)
        if why is not None:
            self._step_failed(ValueError(why), None, {}, set(), device_work, [], [], undo)
        # host tiers first: a failure there (a full disk, a worker error) then leaves the device
        # tier unstepped, and the step counts of every parameter no committed subgroup holds
        # are put back, so a checkpoint taken afterwards is the previous step for them
        t_host = time.perf_counter()
        # process_group: each bucket's gather starts as the subgroups holding its chunks commit
        self._zero.expect_commits({**{i: [sl.param for sl in w.live] for i, w in host_steps.items()},
                                   "device": [w.slice.param for w in device_work]},
                                  direct=not self.overlap_param_gather)
        if host_steps:
            committed: set = set()
            try:
                self._step_host(host_steps, scale, committed)
            except BaseException as e:  # each param stepped or untouched (step_failures.py)
                self._step_failed(e, "the host/nvme tier", host_steps, committed, device_work, [], [], undo)
        t_device = time.perf_counter()
        # "auto" times the device step on the device's clock (GPU time on CUDA: clocks.py)
        auto = self._placement.auto
        d0 = self._step_stats.mark() if auto is not None else None
        self._step_device(device_work, scale, host_steps, undo)
        self._guard.record()  # this step's writes to the params are not the user's (storage.py)
        d1 = self._step_stats.mark() if auto is not None else None
        t_end = time.perf_counter()
        if self._zero.active:
            self._gather_params()
            t_end = time.perf_counter()
        self._step_stats.record(self._placement.plan, self._placement.host, self._placement.host_local,
                                host_steps, device_work, t_device - t_host, t_end - t_device, norm, clip)
        if auto is not None:  # the measured times to the scheduler, which may refit
            self._step_stats.queue_sample(self._ledger.steps_taken, device_work, t_end - t_step, (d0, d1))
            self._step_stats.observe(auto)
            self._placement.refit(self._ledger.steps_taken)
            self._step_stats.predicted(self._placement.plan.prediction)
        return loss

    def _state_init_step(self, loss):
        """The state-init step (checkpoint.looks_like_state_init_step): the step counts advance,
        the tiers (all zeros, masters equal to the params) stay as they are."""
        self._spec.drop_pending()
        self._ledger.state_init_step(self.state, clipping=self.max_grad_norm is not None)
        return loss

    def _collect_work(self) -> tuple:
        """(the device tier's DeviceWork entries, {host subgroup index: HostWork}) of this step."""
        groups = [group_inputs(g, self._decoupled) for g in self.param_groups]
        device_work, host_steps = [], {}
        tiers, steps = self._placement.plan.tiers, self._layout.steps
        for sg in self._layout.subgroups:
            live = self._layout.live(sg)
            if not live:
                continue
            hp = groups[sg.group]
            if tiers[sg.index] == DEVICE:
                device_work.extend(DeviceWork(sg.index, sl, hp, steps[sl.param_index]) for sl in live)
            else:
                host_steps[sg.index] = HostWork(sg, live, hp)
        return device_work, host_steps

    def _step_host(self, host_steps: dict, scale: float, committed: set) -> None:
        local = self._placement.host_local
        work = {local[i]: (GradGatherer(w.sg), self._spec.host_inputs(w.sg, w.live, w.hp, scale, 0))
                for i, w in host_steps.items()}
        by_local = {local[i]: w for i, w in host_steps.items()}

        def copy_params(k: int, views: dict) -> None:
            # the new params reach the model only once their step is committed
            sg, live = by_local[k].sg, by_local[k].live
            src = views["param_copy"] if (sg.dtype != torch.float32 and "param_copy" in views) else views["param"]
            # one blocking batched copy into the live slices (an nvme subgroup's buffer is
            # reused as soon as this returns): on CUDA one host sync, not one per slice
            sg.write(src, slices=live)
            committed.add(sg.index)
            self._zero.committed(sg.index)  # process_group: its buckets' gathers may start (zero_gather.py)

        try:
            outcome = self._placement.host.finish(work, on_commit=copy_params)
        finally:
            self._spec.forget_staged()
        self._spec.stepped()
        index_of = {k: i for i, k in local.items()}
        self._step_stats.note_outcome({index_of[k]: v for k, v in outcome.items()})

    def _step_device(self, device_work: list, scale, host_steps: dict, undo) -> None:
        """The device tier's step (after the host tiers committed every subgroup)."""
        device = self._placement.device
        try:
            device.step(device_work, scale)
        except BaseException as e:
            done, unsure = device.progress
            self._step_failed(e, "the device tier", host_steps, set(host_steps), device_work, done, unsure, undo)

    def _step_failed(self, e: BaseException, where, host_steps: dict, committed: set, device_work: list,
                     done: list, unsure: list, undo) -> None:
        """Raises `e` explained, after putting back the step count of every parameter the
        failed step did not touch (step_failures.py)."""
        world = D.world_size()
        f = failure_of(type(self).__name__, e, where, host_steps, committed, device_work, done, unsure,
                       world, self._zero.active)
        self._ledger.put_back(undo, f.untouched, f.nothing_stepped)
        self._ledger.sync_torch_state(self.state)
        self._guard.record()  # what was stepped was written by the step, not the user
        if not isinstance(e, Exception):  # KeyboardInterrupt and the like: counts fixed, as it is
            raise e
        if world > 1:  # the others stepped: our next step() stops them all
            self._ledger.out_of_step(f.error)
        if self._zero.active:
            # the others all-gather their stepped chunks now: this rank joins (its params
            # then hold their new chunks and its own chunk as its tiers left it), so the
            # next collectives still pair in order and its next step() stops every rank
            RF.quietly(self._gather_params, f.error)
        raise f.error from e

    def _gather_params(self) -> None:
        self._zero.gather(direct=not self.overlap_param_gather)  # waited at once: into the params
        if not self.overlap_param_gather:
            # the params are current when step() returns (as DeepSpeed's ZeRO-2); the
            # overlapped mode lands each bucket as its params are next used (zero.py), and
            # a read outside a forward then needs wait_params() first: opt-in
            self._zero.wait_gathered()

    # ------------------------------------------------------------------ lifecycle
    @lifetime.acts_on_owner
    def close(self) -> None:
        """Idempotent. Stops the worker, frees shared memory, restores the trainer's cores and
        thread counts; parameters keep ordinary memory of their own."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._spec.close()
        self._step_stats.remove_hooks()
        self._zero.close()  # pending all-gathers landed: the params are current after close()
        self._placement.close()  # restores the cores and both thread counts (CoreSplit)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # only the optimizer that built the tiers closes them: a forwarding wrapper's __del__
        # (Lightning's, collected when it rebuilds them) must not (lifetime.py)
        if not lifetime.is_owner(self) or getattr(self, "_closed", True):
            return
        try:
            self.close()  # first: a warning made an error (-W error) must not keep it open
        except Exception:
            pass
        try:
            lifetime.warn_unclosed(self)
        except Exception:
            pass

    def __repr__(self) -> str:
        return super().__repr__() + f"\n{self.plan}" if getattr(self, "_built", False) else super().__repr__()


class HybridAdamW(_HybridBase):
    """torch.optim.AdamW's signature and defaults (decoupled weight decay), plus placement.

    See the README (one line per argument) and docs/usage.md for the hybrid arguments."""
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=None, offload_fraction=1.0,
                 nvme_fraction=0.0, nvme_path=None, subgroup_numel=None,
                 speculative=True, rollback="exact", device_memory_budget=None,
                 host_memory_budget=None, process_group=None, **hybrid):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, max_grad_norm=max_grad_norm, offload_fraction=offload_fraction,
                         nvme_fraction=nvme_fraction, nvme_path=nvme_path,
                         subgroup_numel=subgroup_numel, speculative=speculative, rollback=rollback,
                         device_memory_budget=device_memory_budget,
                         host_memory_budget=host_memory_budget, process_group=process_group, **hybrid)


class HybridAdam(_HybridBase):
    """torch.optim.Adam's signature and defaults (weight_decay=0, L2 decay), plus placement."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=None, offload_fraction=1.0,
                 nvme_fraction=0.0, nvme_path=None, subgroup_numel=None,
                 speculative=True, rollback="exact", device_memory_budget=None,
                 host_memory_budget=None, process_group=None, **hybrid):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, max_grad_norm=max_grad_norm, offload_fraction=offload_fraction,
                         nvme_fraction=nvme_fraction, nvme_path=nvme_path,
                         subgroup_numel=subgroup_numel, speculative=speculative, rollback=rollback,
                         device_memory_budget=device_memory_budget,
                         host_memory_budget=host_memory_budget, process_group=process_group, **hybrid)
