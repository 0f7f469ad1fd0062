"""Shared by the rank scripts and tests/test_distributed.py: the model, the data and the
single-process reference on the global batch."""

from __future__ import annotations

import os

import torch

IN, HID, OUT = 12, 13, 6  # 13: odd, so dim-0 shards are uneven over 2 ranks
BATCH = 8  # global batch, split evenly over the ranks
STEPS = 4
LR = 1e-2


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HID),
        torch.nn.Tanh(),
        torch.nn.Linear(HID, OUT),
        torch.nn.Tanh(),
        torch.nn.Linear(OUT, 3),
    )


def batches(n: int = STEPS, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, IN, generator=gen) for _ in range(n)]


def loss_fn(model, x):
    return model(x).square().mean()


def loss_bias_unused(model, x, rank: int, world: int, step: int):
    """A loss where the last layer's bias is an unused branch on rank 1 (every step) and on
    every rank at the last step: for process_group's buckets when a param has no grad on one
    rank only, or on none. `x` is this rank's batch."""
    if rank == 0 and step != STEPS - 1:
        return loss_fn(model, x)
    return torch.nn.functional.linear(model[:4](x), model[4].weight).square().mean()


def reference_bias_unused(kind: str, world: int = 2, **kw) -> tuple:
    """reference() with loss_bias_unused: the mean over the ranks of their losses."""

    def loss(model, x, step):
        return (
            sum(loss_bias_unused(model, local_batch(x, r, world), r, world, step) for r in range(world))
            / world
        )

    return reference(kind, loss=loss, **kw)


def loss_layer_unused(model, x, rank: int, world: int, step: int):
    """A loss where rank 1 skips the middle Linear (its weight's 6 rows split evenly over 2
    ranks: a bucket reduced straight from p.grad, which rank 1 then does not have)."""
    if rank == 0:
        return loss_fn(model, x)
    return model[4](torch.tanh(torch.tanh(model[0](x))[:, :OUT])).square().mean()


def reference_layer_unused(kind: str, world: int = 2, **kw) -> tuple:
    """reference() with loss_layer_unused: the mean over the ranks of their losses."""

    def loss(model, x, step):
        return (
            sum(loss_layer_unused(model, local_batch(x, r, world), r, world, step) for r in range(world))
            / world
        )

    return reference(kind, loss=loss, **kw)


def loss_unused_everywhere(model, x, rank: int, world: int, step: int):
    """loss_layer_unused, and at the last step the middle Linear and the last layer's bias
    unused on every rank: params no rank uses (one in a bucket reduced straight from p.grad),
    which torch steps from the zero grads zero_grad(set_to_none=False) kept."""
    if step != STEPS - 1:
        return loss_layer_unused(model, x, rank, world, step)
    h = torch.tanh(torch.tanh(model[0](x))[:, :OUT])
    return torch.nn.functional.linear(h, model[4].weight).square().mean()


def reference_ranked(ranked_loss, kind: str, world: int = 2, **kw) -> tuple:
    """reference() with `ranked_loss(model, x, rank, world, step)`: the mean over the ranks of
    their losses."""

    def loss(model, x, step):
        return sum(ranked_loss(model, local_batch(x, r, world), r, world, step) for r in range(world)) / world

    return reference(kind, loss=loss, **kw)


def local_batch(x, rank: int, world: int):
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def reference(
    kind: str,
    n: int = STEPS,
    *,
    max_grad_norm=None,
    weight_decay=0.01,
    skip=(),
    seed: int = 1,
    loss=None,
    set_to_none: bool = True,
) -> tuple:
    """(params after each step, grad norms) of torch.optim.AdamW / Adam (foreach=False) on the
    global batch, clip_grad_norm_ when asked, the steps in `skip` not taken (an overflow);
    zero_grad(set_to_none) before each backward."""
    model = build_model()
    cls = torch.optim.AdamW if kind == "AdamW" else torch.optim.Adam
    opt = cls(model.parameters(), lr=LR, weight_decay=weight_decay, foreach=False)
    params, norms = [], []
    for i, x in enumerate(batches(n, seed)):
        opt.zero_grad(set_to_none=set_to_none)
        (loss_fn(model, x) if loss is None else loss(model, x, i)).backward()
        norm = None
        if max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
        if i not in skip:
            opt.step()
        norms.append(norm)
        params.append([p.detach().clone() for p in model.parameters()])
    return params, norms


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def save_result(obj) -> None:
    rank = int(os.environ.get("RANK", "0"))
    torch.save(obj, os.path.join(os.environ["DIST_OUT"], f"rank{rank}.pt"))


