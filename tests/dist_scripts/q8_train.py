"""Rank script: q8 moments (issue 38: uint8 codes, one fp32 absmax per block of 256) under
torch.distributed — FSDP2 and process_group= — on a model whose large params are quantized, in the
configurations named on the command line (argv[1] is the checkpoint directory).

Per configuration it saves, gathered to full tensors after each step: the params, each param's
state from opt.state_dict() (codes and absmaxes of the q8 params, fp32 moments of the small ones),
step_was_skipped, the scaler's scale; and the absmax DTensors' global shapes. The overflow-free
speculative runs save a DCP checkpoint (model + optimizer) after SAVE_AT steps and train on. The
"refused" configurations build the optimizer over a param whose dim-0 cut falls inside a block
and keep the error's message; the "from1" ones resume from a checkpoint one process saved
(<checkpoint directory>/one, written by the test before the launch)."""

import os
import sys
import tempfile

import common as C
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view

IN, HID, OUT = 32, 256, 25  # 25 rows: FSDP2's shards of the second weight are uneven (13 / 12)
SAVE_AT = 2
# both moments q8; placement on all three tiers of each rank's part
Q8 = dict(exp_avg_dtype="q8", exp_avg_sq_dtype="q8", subgroup_numel=1024)
PLACEMENT = dict(offload_fraction=0.75, nvme_fraction=0.25)
CLIP = 1.0
CONFIGS = {
    # name: (mode, speculative, overflow step on rank 1)
    "fsdp2": ("fsdp2", True, None),
    "fsdp2_seq": ("fsdp2", False, None),
    "fsdp2_overflow": ("fsdp2", True, 1),
    "zero": ("zero", True, None),
    "zero_seq": ("zero", False, None),
    "zero_overflow": ("zero", True, 1),
}


class Gain(torch.nn.Module):
    """A 1-D param of 4,608 elements (18 blocks; cut at 2 ranks after 9): each of the hidden
    units scaled by the mean of its 18 entries."""

    def __init__(self):
        super().__init__()
        self.g = torch.nn.Parameter(1.0 + 0.1 * torch.randn(18 * HID))

    def forward(self, x):
        return x * self.g.view(18, HID).mean(0)


