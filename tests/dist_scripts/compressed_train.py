"""Rank script: compressed optimizer state (bf16 moments + bf16 params' fp32 masters kept as
remainders) under torch.distributed — FSDP2 and process_group= — on the common model cast to
bf16, in the configurations named on the command line (argv[1] is the checkpoint directory).

Per configuration it saves, gathered to full tensors after each step: the params (bf16), the
decoded fp32 masters and the moments (bf16) from opt.state_dict(), step_was_skipped, the
scaler's scale, and every time the optimizer restarted a master from its param (storage.py:
a write it took for the user's; a false positive would drop the remainders' bits). The
overflow-free runs (clip 1.0, never biting here) save a DCP checkpoint (model + optimizer)
after SAVE_AT steps and train on — the uninterrupted trajectory — and end with a real user
write (model.load_state_dict of its own state_dict), which must be seen as one."""

import os
import sys
import tempfile

import common as C
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_train import shard
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from hybrid_opt import HybridAdamW, fp32_master
from hybrid_opt.testing import debug_view

SAVE_AT = 2
COMPRESSED = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True)
CONFIGS = {
    # name: (mode, placement, clip, overflow step on rank 1)
    "fsdp2": ("fsdp2", dict(offload_fraction=0.5, nvme_fraction=0.25), 1.0, None),
    "fsdp2_overflow": ("fsdp2", dict(offload_fraction=0.5, nvme_fraction=0.25), 1.0, 1),
    "zero": ("zero", dict(offload_fraction=1.0), 1.0, None),
    "zero_overflow": ("zero", dict(offload_fraction=1.0), 1.0, 1),
}


def build(mode: str, world: int):
    model = C.build_model().to(torch.bfloat16)
    if mode == "fsdp2":
        model = shard(model, init_device_mesh("cpu", (world,)))
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_master(entry: dict, p) -> torch.Tensor:
    """The full fp32 master of bf16 param `p`: its entry's `master_remainder` (a DTensor like
    the state: this rank's shard or chunk) decoded with this rank's part of p (fp32_master),
    then gathered as that DTensor's layout says."""
    rem, master = entry["master_remainder"], fp32_master(entry, p)
    if not hasattr(rem, "full_tensor"):
        return master
    from torch.distributed.tensor import DTensor

    local = master.reshape(rem.to_local().shape)
    return DTensor.from_local(
        local, rem.device_mesh, rem.placements, shape=rem.shape, stride=rem.stride()
    ).full_tensor()


def snapshot(model, opt) -> dict:
    """Full params and the optimizer's state (masters decoded to fp32 under "master_param",
    moments as stored)."""
    sd = opt.state_dict()["state"]
    params = list(model.parameters())
    state = {k: [full(sd[i][k]).detach().clone() for i in sorted(sd)] for k in ("exp_avg", "exp_avg_sq")}
    state["master_param"] = [full_master(sd[i], params[i]).detach().clone() for i in sorted(sd)]
    return dict(params=[full(p).detach().clone() for p in params], **state)


def run(name: str, rank: int, world: int, tmp: str, ckpt: str) -> dict:
    mode, placement, clip, overflow_at = CONFIGS[name]
    model = build(mode, world)
    kw = dict(placement)
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = os.path.join(tmp, f"{name}-rank{rank}")
        os.makedirs(kw["nvme_path"])
    if mode == "zero":
        kw["process_group"] = dist.group.WORLD
    steps = C.OverflowRun(model, mode, overflow_at, rank, world)
    opt = HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=clip,
        subgroup_numel=32,
        worker_share=0.5,
        **COMPRESSED,
        **kw,
    )
    restarts = []  # (step, param indices) of every master restarted from its param
    orig_restart = debug_view(opt).guard.restart_masters

    def counted(sg, slices, only_changed, **kw):  # kw: previous=, where a param was given new memory
        restarts.append((len(out["steps"]), sorted(sl.param_index for sl in slices)))
        return orig_restart(sg, slices, only_changed, **kw)

    debug_view(opt).guard.restart_masters = counted
    steps.attach(opt)
    out = dict(
        steps=[],
        skipped=[],
        scales=[],
        local_numels=[(p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()],
    )
    for i, x in enumerate(C.batches()):
        steps.step(i, x, out, torch.bfloat16)
        out["steps"].append(snapshot(model, opt))
        if i + 1 == SAVE_AT and name in ("fsdp2", "zero"):
            dcp.save(
                {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                checkpoint_id=os.path.join(ckpt, name),
            )
    out["restarts"] = list(restarts)  # over the training steps
    # this rank's share: elements laid out, opt.stats' state bytes (in the state format)
    out["laid_out"] = sum(sg.numel for sg in debug_view(opt).subgroups)
    out["state_bytes"] = sum(t["state_bytes"] for t in opt.stats["tiers"].values())
    if overflow_at is None:  # a user's write: every master restarts from its param
        model.load_state_dict(model.state_dict())
        opt.state_dict()  # (it checks for written params first)
        out["restarts_after_load"] = restarts[len(out["restarts"]) :]
    opt.close()
    return out


def main():
    ckpt = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[2:]:
            results[name] = run(name, rank, world, tmp, ckpt)
    C.save_result(results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
