"""Rank script: DCP checkpoints of HybridAdamW under FSDP2.

Trains SAVE_AT steps, saves model + optimizer with dcp.save (sharded, DTensor state) and
the full state dict (full_state_dict=True, cpu_offload=True: rank 0 torch.saves it), then
trains on (the uninterrupted trajectory). A fresh model and a fresh optimizer at another
placement then take DCP's lr-0 initialisation step (get_optimizer_state_dict on a fresh
optimizer), load the checkpoint with dcp.load + set_*_state_dict and train the same steps:
their params are saved for comparison with the uninterrupted ones."""

import os
import sys

import common as C
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_train import shard
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from hybrid_opt import HybridAdamW

SAVE_AT, TOTAL = 2, 4


def make(mesh, **hybrid):
    model = shard(C.build_model(), mesh)
    opt = HybridAdamW(
        model.parameters(), lr=C.LR, weight_decay=0.01, max_grad_norm=1.0, subgroup_numel=32, **hybrid
    )
    return model, opt


def train(model, opt, xs, rank, world) -> list:
    for x in xs:
        opt.zero_grad()
        C.loss_fn(model, C.local_batch(x, rank, world)).backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def main():
    ckpt = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    xs = C.batches(TOTAL)
    nvme = os.path.join(ckpt + "-nvme", f"rank{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = make(mesh, offload_fraction=0.5, nvme_fraction=0.25, nvme_path=nvme)
    train(model, opt, xs[:SAVE_AT], rank, world)
    # for load_state_dict of full (plain) tensors: this rank's shards and the gathered state
    shards_at_save = [p.to_local().clone() for p in model.parameters()]
    plain_sd = opt.state_dict()
    plain_sd["state"] = {
        i: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items()}
        for i, st in plain_sd["state"].items()
    }
    osd = get_optimizer_state_dict(model, opt)
    kinds = {
        k: (type(v).__name__, tuple(map(str, getattr(v, "placements", ()))))
        for k, v in osd["state"]["0.weight"].items()
    }
    dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=ckpt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_osd = get_optimizer_state_dict(model, opt, options=full)
    full_msd = get_model_state_dict(model, options=full)
    if rank == 0:
        torch.save({"model": full_msd, "optim": full_osd}, ckpt + "-full.pt")
    full_kinds = (
        sorted({type(v).__name__ for st in full_osd.get("state", {}).values() for v in st.values()})
        if rank == 0
        else None
    )
    uninterrupted = train(model, opt, xs[SAVE_AT:], rank, world)
    opt.close()

    # a fresh optimizer at another placement: DCP's lr-0 step, then the checkpoint
    model2, opt2 = make(mesh, offload_fraction=1.0)
    before = [p.full_tensor().detach().clone() for p in model2.parameters()]
    fresh = get_optimizer_state_dict(model2, opt2)
    fresh_state = {
        k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in st.items()}
        for k, st in fresh["state"].items()
    }
    after_init = [p.full_tensor().detach().clone() for p in model2.parameters()]
    sd = {"model": get_model_state_dict(model2), "optim": fresh}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    resumed = train(model2, opt2, xs[SAVE_AT:], rank, world)
    opt2.close()

    # load_state_dict of full tensors of the params' global shapes: each rank takes its slice
    model3, opt3 = make(mesh, offload_fraction=0.5)
    with torch.no_grad():
        for p, local in zip(model3.parameters(), shards_at_save):
            p.to_local().copy_(local)
    opt3.load_state_dict(plain_sd)
    resumed_from_full = train(model3, opt3, xs[SAVE_AT:], rank, world)
    opt3.close()
    C.save_result(
        dict(
            kinds=kinds,
            full_kinds=full_kinds,
            uninterrupted=uninterrupted,
            resumed=resumed,
            resumed_from_full=resumed_from_full,
            fresh_state=fresh_state,
            before=before,
            after_init=after_init,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
