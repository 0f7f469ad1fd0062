"""HybridAdamW / HybridAdam: drop-in torch.optim optimizers whose state is divided by subgroup
between the device, host and nvme tiers.

The classes are real torch.optim.Optimizer subclasses: param groups, named parameters,
lr schedulers and GradScaler work through torch's own protocols, and the numerics follow
torch.optim.AdamW(foreach=False) / Adam within fp32 rounding whatever the placement.
Per-parameter moments and masters live in the tiers; `self.state` holds, as torch's does,
each stepped param's `step` count (a 0-dim float32 tensor), so tools that read it (torch.
distributed.checkpoint) see a trained optimizer. `state_dict()` gathers the full state in
torch's format and `load_state_dict()` scatters it back.
"""
from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from hybrid_opt import arguments as A
from hybrid_opt import distributed as D
from hybrid_opt import layout as L
from hybrid_opt import lifetime
from hybrid_opt.ledger import StepLedger
from hybrid_opt import node
from hybrid_opt import rank_faults as RF
from hybrid_opt.checkpoint import CheckpointMixin
from hybrid_opt.cost_model import DEFAULT_SUBGROUP_NUMEL
from hybrid_opt.placement import Placement, PlacementConfig, TierEvents, restated
from hybrid_opt.plan import DEVICE
from hybrid_opt.speculation import GradGatherer, SpeculationMixin
from hybrid_opt.step_failures import StepFailureMixin
from hybrid_opt.step_stats import StepStats
from hybrid_opt.step_work import DeviceWork, HostWork
from hybrid_opt.storage import StorageMixin
from hybrid_opt.tiers.device import read_scalars
from hybrid_opt.tiers.host import StepInputs
from hybrid_opt.zero import ZeroParamsMixin


class Parts(NamedTuple):
    """What an optimizer is composed of; each part owns its state (docs/code-map.md)."""
    layout: L.Layout
    ledger: StepLedger
    stats: StepStats
    placement: Placement


def _float_hyper(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value.item())
    return float(value)


