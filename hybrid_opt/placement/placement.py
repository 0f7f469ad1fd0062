"""Placement: which tier holds each subgroup, the tiers themselves, the automatic planner of
"auto", and moving state between tiers (a refit, replan(), add_param_group after
construction, a checkpoint that needs amsgrad's running max; the move's steps in moves.py).

The optimizer's Placement part: it owns `plan`, the device tier, the host tier (`host`: it names
each subgroup by its `Subgroup.index`, as every tier does), the fractions laid out and the
AutoPlanner. A failed move leaves the old plan and its state as they were, so it loses nothing.
What a move means to the other parts (speculation dropped before, hooks and versions after)
reaches them through the `TierEvents` the optimizer hands in.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from hybrid_opt import distributed as D
from hybrid_opt.placement import moves
from hybrid_opt.placement.cost_model import NON_SPECULATIVE_SPARE_BANKS
from hybrid_opt.placement.footprint import device_tier_bytes, host_tier_layout, plan_bytes
from hybrid_opt.placement.plan import DEVICE, HOST, NVME, check_fractions, fraction_miss, fraction_plan
from hybrid_opt.state import layout as L
from hybrid_opt.state.state_format import absmaxes_of
from hybrid_opt.swap import check_nvme_path
from hybrid_opt.tiers.device import DeviceTier
from hybrid_opt.tiers.host import HostTier

if TYPE_CHECKING:
    from hybrid_opt.placement.cost_model import Prediction
    from hybrid_opt.placement.plan import Plan
    from hybrid_opt.placement.scheduler import AutoPlanner


class PlacementConfig(NamedTuple):
    """The placement arguments of the optimizer (README: one line per argument)."""

    offload_fraction: float | str  # a fraction, or "auto"
    nvme_fraction: float | str
    nvme_path: str | os.PathLike | None
    speculative: bool | str  # True, False or "auto": parts.compose makes it True or False
    rollback: str
    device_memory_budget: int | None
    host_memory_budget: int | None
    worker_share: float | None  # None: the arrangement's default
    spare_banks: int | None
    io_banks: int
    refit_every: int
    calibration: dict | None


class TierEvents(NamedTuple):
    """What a change of the tiers asks of the optimizer's other parts."""

    drop_speculation: Callable  # () -> None: pending host steps read the old tiers
    wait_params: Callable  # () -> None: process_group's pending gathers landed first
    rehook: Callable  # (host subgroups) -> None: speculation's grad hooks
    laid_out: Callable  # () -> None: the tiers wrote the params (versions, stats)


class Fixed(NamedTuple):
    """A placement to lay out as it is (no scheduler decision)."""

    offload_fraction: float
    nvme_fraction: float
    prediction: Prediction | None = None
    reason: str = ""


class Extension(NamedTuple):
    """What add_param_group's layout changes, as it was before (Placement.unextend)."""

    params: int
    subgroups: int
    plan: Plan
    fractions: tuple
    auto: AutoPlanner | None
    auto_copy: AutoPlanner | None


def restated(e: Exception, message: str) -> Exception:
    """`message` (which quotes `e`) as an error of `e`'s type where that type takes a message
    alone (MemoryError, torch.OutOfMemoryError, ValueError...), else as a RuntimeError."""
    try:
        new = type(e)(message)
    except Exception:
        return RuntimeError(message)
    return new if str(new) == message else RuntimeError(message)


