"""What a checkpoint of the optimizer costs: RAM as the OS counts it, seconds, bytes on disk.

    python benchmarks/bench_checkpoint.py [--layers 12] [--width 2048] [--rounds 3]
        [--placements torch offload0 offload1 nvme1 compressed1 compressed0 q8rem1 q8master1 q8rem0]
        [--ops torch_save save_state_dict load load_mmap dcp_save]
        [--frameworks] [--ranks 2] [--dir DIR] [--json out.json]

The model: `--layers` x nn.Linear(width, width, bias=False) (default 12 x 2048: 50.3M fp32
params), AdamW lr 1e-3, two steps on random data, HybridAdamW's default subgroup size.

Placements: torch.optim.AdamW(fused=True) (the control); HybridAdamW at offload_fraction 0 and
1.0; offload 1.0 with nvme_fraction 1.0 (nvme_path under --dir); compressed state (the model in
bf16, bf16 moments, fp32 masters kept as int16 remainders) at offload 1.0 and 0; q8 moments (issue
38: the model in bf16, 8-bit codes + an absmax per block of 256) with remainders at offload 1.0
and 0, and with an fp32 master at offload 1.0.

Operations, each measured on its own:
  torch_save       `torch.save(opt.state_dict(), f)`, then the dict dropped
  save_state_dict  `opt.save_state_dict(f)` (HybridAdamW only)
  load             `opt.load_state_dict(torch.load(f))`; the loaded dict's own bytes are given
                   apart, and the extra above them
  load_mmap        `opt.load_state_dict(torch.load(f, mmap=True))`
  dcp_save         `get_optimizer_state_dict(model, opt)` + `torch.distributed.checkpoint.save`
                   (one process: DCP saves without a process group)
Each (placement, operation) runs in a fresh process: build, two steps, then the operation; the
loads read a file one reference run per placement wrote (torch.save(opt.state_dict())). Rounds
alternate the order of the runs.

RAM: the peak over the operation of RssAnon(trainer) + RssAnon(worker) + the system's Shmem
(/proc/meminfo), above its value just before, sampled every 2 ms by a separate process
(ram_sampler.py); also the same peak as RssAnon + RssShmem of both processes (the kernel counts a
shared page once per mapping there), and PSS (trainer + worker) before and after. Before the first
sample the trainer runs gc and malloc_trim(0), so memory the allocator kept from set-up is not
reused for free (torch._dynamo, which DCP imports on first use, is loaded by then), and waits (up to
60 s) until RssAnon + RssShmem of both processes held still for 0.5 s, so the arena's background
population is not counted as the operation's. The extra is in MiB and in % of the state's bytes: the
nbytes of the tensors in the placement's own `state_dict()["state"]` (for fp32 state what torch's
AdamW holds: exp_avg, exp_avg_sq, step), counted once in the reference run. Shmem is system-wide:
another process's shared memory coming or going in the window counts (run on a quiet machine;
`per_round[].sampled.system_shmem_peak` in the JSON shows it).
A load holds the loaded dict 10 ms before `load_state_dict` takes it, so that the sampler sees it.
Seconds: the operation's wall time (less that hold), median and range over rounds. File: bytes on disk.

--frameworks adds a real HF `transformers.Trainer` (our optimizer via `optimizers=(opt, None)`,
save_steps=2: the window is `Trainer._save_optimizer_and_scheduler` at the step that saves) and
Lightning's `trainer.save_checkpoint(path)` after a 2-step fit, with Lightning's own CheckpointIO
(which buffers the whole checkpoint in RAM before writing it) and with
hybrid_opt.lightning_io.DirectCheckpointIO, for torch and HybridAdamW offload 1; a missing package
skips its rows, saying so. --ranks 2 adds a DCP save on 2 gloo ranks
(torchrun; every launch bounded by --timeout, then killed): torch AdamW and HybridAdamW on FSDP2
(`fully_shard`), HybridAdamW(process_group=WORLD) over plain params; a row per rank, each
sampling its own trainer and worker (its Shmem term sees both ranks').

Output: a markdown table on stdout; --json, a list of rows, one per (placement, operation
[, rank]): placement, op (and their keys), extra_mib (+ _min, _max), extra_pct,
rss_shmem_extra_mib, pss_before_mib, pss_after_mib, seconds (+ _min, _max), file_bytes,
state_bytes, dir_bytes (--ranks: the whole checkpoint), loaded_mib and extra_above_loaded_mib
(load), rounds, per_round (each round's own figures and samples), skipped (why, or None).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import psutil
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO, os.path.join(REPO, "tests")]

from _common import host_description, markdown_table, write_json  # noqa: E402
from dist_launch import _kill_tree  # noqa: E402
from ram_sampler import PERIOD_S, RamSampler, wait_until_steady  # noqa: E402

from hybrid_opt import HybridAdamW  # noqa: E402

MIB = 2**20
TRAIN_STEPS = 2
BATCH = 4


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which optimizer holds the state, where, and in what format."""

    label: str
    offload: float | None = None  # None: torch.optim.AdamW(fused=True), the control
    nvme: float = 0.0
    compressed: bool = False  # a bf16 model, `moments`, fp32 masters as remainders where `remainders`
    moments: str = "bf16"  # compressed: "bf16" or "q8"
    remainders: bool = True  # compressed: the fp32 master as int16 remainders beside the bf16 param
    fsdp2: bool = False  # --ranks: the model fully_shard'ed
    process_group: bool = False  # --ranks: HybridAdamW(process_group=WORLD) over plain params