class _HybridBase(ZeroParamsMixin, SpeculationMixin, CheckpointMixin,
                  StorageMixin, StepFailureMixin, torch.optim.Optimizer):
    """The torch.optim facade: arguments, param groups, the step and the lifecycle. Layout,
    speculation, checkpoints and stats are mixins, each in a module of its own."""
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
        betas = A.check_hyperparameters(lr, betas, eps, weight_decay, foreach=foreach,
                                         capturable=capturable)
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
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=self._decoupled)
        self._closed = True  # until the tiers exist
        self._built = False
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.offload_fraction, self.nvme_fraction, self.nvme_path = offload_fraction, nvme_fraction, nvme_path
        self.subgroup_numel = subgroup_numel
        self.speculative, self.rollback = speculative, rollback
        self.device_memory_budget, self.host_memory_budget = device_memory_budget, host_memory_budget
        self.worker_share, self.spare_banks, self.io_banks = worker_share, spare_banks, io_banks
        self.refit_every, self._calibration = refit_every, calibration
        self._grad_scaler = None
        self._accumulation_boundary = True
        self._speculation_error = None
        self._deferred: list = []
        self._zero = None
        self.overlap_param_gather = bool(overlap_param_gather)
        # the ranks on this node, where the launcher did not say (Lightning's DDP): collective
        node.derive_from_dist()
        params = [p for g in self.param_groups for p in g["params"]]
        D.warn_replicated(params, process_group)
        if process_group is not None:
            # registered before the layout: each param's slices are then of its dim-0 chunk
            from hybrid_opt.zero import ZeroSharding
            self._zero = ZeroSharding(params, process_group, release_grads=release_grads)
        if self.subgroup_numel is None:  # automatic: >= 8 subgroups on this rank where it can (layout.py)
            self.subgroup_numel = L.auto_subgroup_numel(sum(D.local_of(p).numel() for p in params),
                                                        DEFAULT_SUBGROUP_NUMEL)
        self._layout = L.Layout(self.param_groups, self.subgroup_numel,
                                any(g["amsgrad"] for g in self.param_groups))
        self._ledger = StepLedger(self._layout)
        self._step_stats = StepStats(self._layout, self.state_format)
        config = PlacementConfig(offload_fraction, nvme_fraction, nvme_path, speculative, rollback,
                                 device_memory_budget, host_memory_budget, worker_share, spare_banks,
                                 io_banks, refit_every, calibration)
        events = TierEvents(self._drop_speculation, self.wait_params, self._install_hooks, self._tiers_wrote)
        self._placement = Placement(self._layout, config, self.state_format, events)
        self._build()

    def _build(self) -> None:
        devices = {p.device for p in self._layout.params()}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        for gi in range(len(self.param_groups)):
            first = len(self._layout.steps)
            self._layout.add_group(gi)
            self._remember_storage(first, self.param_groups[gi]["params"])  # step() checks the params keep it
        self._placement.build()
        self._install_hooks(self._placement.host_subgroups())
        self._record_versions()  # with remainders the host tier writes the params' high halves
        self._built = True
        self._closed = False

    def _tiers_wrote(self) -> None:
        """A move laid the tiers out again: what they wrote into the params is not the user's
        (storage.py), and the new host tier's worker times start again."""
        self._step_stats.new_host_tier()
        self._record_versions()

    def _extend(self, gi: int) -> None:
        """add_param_group after construction: the new group laid out and placed (Placement.
        extend). A failure there (the new group's device state cannot be allocated, ...) takes
        the group out again: param_groups, the layout, the tiers and the scheduler as before
        the call, the error raised saying so."""
        before = self._placement.extension_point()
        try:
            sgs = self._layout.add_group(gi)
            self._remember_storage(before.params, self.param_groups[gi]["params"])
            self._placement.extend(sgs)
        except BaseException as e:
            if self._placement.plan is not before.plan:
                raise  # interrupted after the move switched over: the group is laid out
            self._placement.unextend(before)
            self._layout.drop_group(gi, before.params, before.subgroups)
            del self.param_groups[gi]
            self._forget_storage(before.params)
            self._install_hooks(self._placement.host_subgroups())
            if not isinstance(e, Exception):
                raise
            raise restated(e, f"add_param_group: laying out the new group failed, so it was not "
                              f"added (param_groups, the optimizer's state and its tiers are as "
                              f"before the call, and training goes on): {type(e).__name__}: {e}. "
                              f"Fix the cause and add the group again") from e

    @lifetime.acts_on_owner
    def replan(self, offload_fraction: float, nvme_fraction: float = 0.0) -> None:
        """Moves state to another placement now (what a refit of "auto" does); numerics are
        unchanged. Call between steps."""
        self._check_open()
        self._placement.replan(offload_fraction, nvme_fraction)

    @property
    def plan(self):
        """The placement now: which tier holds each subgroup (plan.Plan)."""
        return self._placement.plan

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
            if getattr(self, "_zero", None) is not None:
                raise NotImplementedError("add_param_group with process_group=: the new params "
                                          "would need their chunks laid out on every rank; build "
                                          "the optimizer with all its param groups")
            if param_group.get("amsgrad", self.defaults["amsgrad"]) and not self._layout.amsgrad:
                raise ValueError("add_param_group: an amsgrad group cannot join an optimizer built "
                                 "without amsgrad; construct it with amsgrad=True")
            have = {p.device for p in self._layout.params()}
            new = {t.device for t in (i[1] if isinstance(i, tuple) else i for i in param_group["params"])
                   if isinstance(t, torch.Tensor)}
            if have and new - have:
                raise ValueError(f"add_param_group: all parameters must be on one device; the "
                                 f"optimizer's are on {sorted(map(str, have))}, the new group's on "
                                 f"{sorted(map(str, new))}: move the group to that device first")
        super().add_param_group(param_group)
        if self._built:
            self._extend(len(self.param_groups) - 1)

    # ------------------------------------------------------------------ properties
    @property
    def parts(self) -> Parts:
        """The parts this optimizer is composed of (docs/code-map.md), for introspection and
        tests: each part's public attributes and methods are its interface."""
        return Parts(self._layout, self._ledger, self._step_stats, self._placement)

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
    def worker_pid(self):
        return self._placement.host.worker_pid if self._placement.host is not None and not self._closed else None

    def _check_open(self) -> None:
        # its host tier closed on its own (the worker's tier shut by anything but close())
        # says the same: a closed tier never steps again, so "call step() again" cannot help
        if self._closed or (self._placement.host is not None and self._placement.host.closed):
            raise RuntimeError(f"this {type(self).__name__} was closed (close(), or the end of its "
                               f"`with` block) and cannot step again: build a new one (its "
                               f"load_state_dict takes this one's last state_dict())")

    # ------------------------------------------------------------------ the step
    def _hyper(self, group: dict, grad_sign: float) -> StepInputs:
        b1, b2 = group["betas"]
        return StepInputs(0, _float_hyper(group["lr"], "lr"), _float_hyper(b1, "betas[0]"),
                          _float_hyper(b2, "betas[1]"), float(group["eps"]), float(group["weight_decay"]),
                          self._decoupled, grad_sign, (), bool(group["amsgrad"]))

    def _grad_norm_sq(self):
        """The grads' squared global norm: a float summed here on a CPU host; on CUDA a 0-dim
        fp64 device tensor, queued and not read (step() reads it with found_inf and the scale)."""
        params = [p for p in self._layout.params() if p.grad is not None]
        if not params:
            return 0.0
        # this rank's grads (a DTensor's local shard), grouped by how many ranks hold a replica
        # of them: under torch.distributed each element counts once (distributed.py)
        world = D.world_size()
        by_replicas: dict = {}
        for p in params:
            by_replicas.setdefault(D.replicas(p) if world > 1 else 1, []).append(D.local_of(p.grad))
        if params[0].is_cuda:
            import gpu_kernels
            total = None
            for r, grads in by_replicas.items():
                s, _ = gpu_kernels.grad_stats([g.contiguous() for g in grads], sum_dtype=torch.float64)
                s = s / r if r != 1 else s
                total = s if total is None else total + s
            return total
        import cpu_kernels
        partials = []
        for r, grads in by_replicas.items():
            total = 0.0
            for g in grads:
                s, _ = cpu_kernels.grad_stats(g.contiguous())
                total += s
            partials.append((total, r))
        return D.weighted_norm_sq(partials)

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
        if self._speculation_error is not None:
            err, self._speculation_error = self._speculation_error, None
            failure = failure or RF.with_cause(f"a speculative host step during backward failed: {err}", err)
            RF.quietly(self._drop_speculation, failure)  # still joins the others' collective
        # process_group: always, so that a grad edit one rank refuses (zero_edits.py) stops
        # every rank at this step (one 5-value all_reduce beside the step's reduce-scatters)
        decides = (RF.decision_runs(self.max_grad_norm, getattr(self, "found_inf", None))
                   or (self._zero is not None and D.world_size() > 1))
        if failure is not None and not decides:
            raise failure
        try:
            self._check_storage()  # a param whose memory was replaced is re-adopted (storage.py)
            self._check_step_inputs()  # what a tier would fail on part-way (step_failures.py)
        except Exception as e:
            if not decides:  # no collective of ours this step: raised here, as in one process
                raise
            # the step's collectives still run on this rank, the error in the decision's flag
            failure = failure or e
        if self._zero is not None:
            try:  # the last step's params landed, every grad's averaged chunk in place (zero.py)
                self._zero.wait_gathered()
                self._zero.finish()
                failure = failure or self._zero.scaler_found_inf(self)  # release_grads (zero_release.py)
                # GradScaler.step hands no grad_scale for grads unscaled already (unscale_)
                unscaled = getattr(self, "found_inf", None) is not None and getattr(self, "grad_scale", None) is None
                failure = failure or self._zero.grad_edit_error(unscaled)
                if failure is not None and not decides:
                    raise failure
                return self._step_taken(loss, t_step, failure, decides)
            finally:
                self._zero.end_step()
        return self._step_taken(loss, t_step, failure, decides)

    def _step_taken(self, loss, t_step, failure, decides: bool):
        scale_t = getattr(self, "grad_scale", None)
        found_t = getattr(self, "found_inf", None)
        # torch.distributed.checkpoint's lr-0 step on a fresh optimizer: decided here from this
        # rank's grads when no decision all_reduce runs (no collective either way); else every
        # rank's vote rides it, so no rank skips the collective that another enters
        init = failure is None and self._looks_like_state_init_step()
        if init and not decides:
            self._take_state_init_step()
            return loss
        self._ledger.saw_amp(found_t)  # GradScaler.step sets found_inf
        # on a GPU, clipping's norm² is queued first so that it, found_inf and the loss scale
        # reach the host in one small copy: at most one sync per step (docs/usage.md: host syncs)
        norm_sq = None
        if (self.max_grad_norm is not None and failure is None and self._layout.subgroups
                and self._layout.subgroups[0].device.type == "cuda"):
            norm_sq = self._grad_norm_sq()
        # with the flags of DTensor grads edited since speculation staged them (CUDA; grad_edits.py)
        found, scale_v, norm_sq, *edited = read_scalars((found_t, scale_t, norm_sq, *self._grad_edit_checks()))
        self._note_grad_edits(edited)
        if decides:
            # one decision for all ranks: norm² and found_inf summed in one all_reduce
            if self.max_grad_norm is not None and norm_sq is None:
                norm_sq = self._grad_norm_sq() if failure is None else 0.0
            try:
                norm_sq, found, all_init = RF.agree(norm_sq, found, failure, init_vote=init)
            except Exception as e:  # a rank failed (or the collective did): nothing is stepped
                RF.quietly(self._drop_speculation, e)
                self._clear_ready()
                raise
            if all_init:
                self._take_state_init_step()
                return loss
            if found is not None:
                D.globalize_scaler_found_inf(self._grad_scaler, self, found)
        if found is not None and found != 0.0:
            # GradScaler saw inf/nan: the whole step is skipped, exactly as torch does
            self._ledger.skipped()
            dropped = self._drop_pending()
            self._step_stats.skipped(self._placement.host, len(dropped))
            return loss
        inv_scale = 1.0 / scale_v if scale_t is not None else 1.0
        # the global norm costs a pass over every grad: only clipping needs it
        norm = None
        clip = 1.0
        if self.max_grad_norm is not None:
            if norm_sq is None:  # a CPU host sums it here, once the step is known not skipped
                norm_sq = self._grad_norm_sq()
            norm = math.sqrt(norm_sq) * inv_scale
            coef = self.max_grad_norm / (norm + 1e-6)
            clip = coef if (coef < 1.0 or coef != coef) else 1.0  # torch clamps at 1; NaN stays
        # put back if the step fails with nothing stepped; the params with a grad advance
        undo = self._ledger.begin(self.state, inv_scale if scale_t is not None else None, norm)
        scale = inv_scale * clip
        groups = [self._hyper(g, -1.0 if g["maximize"] else 1.0) for g in self.param_groups]

        device_work, host_steps = [], {}
        for sg in self._layout.subgroups:
            hp = groups[sg.group]
            live = [sl for sl in sg.slices if sl.param.grad is not None]
            if not live:
                continue
            if self._placement.plan.tiers[sg.index] == DEVICE:
                device_work.extend(DeviceWork(sg.index, sl, hp, self._layout.steps[sl.param_index]) for sl in live)
            else:
                host_steps[sg.index] = HostWork(sg, live, hp)
        self._check_device_scale(device_work, scale, undo)
        # host tiers first: a failure there (a full disk, a worker error) then leaves the device
        # tier unstepped, and the step counts of every parameter no committed subgroup holds
        # are put back, so a checkpoint taken afterwards is the previous step for them
        t_host = time.perf_counter()
        self._expect_gathers(host_steps, device_work)  # process_group: gathers start as commits land
        if host_steps:
            committed: set = set()
            try:
                self._step_host(host_steps, scale, committed)
            except BaseException as e:  # each param stepped or untouched (step_failures.py)
                self._step_failed(e, "the host/nvme tier", host_steps, committed, device_work, [], [], undo)
        t_device = time.perf_counter()
        # "auto" times the device step on the device's clock (GPU time on CUDA: clocks.py)
        d0 = self._step_stats.mark() if self._placement.auto is not None else None
        self._step_device(device_work, scale, host_steps, undo)
        self._record_versions()  # this step's writes to the params are not the user's (storage.py)
        d1 = self._step_stats.mark() if self._placement.auto is not None else None
        t_end = time.perf_counter()
        if self._zero is not None:
            self._gather_params()
            t_end = time.perf_counter()
        self._step_stats.record(self._placement.plan, self._placement.host, self._placement.host_local, host_steps, device_work,
                                t_device - t_host, t_end - t_device, norm, clip)
        if self._placement.auto is not None:  # the measured times to the scheduler, which may refit
            self._step_stats.queue_sample(self._ledger.steps_taken, device_work, t_end - t_step, (d0, d1))
            self._step_stats.observe(self._placement.auto)
            self._placement.refit(self._ledger.steps_taken)
            self._step_stats.predicted(self._placement.plan.prediction)
        return loss

    def _gather_params(self) -> None:
        self._zero.gather(direct=not self.overlap_param_gather)  # waited at once: into the params
        if not self.overlap_param_gather:
            # the params are current when step() returns (as DeepSpeed's ZeRO-2); the
            # overlapped mode lands each bucket as its params are next used (zero.py), and
            # a read outside a forward then needs wait_params() first: opt-in
            self._zero.wait_gathered()

    def _step_host(self, host_steps: dict, scale: float, committed: set) -> None:
        work = {}
        for index, w in host_steps.items():
            work[self._placement.host_local[index]] = (GradGatherer(w.sg), self._host_inputs(w.sg, w.live, w.hp, scale, 0))
        by_local = {self._placement.host_local[index]: w for index, w in host_steps.items()}

        def copy_params(local: int, views: dict) -> None:
            # the new params reach the model only once their step is committed
            sg, live = by_local[local].sg, by_local[local].live
            src = views["param_copy"] if (sg.dtype != torch.float32 and "param_copy" in views) else views["param"]
            # one blocking batched copy into the live slices (an nvme subgroup's buffer is
            # reused as soon as this returns): on CUDA one host sync, not one per slice
            sg.write(src, slices=live)
            committed.add(sg.index)
            self._committed(sg.index)  # process_group: its buckets' gathers may start (zero_gather.py)

        try:
            outcome = self._placement.host.finish(work, on_commit=copy_params)
        finally:
            self._forget_staged()
        self._clear_ready()
        self._deferred.clear()
        index_of = {local: index for index, local in self._placement.host_local.items()}
        self._step_stats.note_outcome({index_of[local]: v for local, v in outcome.items()})
    # ------------------------------------------------------------------ lifecycle
    @lifetime.acts_on_owner
    def close(self) -> None:
        """Idempotent. Stops the worker, frees shared memory, restores the trainer's cores and
        thread counts; parameters keep ordinary memory of their own."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []
        self._step_stats.remove_hooks()
        if getattr(self, "_zero", None) is not None:
            self._zero.close()  # pending all-gathers landed: the params are current after close()
        self._placement.close()

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
        return super().__repr__() + f"\n{self._placement.plan}" if getattr(self, "_built", False) else super().__repr__()


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
