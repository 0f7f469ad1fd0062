"""Argument checks of HybridAdamW / HybridAdam: torch.optim.Adam's own (its order, error types
and messages), then ours (placement, rollback, budgets), all before any memory or process is
made, so a bad argument is an error that names it and costs nothing."""

from __future__ import annotations

import math
import warnings

import torch

from hybrid_opt.distributed.local_shards import is_pre_public_dtensor
from hybrid_opt.placement.plan import check_fractions
from hybrid_opt.state.state_format import StateFormat
from hybrid_opt.swap import check_nvme_path

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_hyperparameters(lr, betas, eps, weight_decay, *, foreach, capturable) -> tuple:
    """torch.optim.Adam's own checks, in its order, with its error types and messages (its
    optimizer database holds them as error inputs: tests/test_optim_db.py). Returns betas as
    torch keeps them (a 1-element Tensor beta squeezed to 0-dim)."""
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
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
    if not (
        (isinstance(betas[0], float) and isinstance(betas[1], float))
        or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))
    ):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor):
            if foreach and not capturable:
                raise ValueError(
                    f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True"
                )
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    return tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() != 0 else b for b in betas)


def check_constructor(
    name: str,
    *,
    amsgrad,
    capturable,
    differentiable,
    fused,
    foreach,
    max_grad_norm,
    rollback,
    subgroup_numel,
    device_memory_budget,
    host_memory_budget,
    offload_fraction,
    nvme_fraction,
    nvme_path,
    refit_every,
) -> None:
    """The constructor's arguments beyond torch's hyperparameters (`name`: the class's)."""
    if capturable:
        raise ValueError(
            f"{name} does not support capturable=True (CUDA graph "
            f"capture): its host tier steps in another process, which a graph "
            f"cannot record; capture the model alone, or use torch.optim."
            f"{name[len('Hybrid') :]}(capturable=True)"
        )
    # torch's fused-flag errors (it raises them after building its groups): the same, sooner
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable:
        raise ValueError(
            f"{name} does not support differentiable=True: no "
            f"autograd graph runs through its in-place tier kernels; use "
            f"torch.optim.{name[len('Hybrid') :]} to differentiate "
            f"through the step"
        )
    # otherwise foreach / fused are accepted: every path of ours is fused already; they change nothing
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float))
        and not isinstance(max_grad_norm, bool)
        and max_grad_norm > 0
        and math.isfinite(max_grad_norm)
    ):
        raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
    if rollback not in ("exact", "inverse"):
        raise ValueError(f"rollback must be 'exact' or 'inverse', got {rollback!r}")
    if rollback == "inverse" and amsgrad:
        raise ValueError(
            "rollback='inverse' cannot undo amsgrad (its running max of v is not "
            "invertible); use rollback='exact' with amsgrad=True"
        )
    if subgroup_numel is not None and (
        not isinstance(subgroup_numel, int) or isinstance(subgroup_numel, bool) or subgroup_numel < 1
    ):
        raise ValueError(f"subgroup_numel must be a positive int or None (automatic), got {subgroup_numel!r}")
    for name, budget in (
        ("device_memory_budget", device_memory_budget),
        ("host_memory_budget", host_memory_budget),
    ):
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


def check_release_grads(release_grads, process_group) -> None:
    """release_grads=True frees each full p.grad once process_group's reduce-scatter has taken
    this rank's chunk (zero_release.py): there is nothing to free without process_group."""
    if not isinstance(release_grads, bool):
        raise TypeError(f"release_grads must be True or False, got {release_grads!r}")
    if release_grads and process_group is None:
        raise ValueError(
            "release_grads=True needs process_group=: it frees each param's full "
            "p.grad once the grads are reduce-scattered and this rank keeps only its "
            "chunk; without process_group every rank steps the whole grad (under "
            "FSDP2 the grads are sharded already). Pass process_group="
            "torch.distributed.group.WORLD, or drop release_grads"
        )


def check_speculative(speculative) -> None:
    """speculative: True (host steps during backward), False (in step()), or "auto" (the
    default: during backward where the worker has cores of its own; speculation.speculates)."""
    if not (isinstance(speculative, bool) or speculative == "auto"):
        raise ValueError(f'speculative must be True, False or "auto", got {speculative!r}')


