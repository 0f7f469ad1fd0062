"""Rank script: DCP checkpoints of HybridAdamW(process_group=WORLD) over plain params.

Trains SAVE_AT steps, saves model + optimizer with dcp.save (the state as Shard(0) DTensors
over the group's mesh) and the full state dict (full_state_dict=True, cpu_offload=True:
rank 0 torch.saves it), then trains on (the uninterrupted trajectory). A fresh model and
optimizer at another placement take DCP's lr-0 step, load the checkpoint with dcp.load +
set_*_state_dict and train the same steps; so does one loaded with load_state_dict from the
gathered (plain, full-size) state."""

import os
import sys

import common as C
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hybrid_opt import HybridAdamW

SAVE_AT, TOTAL = 2, 4


def make(**hybrid):
    model = C.build_model()
    opt = HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=1.0,
        subgroup_numel=32,
        process_group=dist.group.WORLD,
        **hybrid,
    )
    return model, opt


def train(model, opt, xs, rank, world) -> list:
    for x in xs:
        opt.zero_grad()
        C.loss_fn(model, C.local_batch(x, rank, world)).backward()
        opt.step()
    opt.wait_params()  # the params are read outside any forward: land the step's all-gathers
    return [p.detach().clone() for p in model.parameters()]


def main():
    ckpt = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = C.batches(TOTAL)
    nvme = os.path.join(ckpt + "-nvme", f"rank{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = make(offload_fraction=0.5, nvme_fraction=0.25, nvme_path=nvme)
    train(model, opt, xs[:SAVE_AT], rank, world)
    params_at_save = [p.detach().clone() for p in model.parameters()]
    plain_sd = opt.state_dict()
    plain_sd["state"] = {
        i: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items()}
        for i, st in plain_sd["state"].items()
    }
    osd = get_optimizer_state_dict(model, opt)
    kinds = {
        k: (
            type(v).__name__,
            tuple(map(str, getattr(v, "placements", ()))),
            tuple(getattr(v, "to_local", lambda: v)().shape),
        )
        for k, v in osd["state"]["0.weight"].items()
    }
    dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=ckpt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_osd = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": full_osd}, ckpt + "-full.pt")
    uninterrupted = train(model, opt, xs[SAVE_AT:], rank, world)
    opt.close()

    model2, opt2 = make(offload_fraction=1.0)
    fresh = get_optimizer_state_dict(model2, opt2)  # DCP's lr-0 step on a fresh optimizer
    sd = {"model": get_model_state_dict(model2), "optim": fresh}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    resumed = train(model2, opt2, xs[SAVE_AT:], rank, world)
    opt2.close()

    model3, opt3 = make(offload_fraction=0.5)
    with torch.no_grad():
        for p, saved in zip(model3.parameters(), params_at_save):
            p.copy_(saved)
    opt3.load_state_dict(plain_sd)
    resumed_from_full = train(model3, opt3, xs[SAVE_AT:], rank, world)
    opt3.close()
    C.save_result(
        dict(kinds=kinds, uninterrupted=uninterrupted, resumed=resumed, resumed_from_full=resumed_from_full)
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
