"""HybridAdamW / HybridAdam: drop-in torch.optim optimizers whose state is divided by subgroup
between the device, host and (later) nvme tiers.

The classes are real torch.optim.Optimizer subclasses: param groups, named parameters,
lr schedulers and GradScaler work through torch's own protocols, and the numerics follow
torch.optim.AdamW(foreach=False) / Adam within fp32 rounding whatever the placement.
Per-parameter state lives in the tiers, not in `self.state`; `state_dict()` gathers it in
torch's format and `load_state_dict()` scatters it back.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import NamedTuple

import torch

from hybrid_opt import layout as L
from hybrid_opt.plan import DEVICE, HOST, NVME, check_fractions, fraction_plan
from hybrid_opt.swap import check_nvme_path
from hybrid_opt.tiers.device import DeviceTier
from hybrid_opt.tiers.host import HostTier, StepInputs, staging_slots_for

DEFAULT_SUBGROUP_NUMEL = 1 << 22  # 4Mi elements: 16 MB of fp32 master, 48 MB of state
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _float_hyper(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value.item())
    return float(value)


class _HybridBase(torch.optim.Optimizer):
    _decoupled: bool = True
    # GradScaler hands us grad_scale / found_inf and lets step() skip on overflow itself
    _step_supports_amp_scaling = True

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, *, maximize, foreach,
                 capturable, differentiable, fused, max_grad_norm, offload_fraction, nvme_fraction,
                 nvme_path, subgroup_numel, speculative, rollback, device_memory_budget,
                 host_memory_budget, process_group, worker_share=0.5, spare_banks=None,
                 io_banks=4, refit_every=50, calibration=None):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if capturable:
            raise ValueError(f"{type(self).__name__} does not support capturable=True (CUDA graph "
                             f"capture): its host tier steps in another process")
        if differentiable:
            raise ValueError(f"{type(self).__name__} does not support differentiable=True")
        if fused is False or foreach is True:
            pass  # accepted: every path of ours is fused already; the flag changes nothing
        if process_group is not None:
            raise NotImplementedError("process_group: distributed support is not built yet; "
                                      "use one process per optimizer (process_group=None)")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                              and not isinstance(max_grad_norm, bool)
                                              and max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
        if rollback not in ("exact", "inverse"):
            raise ValueError(f"rollback must be 'exact' or 'inverse', got {rollback!r}")
        if rollback == "inverse" and amsgrad:
            raise ValueError("rollback='inverse' cannot undo amsgrad (its running max of v is not "
                             "invertible); use rollback='exact' with amsgrad=True")
        if not isinstance(subgroup_numel, int) or isinstance(subgroup_numel, bool) or subgroup_numel < 1:
            raise ValueError(f"subgroup_numel must be a positive int, got {subgroup_numel!r}")
        for name, budget in (("device_memory_budget", device_memory_budget),
                             ("host_memory_budget", host_memory_budget)):
            if budget is not None and (not isinstance(budget, int) or budget <= 0):
                raise ValueError(f"{name} must be a positive number of bytes or None, got {budget!r}")
        # the fractions' own errors (out of range, nvme above offload) come before "nvme needs a
        # path": a clear error before any training work
        check_fractions(offload_fraction, nvme_fraction)
        if nvme_fraction != "auto" and nvme_fraction not in (0, 0.0):
            check_nvme_path(nvme_path)
        elif nvme_fraction == "auto" and nvme_path is not None:
            check_nvme_path(nvme_path)
        if isinstance(refit_every, bool) or not isinstance(refit_every, int) or refit_every < 0:
            raise ValueError(f"refit_every must be an int >= 0 (0: never refit), got {refit_every!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=self._decoupled)
        self._closed = True  # until the tiers exist
        self._built = False
        self._host = None
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.offload_fraction, self.nvme_fraction, self.nvme_path = offload_fraction, nvme_fraction, nvme_path
        self.subgroup_numel = subgroup_numel
        self.speculative, self.rollback = speculative, rollback
        self.device_memory_budget, self.host_memory_budget = device_memory_budget, host_memory_budget
        self.worker_share, self.spare_banks, self.io_banks = worker_share, spare_banks, io_banks
        self.refit_every, self._calibration = refit_every, calibration
        self._auto = None           # the scheduler, when a fraction is "auto"
        self._bwd_first = self._bwd_last = None
        self.step_was_skipped = False
        self.last_grad_norm = None
        self.stats: dict = {}
        self._grad_scaler = None
        self._last_inv_scale = 1.0
        self._accumulation_boundary = True
        self._speculation_error = None
        self._deferred: list = []
        self._steps_taken = 0
        self._amp_seen = False
        self._build()

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                            "the ordering of tensors in sets will change between runs. Please use a list instead.")
        else:
            params = list(params)
        # de-duplicate (torch only warns): a parameter stepped twice per step is never wanted
        seen, unique = set(), []
        for item in params:
            t = item[1] if isinstance(item, tuple) else item
            if isinstance(t, torch.Tensor) and t in seen:
                continue
            if isinstance(t, torch.Tensor):
                seen.add(t)
            unique.append(item)
        if len(unique) != len(params):
            warnings.warn("optimizer contains a parameter group with duplicate parameters; "
                          "the duplicates are ignored", stacklevel=3)
        param_group = dict(param_group, params=unique)
        for item in unique:
            t = item[1] if isinstance(item, tuple) else item
            if isinstance(t, torch.Tensor):
                if t.is_complex():
                    raise ValueError(f"{type(self).__name__} does not support complex parameters; "
                                     f"optimize torch.view_as_real(param) instead")
                if t.dtype not in _MODEL_DTYPES:
                    raise TypeError(f"{type(self).__name__} supports float32, bfloat16 and float16 "
                                    f"parameters, got {t.dtype}")
        lr = param_group.get("lr", self.defaults["lr"])
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        for key, check in (("lr", lambda v: 0.0 <= v), ("eps", lambda v: 0.0 <= v),
                           ("weight_decay", lambda v: 0.0 <= v)):
            if key in param_group and not check(param_group[key]):
                raise ValueError({"lr": "Invalid learning rate", "eps": "Invalid epsilon value",
                                  "weight_decay": "Invalid weight_decay value"}[key] + f": {param_group[key]}")
        if "betas" in param_group:
            for i, b in enumerate(param_group["betas"]):
                if not 0.0 <= b < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if self._built:
            self._check_open()
            if param_group.get("amsgrad", self.defaults["amsgrad"]) and not self._amsgrad_layout:
                raise ValueError("add_param_group: an amsgrad group cannot join an optimizer built "
                                 "without amsgrad; construct it with amsgrad=True")
        super().add_param_group(param_group)
        if self._built:
            self._extend(len(self.param_groups) - 1)

    # ------------------------------------------------------------------ layout and tiers
    def _all_params(self):
        for g in self.param_groups:
            yield from g["params"]

    def _build(self) -> None:
        params = list(self._all_params())
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self._amsgrad_layout = any(g["amsgrad"] for g in self.param_groups)
        self._subgroups: list = []
        self._index = {}            # param -> index
        self._steps: list = []      # per-parameter step counts (torch's state['step'])
        self._host_local: dict = {}
        for gi in range(len(self.param_groups)):
            self._add_group_layout(gi)
        L.assign_ready_ranks(self._subgroups)
        self._place()
        self._built = True
        self._closed = False

    def _add_group_layout(self, gi: int) -> list:
        params = self.param_groups[gi]["params"]
        first = len(self._steps)
        for k, p in enumerate(params):
            self._index[p] = first + k
        self._steps.extend([0] * len(params))
        sgs, _ = L.flatten_group(params, gi, first, self.subgroup_numel, len(self._subgroups))
        self._subgroups.extend(sgs)
        return sgs

    def _fractions_now(self) -> tuple:
        """(offload, nvme) fractions to lay out: the user's numbers, or the scheduler's choice."""
        sgs = self._subgroups
        if "auto" not in (self.offload_fraction, self.nvme_fraction):
            off, nv = float(self.offload_fraction), float(self.nvme_fraction)
            if self.device_memory_budget is not None or self.host_memory_budget is not None:
                self._check_budgets(off, nv)
            return off, nv, None
        if self._auto is None:
            from hybrid_opt.scheduler import AutoPlanner, default_budgets
            params = list(self._all_params())
            device = params[0].device if params else torch.device("cpu")
            dtype = sgs[0].dtype if sgs else torch.float32
            budgets = default_budgets(params, device, self.device_memory_budget, self.host_memory_budget)
            self._auto = AutoPlanner(
                [s.numel for s in sgs], [s.ready_rank for s in sgs], device,
                model_bytes=torch.tensor([], dtype=dtype).element_size(),
                state_bytes=16 if self._amsgrad_layout else 12,
                subgroup_numel=self.subgroup_numel,
                fixed_offload=None if self.offload_fraction == "auto" else float(self.offload_fraction),
                fixed_nvme=None if self.nvme_fraction == "auto" else float(self.nvme_fraction),
                nvme_path=self.nvme_path, worker_share=self.worker_share,
                spare_banks=self.spare_banks, exact_rollback=self.rollback == "exact",
                speculative=bool(self.speculative),
                device_budget=budgets[0], host_budget=budgets[1], refit_every=self.refit_every,
                calibration=self._calibration)
        d = self._auto.choose()
        return d.offload_fraction, d.nvme_fraction, d

    def _memory(self, off: float, nv: float, spare_banks) -> dict:
        """The cost model's bytes per tier for this optimizer's model at a placement."""
        from hybrid_opt import cost_model as cm
        params = list(self._all_params())
        cuda = bool(params) and params[0].is_cuda
        size = params[0].element_size() if params else 4
        wl = cm.Workload(params=float(sum(s.numel for s in self._subgroups)), model_bytes=size,
                         grad_bytes=size, state_bytes=16 if self._amsgrad_layout else 12,
                         subgroup_numel=self.subgroup_numel)
        return cm.memory_bytes(cm.Machine(gpus=1 if cuda else 0), wl, off, nv, spare_banks)

    def _check_budgets(self, off: float, nv: float) -> None:
        from hybrid_opt.scheduler import check_fixed_plan
        params = list(self._all_params())
        cuda = bool(params) and params[0].is_cuda
        # the spare pool is sized afterwards from what the budget leaves (at least one bank)
        mem = self._memory(off, nv, self.spare_banks if self.spare_banks is not None else 1)
        check_fixed_plan((self.device_memory_budget, self.host_memory_budget), mem, cuda)

    def _place(self, decision=None, plan=None) -> None:
        """Lays the tiers out: at `decision`'s placement, as `plan` exactly (a layout that ran
        before), or else at the fractions asked for."""
        sgs = self._subgroups
        if plan is not None:
            self.plan = dataclasses.replace(plan, tiers=list(plan.tiers), numels=list(plan.numels),
                                            speculation_order=list(plan.speculation_order))
        else:
            self.plan = self._fraction_plan(decision)
        self._refresh_fractions()
        self._device = DeviceTier([s for s in sgs if self.plan.tiers[s.index] == DEVICE],
                                  self._amsgrad_layout)
        host = [s for s in sgs if self.plan.tiers[s.index] in (HOST, NVME)]
        self._host_local = {s.index: k for k, s in enumerate(host)}
        if host:
            dtypes = {s.dtype for s in host}
            copy_dtype = next(iter(dtypes - {torch.float32}), None)
            if len(dtypes - {torch.float32}) > 1:
                raise TypeError("host-tier parameters must share one low-precision dtype")
            grad_dtype = torch.float32 if len(dtypes) > 1 else next(iter(dtypes))
            nvme = [self.plan.tiers[s.index] == NVME for s in host]
            # grads arrive about in reverse parameter order: a subgroup is complete when its
            # first parameter's grad is, and every subgroup that parameter completes is ready
            # in the same hook
            bursts: dict = {}
            for k, s in enumerate(host):
                bursts.setdefault(min(sl.param_index for sl in s.slices), []).append(k)
            self._host = HostTier([s.numel for s in host], grad_dtype=grad_dtype,
                                  staging_slots=staging_slots_for(list(bursts.values()),
                                                                  [s.numel for s in host]),
                                  copy_dtype=copy_dtype, amsgrad=self._amsgrad_layout,
                                  rollback=self.rollback, spare_banks=self.plan.spare_banks or None,
                                  worker_share=self.worker_share, nvme=nvme,
                                  nvme_path=self.nvme_path if any(nvme) else None,
                                  io_banks=self.io_banks)
            for s in host:
                self._host.load_state(self._host_local[s.index], s.flat.detach().float())
            import cpu_kernels
            self._saved_kernel_threads = cpu_kernels.get_num_threads()
            cpu_kernels.set_num_threads(max(1, len(self._host.cores.trainer)))
        self._install_hooks(host)

    # ------------------------------------------------------------------ speculation
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
        if self._auto is not None:
            # the scheduler times backward from the first grad accumulated to the last: hooks on
            # the first and last trainable params only (grads complete in about reverse
            # parameter order; a Python hook on every param would itself slow backward)
            trainable = [p for p in self._all_params() if p.requires_grad]
            for p in {id(q): q for q in trainable[:1] + trainable[-1:]}.values():
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_timed))
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
                if p.requires_grad and p not in hooked:
                    hooked.add(p)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _on_grad_timed(self, p) -> None:
        now = time.perf_counter()
        if self._bwd_first is None:
            self._bwd_first = now
        self._bwd_last = now

    def _may_speculate(self) -> bool:
        """In exact mode always. rollback="inverse" undoes a wrong guess algebraically, and
        that undo is ill-conditioned when the guess was far off (grads still scaled by 2**16,
        or clipped hard: the step's g**2 swamps v): speculate there only when the guess is
        safe — not before the first step shows whether a GradScaler is in play, not with
        clipping, not with a GradScaler whose scale speculation cannot read."""
        if self.rollback != "inverse":
            return True
        if self._steps_taken == 0 or self.max_grad_norm is not None:
            return False
        return not self._amp_seen or self._grad_scaler is not None

    def _on_grad_ready(self, p) -> None:
        if self._closed or not self._accumulation_boundary or not self._may_speculate():
            return
        idx = self._index.get(p)
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
        scaler = self._grad_scaler
        if scaler is not None and scaler.is_enabled():
            return 1.0 / float(scaler.get_scale())
        return self._last_inv_scale

    def _host_inputs(self, sg, live: list, hp: StepInputs, scale: float, ahead: int) -> StepInputs:
        """The inputs a host subgroup's step depends on (ahead=1 during backward: the step
        counts it will have), including which grads, so a changed grad makes it stale."""
        runs = self._runs(sg, live, ahead)
        step = runs[0][2] if runs else self._steps[live[0].param_index] + ahead
        versions = tuple((sl.param.grad.data_ptr(), sl.param.grad._version) for sl in live)
        return StepInputs(step, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled,
                          scale * hp.grad_scale, versions, hp.amsgrad, runs)

    def _speculate(self, sgi: int) -> bool:
        sg = self._subgroups[sgi]
        live = [sl for sl in sg.slices if sl.param.grad is not None]
        if not live:
            return True
        group = self.param_groups[sg.group]
        hp = self._hyper(group, -1.0 if group["maximize"] else 1.0)
        # clipping is assumed not to bite (coefficient 1): validation redoes it when it does
        inputs = self._host_inputs(sg, live, hp, self._predicted_inv_scale(), 1)
        local = self._host_local[sgi]
        self._host.cancel(local)
        self._staged.pop(sgi, None)
        if self._host.speculate(local, _GradGatherer(sg), inputs, wait=False):
            # the grads it read stay referenced until it is validated: a grad tensor made after
            # one was discarded (zero_grad, `p.grad = None`) can then never take its address, so
            # (data_ptr, _version) names the same grad for as long as the speculation is pending
            self._staged[sgi] = [sl.param.grad for sl in live]
            return True
        return False

    def _retry_deferred(self) -> None:
        """Subgroups that found no free bank or staging slot when they became ready are tried
        again as the worker frees them (backward never waits for the worker); those still
        waiting at step() are stepped there."""
        self._host.poll()
        while self._deferred:
            if not self._speculate(self._deferred[0]):
                return
            self._deferred.pop(0)

    def _drop_speculation(self) -> dict:
        """Drops every pending speculation (the committed state is untouched); returns finish()'s
        outcome."""
        outcome = {}
        if self._host is not None and self._host.speculated():
            outcome = self._host.finish({}, overflow=True)
        self._forget_staged()
        self._deferred.clear()
        return outcome

    def _forget_staged(self) -> None:
        pending = set(self._host.speculated()) if self._host is not None else set()
        self._staged = {k: v for k, v in getattr(self, "_staged", {}).items()
                        if self._host_local[k] in pending}

    def attach_grad_scaler(self, scaler) -> None:
        """Lets speculation read the loss scale that will apply (torch.amp.GradScaler);
        without it, speculation assumes the last step's scale and validation redoes what
        does not match."""
        self._grad_scaler = scaler

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's vocabulary: False on micro-batches that are not the last before step()
        suppresses speculation on them (their grads are not final). Unannotated accumulation
        stays correct — a grad changed after speculation makes it stale — only slower."""
        self._accumulation_boundary = bool(is_boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for ready in getattr(self, "_ready", {}).values():
            ready.clear()

    def _fraction_plan(self, decision):
        """The plan at `decision`'s fractions (or those asked for), its spare pool sized."""
        sgs = self._subgroups
        if decision is None:
            off, nv, decision = self._fractions_now()
        else:
            off, nv = decision.offload_fraction, decision.nvme_fraction
        spares = self.spare_banks
        if spares is None and decision is not None and decision.prediction is not None:
            spares = decision.prediction.spare_banks
        plan = fraction_plan([s.numel for s in sgs], [s.ready_rank for s in sgs], off, nv, spares)
        if spares is None:
            from hybrid_opt.scheduler import default_spare_banks
            host = [s for s in sgs if plan.tiers[s.index] != DEVICE]
            biggest = max((s.numel for s in host), default=0)
            budget = self.host_memory_budget
            if budget is not None:  # what the placement leaves of it
                budget = max(0, budget - self._memory(off, nv, spare_banks=0)["host"])
            plan.spare_banks = default_spare_banks(len(host), biggest * (16 if self._amsgrad_layout else 12), budget)
        if decision is not None:
            plan.prediction, plan.reason = decision.prediction, decision.reason
        return plan

    def _refresh_fractions(self) -> None:
        """The shares actually laid out (at subgroup boundaries)."""
        total = sum(self.plan.numels) or 1
        self._fractions = ((self.plan.elements(HOST) + self.plan.elements(NVME)) / total,
                           self.plan.elements(NVME) / total)

    def _rebuild_tiers(self, decision=None, plan=None) -> None:
        """Lays the tiers out again: at `decision`'s placement, or as `plan` (by default the
        plan now); the caller loads their state afterwards."""
        if self._host is not None:
            self._host.close()
            import cpu_kernels
            cpu_kernels.set_num_threads(self._saved_kernel_threads)
            self._host = None
        self.__dict__.pop("_prev_worker_s", None)  # per-subgroup worker times of the old tier
        if decision is not None:
            self._place(decision)
        else:
            self._place(plan=plan or self.plan)

    def _move(self, decision) -> None:
        """Moves subgroups between tiers to `decision`'s plan: every subgroup's committed state
        is copied out, the tiers are laid out anew, and the state is copied back in (bitwise:
        every tier steps with the same arithmetic). If the new layout fails (a worker or an
        arena that cannot start), the old one is laid out again with the same state and the
        error raised: a failed move loses nothing."""
        t0 = time.perf_counter()
        self._drop_speculation()
        saved = {}
        for sg in self._subgroups:
            saved[sg.index] = {k: v.detach().clone() for k, v in self._subgroup_state(sg).items()}
        before = self.plan
        try:
            self._rebuild_tiers(decision)
            self._load_states(saved)
        except Exception:
            self._rebuild_tiers(plan=before)
            self._load_states(saved)
            raise
        if self._auto is not None:
            self._auto.move_cost_s = time.perf_counter() - t0
            self._auto.moves += 1

    def _load_states(self, saved: dict) -> None:
        """Every subgroup's state from `saved` ({index: {name: tensor}}) into the tiers now."""
        for sg in self._subgroups:
            st = self._subgroup_state(sg)
            for k, view in st.items():
                view.copy_(saved[sg.index][k])
            if self.plan.tiers[sg.index] != DEVICE:
                self._host.load_state(self._host_local[sg.index], st["master"], st["exp_avg"],
                                      st["exp_avg_sq"], st.get("max_exp_avg_sq"))

    def _room_to_move(self) -> bool:
        """A move copies every subgroup's state out first: only when that copy fits in half of
        the free host memory."""
        from hybrid_opt.scheduler import _free_host_bytes
        need = sum(s.numel for s in self._subgroups) * (16 if self._amsgrad_layout else 12)
        return need <= 0.5 * _free_host_bytes()

    def replan(self, offload_fraction: float, nvme_fraction: float = 0.0) -> None:
        """Moves state to another placement now (what a refit of "auto" does); numerics are
        unchanged. Call between steps."""
        self._check_open()
        check_fractions(offload_fraction, nvme_fraction)
        if "auto" in (offload_fraction, nvme_fraction):
            raise ValueError('replan() takes numbers; "auto" is chosen at construction')
        if float(nvme_fraction) > 0:
            check_nvme_path(self.nvme_path)
        prediction = None
        if self._auto is not None:
            prediction = self._auto.predict(float(offload_fraction), float(nvme_fraction))
        self._move(_Fixed(float(offload_fraction), float(nvme_fraction), prediction, "replan()"))

    def _extend(self, gi: int) -> None:
        """add_param_group after construction (a layer unfrozen in fine-tuning): the new
        group's subgroups start on the device tier with fresh state; where the placement
        offloads — a fraction above 0, or "auto"'s choice for the grown model — every subgroup
        is then laid out again at that placement, the committed state moved bitwise as a
        refit moves it, so the new group's state need not fit on the device."""
        sgs = self._add_group_layout(gi)
        for s in sgs:
            self.plan.tiers.append(DEVICE)
            self.plan.numels.append(s.numel)
        extra = DeviceTier(sgs, self._amsgrad_layout)
        self._device.subgroups.update(extra.subgroups)
        self._device.master.update(extra.master)
        self._device.state.update(extra.state)
        L.assign_ready_ranks(self._subgroups)
        self._refresh_fractions()
        # the timing hooks sit on the first and last trainable params: the new group's may be
        # either (a move below installs them again anyway)
        self._install_hooks([s for s in self._subgroups if self.plan.tiers[s.index] != DEVICE])
        if self._auto is not None:
            self._auto.regrow([s.numel for s in self._subgroups], [s.ready_rank for s in self._subgroups])
        stay = f"add_param_group: the new group's {sum(s.numel for s in sgs)} elements stay on the device tier"
        try:
            off, nv, decision = self._fractions_now()
        except ValueError as e:  # the grown model fits no placement within the budgets
            warnings.warn(f"{stay}: {e}", stacklevel=3)
            return
        if off == 0 and nv == 0 and self._host is None:
            return  # everything on the device tier: where the new group already is
        if not self._room_to_move():
            warnings.warn(f"{stay}: laying the tiers out again copies all state first, and that copy "
                          f"does not fit in half the free host memory", stacklevel=3)
            return
        if decision is not None:
            decision.reason = "add_param_group: " + decision.reason
        try:
            self._move(decision or _Fixed(off, nv, self.plan.prediction, "add_param_group: laid out again"))
        except Exception as e:  # the layout before is back, state and all (see _move)
            warnings.warn(f"{stay}: laying the tiers out again failed: {type(e).__name__}: {e}", stacklevel=3)

    # ------------------------------------------------------------------ properties
    @property
    def worker_pid(self):
        return self._host.worker_pid if self._host is not None and not self._closed else None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; create a new optimizer")

    # ------------------------------------------------------------------ the step
    def _hyper(self, group: dict, grad_sign: float) -> StepInputs:
        b1, b2 = group["betas"]
        return StepInputs(0, _float_hyper(group["lr"], "lr"), _float_hyper(b1, "betas[0]"),
                          _float_hyper(b2, "betas[1]"), float(group["eps"]), float(group["weight_decay"]),
                          self._decoupled, grad_sign, (), bool(group["amsgrad"]))

    def _grad_norm_sq(self) -> float:
        total = 0.0
        params = [p for p in self._all_params() if p.grad is not None]
        if not params:
            return 0.0
        if params[0].is_cuda:
            import gpu_kernels
            s, _ = gpu_kernels.grad_stats([p.grad.contiguous() for p in params])
            return float(s)
        import cpu_kernels
        for p in params:
            s, _ = cpu_kernels.grad_stats(p.grad.contiguous())
            total += s
        return total

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t_step = time.perf_counter()
        self._check_open()
        if self._speculation_error is not None:
            err, self._speculation_error = self._speculation_error, None
            self._drop_speculation()
            raise RuntimeError(f"a speculative host step during backward failed: {err}") from err
        for p in self._all_params():
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        scale_t = getattr(self, "grad_scale", None)
        found_t = getattr(self, "found_inf", None)
        self._amp_seen = self._amp_seen or found_t is not None  # GradScaler.step sets found_inf
        if found_t is not None and float(found_t) != 0.0:
            # GradScaler saw inf/nan: the whole step is skipped, exactly as torch does
            self.step_was_skipped = True
            dropped = self._drop_speculation()
            for ready in self._ready.values():
                ready.clear()
            # stats describe this (skipped) step, not the last one that was taken
            self.stats = {"host": dict(self._host.stats) if self._host is not None else {},
                          "speculation": dict(committed=0, redone=0, stepped=0, dropped=len(dropped))
                          if self._host is not None else None,
                          "grad_norm": None, "clip_coef": None}
            return loss
        self.step_was_skipped = False
        self._steps_taken += 1
        inv_scale = 1.0 / float(scale_t) if scale_t is not None else 1.0
        if scale_t is not None:
            self._last_inv_scale = inv_scale
        # the global norm costs a pass over every grad: only clipping needs it
        norm = None
        clip = 1.0
        if self.max_grad_norm is not None:
            norm = math.sqrt(self._grad_norm_sq()) * inv_scale
            coef = self.max_grad_norm / (norm + 1e-6)
            clip = coef if (coef < 1.0 or coef != coef) else 1.0  # torch clamps at 1; NaN stays
        self.last_grad_norm = norm
        scale = inv_scale * clip

        # per-parameter step counts: only params with a grad advance (torch's rule)
        for p in self._all_params():
            if p.grad is not None:
                self._steps[self._index[p]] += 1
        groups = [self._hyper(g, -1.0 if g["maximize"] else 1.0) for g in self.param_groups]

        device_work, host_steps = [], {}
        for sg in self._subgroups:
            hp = groups[sg.group]
            live = [sl for sl in sg.slices if sl.param.grad is not None]
            if not live:
                continue
            if self.plan.tiers[sg.index] == DEVICE:
                device_work.extend((sg.index, sl, hp, self._steps[sl.param_index]) for sl in live)
            else:
                host_steps[sg.index] = (sg, live, hp)
        # host tiers first: a failure there (a full disk, a worker error) then leaves the device
        # tier unstepped, and the step counts of every parameter no committed subgroup holds
        # are rolled back, so a checkpoint taken afterwards is the previous step for them
        t_host = time.perf_counter()
        if host_steps:
            committed: set = set()
            try:
                self._step_host(host_steps, scale, committed)
            except Exception as e:
                touched = {sl.param_index for sg, live, _ in host_steps.values() if sg.index in committed
                           for sl in live}
                rolled = []
                for p in self._all_params():
                    idx = self._index[p]
                    if p.grad is not None and idx not in touched:
                        self._steps[idx] -= 1
                        rolled.append(idx)
                done = sorted(committed)
                what = ("Nothing was stepped (state and step counts are the previous step's): fix "
                        "the cause and call step() again." if not done else
                        f"The step was partly applied: subgroups {done} committed it, the others "
                        f"and the device tier did not (their state and step counts are the "
                        f"previous step's). Reload a checkpoint: stepping again would step "
                        f"subgroups {done} twice.")
                raise RuntimeError(f"{type(self).__name__}.step() failed in the host/nvme tier: "
                                   f"{e}\n{what}") from e
        t_device = time.perf_counter()
        self._device.step(device_work, scale)
        t_end = time.perf_counter()
        self._record_stats(host_steps, device_work, t_device - t_host, t_end - t_device, norm, clip)
        if self._auto is not None:
            self._schedule(device_work, t_end - t_step)
        return loss

    def _schedule(self, device_work: list, step_s: float) -> None:
        """Feeds the scheduler this step's measured times, puts its prediction next to them in
        `stats`, and moves subgroups between tiers when a refit says it pays."""
        from hybrid_opt.scheduler import Sample
        tiers = self.stats["tiers"]
        backward_s = None if self._bwd_first is None else self._bwd_last - self._bwd_first
        self._bwd_first = self._bwd_last = None
        self._auto.observe(Sample(
            backward_s=backward_s, step_s=step_s, device_s=self.stats["device_s"],
            host_wait_s=self.stats["host_wait_s"],
            device_elements=sum(sl.numel for _, sl, _, _ in device_work),
            host_worker_s=tiers[HOST]["worker_s"], host_elements=tiers[HOST]["elements"],
            hidden_s=self.stats["hidden_s"]))
        if self._auto.due(self._steps_taken):
            decision = self._auto.refit(*self._fractions, self.plan.spare_banks)
            if decision is not None and not self._room_to_move():
                self.plan.reason = "refit: a move would pay, but a copy of the state does not fit in free memory"
                decision = None
            if decision is not None:
                try:
                    self._move(decision)
                except Exception as e:  # the plan before is back, state and all (see _move)
                    warnings.warn(f"refit: moving to offload_fraction={decision.offload_fraction:g}, "
                                  f"nvme_fraction={decision.nvme_fraction:g} failed; the plan stays as it "
                                  f"was: {type(e).__name__}: {e}", stacklevel=3)
                    self.plan.reason = f"refit: a move failed ({type(e).__name__})"
            elif self._auto.backward_s is not None:
                self.plan.prediction = self._auto.predict(*self._fractions, self.plan.spare_banks)
                self.plan.reason = "refit: kept"
        p = self.plan.prediction
        if p is not None:
            b = p.breakdown
            off = b["host_work"]
            e_off = tiers[HOST]["elements"] + tiers[NVME]["elements"]
            for name in (HOST, NVME):
                tiers[name]["predicted_worker_s"] = off * tiers[name]["elements"] / e_off if e_off else 0.0
            tiers[DEVICE]["predicted_s"] = b["device_step"]
            self.stats["predicted"] = {"step_s": p.step_seconds,
                                       "backward_s": b["backward"] + b["backward_contention"],
                                       "device_s": b["device_step"], "worker_s": off,
                                       "host_exposed_s": b["host_exposed"]}
            self.stats["measured"] = {"step_s": step_s, "backward_s": backward_s,
                                      "device_s": self.stats["device_s"],
                                      "worker_s": self.stats["worker_s"],
                                      "host_wait_s": self.stats["host_wait_s"]}

    def _record_stats(self, host_steps, device_work, host_wait_s, device_s, norm, clip) -> None:
        """Per-tier figures of this step: subgroups, state bytes, the trainer's time in it,
        the worker's time on it, and how much of the worker's time hid under backward."""
        tiers = {t: {"subgroups": 0, "elements": 0, "state_bytes": 0, "worker_s": 0.0,
                     "committed": 0, "redone": 0, "stepped": 0, "dropped": 0}
                 for t in (DEVICE, HOST, NVME)}
        for sg in self._subgroups:
            t = tiers[self.plan.tiers[sg.index]]
            t["subgroups"] += 1
            t["elements"] += sg.numel
            t["state_bytes"] += sg.numel * (16 if self._amsgrad_layout else 12)
        if self._host is not None:
            prev = getattr(self, "_prev_worker_s", [0.0] * len(self._host.worker_seconds))
            now = list(self._host.worker_seconds)
            for index, local in self._host_local.items():
                tiers[self.plan.tiers[index]]["worker_s"] += now[local] - prev[local]
            self._prev_worker_s = now
            for index, outcome in getattr(self, "_last_outcome_by_sg", {}).items():
                tiers[self.plan.tiers[index]][outcome] += 1
        tiers[DEVICE]["trainer_s"] = device_s
        off = tiers[HOST]["worker_s"] + tiers[NVME]["worker_s"]
        for name in (HOST, NVME):
            tiers[name]["trainer_wait_s"] = host_wait_s * (tiers[name]["worker_s"] / off if off else 0.0)
        # the worker's time that did not make step() wait was hidden under backward
        hidden = max(0.0, off - host_wait_s)
        self.stats = {"tiers": tiers, "host_wait_s": host_wait_s, "device_s": device_s,
                      "hidden_s": hidden, "worker_s": off,
                      "speculation": getattr(self, "_last_outcome", None) if host_steps else None,
                      "grad_norm": norm, "clip_coef": clip}

    def _runs(self, sg, live: list, ahead: int = 0) -> tuple:
        """(offset, numel, step) ranges of a subgroup's live slices, merged where contiguous."""
        runs = []
        for sl in live:
            step = self._steps[sl.param_index] + ahead
            if runs and runs[-1][0] + runs[-1][1] == sl.sub_offset and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], runs[-1][1] + sl.numel, step)
            else:
                runs.append((sl.sub_offset, sl.numel, step))
        if len(runs) == 1 and runs[0][:2] == (0, sg.numel):
            return ()
        return tuple(runs)

    def _step_host(self, host_steps: dict, scale: float, committed: set) -> None:
        work = {}
        for index, (sg, live, hp) in host_steps.items():
            work[self._host_local[index]] = (_GradGatherer(sg), self._host_inputs(sg, live, hp, scale, 0))
        by_local = {self._host_local[index]: (sg, live) for index, (sg, live, _) in host_steps.items()}

        def copy_params(local: int, views: dict) -> None:
            # the new params reach the model only once their step is committed
            sg, live = by_local[local]
            src = views["param_copy"] if (sg.dtype != torch.float32 and "param_copy" in views) else views["param"]
            for sl in live:
                a, b = sl.sub_offset, sl.sub_offset + sl.numel
                # a blocking copy: an nvme subgroup's buffer is reused as soon as this returns
                sg.flat[a:b].copy_(src[a:b].to(sg.dtype))
            committed.add(sg.index)

        try:
            outcome = self._host.finish(work, on_commit=copy_params)
        finally:
            self._forget_staged()
        for ready in self._ready.values():
            ready.clear()
        self._deferred.clear()
        counts = {k: 0 for k in ("committed", "redone", "stepped", "dropped")}
        for v in outcome.values():
            counts[v] += 1
        self._last_outcome = counts
        index_of = {local: index for index, local in self._host_local.items()}
        self._last_outcome_by_sg = {index_of[local]: v for local, v in outcome.items()}

    # ------------------------------------------------------------------ state dict
    def _subgroup_state(self, sg) -> dict:
        """A subgroup's fp32 master and moments, wherever it lives: views on the device and
        host tiers, copies read from its file on nvme."""
        if self.plan.tiers[sg.index] == DEVICE:
            st = {"master": self._device.master[sg.index]}
            st.update(self._device.state[sg.index])
            return st
        st = self._host.state(self._host_local[sg.index])
        st["master"] = st.pop("param")
        return st

    def state_dict(self) -> dict:
        self._check_open()
        # called between backward and step(): the committed state is what a checkpoint holds;
        # pending speculations are dropped (step() then steps those subgroups itself)
        self._drop_speculation()
        base = super().state_dict()  # param_groups in torch's format (params as indices)
        state = {}
        buffers: dict = {}
        for sg in self._subgroups:
            for sl in sg.slices:
                buffers.setdefault(sl.param_index, []).append((sg, sl))
        params = list(self._all_params())
        sub_state = {}  # each subgroup's state read once (an nvme read is a whole file slot)
        for idx, p in enumerate(params):
            if self._steps[idx] == 0:
                continue  # never stepped: torch has no state for it either
            entry = {"step": torch.tensor(float(self._steps[idx]), dtype=torch.float32)}
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self._group_of(idx)["amsgrad"] else [])
            if p.dtype != torch.float32:
                keys.append("master")
            flat = {k: torch.empty(p.numel(), dtype=torch.float32, device=p.device) for k in keys}
            for sg, sl in buffers.get(idx, []):
                if sg.index not in sub_state:
                    sub_state[sg.index] = self._subgroup_state(sg)
                a, b = sl.sub_offset, sl.sub_offset + sl.numel
                for k in keys:
                    flat[k][sl.param_offset:sl.param_offset + sl.numel].copy_(sub_state[sg.index][k][a:b])
            for k in keys:
                entry["master_param" if k == "master" else k] = flat[k].view(p.shape)
            state[idx] = entry
        base["state"] = state
        return base

    def _group_of(self, idx: int) -> dict:
        for g in self.param_groups:
            n = len(g["params"])
            if idx < n:
                return g
            idx -= n
        raise IndexError(idx)

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_open()
        self._drop_speculation()
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        if any(s.get("amsgrad", False) for s in saved_groups) and not self._amsgrad_layout:
            # the checkpoint needs a running max of v that this optimizer never laid out: lay
            # the tiers out again with it (the state is loaded into them right below)
            self._amsgrad_layout = True
            self._rebuild_tiers()
        for g, s in zip(groups, saved_groups):
            for k, v in s.items():
                if k not in ("params", "param_names", "decoupled_weight_decay"):
                    g[k] = v
        # saved ids map to our positions in order (as torch does)
        id_map = {}
        for s in saved_groups:
            for pid in s["params"]:
                id_map[pid] = len(id_map)
        saved_state = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
        params = list(self._all_params())
        with torch.no_grad():
            for sg in self._subgroups:
                st = self._subgroup_state(sg)
                for sl in sg.slices:
                    entry = saved_state.get(sl.param_index, {})
                    p = params[sl.param_index]
                    a, b = sl.sub_offset, sl.sub_offset + sl.numel
                    for k, view in st.items():
                        if k == "master":
                            src = p.detach()
                            saved = entry.get("master_param")
                            # a master stands only while the param is still its rounding: torch
                            # carries our extra key along without updating it, so after training
                            # elsewhere the param itself is the truth (and a load never writes params)
                            if saved is not None and torch.equal(saved.to(p.dtype), p.detach()):
                                src = saved
                        elif k in entry:
                            src = entry[k]
                        else:
                            view[a:b].zero_()
                            continue
                        view[a:b].copy_(src.reshape(-1)[sl.param_offset:sl.param_offset + sl.numel])
                if self.plan.tiers[sg.index] != DEVICE:
                    local = self._host_local[sg.index]
                    self._host.load_state(local, st["master"], st["exp_avg"], st["exp_avg_sq"],
                                          st.get("max_exp_avg_sq"))
        for idx in range(len(self._steps)):
            st = saved_state.get(idx)
            self._steps[idx] = int(float(st["step"])) if st is not None and "step" in st else 0

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Idempotent. Stops the worker, frees shared memory, restores the trainer's cores and
        thread counts; parameters keep ordinary memory of their own."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []
        if self._host is not None:
            try:
                self._host.close()
            finally:
                import cpu_kernels
                cpu_kernels.set_num_threads(self._saved_kernel_threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return super().__repr__() + f"\n{self.plan}" if getattr(self, "_built", False) else super().__repr__()


class _Fixed(NamedTuple):
    """A placement to lay out as it is (no scheduler decision)."""
    offload_fraction: float
    nvme_fraction: float
    prediction: object = None
    reason: str = ""


class _GradGatherer:
    """Writes a subgroup's grads [offset, offset + numel) into a staging buffer; params without
    a grad contribute zeros (their elements are outside every run, so never stepped)."""

    def __init__(self, sg):
        self.sg = sg

    def _overlaps(self, offset: int, numel: int):
        """(slice, a, b) for each slice overlapping [offset, offset + numel), [a, b) in
        subgroup elements."""
        end = offset + numel
        for sl in self.sg.slices:
            a, b = max(offset, sl.sub_offset), min(end, sl.sub_offset + sl.numel)
            if a < b:
                yield sl, a, b

    def __call__(self, dst: torch.Tensor, offset: int, numel: int) -> None:
        for sl, a, b in self._overlaps(offset, numel):
            g = sl.grad_view()
            if g is None:
                dst[a - offset:b - offset].zero_()
                continue
            dst[a - offset:b - offset].copy_(g[a - sl.sub_offset:b - sl.sub_offset], non_blocking=False)

    def segments(self, offset: int, numel: int, dtype):
        """Remote gather: [(element offset in the piece, address, elements)] (address 0: zeros)
        and the grad tensors to keep alive, for the worker to read itself; None when a grad
        is on a GPU, non-contiguous or of another dtype (then __call__ stages it here)."""
        entries, keep = [], []
        for sl, a, b in self._overlaps(offset, numel):
            g = sl.param.grad
            if g is None:
                entries.append((a - offset, 0, b - a))
                continue
            if g.is_cuda or g.dtype != dtype or not g.is_contiguous():
                return None
            start = sl.param_offset + (a - sl.sub_offset)
            entries.append((a - offset, g.data_ptr() + start * g.element_size(), b - a))
            keep.append(g)
        return entries, keep


class HybridAdamW(_HybridBase):
    """torch.optim.AdamW's signature and defaults (decoupled weight decay), plus placement.

    See the README for the hybrid arguments (offload_fraction, nvme_fraction, ...)."""
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=None, offload_fraction=1.0,
                 nvme_fraction=0.0, nvme_path=None, subgroup_numel=DEFAULT_SUBGROUP_NUMEL,
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
                 nvme_fraction=0.0, nvme_path=None, subgroup_numel=DEFAULT_SUBGROUP_NUMEL,
                 speculative=True, rollback="exact", device_memory_budget=None,
                 host_memory_budget=None, process_group=None, **hybrid):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, max_grad_norm=max_grad_norm, offload_fraction=offload_fraction,
                         nvme_fraction=nvme_fraction, nvme_path=nvme_path,
                         subgroup_numel=subgroup_numel, speculative=speculative, rollback=rollback,
                         device_memory_budget=device_memory_budget,
                         host_memory_budget=host_memory_budget, process_group=process_group, **hybrid)
