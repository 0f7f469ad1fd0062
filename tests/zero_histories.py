"""Random training histories at 2 gloo ranks, under `process_group=` (ZeRO-2 style sharded state)
or FSDP2 (`fully_shard`), drawn from a seed, and the one trainer that runs them: on a rank of the
launch (tests/dist_scripts/zero_histories_train.py) and in one process, the reference
(tests/test_random_histories_zero.py).

Each rank has grads of its own every step: a backward pass per micro-batch (one to three,
annotated by `set_gradient_accumulation_boundary` or not), each param's grad a tensor, zeros, or
none (the param unused on that rank in that micro-batch; every pass uses one param at least).
Under `process_group=` the ranks' grads accumulate in p.grad, are reduced and averaged (÷ world)
as buckets complete in backward, and every rank steps its own dim-0 chunks. The single-process
reference is HybridAdamW at offload 0 given, by one backward pass, the grad every rank's
reduction makes: each rank's micro-batch grads summed in order, the ranks' sums added and halved
(both exact for two ranks: a + b is b + a, and halving is exact in binary) — so the two runs
agree bit for bit where no clipping norm is summed across shards.
Under FSDP2 the params are a module's that `fully_shard` shards (its forward is sum(p * g)), each
backward pass is reduced by FSDP2 on its own (each rank's grad halved, then added) and the
reduced passes accumulate; a param unused on one rank is unused on every rank, as FSDP2 needs.

Events besides: a GradScaler with an infinity in one rank's grad (every rank skips), lr changed
(a float, or a tensor in place), the state dict loaded into a new optimizer (from `state_dict()`,
or `save_state_dict`'s file read with weights_only), `replan()` to another placement, the worker
of one rank killed (SIGKILL) before backward, and the placement: offload fraction, nvme, speculation,
subgroup size, small buckets, the overlapped all-gather.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, field

import torch
from helpers import backward_with, draw_grads, grads_loss, grads_pattern, reloaded_state

WORLD = 2
FORMATS = {
    "fp32": {},
    "bf16 moments": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "q8": {"exp_avg_dtype": "q8", "exp_avg_sq_dtype": "q8"},
    "remainders": {"store_param_remainders": True},
    "remainders + q8": {"store_param_remainders": True, "exp_avg_dtype": "q8", "exp_avg_sq_dtype": "q8"},
}


@dataclass
class Step:
    # passes[k][rank][param]: micro-batch k's grad on that rank (a tensor, "zero" or None)
    passes: list
    annotate: bool = False
    infinite: tuple | None = None  # (rank, param): an infinity in that rank's last pass
    lr: tuple | None = None  # (group, value)
    reload: str | None = None  # after the step, into a new optimizer: "memory" (state_dict()) or "file"
    replan: tuple | None = None  # after the step, on the ranks: opt.replan(offload_fraction, nvme_fraction)
    kill_worker: int | None = None  # this rank's worker SIGKILLed before the step's backward


@dataclass
class History:
    params: list  # initial values
    format: str
    adamw: bool
    hyper: dict
    clip: float | None
    scaler: bool
    lr_tensor: bool
    placement: dict
    small_buckets: bool
    mode: str = "process_group"  # or "fsdp2": the params fully_shard's, the grads reduced by FSDP2
    steps: list = field(default_factory=list)


def _draw_grads(rng: random.Random, params: list) -> list:
    return draw_grads(rng, params, none=0.2, zero=0.05)


def draw(seed: int, mode: str = "process_group") -> History:
    rng = random.Random(seed)
    fmt = rng.choice(sorted(FORMATS))
    dtype = torch.bfloat16 if "remainders" in fmt else torch.float32
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    shapes = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.random()
        if kind < 0.2:
            shapes.append((rng.randint(1, 5),))
        elif kind < 0.7:
            shapes.append((rng.randint(1, 40), rng.randint(1, 60)))
        elif "q8" in fmt:  # each rank's dim-0 part a whole number of q8 blocks (or refused)
            shapes.append((512 * rng.randint(1, 10),))
        else:
            shapes.append((rng.randint(500, 5000),))
    placement = {
        "offload_fraction": rng.choice([0.0, 0.5, 1.0, 1.0]),
        "speculative": rng.choice([True, False]),
        "subgroup_numel": rng.choice([256, 4096] if "q8" in fmt else [32, 256, 4096]),  # q8: a block at least
        "overlap_param_gather": rng.random() < 0.3,
    }
    if rng.random() < 0.3:
        placement.update(offload_fraction=1.0, nvme_fraction=rng.choice([0.5, 1.0]))
    if mode == "fsdp2":
        del placement["overlap_param_gather"]  # process_group='s own
    history = History(
        params=[(torch.randn(s, generator=gen) * 0.5).to(dtype) for s in shapes],
        format=fmt,
        adamw=rng.random() < 0.8,
        hyper=dict(
            lr=rng.choice([1e-3, 1e-2]),
            weight_decay=rng.choice([0.0, 0.01, 0.1]),
            amsgrad=rng.random() < 0.2,
            betas=rng.choice([(0.9, 0.999), (0.8, 0.99)]),
        ),
        clip=rng.choice([None, None, 0.3, 100.0]),
        scaler=rng.random() < 0.35,
        lr_tensor=rng.random() < 0.2,
        placement=placement,
        small_buckets=rng.random() < 0.5,
        mode=mode,
    )
    for _ in range(rng.randint(2, 6)):
        passes = [[_draw_grads(rng, history.params) for _ in range(WORLD)] for _ in range(rng.randint(1, 3))]
        for ranks in passes:
            if mode == "fsdp2":  # a param unused on one rank is unused on all (FSDP2 reduces what has grads)
                for grads in ranks[1:]:
                    grads[:] = [
                        None if g0 is None else "zero" if g is None else g for g0, g in zip(ranks[0], grads)
                    ]
            for grads in ranks:
                if all(g is None for g in grads):
                    # every rank runs every backward pass (the contract: a rank that skips one
                    # leaves its peers waiting in the reduction, up to the group's timeout)
                    grads[0] = "zero"
        step = Step(passes=passes, annotate=len(passes) > 1 and rng.random() < 0.5)
        if history.scaler and rng.random() < 0.2:
            step.infinite = (rng.randrange(WORLD), rng.randrange(len(history.params)))
        if rng.random() < 0.2:
            step.lr = (rng.randint(0, 1), rng.choice([1e-4, 2e-3]))
        if rng.random() < 0.15:
            step.reload = rng.choice(["memory", "file"])
        if rng.random() < 0.1:
            step.replan = rng.choice([(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 0.25)])
        if placement["offload_fraction"] > 0 and rng.random() < 0.1:
            step.kill_worker = rng.randrange(WORLD)
        history.steps.append(step)
    return history


def describe(history: History) -> str:
    steps = []
    for s in history.steps:
        grads = " ".join("/".join(grads_pattern(r) for r in ranks) for ranks in s.passes)
        held = {k: v for k, v in vars(s).items() if k != "passes" and v not in (None, False)}
        steps.append(f"{grads} {held}" if held else grads)
    return (
        f"format {history.format}, {'AdamW' if history.adamw else 'Adam'} {history.hyper}, "
        f"clip {history.clip}, scaler {history.scaler}, lr tensor {history.lr_tensor}, "
        f"placement {history.placement}, small buckets {history.small_buckets}, "
        f"shapes {[tuple(p.shape) for p in history.params]}, steps {steps}"
    )


def _grad(g, p: torch.Tensor, scale: float, inf: bool) -> torch.Tensor | None:
    if g is None:
        return None
    g = torch.zeros(p.shape) if isinstance(g, str) else g * scale
    if inf and g.numel():
        g.view(-1)[0] = float("inf")
    return g.to(p.dtype)


def reduced_grads(step: Step, params: list, scale: float, mode: str) -> list:
    """The grad every rank's reduction makes of this step. process_group=: each rank's passes
    accumulated in order (as autograd does), the ranks' sums added and halved (None where no
    rank has one). FSDP2: each pass reduced on its own (every rank's grad halved, then added:
    its pre-divide factor at 2 ranks) and the results accumulated in order."""
    if mode == "fsdp2":
        out = []
        for i, p in enumerate(params):
            acc = None
            for k, ranks in enumerate(step.passes):
                last = k == len(step.passes) - 1
                halves = [
                    _grad(ranks[r][i], p, scale, last and step.infinite == (r, i)) for r in range(WORLD)
                ]
                if halves[0] is not None:
                    reduced = halves[0] / WORLD + halves[1] / WORLD
                    acc = reduced if acc is None else acc + reduced
            out.append(acc)
        return out
    out = []
    for i, p in enumerate(params):
        total = None
        for r in range(WORLD):
            acc = None
            for k, ranks in enumerate(step.passes):
                last = k == len(step.passes) - 1
                g = _grad(ranks[r][i], p, scale, last and step.infinite == (r, i))
                if g is not None:
                    acc = g if acc is None else acc + g
            if acc is not None:
                total = acc if total is None else total + acc
        out.append(None if total is None else total / WORLD)
    return out


def _lr(history: History, value: float):
    return torch.tensor(value) if history.lr_tensor else value


class _Terms(torch.nn.Module):
    """The params as a module FSDP2 can shard: its forward is sum(p * g) over the params given
    a grad, so that backward makes each grad `g` bit for bit."""

    def __init__(self, params: list):
        super().__init__()
        self.held = torch.nn.ParameterList(params)

    def forward(self, grads: list) -> torch.Tensor:
        return grads_loss(self.held, grads)


def _build(cls, history: History, params: list, dist_args: dict):
    groups = [{"params": params[: max(1, len(params) // 2)]}]
    if len(params) > 1:
        groups.append({"params": params[max(1, len(params) // 2) :], "lr": _lr(history, 5e-3)})
    return cls(
        groups,
        max_grad_norm=history.clip,
        **FORMATS[history.format],
        **dict(history.hyper, lr=_lr(history, history.hyper["lr"])),
        **dist_args,
    )


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole param (a DTensor's gathered: a collective every rank makes in the same order)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def train(history: History, cls, *, rank: int | None, nvme_path: str | None = None) -> dict:
    """Trains `history`: on this rank of the launch (`rank`; at the drawn placement, under
    process_group=WORLD or FSDP2 as `history.mode` says), or in one process at offload 0
    (`rank=None`). Returns the whole params after each step and whether each step was skipped."""
    params = [torch.nn.Parameter(v.clone()) for v in history.params]
    backward = backward_with
    if rank is None:
        dist_args = {"offload_fraction": 0.0}
    elif history.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(_Terms(params))
        params = list(model.parameters())  # the DTensor shards

        def backward(_params: list, grads: list) -> None:
            model(grads).backward()

        dist_args = dict(history.placement)
    else:
        import torch.distributed as dist

        dist_args = dict(history.placement, process_group=dist.group.WORLD)
    if rank is not None:
        dist_args["nvme_path"] = nvme_path  # every placement may be replanned onto nvme
    opt = _build(cls, history, params, dist_args)
    scaler = None
    if history.scaler:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        scaler.scale(torch.ones(()))  # the scale starts here, as a loss's scale() starts it
        opt.attach_grad_scaler(scaler)
    out = {"params": [], "skipped": []}
    try:
        for step in history.steps:
            scale = scaler.get_scale() if scaler is not None else 1.0
            if rank is not None and step.kill_worker == rank and opt.worker_pid is not None:
                os.kill(opt.worker_pid, signal.SIGKILL)
            opt.zero_grad(set_to_none=True)
            if rank is None:
                backward_with(params, reduced_grads(step, params, scale, history.mode))
            else:
                for k, ranks in enumerate(step.passes):
                    last = k == len(step.passes) - 1
                    if step.annotate:
                        opt.set_gradient_accumulation_boundary(last)
                    grads = [
                        _grad(g, v, scale, last and step.infinite == (rank, i))
                        for i, (v, g) in enumerate(zip(history.params, ranks[rank]))
                    ]
                    backward(params, grads)
            if step.lr is not None:
                group = opt.param_groups[step.lr[0] % len(opt.param_groups)]
                if torch.is_tensor(group["lr"]):
                    group["lr"].fill_(step.lr[1])
                else:
                    group["lr"] = step.lr[1]
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            out["skipped"].append(opt.step_was_skipped)
            if step.replan is not None and rank is not None:
                opt.replan(*step.replan)
            if step.reload is not None:
                saved = reloaded_state(opt, step.reload)
                opt.close()
                opt = _build(cls, history, params, dist_args)
                if scaler is not None:
                    opt.attach_grad_scaler(scaler)
                opt.load_state_dict(saved)
            opt.wait_params()
            out["params"].append([_full(p) for p in params])
    finally:
        opt.close()
    return out