PLACEMENTS = {
    "torch": Placement("torch AdamW(fused=True)"),
    "offload0": Placement("HybridAdamW offload 0", 0.0),
    "offload1": Placement("HybridAdamW offload 1", 1.0),
    "nvme1": Placement("HybridAdamW offload 1, nvme 1", 1.0, 1.0),
    "compressed1": Placement("HybridAdamW compressed, offload 1", 1.0, compressed=True),
    "compressed0": Placement("HybridAdamW compressed, offload 0", 0.0, compressed=True),
    "q8rem1": Placement("HybridAdamW q8 + remainders, offload 1", 1.0, compressed=True, moments="q8"),
    "q8master1": Placement(
        "HybridAdamW q8 + fp32 master, offload 1", 1.0, compressed=True, moments="q8", remainders=False
    ),
    "q8rem0": Placement("HybridAdamW q8 + remainders, offload 0", 0.0, compressed=True, moments="q8"),
}
RANK_PLACEMENTS = {
    "fsdp2-torch": Placement("FSDP2 + torch AdamW(fused=True)", fsdp2=True),
    "fsdp2-offload1": Placement("FSDP2 + HybridAdamW offload 1", 1.0, fsdp2=True),
    "pg-offload1": Placement("HybridAdamW process_group, offload 1", 1.0, process_group=True),
}
OPS = {
    "torch_save": "torch.save(opt.state_dict(), f)",
    "save_state_dict": "opt.save_state_dict(f)",
    "load": "opt.load_state_dict(torch.load(f))",
    "load_mmap": "opt.load_state_dict(torch.load(f, mmap=True))",
    "dcp_save": "DCP get_optimizer_state_dict + save",
}
FRAMEWORK_OPS = {
    "hf_trainer": ("transformers", "HF Trainer, save_steps: _save_optimizer_and_scheduler"),
    "lightning": ("lightning", "Lightning trainer.save_checkpoint(path)"),
    "lightning_direct": ("lightning", "Lightning save_checkpoint, plugins=[DirectCheckpointIO()]"),
}
FRAMEWORK_PLACEMENTS = ("torch", "offload1")
HYBRID_ONLY_OPS = ("save_state_dict",)
LOAD_OPS = ("load", "load_mmap")  # they read the placement's reference file


# ---------------------------------------------------------------- the model, the optimizer, the steps


