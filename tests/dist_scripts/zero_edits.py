"""Rank script: what frameworks do to HybridAdamW(process_group=WORLD) that it cannot honour —
grads edited in place after backward (zero_edits.py: refused on every rank at the same step
with nothing stepped), and one rank's checkpoint loaded on every rank (rank0_checkpoint:
refused on the others) — in the configurations named on the command line; saves per
configuration the error each rank raised (type and message), the optimizer's step count and
the params (unchanged by a refused step)."""

import common as C
import torch
import torch.distributed as dist

from hybrid_opt import GradsEditedError, HybridAdamW
from hybrid_opt.testing import debug_view


def _edit(name: str, model, opt, rank: int) -> None:
    params = list(model.parameters())
    if name in ("clip", "ddp_unbitten_clip"):
        # a coefficient of 1 (HF Trainer's clip_grad_norm_(params, inf) for its logged norm):
        # an edit by its version; under DDP one that changed nothing
        torch.nn.utils.clip_grad_norm_(params, float("inf"))
    elif name == "ddp_clip":
        torch.nn.utils.clip_grad_norm_(params, 0.01)  # bites
    elif name == "clip_rank1":
        if rank == 1:
            torch.nn.utils.clip_grad_norm_(params, 0.01)
    elif name == "mul":
        params[0].grad.mul_(0.5)
    elif name == "sparse_rank1":  # refused by step()'s checks, on this rank only
        if rank == 1:
            params[-1].grad = params[-1].grad.to_sparse()


def rank0_checkpoint(rank: int, tmp: str) -> dict:
    """HF Trainer's way: rank 0 saves its optimizer's state_dict, every rank loads that file."""
    import os

    model = C.build_model()
    path = os.path.join(os.environ["DIST_OUT"], "optimizer.pt")  # shared by the ranks (tmp is each rank's)
    out = dict(error=None, message=None)
    with HybridAdamW(
        model.parameters(), lr=C.LR, subgroup_numel=32, offload_fraction=0.5, process_group=dist.group.WORLD
    ) as opt:
        C.loss_fn(model, C.local_batch(C.batches(1)[0], rank, 2)).backward()
        opt.step()
        own = opt.state_dict()
        if rank == 0:
            torch.save(own, path)
        dist.barrier()
        saved = torch.load(path, weights_only=False)
        try:
            opt.load_state_dict(saved)
        except ValueError as e:
            out.update(error=type(e).__name__, message=str(e))
        after = opt.state_dict()
        opt.load_state_dict(own)  # each rank's own file loads (and agrees on it)
        out["state_kept"] = all(
            torch.equal(a["exp_avg"].to_local(), b["exp_avg"].to_local())
            for a, b in zip(own["state"].values(), after["state"].values())
        )
        dist.barrier()
    return out


def takeover(rank: int, world: int) -> dict:
    """A process_group optimizer dropped while in a reference cycle (as a Trainer's is) lives
    until the cyclic gc runs, which rank 0 does here and rank 1 does not; a new optimizer on
    the same model takes its hooks over at construction, so the ranks' collectives still pair."""
    import gc

    model = C.build_model()
    x = C.local_batch(C.batches(1)[0], rank, world)

    class Holder:  # a Trainer-like object in a cycle
        def __init__(self):
            self.me, self.opt = (
                self,
                HybridAdamW(
                    model.parameters(),
                    lr=C.LR,
                    subgroup_numel=32,
                    offload_fraction=0.5,
                    process_group=dist.group.WORLD,
                ),
            )

    holder = Holder()
    C.loss_fn(model, x).backward()
    holder.opt.step()
    holder.opt.zero_grad()
    if rank == 1:
        gc.disable()  # its automatic collections would find the cycle too, some time
    del holder
    if rank == 0:
        gc.collect()
    with HybridAdamW(
        model.parameters(), lr=C.LR, subgroup_numel=32, offload_fraction=0.5, process_group=dist.group.WORLD
    ) as opt:
        for _ in range(2):
            opt.zero_grad()
            C.loss_fn(model, x).backward()
            opt.step()
        out = dict(
            error=None,
            steps=debug_view(opt).steps_taken,
            params=[p.detach().clone() for p in model.parameters()],
        )
    gc.enable()
    return out


