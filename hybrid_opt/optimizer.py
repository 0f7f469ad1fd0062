"""HybridAdamW / HybridAdam: drop-in torch.optim optimizers whose state is divided by subgroup
between the device, host and nvme tiers.

Real torch.optim.Optimizer subclasses, following torch.optim.AdamW(foreach=False) / Adam within
fp32 rounding whatever the placement; `state_dict()` is torch's format. The class is a facade over
parts that own their state (docs/code-map.md); `self.state` holds only each stepped param's `step`,
as torch's does. Design notes: docs/internals.md."""

from __future__ import annotations

import contextlib

import torch

from hybrid_opt import arguments as A
from hybrid_opt import lifetime, torch_methods
from hybrid_opt import parts as P
from hybrid_opt import stepping as S
from hybrid_opt.distributed import node
from hybrid_opt.distributed.local_shards import warn_replicated
from hybrid_opt.distributed.sharding import NoSharding, sharding_for
from hybrid_opt.distributed.zero_gather import SHARD_KEY
from hybrid_opt.placement.placement import PlacementConfig
from hybrid_opt.state import checkpoint as C
from hybrid_opt.state import saving as SV
from hybrid_opt.state import torch_extras as TX
from hybrid_opt.step_plan import StepInputs


class _HybridBase(torch.optim.Optimizer):
    """The torch.optim facade: arguments, param groups, the step and the lifecycle."""

    _decoupled: bool = True
    _keeps_on_load: tuple = ()  # group keys load_state_dict leaves as they are
    # GradScaler sets grad_scale / found_inf on the optimizer for one step() call, which skips on
    # overflow itself (torch's protocol: absent otherwise, no class default: it multiplies one it finds)
    _step_supports_amp_scaling = True
    # until the tiers exist (a constructor that raised: __del__)
    _closed = True
    _built = False

    def __init__(
        self,
        params,
        lr,
        betas,
        eps,
        weight_decay,
        amsgrad,
        *,
        maximize,
        foreach,
        capturable,
        differentiable,
        fused,
        max_grad_norm,
        offload_fraction,
        nvme_fraction,
        nvme_path,
        subgroup_numel,
        speculative,
        rollback,
        device_memory_budget,
        host_memory_budget,
        process_group,
        worker_share=None,
        spare_banks=None,
        io_banks=4,
        refit_every=50,
        calibration=None,
        overlap_param_gather=False,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        store_param_remainders=False,
        release_grads=False,
        decoupled_weight_decay=None,
    ):
        lifetime.mark_owner(self)  # a forwarding wrapper's calls act on this object (lifetime.py)
        betas = A.check_hyperparameters(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable)
        A.check_constructor(
            type(self).__name__,
            amsgrad=amsgrad,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            foreach=foreach,
            max_grad_norm=max_grad_norm,
            rollback=rollback,
            subgroup_numel=subgroup_numel,
            device_memory_budget=device_memory_budget,
            host_memory_budget=host_memory_budget,
            offload_fraction=offload_fraction,
            nvme_fraction=nvme_fraction,
            nvme_path=nvme_path,
            refit_every=refit_every,
        )
        A.check_release_grads(release_grads, process_group)
        A.check_speculative(speculative)
        self.state_format = A.check_state_format(
            exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, rollback
        )
        if decoupled_weight_decay is not None:  # Adam's (torch >= 2.6); each group may say otherwise
            self._decoupled = bool(decoupled_weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=self._decoupled,
        )
        super().__init__(params, defaults)
        A.check_materialised(type(self).__name__, self.param_groups, offload_fraction)
        A.check_q8_placement(
            self.state_format, process_group, [p for g in self.param_groups for p in g["params"]]
        )
        self.max_grad_norm = max_grad_norm
        self.offload_fraction, self.nvme_fraction, self.nvme_path = offload_fraction, nvme_fraction, nvme_path
        self.speculative, self.rollback = speculative, rollback
        self.device_memory_budget, self.host_memory_budget = device_memory_budget, host_memory_budget
        self.worker_share, self.spare_banks, self.io_banks = worker_share, spare_banks, io_banks
        self.refit_every = refit_every
        self.overlap_param_gather = bool(overlap_param_gather)
        params = [p for g in self.param_groups for p in g["params"]]
        # the ranks on this node, where the launcher did not say (Lightning's DDP)
        node.derive_from_dist(params[0].device if params else None)
        lifetime.claim(self, params)
        warn_replicated(params, process_group)
        sharding = sharding_for(params, process_group, release_grads)
        config = PlacementConfig(
            offload_fraction,
            nvme_fraction,
            nvme_path,
            speculative,
            rollback,
            device_memory_budget,
            host_memory_budget,
            worker_share,
            spare_banks,
            io_banks,
            refit_every,
            calibration,
        )
        self._parts = P.compose(
            self.param_groups,
            owner=type(self).__name__,
            decoupled=self._decoupled,
            state_format=self.state_format,
            placement_config=config,
            max_grad_norm=max_grad_norm,
            sharding=sharding,
            subgroup_numel=subgroup_numel,
        )
        self.subgroup_numel = self._parts.layout.subgroup_numel
        P.build(self._parts)
        self._built = True
        self._closed = False

    # ------------------------------------------------------------------ param groups
    @lifetime.acts_on_owner
    def add_param_group(self, param_group: dict) -> None:
        param_group = A.check_group_params(type(self).__name__, param_group)
        # a group's own values get the constructor's checks (torch checks only the defaults)
        if any(k in param_group for k in ("lr", "betas", "eps", "weight_decay")):
            get = lambda k: param_group.get(k, self.defaults[k])  # noqa: E731
            betas = A.check_hyperparameters(
                get("lr"),
                get("betas"),
                get("eps"),
                get("weight_decay"),
                foreach=get("foreach"),
                capturable=get("capturable"),
            )
            if "betas" in param_group:
                param_group["betas"] = betas
        if self._built:
            self._check_open()
            self._parts.layout.check_joining(param_group, self.defaults, self._parts.sharding.active)
            # a joining FSDP2 param cut inside one of its q8 blocks, refused as at construction
            first = sum(len(g["params"]) for g in self.param_groups)
            joining = [i[1] if isinstance(i, tuple) else i for i in param_group["params"]]
            A.check_q8_placement(self.state_format, None, joining, first)
        torch_methods.base(super().add_param_group)(param_group)
        if self._built:
            P.extend(self._parts, len(self.param_groups) - 1)
            lifetime.claim(self, self.param_groups[-1]["params"])

    # ------------------------------------------------------------------ properties
    @property
    def parts(self):
        """The parts this optimizer is composed of (docs/code-map.md); tests and tools look inside
        through hybrid_opt.testing.debug_view(opt), the one documented introspection surface."""
        return self._parts

    @property
    def plan(self):
        """The placement now: which tier holds each subgroup."""
        return self._parts.placement.plan

    @property
    def stats(self):
        """The last step's figures per tier (docs/usage.md)."""
        return self._parts.stats.last

    @property
    def step_was_skipped(self):
        """Whether the last step() was skipped (a GradScaler's inf/nan: nothing stepped)."""
        return self._parts.ledger.step_was_skipped

    @property
    def last_grad_norm(self):
        """The global grad norm the last step clipped by (unscaled); None without clipping."""
        return self._parts.ledger.last_grad_norm

    @property
    def closed(self):
        """Whether close() ran (or the end of its `with` block)."""
        return self._closed

    @property
    def allocated_bytes(self) -> dict:
        """{"device", "host", "nvme", "comm"}: the bytes this optimizer holds now, as the OS
        and the allocator report them (allocated.py); all 0 once closed."""
        from hybrid_opt.state.allocated import allocated_bytes

        if self._closed:
            return allocated_bytes(None, None, NoSharding())  # nothing held, comm included
        return allocated_bytes(self._parts.placement.device, self._parts.placement.host, self._parts.sharding)

    @property
    def worker_pid(self):
        """The host tier's worker process, or None."""
        if self._closed or self._parts.placement.host is None:
            return None
        return self._parts.placement.host.client.pid

    def _check_open(
        self, cannot="step again: build a new one (its load_state_dict takes this one's last state_dict())"
    ) -> None:
        # its host tier closed on its own (shut by anything but close()) says the same: it never steps again
        host = self._parts.placement.host
        if self._closed or (host is not None and host.closed):
            raise RuntimeError(
                f"this {type(self).__name__} was closed (close(), or the end of its "
                f"`with` block) and cannot {cannot}"
            )

    # ------------------------------------------------------------------ the user's calls
    @lifetime.acts_on_owner
    def attach_grad_scaler(self, scaler) -> None:
        """Lets speculation read the loss scale that will apply (torch.amp.GradScaler);
        without it, speculation assumes the last step's scale and validation redoes what
        does not match."""
        self._parts.speculator.attach_grad_scaler(scaler)

    @lifetime.acts_on_owner
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's vocabulary: False on micro-batches that are not the last before step()
        suppresses speculation on them (their grads are not final). Unannotated accumulation
        stays correct — a grad changed after speculation makes it stale — only slower."""
        self._parts.speculator.set_boundary(is_boundary)

    @lifetime.acts_on_owner
    def zero_grad(self, set_to_none: bool = True) -> None:
        torch_methods.base(super().zero_grad)(set_to_none)
        self._parts.zero_grad(set_to_none)

    @lifetime.acts_on_owner
    def wait_params(self) -> None:
        """process_group mode: makes every param current on this rank (lands the pending
        all-gathers of the last step, each wait bounded). Call it before reading params outside
        a module's forward — an EMA, model.state_dict(), a param used by another module; a
        module's own params land before its forward by themselves. No-op otherwise."""
        self._parts.sharding.wait_gathered()

    @lifetime.acts_on_owner
    def replan(self, offload_fraction: float, nvme_fraction: float = 0.0) -> None:
        """Moves state to another placement now (what a refit of "auto" does); numerics are
        unchanged. Call between steps."""
        self._check_open()
        A.check_materialised(type(self).__name__, self.param_groups, offload_fraction)
        self._parts.placement.replan(offload_fraction, nvme_fraction)

    # ------------------------------------------------------------------ checkpoints
    @lifetime.acts_on_owner
    def state_dict(self) -> dict:
        """torch's format (checkpoint.gather_state says where each param's state lands)."""
        sd, post = self._state_dict_shell("state_dict")
        unowned = TX.unowned_entries(sd)  # opt.state's entries under keys that are not params
        sd["state"] = C.gather_state(self._parts.layout, self._parts.placement, self.state_format)
        sd["state"].update(unowned)
        return _through(post, self, sd)

    @lifetime.acts_on_owner
    def save_state_dict(self, f, *, fp32: bool = False) -> None:
        """torch.save(self.state_dict(), f), one param's state in memory at a time (saving.py).
        `fp32=True`: the moments in fp32 (q8 dequantized, bf16 upcast) and a 16-bit param's fp32
        master under `master_param`: a checkpoint torch.optim.AdamW loads, one param's fp32
        state made at a time (checkpoint.fp32_entries)."""
        sd, post = self._state_dict_shell("save_state_dict")
        unowned = TX.unowned_entries(sd)  # as state_dict(): after the params' entries
        entries = C.iter_state(self._parts.layout, self._parts.placement, self.state_format)
        if fp32:
            entries = C.fp32_entries(entries, list(self._parts.layout.params()))
        if post:  # torch's post hooks are handed the whole dict: what they return is written
            sd["state"] = dict(entries)
            sd["state"].update(unowned)
            return SV.save(f, _through(post, self, sd))
        sd["state"] = unowned  # saving.save writes them after the entries it makes
        SV.save(f, sd, entries)

    def _state_dict_shell(self, call: str) -> tuple:
        self.wait_params()
        self._check_open(
            "give its state, which close() freed: take state_dict() or save_state_dict() "
            "before it closes (inside its `with` block)"
        )
        TX.check_laid_out(self._parts.layout, type(self).__name__, call)
        return C.committed_shell(
            self._parts, self._optimizer_state_dict_post_hooks, torch_methods.base(super().state_dict)
        )

    @lifetime.acts_on_owner
    def load_state_dict(self, state_dict: dict) -> None:
        self.wait_params()
        state_dict = _through(self._optimizer_load_state_dict_pre_hooks, self, state_dict.copy())
        self._parts.sharding.check_owner(state_dict.get(SHARD_KEY))
        self._check_open()
        TX.check_laid_out(self._parts.layout, type(self).__name__, "load_state_dict")
        C.load(self._parts, state_dict, self.state, keep=self._keeps_on_load)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __getstate__(self):  # torch's pickles defaults, state and param_groups: a shell of this one
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied: its state lives in a worker, "
            f"shared memory and nvme files. Save opt.state_dict() and load it into a new one."
        )

    # ------------------------------------------------------------------ the step
    @lifetime.acts_on_owner
    @torch.no_grad()
    def step(self, closure=None):
        """torch.optim's step (stepping.step reads it top to bottom)."""
        loss = None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._check_open()
            # GradScaler.step sets found_inf / grad_scale on the optimizer for this call
            S.step(
                self._parts,
                StepInputs(
                    type(self).__name__,
                    self._decoupled,
                    self.max_grad_norm,
                    self.overlap_param_gather,
                    self.state,
                    getattr(self, "found_inf", None),
                    getattr(self, "grad_scale", None),
                    id(self),
                ),
            )
        except BaseException:
            # GradScaler.step deletes them only after a return: a step that raised would scale the next
            # by them
            for name in ("grad_scale", "found_inf"):
                with contextlib.suppress(AttributeError):  # set for this call, or not at all
                    delattr(self, name)
            raise
        return loss

    # ------------------------------------------------------------------ lifecycle
    @lifetime.acts_on_owner
    def close(self) -> None:
        """Idempotent. Stops the worker, frees shared memory, restores the trainer's cores and
        thread counts; parameters keep ordinary memory of their own."""
        if self._closed:
            return
        self._closed = True
        if lifetime.forked_copy(self):
            return  # a forked child's copy: the worker, memory and files are the parent's
        self._parts.speculator.close()
        self._parts.stats.remove_hooks()
        self._parts.sharding.close()  # pending all-gathers landed: the params are current after close()
        self._parts.placement.close()  # restores the cores and both thread counts (CoreSplit)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        lifetime.collected(self)

    def __repr__(self) -> str:
        return super().__repr__() + f"\n{self.plan}" if self._built else super().__repr__()