def build_model(layers: int, width: int, compressed: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model.to(torch.bfloat16) if compressed else model


def build_optimizer(params, placement: Placement, nvme_dir: str):
    if placement.offload is None:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    kw: dict = dict(offload_fraction=placement.offload)
    if placement.nvme:
        kw.update(nvme_fraction=placement.nvme, nvme_path=nvme_dir)
    if placement.compressed:
        moments = torch.bfloat16 if placement.moments == "bf16" else placement.moments
        kw.update(
            exp_avg_dtype=moments, exp_avg_sq_dtype=moments, store_param_remainders=placement.remainders
        )
    if placement.process_group:
        kw.update(process_group=dist.group.WORLD)
    return HybridAdamW(params, lr=1e-3, **kw)


def train(model, opt, width: int, seed: int = 1) -> None:
    """TRAIN_STEPS steps on random inputs, so every param has its state."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(TRAIN_STEPS):
        x = torch.randn(BATCH, width, generator=gen).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def worker_pid(opt) -> int | None:
    return opt.worker_pid if isinstance(opt, HybridAdamW) else None


def close(opt) -> None:
    if isinstance(opt, HybridAdamW):
        opt.close()


# ---------------------------------------------------------------- sizes


def state_bytes(state_dict: dict) -> int:
    """nbytes of the tensors in a state dict's "state" (a DTensor: this rank's local part)."""
    total = 0
    for per_param in state_dict["state"].values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.nbytes
    return total


def path_bytes(path: str) -> int:
    """A file's size, or the sizes of the files under a directory (a DCP checkpoint)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def pss_bytes(pids: list[int | None]) -> int:
    return sum(psutil.Process(pid).memory_full_info().pss for pid in pids if pid is not None)


def release_free_memory() -> None:
    """gc, then glibc hands its free heap back: what set-up freed is not there to reuse."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        pass


# ---------------------------------------------------------------- the operations


def op_torch_save(model, opt, path: str) -> dict:
    sd = opt.state_dict()
    torch.save(sd, path)
    del sd  # inside the window: the dict's copies are freed before it ends
    return {}


def op_save_state_dict(model, opt, path: str) -> dict:
    opt.save_state_dict(path)
    return {}


# the loaded dict held this long before load_state_dict takes it, so the sampler sees it (torch's
# AdamW adopts the dict and frees its old state within a millisecond or two on a fast host: the
# 2 ms sampler saw half of a 16 MiB dict once); measure() leaves it out of the seconds. Pages the
# allocator reuses from the ops before show no growth at all, held or not (half of the dict, once)
LOADED_HOLD_S = 5 * PERIOD_S


def op_load(model, opt, path: str) -> dict:
    sd = torch.load(path)
    loaded = state_bytes(sd)
    time.sleep(LOADED_HOLD_S)
    opt.load_state_dict(sd)
    del sd
    return {"loaded_bytes": loaded, "held_s": LOADED_HOLD_S}


def op_load_mmap(model, opt, path: str) -> dict:
    opt.load_state_dict(torch.load(path, mmap=True))
    return {}


def op_dcp_save(model, opt, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    local = state_bytes(osd)
    with warnings.catch_warnings():  # one process, no process group: saving alone is the point
        warnings.filterwarnings("ignore", ".*assuming the intent is to save in a single process")
        dcp.save({"optim": osd}, checkpoint_id=path)
    del osd
    return {"state_bytes": local}


OP_FUNCS = {
    "torch_save": op_torch_save,
    "save_state_dict": op_save_state_dict,
    "load": op_load,
    "load_mmap": op_load_mmap,
    "dcp_save": op_dcp_save,
}


def measure(run, pids: list[int | None], path: str) -> dict:
    """RAM (sampled, PSS), seconds and the file's bytes of `run()`, which returns facts of its own;
    `steady_before` says whether the processes' memory held still before it (else it timed out)."""
    # torch._dynamo loaded first: DCP's get_optimizer_state_dict imports it on its first call (about
    # 80 MiB of modules, once a process). torch.optim.AdamW's construction loaded it already, and
    # HybridAdamW's does not (hybrid_opt/torch_methods.py): an import is not the operation's RAM.
    importlib.import_module("torch._dynamo")
    release_free_memory()
    steady = wait_until_steady(pids)
    pss_before = pss_bytes(pids)
    with RamSampler(pids) as ram:
        t0 = time.perf_counter()
        facts = run()
        seconds = time.perf_counter() - t0 - facts.get("held_s", 0.0)  # op_load's hold is not its time
    return dict(
        extra_bytes=ram.result["anon_shmem_peak"],
        rss_shmem_extra_bytes=ram.result["rss_shmem_peak"],
        pss_before=pss_before,
        pss_after=pss_bytes(pids),
        seconds=seconds,
        file_bytes=path_bytes(path) if os.path.exists(path) else None,
        steady_before=steady,
        sampled=ram.result,
        **facts,
    )