def overflow_local_grad(model) -> None:
    """An inf in this rank's local grad of the model's first param (a DTensor's local shard):
    an overflow the other ranks do not see in their own grads."""
    g = next(iter(model.parameters())).grad
    with torch.no_grad():
        (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")


def step_after_unscale(opt, scaler) -> None:
    """The user's order for editing unscaled grads: scaler.unscale_, step, update — or a plain
    step without a scaler."""
    if scaler is None:
        opt.step()
        return
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


class OverflowRun:
    """The 2-rank scripts' training loop with an overflow in rank 1's grads at step `at` (None:
    none, and no GradScaler): under process_group= (`mode` "zero") it is written during backward
    (OverflowInBackward: an edit after backward is refused), else after it; the step goes
    through a GradScaler where there is an overflow to skip, and process_group's params are
    gathered after it. `out` collects per step what the scripts compare: "skipped" and
    "scales" (the scaler's after its update)."""

    def __init__(self, model, mode: str, at: int | None, rank: int, world: int):
        """Before the optimizer: OverflowInBackward's hook must run before the optimizer's."""
        self.model, self.mode, self.at, self.rank, self.world = model, mode, at, rank, world
        self.overflow = OverflowInBackward(model) if at is not None and mode == "zero" else None
        self.opt = self.scaler = None

    def attach(self, opt) -> None:
        """The optimizer to step, and a GradScaler attached to it where there is an overflow."""
        self.opt = opt
        if self.at is not None:
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
            opt.attach_grad_scaler(self.scaler)

    def step(self, i: int, x, out: dict, dtype: torch.dtype | None = None) -> None:
        """Step `i` on this rank's share of the global batch `x` (cast to `dtype` if given)."""
        opt, scaler, overflows = self.opt, self.scaler, i == self.at and self.rank == 1
        opt.zero_grad()
        if overflows and self.overflow is not None:
            self.overflow.arm()
        batch = local_batch(x, self.rank, self.world)
        loss = loss_fn(self.model, batch if dtype is None else batch.to(dtype))
        (scaler.scale(loss) if scaler else loss).backward()
        if overflows and self.overflow is None:  # an overflow in this rank's local grads only
            overflow_local_grad(self.model)
        scaled_step(opt, scaler, out)
        if self.mode == "zero":
            opt.wait_params()
        out["skipped"].append(opt.step_was_skipped)


def scaled_step(opt, scaler, out: dict) -> None:
    """opt.step(), through the GradScaler where there is one (its new scale to out["scales"])."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
        out["scales"].append(float(scaler.get_scale()))
    else:
        opt.step()


class OverflowInBackward:
    """overflow_local_grad during backward, for process_group= (where an edit of p.grad after
    backward is refused: hybrid_opt/distributed/zero_edits.py): a hook on the first param, registered
    before the optimizer's, writes the inf into this rank's local grad as soon as it is
    accumulated — before the reduction reads it, as a real overflow would be. `arm()` before
    the backward that should overflow."""

    def __init__(self, model):
        self.armed = False
        next(iter(model.parameters())).register_post_accumulate_grad_hook(self._hook)

    def arm(self) -> None:
        self.armed = True

    def _hook(self, p) -> None:
        if self.armed:
            self.armed = False
            with torch.no_grad():
                p.grad.view(-1)[0] = float("inf")


def rank_main(run) -> None:
    """A rank script's main: joins the process group (gloo; with DIST_DEVICE=cuda one GPU per
    rank and NCCL beside gloo), runs `run(name, rank, world, tmp)` for each configuration named
    on the command line (a shared temporary directory), with its wall time under "seconds"
    when it returns a dict, and saves {name: result} for the test (save_result)."""
    import sys
    import tempfile
    import time

    import torch.distributed as dist

    device = os.environ.get("DIST_DEVICE", "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[1:]:
            t0 = time.perf_counter()
            results[name] = run(name, rank, world, tmp)
            if isinstance(results[name], dict):
                results[name]["seconds"] = time.perf_counter() - t0
    save_result(results)
    dist.destroy_process_group()
