"""Placement: the subgroup layout, which tier holds each subgroup, and moving state between
tiers (a refit of "auto", replan(), add_param_group after construction; the move itself in
moves.py).

A mixin of the optimizer class: it owns `plan`, `_subgroups`, `_device`, `_host` and
`_host_local`; a failed move leaves the old plan and its state as they were, so it loses nothing.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch

from hybrid_opt import distributed as D
from hybrid_opt import layout as L
from hybrid_opt.lifetime import acts_on_owner
from hybrid_opt.moves import MoveMixin
from hybrid_opt.cost_model import NON_SPECULATIVE_SPARE_BANKS
from hybrid_opt.plan import DEVICE, HOST, NVME, check_fractions, fraction_miss, fraction_plan
from hybrid_opt.footprint import host_tier_layout, plan_bytes
from hybrid_opt.swap import check_nvme_path
from hybrid_opt.tiers.device import DeviceTier
from hybrid_opt.tiers.host import HostTier


class _Fixed(NamedTuple):
    """A placement to lay out as it is (no scheduler decision)."""
    offload_fraction: float
    nvme_fraction: float
    prediction: object = None
    reason: str = ""


class _Extension(NamedTuple):
    """What add_param_group's layout changes, as it was before (PlacementMixin._unextend)."""
    params: int
    subgroups: int
    plan: object
    fractions: tuple
    auto: object
    auto_vars: dict | None


def _restated(e: Exception, message: str) -> Exception:
    """`message` (which quotes `e`) as an error of `e`'s type where that type takes a message
    alone (MemoryError, torch.OutOfMemoryError, ValueError...), else as a RuntimeError."""
    try:
        new = type(e)(message)
    except Exception:
        return RuntimeError(message)
    return new if str(new) == message else RuntimeError(message)