class Placement:
    """Lays the tiers out (at construction) and moves subgroups between them."""

    def __init__(self, layout, config: PlacementConfig, state_format, events: TierEvents):
        """Lays the tiers out at construction, at the fractions asked for (or "auto"'s): every
        param group of `layout` is laid out already."""
        self.layout = layout
        self.config = config
        self.state_format = state_format
        self.events = events
        self.auto: AutoPlanner | None = None  # when a fraction is "auto": fractions_now makes it
        sgs = layout.subgroups
        if state_format.store_param_remainders and not any(state_format.remainders_for(s.dtype) for s in sgs):
            warnings.warn(
                "store_param_remainders=True has no effect here: no parameter is bf16 "
                "(only a bf16 param's master is kept as a remainder; fp32/fp16 params "
                "keep an fp32 master)",
                stacklevel=5,
            )
        self.plan: Plan = self.plan_for(None)
        self._warn_fraction_miss()
        self.fractions = self._laid_out_shares()  # (off the device, on nvme) as laid out
        self.device = DeviceTier(
            [s for s in sgs if self.plan.tiers[s.index] == DEVICE], layout.amsgrad, state_format
        )
        self.host: HostTier | None = None  # the host and nvme subgroups' tier, where there are any
        host = self.host_subgroups()
        if host:
            self.host = self.make_host_tier(host, self.plan)
            # the tier's CoreSplit sized torch's and cpu_kernels' thread counts to the trainer's
            # cores, and its close() restores both
            try:
                for s in host:
                    self.host.load_state(s.index, s)  # read into its bank
            except BaseException:
                # the optimizer is not built, so its close() would not reach this tier
                self.host.close()
                raise

    # ------------------------------------------------------------------ reading it
    def host_subgroups(self) -> list:
        return [s for s in self.layout.subgroups if self.plan.tiers[s.index] != DEVICE]

    def state_of(self, sg, master: bool = True) -> dict:
        """A subgroup's fp32 master and moments, wherever it lives: views on the device and
        host tiers, copies read from its file on nvme; a master kept as remainders is decoded
        (a new tensor: written back with `load`). `master=False`: the moments only (an fp32
        subgroup's master is a copy of its params on the device tier where several share it,
        and a copy of the file's on nvme: neither is made)."""
        if self.plan.tiers[sg.index] == DEVICE:
            return self.device.state_of(sg.index, master)
        assert self.host is not None  # the plan has a subgroup off the device: a host tier holds it
        st = self.host.state(sg.index, master)
        if master:
            st["master"] = st.pop("param")
        return st

    def load(self, sg, st: dict) -> None:
        """Writes state `st` (state_of's keys) back into subgroup `sg`'s tier."""
        if self.plan.tiers[sg.index] == DEVICE:
            self.device.set_master(sg.index, st["master"])  # remainders: encoded back
        else:
            assert self.host is not None  # the plan has a subgroup off the device: a host tier holds it
            self.host.load_state(
                sg.index,
                st["master"],
                st["exp_avg"],
                st["exp_avg_sq"],
                st.get("max_exp_avg_sq"),
                **absmaxes_of(st),
            )

    # ------------------------------------------------------------------ laying out
    def _warn_fraction_miss(self) -> None:
        """Once, at construction: fixed fractions the whole-subgroup placement misses (plan.py)."""
        c = self.config
        if "auto" in (c.offload_fraction, c.nvme_fraction):
            return
        off, nv = float(c.offload_fraction), float(c.nvme_fraction)  # numbers: neither is "auto"
        why = fraction_miss(self.plan, off, nv, self.layout.subgroup_numel)
        if why is not None:
            warnings.warn(why, stacklevel=6)

    def make_host_tier(self, host: list, plan) -> HostTier:
        """A host tier (worker, arena, swap files) for the subgroups `host` of `plan`, empty:
        the caller loads their state."""
        if len({s.dtype for s in host} - {torch.float32}) > 1:
            raise TypeError("host-tier parameters must share one low-precision dtype")
        c = self.config
        layout = host_tier_layout(host, plan, self.state_format, self.layout.amsgrad, c.rollback, c.io_banks)
        nvme = layout["nvme"]
        return HostTier(
            layout.pop("numels"),
            **layout,
            ids=[s.index for s in host],
            worker_share=c.worker_share,
            nvme_path=c.nvme_path if any(nvme) else None,
            pin=host[0].device if host[0].device.type == "cuda" else False,
        )

    def _laid_out_shares(self) -> tuple[float, float]:
        """(off the device, on nvme): the shares of the plan's elements, as laid out (at subgroup
        boundaries)."""
        total = sum(self.plan.numels) or 1
        return (
            (self.plan.elements(HOST) + self.plan.elements(NVME)) / total,
            self.plan.elements(NVME) / total,
        )

    # ------------------------------------------------------------------ the fractions
    def fractions_now(self) -> tuple:
        """(offload, nvme, decision) to lay out: the user's numbers, or the scheduler's choice."""
        c, sgs = self.config, self.layout.subgroups
        if "auto" not in (c.offload_fraction, c.nvme_fraction):
            off, nv = float(c.offload_fraction), float(c.nvme_fraction)
            if c.device_memory_budget is not None or c.host_memory_budget is not None:
                self._check_budgets(off, nv)
            return off, nv, None
        if self.auto is None:
            from hybrid_opt.placement.scheduler import AutoPlanner, default_budgets

            params = list(self.layout.params())
            device = params[0].device if params else torch.device("cpu")
            fmt, dtype = self.budget_format(sgs)
            budgets = default_budgets(params, device, c.device_memory_budget, c.host_memory_budget)
            self.auto = AutoPlanner(
                [s.numel for s in sgs],
                [s.ready_rank for s in sgs],
                device,
                model_bytes=torch.tensor([], dtype=dtype).element_size(),
                state_bytes=16 if self.layout.amsgrad else 12,
                state_format=fmt,
                model_dtype=dtype,
                subgroup_numel=self.layout.subgroup_numel,
                fixed_offload=None if c.offload_fraction == "auto" else float(c.offload_fraction),
                fixed_nvme=None if c.nvme_fraction == "auto" else float(c.nvme_fraction),
                nvme_path=c.nvme_path,
                worker_share=c.worker_share,
                spare_banks=c.spare_banks,
                exact_rollback=c.rollback == "exact",
                speculative=bool(c.speculative),
                device_budget=budgets[0],
                host_budget=budgets[1],
                refit_every=c.refit_every,
                calibration=c.calibration,
                device_from_peak=(
                    device.type == "cuda" and c.device_memory_budget is None and c.offload_fraction == "auto"
                ),
            )
            if self.auto.device_from_peak:
                # the peak from here on is training's (activations), not flattening's or calibration's
                torch.cuda.reset_peak_memory_stats(device)
        d = self.auto.choose()
        return d.offload_fraction, d.nvme_fraction, d

    def budget_format(self, sgs) -> tuple:
        """(state format, model dtype) the budgets count for subgroups `sgs`: theirs when they
        share one dtype; for a mix (fp32 norms beside bf16 weights) an upper bound of what any
        tier holds of them — the low-precision dtype (its bank keeps the model-dtype copy) and,
        as a host tier that mixes them keeps a 4-byte master region (tiers/compressed.py), no
        remainders."""
        dtypes = {s.dtype for s in sgs}
        if len(dtypes) <= 1:
            return self.state_format, next(iter(dtypes), torch.float32)
        low = sorted(dtypes - {torch.float32}, key=str)
        return (
            dataclasses.replace(self.state_format, store_param_remainders=False),
            low[0] if low else torch.float32,
        )

    def modelled_bytes(self, off: float, nv: float, spare_banks) -> dict:
        """The cost model's bytes per tier for this optimizer's model at a placement."""
        from hybrid_opt.placement import cost_model as cm

        sgs = self.layout.subgroups
        params = list(self.layout.params())
        cuda = bool(params) and params[0].is_cuda
        size = params[0].element_size() if params else 4
        fmt, dtype = self.budget_format(sgs)
        # a host tier mixing dtypes (fp32 norms beside bf16 weights) stages fp32 grads
        grads = 4 if len({s.dtype for s in sgs}) > 1 else size
        wl = cm.Workload(
            params=float(sum(s.numel for s in sgs)),
            model_bytes=size,
            grad_bytes=grads,
            amsgrad=self.layout.amsgrad,
            state_format=fmt,
            model_dtype=dtype if sgs else None,
            subgroup_numel=self.layout.subgroup_numel,
            bank_padding=L.bank_padding([s.numel for s in sgs]),
        )
        return cm.memory_bytes(cm.Machine(gpus=1 if cuda else 0), wl, off, nv, spare_banks)

    def _check_budgets(self, off: float, nv: float) -> None:
        """Fixed fractions: the bytes the plan's tiers will allocate against the budgets, before
        anything is allocated. The spare pool is sized afterwards from what the budget leaves:
        counted here at its least (one bank where exact rollback needs one)."""
        from hybrid_opt.placement.scheduler import check_fixed_plan

        c, sgs = self.config, self.layout.subgroups
        plan = fraction_plan([s.numel for s in sgs], [s.ready_rank for s in sgs], off, nv, None)
        resident = sum(1 for t in plan.tiers if t == HOST)
        plan.spare_banks = (
            0 if c.rollback != "exact" or not resident else c.spare_banks if c.spare_banks is not None else 1
        )
        check_fixed_plan(
            (c.device_memory_budget, c.host_memory_budget), self.bytes_of(plan), self.layout.cuda()
        )

    def bytes_of(self, plan) -> dict:
        """{"device", "host"} bytes the tiers of `plan` will allocate (footprint.py)."""
        c = self.config
        return plan_bytes(
            self.layout.subgroups,
            plan,
            self.state_format,
            self.layout.amsgrad,
            c.rollback,
            c.io_banks,
            self.layout.cuda(),
        )

    def device_bytes(self, sgs) -> int:
        """The bytes a device tier of subgroups `sgs` allocates."""
        return device_tier_bytes(sgs, self.state_format, self.layout.amsgrad)

    def plan_for(self, decision) -> Plan:
        """The plan at `decision`'s fractions (or those asked for), its spare pool sized."""
        c, sgs = self.config, self.layout.subgroups
        if decision is None:
            off, nv, decision = self.fractions_now()
        else:
            off, nv = decision.offload_fraction, decision.nvme_fraction
        spares, awake = c.spare_banks, None  # awake: None, every spare from the start
        if spares is None and decision is not None and decision.prediction is not None:
            spares = decision.prediction.spare_banks
        plan = fraction_plan([s.numel for s in sgs], [s.ready_rank for s in sgs], off, nv, spares)
        resident = sum(1 for t in plan.tiers if t == HOST)
        if c.rollback != "exact" or not resident:
            # inverse steps in place; an nvme step borrows the io banks: no spare would be used
            plan.spare_banks = 0
        elif spares is None:
            from hybrid_opt.placement.scheduler import default_spare_banks

            host = [s for s in sgs if plan.tiers[s.index] != DEVICE]
            plan.spare_banks = 0
            without = self.bytes_of(plan)["host"]
            plan.spare_banks = 1
            bank = self.bytes_of(plan)["host"] - without  # one bank, exactly
            budget = c.host_memory_budget
            if budget is not None:  # what the placement leaves of it
                budget = max(0, budget - without)
            if c.speculative:
                plan.spare_banks = default_spare_banks(len(host), bank, budget)
                # the pool starts as a step without speculation needs it and grows by what
                # backward shows it can fill (HostStepping.finish): where backward is shorter
                # than the host step, the other spares would be memory for nothing
                awake = min(plan.spare_banks, NON_SPECULATIVE_SPARE_BANKS)
            else:
                # no step waits for validation, so the pool needs no bank per subgroup: a step
                # writes one spare (a step failing mid-way must not tear committed state) and a
                # second lets the next subgroup stage while the worker steps this one, where
                # the budget leaves room for it
                fit = NON_SPECULATIVE_SPARE_BANKS if budget is None else max(1, budget // max(1, bank))
                plan.spare_banks = min(NON_SPECULATIVE_SPARE_BANKS, resident, fit)
        why = {} if decision is None else {"prediction": decision.prediction, "reason": decision.reason}
        return dataclasses.replace(plan, shard=self._shard_note(), spares_awake=awake, **why)

    def _shard_note(self) -> str:
        """'rank r of N: its share, e of E elements' where this rank lays out only its part
        (FSDP2's local shards, process_group's dim-0 chunks; an HSDP replica holds its whole
        shard); '' otherwise."""
        params = list(self.layout.params())
        if D.world_size() <= 1 or not any(D.is_sharded(p) for p in params):
            return ""
        import torch.distributed as dist

        mine = sum(s.numel for s in self.layout.subgroups)
        return (
            f"rank {dist.get_rank()} of {dist.get_world_size()}: its share, {mine} of "
            f"{sum(p.numel() for p in params)} elements"
        )

    # ------------------------------------------------------------------ moves
    def room_shortfall(self, plan) -> str | None:
        """None when a move to `plan` fits (moves.py, step 1), else what does not."""
        return moves.room_shortfall(self.move_memory(plan))

    def move_memory(self, plan) -> dict:
        """Bytes a move to `plan` needs and has, on the device and on the host (moves.py)."""
        return moves.move_memory(self, plan)

    def room_to_move(self, decision) -> bool:
        """Whether a move to `decision`'s placement fits in the memory free now."""
        return self.room_shortfall(self.plan_for(decision)) is None

    def move(self, decision) -> None:
        """Moves subgroups between tiers to `decision`'s plan, bitwise (every tier steps with
        the same arithmetic). Raises MemoryError when it does not fit, or the error of a new
        tier that cannot be built; either way the old plan stays, state and all."""
        t0 = time.perf_counter()
        self.events.drop_speculation()
        plan = self.plan_for(decision)
        short = self.room_shortfall(plan)
        if short is not None:
            raise MemoryError(
                f"moving to offload_fraction={decision.offload_fraction:g}, "
                f"nvme_fraction={decision.nvme_fraction:g}: {short}; the placement "
                f"stays as it is"
            )
        self.relayout(plan)
        if self.auto is not None:
            self.auto.moved(time.perf_counter() - t0)

    def rebuild(self) -> None:
        """Lays the tiers out again as the plan now, with the committed state (a failure leaves
        the tiers as they were); state the layout now needs and the old tiers lack is zeros."""
        self.events.drop_speculation()
        self.relayout(self.plan)

    def relayout(self, plan) -> None:
        """Lays the tiers out as `plan` with the committed state now (moves.py: steps 2-4)."""
        self.events.wait_params()
        new_host, extra, leaving = moves.build_tiers(self, plan)
        # 4. the switch: nothing below allocates device or host memory
        for s in leaving:
            self.device.drop(s.index)
        self.device.absorb(extra)
        old_host, self.host = self.host, new_host
        self.plan = plan
        self.fractions = self._laid_out_shares()
        self.events.rehook(self.host_subgroups())
        self.events.laid_out()
        if old_host is not None:
            try:
                old_host.close()
            except Exception as e:  # the new tiers hold every subgroup: nothing is lost
                warnings.warn(
                    f"closing the host tier of the previous placement failed: {type(e).__name__}: {e}",
                    stacklevel=3,
                )

    def replan(self, offload_fraction: float, nvme_fraction: float = 0.0) -> None:
        """The optimizer's replan(): a move to fixed fractions now."""
        check_fractions(offload_fraction, nvme_fraction)
        if "auto" in (offload_fraction, nvme_fraction):
            raise ValueError('replan() takes numbers; "auto" is chosen at construction')
        if float(nvme_fraction) > 0:
            check_nvme_path(self.config.nvme_path)
        prediction = None
        if self.auto is not None:
            prediction = self.auto.predict(float(offload_fraction), float(nvme_fraction))
        self.move(Fixed(float(offload_fraction), float(nvme_fraction), prediction, "replan()"))

    def refit(self, steps_taken: int) -> None:
        """ "auto", after each step: moves subgroups between tiers when a refit says it pays
        (the scheduler has the measured samples: step_stats.py)."""
        auto = self.auto
        assert auto is not None  # the optimizer refits only under "auto" (stepping.record_step)
        if not auto.due(steps_taken):
            return
        self._observe_device_memory()  # "auto" on CUDA: the device budget beside the activations
        decision = auto.refit(*self.fractions, self.plan.spare_banks)
        kept = "refit: kept"
        if decision is not None and not self.room_to_move(decision):
            kept = (
                "refit: a move would pay, but it does not fit in free memory: "
                f"{self.room_shortfall(self.plan_for(decision))}"
            )
            decision = None
        if decision is not None:
            try:
                self.move(decision)
            except Exception as e:  # the plan before is back, state and all (see move)
                warnings.warn(
                    f"refit: moving to offload_fraction={decision.offload_fraction:g}, "
                    f"nvme_fraction={decision.nvme_fraction:g} failed; the plan stays as it "
                    f"was: {type(e).__name__}: {e}",
                    stacklevel=3,
                )
                self._note(f"refit: a move failed ({type(e).__name__})")
        elif auto.backward_s is not None:  # what the kept plan predicts, and why it is kept
            self._note(kept, prediction=auto.predict(*self.fractions, self.plan.spare_banks))
        elif kept != "refit: kept":
            self._note(kept)

    def _note(self, reason: str, **fields) -> None:
        """The plan stays; why (and what it predicts) is recorded in a new Plan record, so a
        plan read before keeps its reason and prediction (its tier lists are shared)."""
        self.plan = dataclasses.replace(self.plan, reason=reason, **fields)

    def _observe_device_memory(self) -> None:
        """ "auto" on CUDA without device_memory_budget: the device budget from the memory free
        now and the peak of the iterations so far (activations included), so a refit puts
        state on the device only where the next iterations will not need the memory
        (scheduler.measured_device_budget)."""
        if self.auto is None or not self.auto.device_from_peak or not self.layout.subgroups:
            return
        from hybrid_opt.placement.scheduler import cuda_memory

        spares = self.plan.spare_banks
        self.auto.observe_device_memory(
            cuda_memory(self.layout.subgroups[0].device),
            counted=self.modelled_bytes(*self.fractions, spares)["device"],
            floor=self.modelled_bytes(1.0, 0.0, spares)["device"],
        )

    # ------------------------------------------------------------------ add_param_group
    def extension_point(self) -> Extension:
        """What extend() changes, as it is now (for unextend)."""
        return Extension(
            len(self.layout.steps),
            len(self.layout.subgroups),
            self.plan,
            self.fractions,
            self.auto,
            copy.copy(self.auto) if self.auto is not None else None,
        )

    def unextend(self, before: Extension) -> None:
        """Undoes what extend() did of the new subgroups before it failed (the layout's are
        the caller's)."""
        k = before.subgroups
        for s in self.layout.subgroups[k:]:
            self.device.drop(s.index)
        del self.plan.tiers[k:], self.plan.numels[k:]
        self.fractions = before.fractions
        self.auto = before.auto_copy

    def extend(self, sgs: list) -> None:
        """add_param_group after construction (a layer unfrozen in fine-tuning): the new
        group's subgroups `sgs` (laid out already) start on the device tier with fresh state;
        where the placement offloads — a fraction above 0, or "auto"'s choice for the grown
        model — every subgroup is then laid out again at that placement, the committed state
        moved bitwise as a refit moves it, so the new group's state need not fit on the device
        (a move that fails warns and keeps the new group on the device tier)."""
        for s in sgs:
            self.plan.tiers.append(DEVICE)
            self.plan.numels.append(s.numel)
        self.device.absorb(DeviceTier(sgs, self.layout.amsgrad, self.state_format))
        self.fractions = self._laid_out_shares()
        # the timing hooks sit on the first and last trainable params: the new group's may be
        # either (a move below installs them again anyway)
        self.events.rehook(self.host_subgroups())
        if self.auto is not None:
            self.auto.regrow(
                [s.numel for s in self.layout.subgroups], [s.ready_rank for s in self.layout.subgroups]
            )
        stay = (
            f"add_param_group: the new group's {sum(s.numel for s in sgs)} elements stay on the device tier"
        )
        try:
            off, nv, decision = self.fractions_now()
        except ValueError as e:  # the grown model fits no placement within the budgets
            warnings.warn(f"{stay}: {e}", stacklevel=4)
            return
        if off == 0 and nv == 0 and self.host is None:
            return  # everything on the device tier: where the new group already is
        target = decision or Fixed(off, nv, self.plan.prediction, "add_param_group: laid out again")
        if not self.room_to_move(target):
            warnings.warn(
                f"{stay}: laying the tiers out again does not fit in free memory: "
                f"{self.room_shortfall(self.plan_for(target))}",
                stacklevel=4,
            )
            return
        if decision is not None:
            decision.reason = "add_param_group: " + decision.reason
        try:
            self.move(target)
        except Exception as e:  # the layout before is back, state and all (see move)
            warnings.warn(f"{stay}: laying the tiers out again failed: {type(e).__name__}: {e}", stacklevel=4)

    def close(self) -> None:
        self.device.close()
        if self.host is not None:
            self.host.close()  # restores the cores and both thread counts (CoreSplit)
