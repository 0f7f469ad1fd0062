"""Rank script: under FSDP2 the user edits the DTensor grads in place between backward and
step() — torch's clip_grad_norm_ (a foreach multiply: no version counter moves), a GradScaler's
unscale_ done by the user (a foreach unscale; the scaler is not attached, so speculation
assumes the scale of the last step, 1.0), or a plain DTensor `mul_(-1)` per grad (a sign
flip: the sum of squares is unchanged, only the DTensor's own version moves) — while
HybridAdamW speculates its host/nvme steps during backward.

Per configuration it saves the full params after each step of HybridAdamW and of
torch.optim.AdamW(foreach=False) run over an identical FSDP2 model with the same edits, and
speculation's outcome counts per step. "noedit": no edit at all (speculation must commit)."""

import os

import common as C
import torch
from fsdp_train import shard
from torch.distributed.device_mesh import init_device_mesh

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view

DEVICE = os.environ.get("DIST_DEVICE", "cpu")  # "cuda": the gpu test (one rank per GPU)
HOST = dict(offload_fraction=1.0)
NVME = dict(offload_fraction=0.5, nvme_fraction=0.25)
CONFIGS = {
    # name: (placement, the user's edit between backward and step())
    "clip_host": (HOST, "clip"),
    "clip_nvme": (NVME, "clip"),
    "unscale_host": (HOST, "unscale"),
    "unscale_nvme": (NVME, "unscale"),
    "mul_host": (HOST, "mul"),
    "noedit_host": (HOST, None),
}
CLIP = 0.01  # far below the grads' norm here: clipping bites at every step
INIT_SCALE = 2.0**8


def train(model, opt, edit: str | None, rank: int, world: int) -> tuple:
    """(full params after each step, speculation outcome per step or None)."""
    scaler = torch.amp.GradScaler(DEVICE, init_scale=INIT_SCALE) if edit == "unscale" else None
    params, outcomes = [], []
    for x in C.batches():
        opt.zero_grad()
        loss = C.loss_fn(model, C.local_batch(x, rank, world).to(DEVICE))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if edit == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        elif edit == "mul":
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(-1.0)
        C.step_after_unscale(opt, scaler)
        stats = getattr(opt, "stats", None)
        outcomes.append(dict(stats.get("speculation") or {}) if stats is not None else None)
        params.append([p.full_tensor().detach().cpu().clone() for p in model.parameters()])
    return params, outcomes


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    placement, edit = CONFIGS[name]
    mesh = init_device_mesh(DEVICE, (world,))
    model = shard(C.build_model().to(DEVICE), mesh)
    kw = dict(placement)
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = os.path.join(tmp, f"{name}-rank{rank}")
        os.makedirs(kw["nvme_path"])
    opt = HybridAdamW(
        model.parameters(), lr=C.LR, weight_decay=0.01, subgroup_numel=32, worker_share=0.5, **kw
    )
    try:
        params, outcomes = train(model, opt, edit, rank, world)
        host_stats = dict(debug_view(opt).host_stats) if debug_view(opt).host is not None else {}
    finally:
        opt.close()
    ref_model = shard(C.build_model().to(DEVICE), mesh)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=C.LR, weight_decay=0.01, foreach=False)
    torch_params, _ = train(ref_model, ref, edit, rank, world)
    return dict(params=params, speculation=outcomes, torch_params=torch_params, host_stats=host_stats)


def main():
    C.rank_main(run)


if __name__ == "__main__":
    main()
