"""Rank script: trains the common model under FSDP2 with HybridAdamW / HybridAdam in the
configurations named on the command line and saves, per configuration, the full params after
each step, last_grad_norm, step_was_skipped, the scaler's scale and speculation's stats."""

import os
import warnings

import common as C
import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hybrid_opt import HybridAdam, HybridAdamW

DEVICE = os.environ.get("DIST_DEVICE", "cpu")  # "cuda": the gpu test (one rank per GPU)

CONFIGS = {
    # name: (optimizer, mesh, hybrid kwargs, clip, overflow step on rank 1)
    "adamw_1d_nvme": ("AdamW", "1d", dict(offload_fraction=0.5, nvme_fraction=0.25), 1.0, None),
    "adam_1d_host": ("Adam", "1d", dict(offload_fraction=1.0), 1.0, None),
    "adamw_hsdp_nvme": ("AdamW", "hsdp", dict(offload_fraction=0.5, nvme_fraction=0.25), 0.5, None),
    "adam_hsdp_host": ("Adam", "hsdp", dict(offload_fraction=1.0), 1.0, None),
    "adamw_overflow": ("AdamW", "1d", dict(offload_fraction=0.5), 1.0, 1),
    "adamw_noclip": ("AdamW", "1d", dict(offload_fraction=0.5), None, None),
    # FSDP2's CPUOffloadPolicy: shards and grads on the CPU (pinned only with CUDA)
    "adamw_cpu_offload": ("AdamW", "1d", dict(offload_fraction=0.5), 1.0, None),
    # the model loaded with assign=True under swap_tensors after the optimizer was built: the
    # shards get new memory, the optimizer re-points its subgroups (storage.py)
    "adamw_swap_load": ("AdamW", "1d", dict(offload_fraction=0.5), 1.0, None),
    # MixedPrecisionPolicy(bf16 params, fp32 reduce): the fp32 shards are the masters; torch's
    # AdamW runs over an identical FSDP2 model under the same policy in this script
    "adamw_mixed_precision": ("AdamW", "1d", dict(offload_fraction=0.5), 1.0, None),
}


def mixed_precision():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def torch_under_fsdp2(mesh, rank: int, world: int, max_grad_norm, **policy) -> tuple:
    """(full params after each step, grad norms) of torch.optim.AdamW(foreach=False) over the
    same FSDP2 model, policy and local batches, clip_grad_norm_ over the DTensor grads."""
    model = shard(C.build_model().to(DEVICE), mesh, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=0.01, foreach=False)
    params, norms = [], []
    for x in C.batches():
        opt.zero_grad()
        C.loss_fn(model, C.local_batch(x, rank, world).to(DEVICE)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        params.append([p.full_tensor().detach().cpu().clone() for p in model.parameters()])
    return params, norms


class CountAllReduce:
    """Counts torch.distributed.all_reduce calls while active (the optimizer's collectives)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self.orig = dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self.orig(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.orig


def plain_params_warning(rank: int, world: int) -> dict:
    """Plain (replicated) params in a world > 1 without process_group: the warnings given."""
    model = C.build_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = HybridAdamW(model.parameters(), offload_fraction=0.0)
    opt.close()
    return dict(warnings=[str(w.message) for w in caught])


def shard(model, mesh, **policy):
    # imported here: test modules import this one to collect (torch < 2.6 has no public fully_shard)
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    kind, mesh_kind, hybrid, clip, overflow_at = CONFIGS[name]
    mesh = (
        init_device_mesh(DEVICE, (world,))
        if mesh_kind == "1d"
        else init_device_mesh(DEVICE, (world, 1), mesh_dim_names=("replicate", "shard"))
    )
    policy = {}
    if name == "adamw_cpu_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=DEVICE == "cuda"))
    if name == "adamw_mixed_precision":
        policy = mixed_precision()
    model = shard(C.build_model().to(DEVICE), mesh, **policy)
    cls = HybridAdamW if kind == "AdamW" else HybridAdam
    if hybrid.get("nvme_fraction"):
        hybrid = dict(hybrid, nvme_path=os.path.join(tmp, f"{name}-rank{rank}"))
        os.makedirs(hybrid["nvme_path"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = cls(
            model.parameters(),
            lr=C.LR,
            weight_decay=0.01,
            max_grad_norm=clip,
            subgroup_numel=32,
            worker_share=0.5,
            **hybrid,
        )
    if name == "adamw_swap_load":
        state = {k: v.clone() for k, v in model.state_dict().items()}
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.load_state_dict(state, assign=True)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    scaler = None
    if overflow_at is not None:
        scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**8)
        opt.attach_grad_scaler(scaler)
    out = dict(
        params=[],
        norms=[],
        skipped=[],
        scales=[],
        speculation=[],
        all_reduces=[],
        warnings=[str(w.message) for w in caught],
    )
    for i, x in enumerate(C.batches()):
        opt.zero_grad()
        loss = C.loss_fn(model, C.local_batch(x, rank, world).to(DEVICE))
        (scaler.scale(loss) if scaler else loss).backward()
        if i == overflow_at and rank == 1:  # an overflow in this rank's local grads only
            C.overflow_local_grad(model)
        with CountAllReduce() as count:
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
        out["all_reduces"].append(count.calls)
        if scaler is not None:
            scaler.update()
            out["scales"].append(float(scaler.get_scale()))
        out["norms"].append(opt.last_grad_norm)
        out["skipped"].append(opt.step_was_skipped)
        out["speculation"].append(dict(opt.stats.get("speculation") or {}))
        out["params"].append([p.full_tensor().detach().cpu().clone() for p in model.parameters()])
    out["placements"] = [tuple(map(str, p.placements)) for p in model.parameters()]
    # what node.py saw (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE) and the cores it gave the worker
    from hybrid_opt.distributed import node

    out["node"] = (node.local_rank(), node.local_world_size())
    out["worker_cpus"] = sorted(psutil.Process(opt.worker_pid).cpu_affinity())
    out["local_numels"] = [p.to_local().numel() for p in model.parameters()]
    out["plan"], out["opt_repr"] = repr(opt.plan), repr(opt)
    out["param_dtypes"] = [str(p.dtype) for p in model.parameters()]
    if name == "adamw_mixed_precision":
        out["torch_params"], out["torch_norms"] = torch_under_fsdp2(mesh, rank, world, clip, **policy)
    opt.close()
    return out


def main():
    C.rank_main(
        lambda name, rank, world, tmp: (
            plain_params_warning(rank, world) if name == "plain_warn" else run(name, rank, world, tmp)
        )
    )


if __name__ == "__main__":
    main()