class HybridAdamW(_HybridBase):
    """torch.optim.AdamW's signature and defaults (decoupled weight decay), plus placement.

    See the README (one line per argument) and docs/usage.md for the hybrid arguments."""

    _decoupled = True
    _keeps_on_load = ("decoupled_weight_decay",)  # as torch's AdamW.__setstate__

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        max_grad_norm=None,
        offload_fraction=1.0,
        nvme_fraction=0.0,
        nvme_path=None,
        subgroup_numel=None,
        speculative="auto",
        rollback="exact",
        device_memory_budget=None,
        host_memory_budget=None,
        process_group=None,
        **hybrid,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            max_grad_norm=max_grad_norm,
            offload_fraction=offload_fraction,
            nvme_fraction=nvme_fraction,
            nvme_path=nvme_path,
            subgroup_numel=subgroup_numel,
            speculative=speculative,
            rollback=rollback,
            device_memory_budget=device_memory_budget,
            host_memory_budget=host_memory_budget,
            process_group=process_group,
            **hybrid,
        )


class HybridAdam(_HybridBase):
    """torch.optim.Adam's signature and defaults (weight_decay=0, L2 decay), plus placement."""

    _decoupled = False

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        max_grad_norm=None,
        offload_fraction=1.0,
        nvme_fraction=0.0,
        nvme_path=None,
        subgroup_numel=None,
        speculative="auto",
        rollback="exact",
        device_memory_budget=None,
        host_memory_budget=None,
        process_group=None,
        decoupled_weight_decay=False,
        **hybrid,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            max_grad_norm=max_grad_norm,
            offload_fraction=offload_fraction,
            nvme_fraction=nvme_fraction,
            nvme_path=nvme_path,
            subgroup_numel=subgroup_numel,
            speculative=speculative,
            rollback=rollback,
            device_memory_budget=device_memory_budget,
            host_memory_budget=host_memory_budget,
            process_group=process_group,
            decoupled_weight_decay=decoupled_weight_decay,
            **hybrid,
        )


def _through(hooks: dict, opt, value):
    """`value` through torch's hooks in order: a hook's non-None return replaces it."""
    for hook in hooks.values():
        value = value if (out := hook(opt, value)) is None else out
    return value