def check_state_format(exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, rollback) -> StateFormat:
    """The compressed-state options (#16) as one StateFormat: its dtype and flag errors, then
    rollback='inverse' refused with bf16 moments (rounding to bf16 is not invertible)."""
    fmt = StateFormat(exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders)
    fmt.check_rollback(rollback)
    if rollback == "inverse" and fmt.store_param_remainders:
        raise ValueError(
            "rollback='inverse' cannot be combined with store_param_remainders=True: "
            "its fp64 inverse reads and writes an fp32 master, which remainders do "
            "not keep; use rollback='exact' (the default)"
        )
    return fmt


def check_q8_placement(fmt: StateFormat, process_group, params, first: int = 0) -> None:
    """q8 moments of sharded params (FSDP2's DTensors, process_group's chunks), before anything
    is laid out: a q8 param whose dim-0 cut falls inside one of its blocks of 256 is refused,
    naming it (its index: `first` + its place in `params`; distributed/q8_shards.py)."""
    from hybrid_opt.distributed.q8_shards import check_q8_shards

    check_q8_shards(params, process_group, fmt, lambda i: f"parameter {first + i}")


def check_group_params(name: str, param_group: dict) -> dict:
    """A param group's params as torch takes them (a Tensor or an ordered collection, named
    or not), de-duplicated with a warning, each of a dtype we step; returns the group."""
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but "
            "the ordering of tensors in sets will change between runs. Please use a list instead."
        )
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
        warnings.warn(
            "optimizer contains a parameter group with duplicate parameters; the duplicates are ignored",
            stacklevel=4,
        )
    param_group = dict(param_group, params=unique)
    for item in unique:
        t = item[1] if isinstance(item, tuple) else item
        if is_pre_public_dtensor(t):  # first: on torch 2.4 the lazy-module check below takes it too
            raise ValueError(
                f"{name} takes DTensor parameters (FSDP2) from torch 2.6, where "
                f"torch.distributed.tensor and torch.distributed.fsdp.fully_shard are public; "
                f"this torch ({torch.__version__}) has them only under torch.distributed._tensor "
                f"and ._composable. Upgrade torch"
            )
        if isinstance(t, torch.nn.parameter.UninitializedParameter):  # a lazy module's, before its forward
            raise ValueError(
                f"{name} lays its state out for each parameter's size when it is built, and "
                f"a parameter is still uninitialized (a torch.nn.Lazy* module): run one "
                f"forward pass before building the optimizer"
            )
        if isinstance(t, torch.Tensor):
            if t.is_complex():
                raise ValueError(
                    f"{name} does not support complex parameters; optimize torch.view_as_real(param) instead"
                )
            if t.dtype not in MODEL_DTYPES:
                raise TypeError(f"{name} supports float32, bfloat16 and float16 parameters, got {t.dtype}")
    return param_group


def check_materialised(name: str, param_groups: list, offload_fraction) -> None:
    """Params on the meta device (deferred init: a model built under torch.device("meta"))
    stay where the state is all on the device tier (offload_fraction=0), as torch.optim takes
    them; the host and nvme tiers copy each param's values into its fp32 master when they lay
    it out, and a meta tensor has none (laying them out later, on first use, would take every
    tier a second way of being built)."""
    if offload_fraction == 0:
        return
    i = 0
    for group in param_groups:
        names = group.get("param_names")
        for k, p in enumerate(group["params"]):
            if p.is_meta:
                label = f"parameter {i}" + (f" ({names[k]})" if names else "")
                raise ValueError(
                    f"{name}: {label} is on the meta device (deferred init: a model built "
                    f"under torch.device('meta')), which holds no values, and "
                    f"offload_fraction={offload_fraction!r} puts state in host memory or on "
                    f"nvme, whose tiers copy each param's values into its fp32 master when "
                    f"they lay it out. Build the optimizer after materialising the model: "
                    f"model.to_empty(device=...) and its weights' init first (an optimizer "
                    f"built before to_empty() holds the meta params, which to_empty() "
                    f"replaces in the module: torch.optim's would not train the model "
                    f"either)"
                )
            i += 1
