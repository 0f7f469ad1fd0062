"""Rank script: trains the common model's plain (replicated) params with HybridAdamW /
HybridAdam(process_group=WORLD) — ZeRO-2 style sharded state — in the configurations named on
the command line; saves per configuration the params after each step (every rank's own copy,
refreshed by the all-gather), last_grad_norm, skips, the scaler's scale, speculation's stats,
the state elements this rank keeps and the warnings given."""

import os
import warnings

import common as C
import torch
import torch.distributed as dist

from hybrid_opt import HybridAdam, HybridAdamW
from hybrid_opt.distributed import zero, zero_counts
from hybrid_opt.distributed.zero import BUCKET_NUMEL
from hybrid_opt.testing import debug_view

DEVICE = os.environ.get("DIST_DEVICE", "cpu")  # "cuda": the gpu test (NCCL, one rank per GPU)

CONFIGS = {
    # name: (optimizer, hybrid kwargs, clip, overflow step on rank 1, micro-batches per step)
    "adamw_nvme": ("AdamW", dict(offload_fraction=0.5, nvme_fraction=0.25), 1.0, None, 1),
    "adam_host": ("Adam", dict(offload_fraction=1.0), 1.0, None, 1),
    # a spare bank per subgroup awake (spare_banks=): speculation's commits, not the pool's size
    "adamw_host_noclip": (
        "AdamW",
        dict(offload_fraction=1.0, overlap_param_gather=True, spare_banks=64),
        None,
        None,
        1,
    ),
    "adamw_overflow": ("AdamW", dict(offload_fraction=0.5), 1.0, 1, 1),
    "adamw_accum": ("AdamW", dict(offload_fraction=0.5, nvme_fraction=0.25), 1.0, None, 2),
    # the same accumulation without the boundary flag: each backward reduces every bucket (the
    # second one the accumulated grads again), 4 buckets, speculation from the first redone
    "adamw_accum_noflag": ("AdamW", dict(offload_fraction=0.5), 1.0, None, 2),
    "adamw_ddp": ("AdamW", dict(offload_fraction=0.5), None, None, 1),
    # the overlapped all-gather (opt-in): small buckets (4 of this model), the params then read
    # after a forward (adamw_host_noclip); the default, synchronous (adamw_sync, which also calls
    # wait_params(), a no-op then); overlapped and read after state_dict() and,
    # at the last step, close() (adamw_sd_close); adamw_load: model.load_state_dict after step()
    "adamw_sync": ("AdamW", dict(offload_fraction=1.0), None, None, 1),
    "adamw_sd_close": ("AdamW", dict(offload_fraction=1.0, overlap_param_gather=True), None, None, 1),
    "adamw_load": ("AdamW", dict(offload_fraction=1.0, overlap_param_gather=True), None, None, 1),
    # the last layer's bias unused on rank 1 (every step) and on both (last step), 4 buckets:
    # rank 1 issues that bucket late, in step(), and must not reorder its reduce-scatters
    "adamw_unused": ("AdamW", dict(offload_fraction=0.5), 1.0, None, 1),
    # adamw_sync / adamw_host_noclip over the other collectives (gloo's default is all_to_all +
    # broadcasts): reduce-scatter + all-gather (NCCL's), and all_reduce + broadcasts (a backend
    # without reduce-scatter), each of the 4 buckets landing in place or through its staging
    "adamw_sync_rs": ("AdamW", dict(offload_fraction=1.0), None, None, 1),
    # the middle Linear unused on rank 1: its weight's bucket, reduced straight from p.grad on
    # rank 0, is reduced from zeros on rank 1, which gets the averaged grad too
    "adamw_unused_direct": ("AdamW", dict(offload_fraction=0.5), 1.0, None, 1),
    "adamw_overlap_ar": ("AdamW", dict(offload_fraction=1.0, overlap_param_gather=True), None, None, 1),
    # adamw_unused / adamw_unused_direct with the has-grad counts read lazily (CUDA's way:
    # kept on the device in backward, read in step() in one copy), forced here on gloo
    "adamw_unused_lazy": ("AdamW", dict(offload_fraction=0.5), 1.0, None, 1),
    "adamw_unused_direct_lazy": ("AdamW", dict(offload_fraction=0.5), 1.0, None, 1),
    # the params' gathers launched as step() commits: rank 1 drops its first host subgroup's
    # speculation before each step, so it commits that subgroup last (stepped in step()) while
    # rank 0 commits it first; the launches and commits are logged. Every spare awake
    # (spare_banks=): every subgroup speculated, whatever the default pool would have woken
    "adamw_commit_order": ("AdamW", dict(offload_fraction=1.0, spare_banks=64), 1.0, None, 1),
}
SMALL_BUCKETS = (
    "adamw_host_noclip",
    "adamw_sync",
    "adamw_sd_close",
    "adamw_load",
    "adamw_unused",
    "adamw_sync_rs",
    "adamw_overlap_ar",
    "adamw_accum_noflag",
    "adamw_unused_direct",
    "adamw_unused_lazy",
    "adamw_unused_direct_lazy",
    "adamw_commit_order",
)
PATHS = {"adamw_sync_rs": "reduce_scatter", "adamw_overlap_ar": "all_reduce"}


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    kind, hybrid, clip, overflow_at, micro = CONFIGS[name]
    model = C.build_model().to(DEVICE)
    stepped_model = model
    if name == "adamw_ddp":
        stepped_model = torch.nn.parallel.DistributedDataParallel(model)
    cls = HybridAdamW if kind == "AdamW" else HybridAdam
    if hybrid.get("nvme_fraction"):
        hybrid = dict(hybrid, nvme_path=os.path.join(tmp, f"{name}-rank{rank}"))
        os.makedirs(hybrid["nvme_path"])
    zero.BUCKET_NUMEL = 64 if name in SMALL_BUCKETS else BUCKET_NUMEL
    zero.COLLECTIVES = PATHS.get(name)
    zero_counts.LAZY = True if name.endswith("_lazy") else None
    probe = torch.randn(4, C.IN, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    overflow = C.OverflowInBackward(model) if overflow_at is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = cls(
            model.parameters(),
            lr=C.LR,
            weight_decay=0.01,
            max_grad_norm=clip,
            subgroup_numel=32,
            worker_share=0.5,
            process_group=dist.group.WORLD,
            **hybrid,
        )
        view = debug_view(opt)
        scaler = None
        if overflow_at is not None:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
            opt.attach_grad_scaler(scaler)
        out = dict(
            params=[],
            norms=[],
            skipped=[],
            scales=[],
            speculation=[],
            worker=[],
            probe=[],
            pending_after_step=[],
            buffer_bytes=[],
            buckets=len(view.sharding.buckets),
            direct=[b.direct for b in view.sharding.buckets],
            state_numel=view.sharding.state_numel(),
            plan=repr(opt.plan),
            opt_repr=repr(opt),
            laid_out=sum(sg.numel for sg in view.subgroups),
            events=[],
            bucket_params=[[view.param_index[p] for p in b.params] for b in view.sharding.buckets],
            sg_params=[sorted({sl.param_index for sl in sg.slices}) for sg in view.subgroups],
            count_reads_after_backward=[],
            count_reads_after_step=[],
            grad_none_after_backward=[],
        )
        if name == "adamw_commit_order":  # logs each host commit and each bucket's gather launch
            committed, launch = view.sharding.committed, view.sharding.gathers.launch
            view.sharding.committed = lambda i: (
                out["events"][-1].append(("commit", i)),
                committed(i),
            )
            view.sharding.gathers.set_launcher(
                lambda b, d: (out["events"][-1].append(("gather", b.index)), launch(b, d))
            )
        for i, x in enumerate(C.batches()):
            opt.zero_grad()
            local = C.local_batch(x, rank, world).to(DEVICE)
            n = local.shape[0] // micro
            if i == overflow_at and rank == 1:  # an overflow in this rank's local grads only
                overflow.arm()
            for m in range(micro):
                if name != "adamw_accum_noflag":
                    opt.set_gradient_accumulation_boundary(m == micro - 1)
                if name.startswith("adamw_unused") and "direct" not in name:
                    loss = C.loss_bias_unused(model, local, rank, world, i)
                elif name.startswith("adamw_unused_direct"):
                    loss = C.loss_layer_unused(model, local, rank, world, i)
                else:
                    loss = C.loss_fn(stepped_model, local[m * n : (m + 1) * n]) / micro
                (scaler.scale(loss) if scaler else loss).backward()
            out["count_reads_after_backward"].append(view.sharding.stats["count_reads"])
            out["grad_none_after_backward"].append([p.grad is None for p in model.parameters()])
            out["events"].append([])
            if name == "adamw_commit_order" and rank == 1:
                view.host.stepping.drop(0)  # stepped in step(), after the others commit
            C.scaled_step(opt, scaler, out)
            out["pending_after_step"].append(len(view.sharding.gathers.pending()))
            out["count_reads_after_step"].append(view.sharding.stats["count_reads"])
            out["buffer_bytes"].append(view.sharding.stats["buffer_bytes"])
            if name == "adamw_load" and i == 2:  # written after step(), before the gathers land
                model.load_state_dict(
                    {k: torch.full_like(v, 0.25 + j) for j, (k, v) in enumerate(model.state_dict().items())}
                )
            if name == "adamw_sync":
                opt.wait_params()
            elif name == "adamw_sd_close":  # the params read before any forward
                opt.close() if i == len(C.batches()) - 1 else opt.state_dict()
                out["params"].append([p.detach().to("cpu", copy=True) for p in model.parameters()])
            with torch.no_grad():  # a forward right after step(): the gathers land in its hooks
                out["probe"].append(model(probe).cpu())
            out["norms"].append(opt.last_grad_norm)
            out["skipped"].append(opt.step_was_skipped)
            out["speculation"].append(dict(opt.stats.get("speculation") or {}))
            if name != "adamw_sd_close":
                out["params"].append([p.detach().to("cpu", copy=True) for p in model.parameters()])
            if name == "adamw_load" and i == 2:
                break
            out["worker"].append((opt.stats.get("worker_s", 0.0), opt.stats.get("hidden_s", 0.0)))
        out["state_bytes"] = sum(t["state_bytes"] for t in opt.stats["tiers"].values())
        out["device_elements"] = opt.stats["tiers"]["device"]["elements"]
        out["zero"] = dict(view.sharding.stats)
    out["warnings"] = [str(w.message) for w in caught]
    opt.close()
    return out


def main():
    C.rank_main(run)


if __name__ == "__main__":
    main()