class PlacementMixin(MoveMixin):
    """Lays the tiers out and moves subgroups between them."""

    def _build(self) -> None:
        params = list(self._layout.params())
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self._host_local: dict = {}
        for gi in range(len(self.param_groups)):
            self._add_group_layout(gi)
        if self.state_format.store_param_remainders and not any(
                self.state_format.remainders_for(s.dtype) for s in self._layout.subgroups):
            warnings.warn("store_param_remainders=True has no effect here: no parameter is bf16 "
                          "(only a bf16 param's master is kept as a remainder; fp32/fp16 params "
                          "keep an fp32 master)", stacklevel=4)
        self._place()
        self._built = True
        self._closed = False

    def _add_group_layout(self, gi: int) -> list:
        first = len(self._layout.steps)
        sgs = self._layout.add_group(gi)
        self._remember_storage(first, self.param_groups[gi]["params"])  # step() checks the params keep it (storage.py)
        return sgs

    def _fractions_now(self) -> tuple:
        """(offload, nvme) fractions to lay out: the user's numbers, or the scheduler's choice."""
        sgs = self._layout.subgroups
        if "auto" not in (self.offload_fraction, self.nvme_fraction):
            off, nv = float(self.offload_fraction), float(self.nvme_fraction)
            if self.device_memory_budget is not None or self.host_memory_budget is not None:
                self._check_budgets(off, nv)
            return off, nv, None
        if self._auto is None:
            from hybrid_opt.scheduler import AutoPlanner, default_budgets
            params = list(self._layout.params())
            device = params[0].device if params else torch.device("cpu")
            fmt, dtype = self._budget_format(sgs)
            budgets = default_budgets(params, device, self.device_memory_budget, self.host_memory_budget)
            self._auto = AutoPlanner(
                [s.numel for s in sgs], [s.ready_rank for s in sgs], device,
                model_bytes=torch.tensor([], dtype=dtype).element_size(),
                state_bytes=16 if self._layout.amsgrad else 12,
                state_format=fmt, model_dtype=dtype,
                subgroup_numel=self.subgroup_numel,
                fixed_offload=None if self.offload_fraction == "auto" else float(self.offload_fraction),
                fixed_nvme=None if self.nvme_fraction == "auto" else float(self.nvme_fraction),
                nvme_path=self.nvme_path, worker_share=self.worker_share,
                spare_banks=self.spare_banks, exact_rollback=self.rollback == "exact",
                speculative=bool(self.speculative),
                device_budget=budgets[0], host_budget=budgets[1], refit_every=self.refit_every,
                calibration=self._calibration,
                device_from_peak=(device.type == "cuda" and self.device_memory_budget is None
                                  and self.offload_fraction == "auto"))
            if self._auto.device_from_peak:
                # the peak from here on is training's (activations), not flattening's or calibration's
                torch.cuda.reset_peak_memory_stats(device)
        d = self._auto.choose()
        return d.offload_fraction, d.nvme_fraction, d

    def _observe_device_memory(self) -> None:
        """"auto" on CUDA without device_memory_budget: the device budget from the memory free
        now and the peak of the iterations so far (activations included), so a refit puts
        state on the device only where the next iterations will not need the memory
        (scheduler.measured_device_budget)."""
        if self._auto is None or not self._auto.device_from_peak or not self._layout.subgroups:
            return
        from hybrid_opt.scheduler import cuda_memory
        spares = self.plan.spare_banks
        self._auto.observe_device_memory(cuda_memory(self._layout.subgroups[0].device),
                                         counted=self._memory(*self._fractions, spares)["device"],
                                         floor=self._memory(1.0, 0.0, spares)["device"])

    def _refit(self) -> None:
        """"auto", after each step: moves subgroups between tiers when a refit says it pays
        (the scheduler has the measured samples: step_stats.py)."""
        if self._auto.due(self._ledger.steps_taken):
            self._observe_device_memory()  # "auto" on CUDA: the device budget beside the activations
            decision = self._auto.refit(*self._fractions, self.plan.spare_banks)
            if decision is not None and not self._room_to_move(decision):
                self.plan.reason = ("refit: a move would pay, but it does not fit in free memory: "
                                    f"{self._room_shortfall(self._fraction_plan(decision))}")
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

    def _budget_format(self, sgs) -> tuple:
        """(state format, model dtype) the budgets count for subgroups `sgs`: theirs when they
        share one dtype; for a mix (fp32 norms beside bf16 weights) an upper bound of what any
        tier holds of them — the low-precision dtype (its bank keeps the model-dtype copy) and,
        as a host tier that mixes them keeps a 4-byte master region (tiers/compressed.py), no
        remainders."""
        dtypes = {s.dtype for s in sgs}
        if len(dtypes) <= 1:
            return self.state_format, next(iter(dtypes), torch.float32)
        low = sorted(dtypes - {torch.float32}, key=str)
        return (dataclasses.replace(self.state_format, store_param_remainders=False),
                low[0] if low else torch.float32)

    def _memory(self, off: float, nv: float, spare_banks) -> dict:
        """The cost model's bytes per tier for this optimizer's model at a placement."""
        from hybrid_opt import cost_model as cm
        params = list(self._layout.params())
        cuda = bool(params) and params[0].is_cuda
        size = params[0].element_size() if params else 4
        fmt, dtype = self._budget_format(self._layout.subgroups)
        # a host tier mixing dtypes (fp32 norms beside bf16 weights) stages fp32 grads
        grads = 4 if len({s.dtype for s in self._layout.subgroups}) > 1 else size
        wl = cm.Workload(params=float(sum(s.numel for s in self._layout.subgroups)), model_bytes=size,
                         grad_bytes=grads, amsgrad=self._layout.amsgrad, state_format=fmt,
                         model_dtype=dtype if self._layout.subgroups else None,
                         subgroup_numel=self.subgroup_numel,
                         bank_padding=L.bank_padding([s.numel for s in self._layout.subgroups]))
        return cm.memory_bytes(cm.Machine(gpus=1 if cuda else 0), wl, off, nv, spare_banks)

    def _check_budgets(self, off: float, nv: float) -> None:
        """Fixed fractions: the bytes the plan's tiers will allocate against the budgets, before
        anything is allocated. The spare pool is sized afterwards from what the budget leaves:
        counted here at its least (one bank where exact rollback needs one)."""
        from hybrid_opt.scheduler import check_fixed_plan
        sgs = self._layout.subgroups
        plan = fraction_plan([s.numel for s in sgs], [s.ready_rank for s in sgs], off, nv, None)
        resident = sum(1 for t in plan.tiers if t == HOST)
        plan.spare_banks = (0 if self.rollback != "exact" or not resident else
                            self.spare_banks if self.spare_banks is not None else 1)
        check_fixed_plan((self.device_memory_budget, self.host_memory_budget), self._plan_bytes(plan),
                         self._layout.cuda())

    def _place(self, decision=None, plan=None) -> None:
        """Lays the tiers out: at `decision`'s placement, as `plan` exactly (a layout that ran
        before), or else at the fractions asked for."""
        sgs = self._layout.subgroups
        if plan is not None:
            self.plan = dataclasses.replace(plan, tiers=list(plan.tiers), numels=list(plan.numels),
                                            speculation_order=list(plan.speculation_order))
        else:
            self.plan = self._fraction_plan(decision)
            if decision is None and not self._built:
                self._warn_fraction_miss()
        self._refresh_fractions()
        self._device = DeviceTier([s for s in sgs if self.plan.tiers[s.index] == DEVICE],
                                  self._layout.amsgrad, self.state_format)
        host = [s for s in sgs if self.plan.tiers[s.index] in (HOST, NVME)]
        self._host_local = {s.index: k for k, s in enumerate(host)}
        if host:
            self._host = self._make_host_tier(host, self.plan)
            # the tier's CoreSplit sized torch's and cpu_kernels' thread counts to the trainer's
            # cores, and its close() restores both
            try:
                for s in host:
                    self._host.load_state(self._host_local[s.index], s)  # read into its bank
            except BaseException:
                # the optimizer is not built yet, so its close() would not reach this tier
                self._host.close()
                self._host = None
                raise
        self._install_hooks(host)
        self._record_versions()  # with remainders the host tier writes the params' high halves

    def _warn_fraction_miss(self) -> None:
        """Once, at construction: fixed fractions the whole-subgroup placement misses (plan.py)."""
        if "auto" in (self.offload_fraction, self.nvme_fraction):
            return
        why = fraction_miss(self.plan, self.offload_fraction, self.nvme_fraction, self.subgroup_numel)
        if why is not None:
            warnings.warn(why, stacklevel=6)

    def _make_host_tier(self, host: list, plan) -> HostTier:
        """A host tier (worker, arena, swap files) for the subgroups `host` of `plan`, empty:
        the caller loads their state."""
        if len({s.dtype for s in host} - {torch.float32}) > 1:
            raise TypeError("host-tier parameters must share one low-precision dtype")
        layout = host_tier_layout(host, plan, self.state_format, self._layout.amsgrad, self.rollback,
                                  self.io_banks)
        nvme = layout["nvme"]
        return HostTier(layout.pop("numels"), **layout, worker_share=self.worker_share,
                        nvme_path=self.nvme_path if any(nvme) else None,
                        pin=host[0].device if host[0].device.type == "cuda" else False)

    def _plan_bytes(self, plan) -> dict:
        """{"device", "host"} bytes the tiers of `plan` will allocate (footprint.py)."""
        return plan_bytes(self._layout.subgroups, plan, self.state_format, self._layout.amsgrad, self.rollback,
                          self.io_banks, self._layout.cuda())

    def _fraction_plan(self, decision):
        """The plan at `decision`'s fractions (or those asked for), its spare pool sized."""
        sgs = self._layout.subgroups
        if decision is None:
            off, nv, decision = self._fractions_now()
        else:
            off, nv = decision.offload_fraction, decision.nvme_fraction
        spares = self.spare_banks
        if spares is None and decision is not None and decision.prediction is not None:
            spares = decision.prediction.spare_banks
        plan = fraction_plan([s.numel for s in sgs], [s.ready_rank for s in sgs], off, nv, spares)
        resident = sum(1 for t in plan.tiers if t == HOST)
        if self.rollback != "exact" or not resident:
            # inverse steps in place; an nvme step borrows the io banks: no spare would be used
            plan.spare_banks = 0
        elif spares is None and not self.speculative:
            # no step waits for validation, so the pool needs no bank per subgroup: a step
            # writes one spare (a step failing mid-way must not tear committed state) and a
            # second lets the next subgroup stage while the worker steps this one
            plan.spare_banks = min(NON_SPECULATIVE_SPARE_BANKS, resident)
        elif spares is None:
            from hybrid_opt.scheduler import default_spare_banks
            host = [s for s in sgs if plan.tiers[s.index] != DEVICE]
            plan.spare_banks = 0
            without = self._plan_bytes(plan)["host"]
            plan.spare_banks = 1
            bank = self._plan_bytes(plan)["host"] - without  # one bank, exactly
            budget = self.host_memory_budget
            if budget is not None:  # what the placement leaves of it
                budget = max(0, budget - without)
            plan.spare_banks = default_spare_banks(len(host), bank, budget)
        if decision is not None:
            plan.prediction, plan.reason = decision.prediction, decision.reason
        plan.shard = self._shard_note()
        return plan

    def _shard_note(self) -> str:
        """'rank r of N: its share, e of E elements' where this rank lays out only its part
        (FSDP2's local shards, process_group's dim-0 chunks; an HSDP replica holds its whole
        shard); '' otherwise."""
        params = list(self._layout.params())
        if D.world_size() <= 1 or not any(D.is_sharded(p) for p in params):
            return ""
        import torch.distributed as dist
        mine = sum(s.numel for s in self._layout.subgroups)
        return (f"rank {dist.get_rank()} of {dist.get_world_size()}: its share, {mine} of "
                f"{sum(p.numel() for p in params)} elements")

    def _refresh_fractions(self) -> None:
        """The shares actually laid out (at subgroup boundaries)."""
        total = sum(self.plan.numels) or 1
        self._fractions = ((self.plan.elements(HOST) + self.plan.elements(NVME)) / total,
                           self.plan.elements(NVME) / total)

    def _rebuild_tiers(self, decision=None, plan=None) -> None:
        """Lays the tiers out again: at `decision`'s placement, or as `plan` (by default the
        plan now), with the committed state (moves.py: a failure leaves the tiers as they were)."""
        self._drop_speculation()
        self._relayout(self._fraction_plan(decision) if decision is not None else (plan or self.plan))

    @acts_on_owner
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
        refit moves it, so the new group's state need not fit on the device (a move that
        fails warns and keeps the new group on the device tier). Any other failure (the new
        group's flat buffer or device state cannot be allocated, ...) takes the group out
        again: param_groups, the layout, the tiers and the scheduler as before the call, the
        error raised saying so; only the new params are left views of a flat buffer of their
        own (same values)."""
        before = _Extension(len(self._layout.steps), len(self._layout.subgroups), self.plan, self._fractions,
                            self._auto, dict(vars(self._auto)) if self._auto is not None else None)
        try:
            self._extend_layout(gi)
        except BaseException as e:
            if self.plan is not before.plan:
                raise  # interrupted after the move switched over: the group is laid out
            self._unextend(gi, before)
            if not isinstance(e, Exception):
                raise
            raise _restated(e, f"add_param_group: laying out the new group failed, so it was not "
                               f"added (param_groups, the optimizer's state and its tiers are as "
                               f"before the call, and training goes on): {type(e).__name__}: {e}. "
                               f"Fix the cause and add the group again") from e

    def _unextend(self, gi: int, before: "_Extension") -> None:
        """Undoes what _extend_layout did of group `gi` before it failed."""
        n, k = before.params, before.subgroups
        for s in self._layout.subgroups[k:]:
            self._device.drop(s.index)
        self._layout.drop_group(gi, n, k)
        del self.param_groups[gi]
        for name in ("_flat_views", "_flat_ptrs", "_param_versions"):  # storage.py's records
            del self.__dict__.setdefault(name, [])[n:]
        del self.plan.tiers[k:], self.plan.numels[k:]
        self._fractions = before.fractions
        self._auto = before.auto
        if before.auto is not None:
            self._auto.__dict__.clear()
            self._auto.__dict__.update(before.auto_vars)
        self._install_hooks([s for s in self._layout.subgroups if self.plan.tiers[s.index] != DEVICE])

    def _extend_layout(self, gi: int) -> None:
        sgs = self._add_group_layout(gi)
        for s in sgs:
            self.plan.tiers.append(DEVICE)
            self.plan.numels.append(s.numel)
        self._device.absorb(DeviceTier(sgs, self._layout.amsgrad, self.state_format))
        self._refresh_fractions()
        # the timing hooks sit on the first and last trainable params: the new group's may be
        # either (a move below installs them again anyway)
        self._install_hooks([s for s in self._layout.subgroups if self.plan.tiers[s.index] != DEVICE])
        if self._auto is not None:
            self._auto.regrow([s.numel for s in self._layout.subgroups], [s.ready_rank for s in self._layout.subgroups])
        stay = f"add_param_group: the new group's {sum(s.numel for s in sgs)} elements stay on the device tier"
        try:
            off, nv, decision = self._fractions_now()
        except ValueError as e:  # the grown model fits no placement within the budgets
            warnings.warn(f"{stay}: {e}", stacklevel=4)
            return
        if off == 0 and nv == 0 and self._host is None:
            return  # everything on the device tier: where the new group already is
        target = decision or _Fixed(off, nv, self.plan.prediction, "add_param_group: laid out again")
        if not self._room_to_move(target):
            warnings.warn(f"{stay}: laying the tiers out again does not fit in free memory: "
                          f"{self._room_shortfall(self._fraction_plan(target))}", stacklevel=4)
            return
        if decision is not None:
            decision.reason = "add_param_group: " + decision.reason
        try:
            self._move(target)
        except Exception as e:  # the layout before is back, state and all (see _move)
            warnings.warn(f"{stay}: laying the tiers out again failed: {type(e).__name__}: {e}", stacklevel=4)