def build_model() -> torch.nn.Module:
    """Quantized (>= 4,096 elements): 0.weight (256 x 32: absmax of its 32 blocks of the flat
    index), 1.g (1-D), 3.weight (25 x 256: absmax (25, 1), a row per block); the biases and the
    last layer keep fp32 moments."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HID),
        Gain(),
        torch.nn.Tanh(),
        torch.nn.Linear(HID, OUT),
        torch.nn.Tanh(),
        torch.nn.Linear(OUT, 3),
    )


def batches(n: int = C.STEPS) -> list:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(C.BATCH, IN, generator=gen) for _ in range(n)]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(model, opt) -> dict:
    """Full params and every state tensor of opt.state_dict() (codes, absmaxes, fp32 moments)."""
    sd = opt.state_dict()["state"]
    state = {i: {k: full(v).detach().clone() for k, v in sd[i].items() if k != "step"} for i in sorted(sd)}
    return dict(params=[full(p).detach().clone() for p in model.parameters()], state=state)


def sharded_model(mode: str, world: int):
    """The test model, each Linear and Gain and the whole under fully_shard for "fsdp2"."""
    model = build_model()
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, (torch.nn.Linear, Gain)):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def run(name: str, rank: int, world: int, tmp: str, ckpt: str) -> dict:
    mode, speculative, overflow_at = CONFIGS[name]
    model = sharded_model(mode, world)
    kw = dict(PLACEMENT, nvme_path=os.path.join(tmp, f"{name}-rank{rank}"))
    os.makedirs(kw["nvme_path"])
    if mode == "zero":
        kw["process_group"] = dist.group.WORLD
    steps = C.OverflowRun(model, mode, overflow_at, rank, world)
    opt = HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=CLIP,
        speculative=speculative,
        worker_share=0.5,
        **Q8,
        **kw,
    )
    steps.attach(opt)
    out = dict(steps=[], skipped=[], scales=[], norms=[])
    for i, x in enumerate(batches()):
        steps.step(i, x, out)
        out["norms"].append(opt.last_grad_norm)
        out["steps"].append(snapshot(model, opt))
        if i + 1 == SAVE_AT and name in ("fsdp2", "zero"):
            optim = get_optimizer_state_dict(model, opt)
            out["absmax_shapes"] = {
                fqn: {k: (type(v).__name__, tuple(v.shape)) for k, v in st.items() if k.endswith("_absmax")}
                for fqn, st in optim["state"].items()
            }
            dcp.save(
                {"model": get_model_state_dict(model), "optim": optim},
                checkpoint_id=os.path.join(ckpt, name),
            )
    if name in ("fsdp2", "zero"):  # save_state_dict(fp32=True): each rank's moments dequantized
        path = os.path.join(tmp, f"{name}-fp32-rank{rank}.pt")
        opt.save_state_dict(path, fp32=True)
        saved = torch.load(path, weights_only=False)["state"]
        out["fp32"] = {
            i: {k: (type(v).__name__, full(v).clone()) for k, v in e.items() if k != "step"}
            for i, e in saved.items()
        }
    out["quantized"] = [sg.quantized for sg in debug_view(opt).subgroups]
    out["host_stats"] = debug_view(opt).host_stats
    opt.close()
    return out


def from_one(mode: str, rank: int, world: int, tmp: str, one: str) -> dict:
    """Resumes at 2 ranks from the checkpoint one process saved after SAVE_AT steps (`one`: its
    DCP directory "dcp" and its torch.save'd "sd.pt"): dcp.load into get_optimizer_state_dict's
    DTensors and, for process_group, load_state_dict of the full state dict (each rank takes its
    elements and blocks); the snapshot after each remaining step."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    out = {}
    for how in ("dcp", "full") if mode == "zero" else ("dcp",):
        model = sharded_model(mode, world)
        kw = dict(PLACEMENT, nvme_path=os.path.join(tmp, f"{mode}-{how}-from1-rank{rank}"))
        os.makedirs(kw["nvme_path"])
        if mode == "zero":
            kw["process_group"] = dist.group.WORLD
        opt = HybridAdamW(model.parameters(), lr=C.LR, weight_decay=0.01, max_grad_norm=CLIP, **Q8, **kw)
        if how == "dcp":
            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=os.path.join(one, "dcp"))
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
        else:
            saved = torch.load(os.path.join(one, "sd.pt"), weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        steps = []
        for x in batches()[SAVE_AT:]:
            opt.zero_grad()
            C.loss_fn(model, C.local_batch(x, rank, world)).backward()
            opt.step()
            if mode == "zero":
                opt.wait_params()
            steps.append(snapshot(model, opt))
        opt.close()
        out[how] = steps
    return out


def refused(mode: str, world: int) -> dict:
    """The constructor's error for a q8 param whose dim-0 cut falls inside a block (9 x 1000,
    cut after 5 rows = 5,000 elements) and, under FSDP2, add_param_group's for it joining an
    optimizer built over a 1-D param of 8,192 (cut at 4,096)."""
    model = torch.nn.Sequential(torch.nn.Linear(1000, 9))
    good = torch.nn.Linear(1, 8192)
    kw = {}
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
        fully_shard(good, mesh=mesh)
    else:
        kw["process_group"] = dist.group.WORLD
    out = {}
    try:
        HybridAdamW(model.parameters(), lr=C.LR, offload_fraction=0.0, **Q8, **kw).close()
        out["construct"] = "built"
    except ValueError as e:
        out["construct"] = str(e)
    if mode == "fsdp2":
        with HybridAdamW([good.bias], lr=C.LR, offload_fraction=0.0, **Q8) as opt:
            try:
                opt.add_param_group({"params": [model[0].weight]})
                out["add_param_group"] = "added"
            except ValueError as e:
                out["add_param_group"] = str(e)
    return out


def main():
    ckpt = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[2:]:
            if name.endswith("_refused"):
                results[name] = refused(name.split("_")[0], world)
            elif name.endswith("_from1"):
                results[name] = from_one(name.split("_")[0], rank, world, tmp, os.path.join(ckpt, "one"))
            else:
                results[name] = run(name, rank, world, tmp, ckpt)
    C.save_result(results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