# ---------------------------------------------------------------- one run in a fresh process


@contextlib.contextmanager
def trained(args):
    """(model, optimizer) of args.placement, built and trained two steps; closed after."""
    placement = PLACEMENTS[args.placement]
    model = build_model(args.layers, args.width, placement.compressed)
    opt = build_optimizer(model.parameters(), placement, tempfile.mkdtemp(dir=args.dir))
    try:
        train(model, opt, args.width)
        yield model, opt
    finally:
        close(opt)


def prepare_main(args) -> dict:
    """The reference run: the file the loads read, and the state's bytes."""
    with trained(args) as (model, opt):
        sd = opt.state_dict()
        torch.save(sd, args.path)
        return {"state_bytes": state_bytes(sd), "params": sum(p.numel() for p in model.parameters())}


def op_main(args) -> dict:
    """One operation on a freshly built and trained optimizer."""
    with trained(args) as (model, opt):
        return measure(
            lambda: OP_FUNCS[args.op](model, opt, args.path), [os.getpid(), worker_pid(opt)], args.path
        )


def hf_trainer_main(args) -> dict:
    """A real transformers.Trainer, save_steps=TRAIN_STEPS: the window is its
    _save_optimizer_and_scheduler at the step that saves (the model's own file is not in it)."""
    import transformers

    transformers.logging.set_verbosity_error()
    placement = PLACEMENTS[args.placement]

    class WithLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, labels=None):
            return {"loss": self.net(x.to(next(self.net.parameters()).dtype)).float().square().mean()}

    model = WithLoss(build_model(args.layers, args.width, placement.compressed))
    opt = build_optimizer(model.parameters(), placement, tempfile.mkdtemp(dir=args.dir))
    gen = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(args.width, generator=gen)} for _ in range(BATCH * TRAIN_STEPS)]
    measured: list[dict] = []

    class MeasuredTrainer(transformers.Trainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            save = super()._save_optimizer_and_scheduler
            measured.append(
                measure(
                    lambda: save(output_dir) or {},
                    [os.getpid(), worker_pid(opt)],
                    os.path.join(output_dir, transformers.trainer.OPTIMIZER_NAME),
                )
            )

    targs = transformers.TrainingArguments(
        output_dir=args.path,
        max_steps=TRAIN_STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=TRAIN_STEPS,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        logging_strategy="no",
        seed=0,
    )
    try:
        MeasuredTrainer(model=model, args=targs, train_dataset=data, optimizers=(opt, None)).train()
    finally:
        close(opt)
    if len(measured) != 1:
        raise RuntimeError(f"HF Trainer saved {len(measured)} times in {TRAIN_STEPS} steps, not once")
    return measured[0]


def lightning_main(args) -> dict:
    """Lightning's trainer.save_checkpoint(path) after a TRAIN_STEPS-step fit: its own
    CheckpointIO, or (op lightning_direct) hybrid_opt.lightning_io.DirectCheckpointIO."""
    import lightning.pytorch as pl

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")
    placement = PLACEMENTS[args.placement]
    nvme_dir = tempfile.mkdtemp(dir=args.dir)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model(args.layers, args.width, placement.compressed)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x.to(next(self.net.parameters()).dtype)).float().square().mean()

        def configure_optimizers(self):
            return build_optimizer(self.parameters(), placement, nvme_dir)

    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * TRAIN_STEPS, args.width, generator=gen))
    plugins = []
    if args.op == "lightning_direct":
        from hybrid_opt.lightning_io import DirectCheckpointIO

        plugins.append(DirectCheckpointIO())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=TRAIN_STEPS,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        plugins=plugins,
    )
    module = Module()
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
        opt = trainer.optimizers[0]
        return measure(
            lambda: trainer.save_checkpoint(args.path) or {}, [os.getpid(), worker_pid(opt)], args.path
        )
    finally:
        for opt in trainer.optimizers:
            close(opt)