def ddp_unused(name: str, rank: int, world: int) -> dict:
    """DDP(find_unused_parameters=True) — HF Trainer's default for most models — around a
    process_group model whose last bias gets no grad on rank 1 (C.loss_bias_unused), small
    buckets; "_lazy": the has-grad counts read in step() (CUDA's way), after DDP has written
    its average into that bias's grad. Saves the params after each step."""
    from hybrid_opt.distributed import zero, zero_counts

    saved = zero.BUCKET_NUMEL, zero_counts.LAZY
    zero.BUCKET_NUMEL, zero_counts.LAZY = 64, (True if name.endswith("_lazy") else None)

    class Loss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, step):
            return C.loss_bias_unused(self.model, x, rank, world, step)

    model = C.build_model()
    ddp = torch.nn.parallel.DistributedDataParallel(Loss(model), find_unused_parameters=True)
    out = dict(error=None, params=[])
    try:
        with HybridAdamW(
            model.parameters(),
            lr=C.LR,
            subgroup_numel=32,
            offload_fraction=0.5,
            process_group=dist.group.WORLD,
        ) as opt:
            for i, x in enumerate(C.batches()):
                opt.zero_grad()
                ddp(C.local_batch(x, rank, world), i).backward()
                opt.step()
                out["params"].append([p.detach().clone() for p in model.parameters()])
    finally:
        zero.BUCKET_NUMEL, zero_counts.LAZY = saved
    return out


def ddp_overflow(rank: int, world: int) -> dict:
    """accelerate's prepare() + fp16: DDP around the model, a GradScaler attached, an inf in
    rank 1's local grad at the first step (DDP's average there is inf too). Saves whether each
    step was skipped and the error, if any."""
    model = C.build_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    overflow = C.OverflowInBackward(model)
    out = dict(error=None, message=None, skipped=[])
    with HybridAdamW(
        model.parameters(), lr=C.LR, subgroup_numel=32, offload_fraction=0.5, process_group=dist.group.WORLD
    ) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        opt.attach_grad_scaler(scaler)
        try:
            for i, x in enumerate(C.batches(3)):
                opt.zero_grad()
                if i == 0 and rank == 1:
                    overflow.arm()
                scaler.scale(C.loss_fn(ddp, C.local_batch(x, rank, world))).backward()
                scaler.step(opt)
                scaler.update()
                out["skipped"].append(opt.step_was_skipped)
        except RuntimeError as e:
            out.update(error=type(e).__name__, message=str(e))
    return out


def grant_set(name: str, rank: int, world: int) -> dict:
    """The last bias unused on rank 1 (C.loss_bias_unused); at the first step rank 1 sets that
    bias's grad by hand after backward, once its reduction had counted it absent. "_lazy": the
    has-grad counts read in step() (CUDA's way), after the grad was set."""
    from hybrid_opt.distributed import zero, zero_counts

    saved = zero.BUCKET_NUMEL, zero_counts.LAZY
    zero.BUCKET_NUMEL, zero_counts.LAZY = 64, (True if name.endswith("_lazy") else False)
    model = C.build_model()
    out = dict(error=None, message=None, steps=0)
    try:
        with HybridAdamW(
            model.parameters(),
            lr=C.LR,
            subgroup_numel=32,
            offload_fraction=0.5,
            process_group=dist.group.WORLD,
        ) as opt:
            C.loss_bias_unused(model, C.local_batch(C.batches(1)[0], rank, world), rank, world, 0).backward()
            bias = list(model.parameters())[-1]
            if rank == 1:
                bias.grad = torch.full_like(bias, 100.0)
            try:
                opt.step()
            except RuntimeError as e:
                out.update(error=type(e).__name__, message=str(e))
            out["steps"] = debug_view(opt).steps_taken
    finally:
        zero.BUCKET_NUMEL, zero_counts.LAZY = saved
    return out


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    if name == "ddp_overflow":
        return ddp_overflow(rank, world)
    if name.startswith("grant_set"):
        return grant_set(name, rank, world)
    if name == "rank0_checkpoint":
        return rank0_checkpoint(rank, tmp)
    if name.startswith("ddp_unused"):
        return ddp_unused(name, rank, world)
    if name == "takeover":
        return takeover(rank, world)
    model = C.build_model()
    before = [p.detach().clone() for p in model.parameters()]
    # gradient_as_bucket_view: DDP's averages land in grads of its own, views of its buckets
    forward = (
        torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=name == "ddp_bucket_view")
        if name.startswith("ddp")
        else model
    )
    opt = HybridAdamW(
        model.parameters(), lr=C.LR, subgroup_numel=32, offload_fraction=0.5, process_group=dist.group.WORLD
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if name == "unscale" else None
    out = dict(error=None, message=None)
    x = C.local_batch(C.batches(1)[0], rank, world)
    try:
        loss = C.loss_fn(forward, x)
        (scaler.scale(loss) if scaler else loss).backward()
        _edit(name, model, opt, rank)
        C.step_after_unscale(opt, scaler)
    except (RuntimeError, ValueError, TypeError) as e:
        out.update(error=type(e).__name__, message=str(e), is_edit=isinstance(e, GradsEditedError))
    out["steps"] = debug_view(opt).steps_taken
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["unchanged"] = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    opt.close()
    return out


if __name__ == "__main__":
    C.rank_main(run)
