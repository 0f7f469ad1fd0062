"""Rank script: grads edited in place after backward under HybridAdamW(process_group=WORLD)
(zero_edits.py) — refused on every rank at the same step with nothing stepped — in the
configurations named on the command line; saves per configuration the error each rank raised
(type and message), the optimizer's step count and the params (unchanged by a refused step)."""
import torch
import torch.distributed as dist

import common as C
from hybrid_opt import GradsEditedError, HybridAdamW


def _edit(name: str, model, opt, rank: int) -> None:
    params = list(model.parameters())
    if name in ("clip", "ddp_clip"):
        torch.nn.utils.clip_grad_norm_(params, 1e9)  # a coefficient of 1: still an edit
    elif name == "clip_rank1":
        if rank == 1:
            torch.nn.utils.clip_grad_norm_(params, 0.01)
    elif name == "mul":
        params[0].grad.mul_(0.5)


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    model = C.build_model()
    before = [p.detach().clone() for p in model.parameters()]
    forward = torch.nn.parallel.DistributedDataParallel(model) if name.startswith("ddp") else model
    opt = HybridAdamW(model.parameters(), lr=C.LR, subgroup_numel=32, offload_fraction=0.5,
                      process_group=dist.group.WORLD)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if name == "unscale" else None
    out = dict(error=None, message=None)
    x = C.local_batch(C.batches(1)[0], rank, world)
    try:
        loss = C.loss_fn(forward, x)
        (scaler.scale(loss) if scaler else loss).backward()
        _edit(name, model, opt, rank)
        if scaler is not None:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    except RuntimeError as e:
        out.update(error=type(e).__name__, message=str(e), is_edit=isinstance(e, GradsEditedError))
    out["steps"] = opt._steps_taken
    out["unchanged"] = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    opt.close()
    return out


if __name__ == "__main__":
    C.rank_main(run)