def rank_main(args) -> None:
    """--ranks: one rank of a torchrun launch; the DCP save of this rank's state."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    placement = RANK_PLACEMENTS[args.placement]
    model = build_model(args.layers, args.width, placement.compressed)
    if placement.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = build_optimizer(model.parameters(), placement, tempfile.mkdtemp(dir=args.dir))
    try:
        train(model, opt, args.width, seed=1 + rank)
        dist.barrier()
        result = measure(
            lambda: op_dcp_save(model, opt, args.path), [os.getpid(), worker_pid(opt)], args.path
        )
        result["file_bytes"] = (
            None  # the ranks write into one directory: its total is the launch's (dir_bytes)
        )
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
    finally:
        close(opt)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": gathered, "file_bytes": path_bytes(args.path)}, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher


@dataclasses.dataclass(frozen=True)
class Job:
    """One fresh process: a placement and an operation (a framework's, or on --ranks ranks)."""

    placement: str
    op: str
    ranks: int = 1


def child_argv(args, job: Job, path: str) -> list[str]:
    common = [
        f"--layers={args.layers}",
        f"--width={args.width}",
        f"--dir={args.run_dir}",
        f"--placement={job.placement}",
        f"--path={path}",
        f"--timeout={args.timeout}",
    ]
    if job.ranks > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={job.ranks}",
            f"--log-dir={os.path.join(args.run_dir, 'torchelastic')}",  # not a /tmp/torchelastic_* per launch
            "--standalone",
            os.path.abspath(__file__),
            "--rank-main",
            f"--out={path}.json",
            *common,
        ]
    return [sys.executable, os.path.abspath(__file__), f"--child={job.op}", *common]


