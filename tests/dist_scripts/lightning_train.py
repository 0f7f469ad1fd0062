"""The Lightning module, data and trainer of tests/test_frameworks_lightning.py, and its rank
script.

`python lightning_train.py ddp|fsdp2 OUT_DIR` trains Tiny on 2 CPU processes through
Lightning's own launcher (strategy="ddp", or ModelParallelStrategy with FSDP2's fully_shard in
configure_model): the launcher re-runs this script as rank 1 with LOCAL_RANK set and
LOCAL_WORLD_SIZE not. Each rank saves {rank, env, node, worker_pid, worker_cores, params, warnings}
to OUT_DIR/rank<R>.pt; rank 0 exits only after rank 1 has (so both files exist once the
process the test started ends).
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
import torch

IN, HID, OUT = 8, 16, 4  # 212 elements
SUBGROUP = 53  # 4 subgroups, so nvme_fraction=0.5 is 2 of them
BATCH = 8  # global batch
STEPS = 6
LR, WD = 1e-2, 0.01

# Lightning's own noise (a rank script has no pytest filters)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=False)


def hybrid(**kw):
    """A factory of HybridAdamW over the given params (offload_fraction 1.0 unless told)."""

    def make(params):
        from hybrid_opt import HybridAdamW

        return HybridAdamW(params, lr=LR, weight_decay=WD, subgroup_numel=SUBGROUP, **kw)

    return make


class Tiny(pl.LightningModule):
    """Linear-Tanh-Linear on a squared loss. `make_optimizer(params)` builds the optimizer in
    configure_optimizers; `scheduler`: a StepLR stepped every step; `manual`: manual
    optimization; `fsdp2`: configure_model shards each Linear and the net over the
    "data_parallel" mesh (ModelParallelStrategy); `scale` multiplies the output (grad norms > 1)."""

    def __init__(self, make_optimizer, *, scheduler=False, manual=False, fsdp2=False, scale=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
        self.make_optimizer, self.scheduler, self.fsdp2, self.scale = make_optimizer, scheduler, fsdp2, scale
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = (self.net(x).float() * self.scale).square().mean()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_model(self):
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self):
        opt = self.make_optimizer(self.parameters())
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(steps: int = STEPS, rank: int = 0, world: int = 1):
    """`steps` global batches of BATCH rows in order (one epoch), this rank's BATCH // world of
    each (rows rank, rank + world, ...: a DistributedSampler without shuffling)."""
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(steps * BATCH, IN, generator=gen))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=BATCH // world, sampler=sampler)


def trainer(**kw) -> pl.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    args.update(kw)
    return pl.Trainer(**args)


def full_params(model) -> list:
    """Each param whole (a DTensor gathered: collective, every rank calls it)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()
    ]


def fit(model, *, data=None, ckpt_path=None, **trainer_kw) -> tuple:
    """(trainer, params after fit); a HybridAdamW it built is closed afterwards."""
    tr = trainer(**trainer_kw)
    try:
        tr.fit(model, data if data is not None else loader(), ckpt_path=ckpt_path)
        return tr, full_params(model)
    finally:
        for opt in tr.optimizers:
            if hasattr(opt, "close"):
                opt.close()


def rank_main(mode: str, out_dir: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from hybrid_opt.distributed import node

    if mode == "ddp":
        strategy, model = "ddp", Tiny(hybrid(process_group=None))
    elif mode == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        model = Tiny(hybrid(), fsdp2=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}: ddp or fsdp2")
    # Lightning's own sampler shuffles a training set (whatever its loader says): this one
    # does not, so the ranks' batches together are the single-process run's
    tr = trainer(strategy=strategy, devices=2, use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # rank 0 is LOCAL_RANK 0 before its launcher sets it; Lightning started rank 1 with it
        tr.fit(model, loader(rank=int(os.environ.get("LOCAL_RANK", "0")), world=2))
    opt = tr.optimizers[0]
    # read after fit: Lightning's launcher sets rank 0's LOCAL_RANK when it starts rank 1
    env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    here = node.info()  # who shares this node, as the optimizer found out at construction
    result = dict(
        rank=tr.global_rank,
        world=tr.world_size,
        env=env,
        node=(here.local_rank, here.local_world_size),
        worker_pid=opt.worker_pid,
        worker_cores=sorted(os.sched_getaffinity(opt.worker_pid)),
        params=full_params(model),
        warnings=[str(w.message) for w in caught],
    )
    opt.close()
    path = os.path.join(out_dir, f"rank{tr.global_rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    if tr.global_rank == 0:  # Lightning's launcher does not wait for the ranks it started
        codes = [p.wait() for p in getattr(tr.strategy.launcher, "procs", [])]
        if any(codes):
            raise SystemExit(f"rank(s) started by Lightning exited with {codes}")


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