def run_child(argv: list[str], what: str, timeout: float) -> str:
    """A child's stdout once it exits 0; its whole tree (the worker too) killed past `timeout`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        sys.exit(f"bench_checkpoint: {what}: no result within {timeout:.0f} s (its processes killed)")
    if proc.returncode != 0:
        sys.exit(f"bench_checkpoint: {what} failed (exit {proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    return out


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def run_job(args, job: Job, r: int) -> list[dict]:
    """One round of a job: a result per rank; what it wrote removed afterwards."""
    reads = job.op in LOAD_OPS
    path = (
        reference_path(args, job.placement)
        if reads
        else os.path.join(args.run_dir, f"{job.placement}-{job.op}-r{r}")
    )
    what = f"{job.placement} {job.op}" + (f" on {job.ranks} ranks" if job.ranks > 1 else "")
    out = run_child(child_argv(args, job, path), what, args.timeout)
    if job.ranks > 1:
        with open(f"{path}.json") as f:
            got = json.load(f)
        results = [dict(rank, rank=k, dir_bytes=got["file_bytes"]) for k, rank in enumerate(got["ranks"])]
    else:
        results = [last_json(out)]
    if not reads:
        remove(path)
        remove(f"{path}.json")
    return results


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def reference_path(args, placement: str) -> str:
    return os.path.join(args.run_dir, f"reference-{placement}.pt")


def jobs_for(args) -> tuple[list[Job], list[dict]]:
    """The jobs to run, and a row for each one skipped (with its reason)."""
    jobs, skipped = [], []
    for p in args.placements:
        jobs += [
            Job(p, op) for op in args.ops if not (op in HYBRID_ONLY_OPS and PLACEMENTS[p].offload is None)
        ]
    if args.frameworks is not None:
        for op, (package, label) in FRAMEWORK_OPS.items():
            if args.frameworks and op not in args.frameworks:
                continue
            chosen = [p for p in FRAMEWORK_PLACEMENTS if p in args.placements]
            if importlib.util.find_spec(package) is None:
                reason = f"{package} is not installed"
                print(f"skipped: {label}: {reason}", file=sys.stderr)
                skipped += [skipped_row(Job(p, op), reason) for p in chosen]
                continue
            jobs += [Job(p, op) for p in chosen]
    if args.ranks > 1:
        jobs += [Job(p, "dcp_save", args.ranks) for p in RANK_PLACEMENTS]
    return jobs, skipped


def run_all(args) -> tuple[dict, dict, list]:
    """({placement: its reference facts}, {job: [each round's results]}, skipped rows); rounds
    alternate the order of the jobs."""
    jobs, skipped = jobs_for(args)
    needs_reference = list(dict.fromkeys(j.placement for j in jobs if j.ranks == 1))
    references = {
        p: last_json(
            run_child(
                child_argv(args, Job(p, "prepare"), reference_path(args, p)), f"{p} reference", args.timeout
            )
        )
        for p in needs_reference
    }
    results: dict = {job: [] for job in jobs}
    for r in range(args.rounds):
        for job in jobs if r % 2 == 0 else jobs[::-1]:
            print(f"round {r + 1}/{args.rounds}: {job.placement} {job.op}", file=sys.stderr, flush=True)
            results[job].append(run_job(args, job, r))
    return references, results, skipped


# ---------------------------------------------------------------- rows and the table


def row_for(job: Job, rank: int, rounds: list[dict], reference: dict | None) -> dict:
    """One JSON row: medians over rounds (ranges beside), extra RAM in MiB and % of the state."""
    placement = (RANK_PLACEMENTS if job.ranks > 1 else PLACEMENTS)[job.placement]
    label = FRAMEWORK_OPS[job.op][1] if job.op in FRAMEWORK_OPS else OPS[job.op]
    state = reference["state_bytes"] if reference else rounds[0]["state_bytes"]
    extra = [r["extra_bytes"] / MIB for r in rounds]
    secs = [r["seconds"] for r in rounds]
    row = dict(
        placement=placement.label,
        op=label,
        op_key=job.op,
        placement_key=job.placement,
        ranks=job.ranks,
        rank=rank if job.ranks > 1 else None,
        extra_mib=statistics.median(extra),
        extra_mib_min=min(extra),
        extra_mib_max=max(extra),
        extra_pct=100 * statistics.median(extra) * MIB / state,
        rss_shmem_extra_mib=statistics.median(r["rss_shmem_extra_bytes"] / MIB for r in rounds),
        pss_before_mib=statistics.median(r["pss_before"] / MIB for r in rounds),
        pss_after_mib=statistics.median(r["pss_after"] / MIB for r in rounds),
        seconds=statistics.median(secs),
        seconds_min=min(secs),
        seconds_max=max(secs),
        file_bytes=rounds[0]["file_bytes"],
        state_bytes=state,
        dir_bytes=rounds[0].get("dir_bytes"),
        rounds=len(rounds),
        per_round=rounds,
        skipped=None,
    )
    if "loaded_bytes" in rounds[0]:
        row["loaded_mib"] = rounds[0]["loaded_bytes"] / MIB
        row["extra_above_loaded_mib"] = row["extra_mib"] - row["loaded_mib"]
    return row


def skipped_row(job: Job, reason: str) -> dict:
    """A row of the same keys, every figure None."""
    figures = (
        "extra_mib",
        "extra_mib_min",
        "extra_mib_max",
        "extra_pct",
        "rss_shmem_extra_mib",
        "pss_before_mib",
        "pss_after_mib",
        "seconds",
        "seconds_min",
        "seconds_max",
        "file_bytes",
        "state_bytes",
        "dir_bytes",
    )
    return dict(
        placement=PLACEMENTS[job.placement].label,
        op=FRAMEWORK_OPS[job.op][1],
        op_key=job.op,
        placement_key=job.placement,
        ranks=job.ranks,
        rank=None,
        **dict.fromkeys(figures),
        rounds=0,
        per_round=[],
        skipped=reason,
    )


def rows_for(references: dict, results: dict, skipped: list[dict]) -> list[dict]:
    rows = []
    for job, rounds in results.items():
        for rank in range(job.ranks):
            rows.append(row_for(job, rank, [r[rank] for r in rounds], references.get(job.placement)))
    return rows + skipped


def _median_range(lo: float, mid: float, hi: float, fmt: str) -> str:
    return format(mid, fmt) if lo == hi else f"{mid:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"


def file_cell(row: dict) -> str | None:
    if row["dir_bytes"] is not None:
        return f"{row['dir_bytes'] / MIB:.0f} (all ranks)"
    return None if row["file_bytes"] is None else f"{row['file_bytes'] / MIB:.0f}"


def markdown(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        if r.get("skipped"):
            continue
        cells.append(
            dict(
                placement=r["placement"] + (f", rank {r['rank']}" if r["rank"] is not None else ""),
                op=r["op"],
                extra=_median_range(r["extra_mib_min"], r["extra_mib"], r["extra_mib_max"], ".0f"),
                pct=f"{r['extra_pct']:.0f} %",
                loaded=(
                    f"{r['loaded_mib']:.0f} · {r['extra_above_loaded_mib']:+.0f}"
                    if "loaded_mib" in r
                    else None
                ),
                rss_shmem=f"{r['rss_shmem_extra_mib']:.0f}",
                pss=f"{r['pss_before_mib']:,.0f} → {r['pss_after_mib']:,.0f}",
                seconds=_median_range(r["seconds_min"], r["seconds"], r["seconds_max"], ".2f"),
                file=file_cell(r),
            )
        )
    return markdown_table(
        cells,
        [
            ("placement", "placement", "s"),
            ("op", "operation", "s"),
            ("extra", "extra RAM, MiB (median, range)", "s"),
            ("pct", "% of state", "s"),
            ("loaded", "loaded dict, MiB · extra above it", "s"),
            ("rss_shmem", "RssAnon+RssShmem extra, MiB", "s"),
            ("pss", "PSS before → after, MiB", "s"),
            ("seconds", "seconds (median, range)", "s"),
            ("file", "file, MiB", "s"),
        ],
    )


def preamble(args, references: dict) -> str:
    params = args.layers * args.width * args.width
    states = ", ".join(
        f"{PLACEMENTS[p].label} {ref['state_bytes'] / MIB:.0f} MiB" for p, ref in references.items()
    )
    return (
        f"{args.layers} x Linear({args.width}, {args.width}, bias=False): {params / 1e6:.1f}M params, "
        f"{TRAIN_STEPS} AdamW steps; {args.rounds} round(s), a fresh process per row per round; "
        f"{host_description()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.\n"
        f"State (the tensors in state_dict()['state']): {states}.\n"
        f"Extra RAM: peak of RssAnon (trainer + worker) + system Shmem above before, sampled every 2 ms."
    )


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    ap.add_argument("--ops", nargs="*", default=list(OPS), choices=list(OPS))
    ap.add_argument(
        "--frameworks",
        nargs="*",
        choices=list(FRAMEWORK_OPS),
        help="HF Trainer and Lightning rows (these, or all when given bare)",
    )
    ap.add_argument("--ranks", type=int, default=1, help="2: DCP saves on 2 gloo ranks too")
    ap.add_argument(
        "--dir", help="where checkpoints and nvme files go (a temp dir under it; default bench_out/)"
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds each fresh process may take")
    ap.add_argument("--json")
    # a fresh process's own arguments
    ap.add_argument("--child", choices=["prepare", *OPS, *FRAMEWORK_OPS], help=argparse.SUPPRESS)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--placement", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


CHILD_MAINS = {
    "prepare": prepare_main,
    "hf_trainer": hf_trainer_main,
    "lightning": lightning_main,
    "lightning_direct": lightning_main,
}


def main() -> None:
    args = parse_args()
    if args.rank_main:
        return rank_main(args)
    if args.child:
        args.op = args.child
        print(json.dumps(CHILD_MAINS.get(args.child, op_main)(args)), flush=True)
        return
    if args.ranks not in (1, 2):
        sys.exit("--ranks: 1 or 2")
    base = args.dir or os.path.join(REPO, "bench_out")
    os.makedirs(base, exist_ok=True)
    args.run_dir = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=base)
    try:
        references, results, skipped = run_all(args)
    finally:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    rows = rows_for(references, results, skipped)
    skipped = "".join(f"\n- {r['placement']}, {r['op']}: {r['skipped']}" for r in rows if r["skipped"])
    print(
        preamble(args, references) + "\n\n" + markdown(rows) + (f"\n\nSkipped:{skipped}" if skipped else "")
    )
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
