"""Rank script: faults under FSDP2 (2 ranks), each scenario named on the command line.

- "plain" / "kill_between" / "kill_backward": the same training (host tier with nvme, clipping);
  rank 1 SIGKILLs its own worker after step 1's step() / inside step 2's backward (a grad hook
  of the middle layer, after the last layer's subgroups were handed to the worker). Saved: the
  full params after each step and the worker restarts, to compare bitwise with "plain".
- "fail_speculation": rank 1's speculative host step raises during step 2's backward (a
  test-only fault: its host tier's speculate() patched to raise). Both ranks raise at step 2,
  nothing is stepped; training then goes on, so the trajectory is the one with step 2 skipped.
- "nvme_lost": after step 1, rank 1's swap files are truncated (a real fault: the state on
  disk is gone). Every rank goes on calling step() after an error (a rank that catches and
  continues); what each raised, and when, is saved.
- process_group mode (plain params, ZeRO-2), each a test-only or real fault on rank 1:
  "zero_host_fails": rank 1's host step in step() fails at step 2 (after the decision: its
  host tier's finish() patched to raise); both ranks go on calling step().
  "zero_check_fails": rank 1 casts a param's memory after step 2's backward, so its
  _check_storage() refuses it before the decision; both ranks stop the scenario there.
  "zero_init": lr-0 first steps (torch.distributed.checkpoint's state-init step): A, rank 1
  carries a kept failure while every grad is zero; B, the averaged grads are zero in rank 0's
  chunks only (grads set by hand, no backward), so the ranks' local verdicts differ.
- "rank_gone": at step 2, rank 1 runs backward and then exits without calling step(); rank 0
  waits in the decision all_reduce. Must be last (rank 1 exits there).
The process group's timeout is 20 s, so nothing here can wait longer than that.
"""

import datetime
import glob
import os
import signal
import sys
import tempfile
import time

import common as C
import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hybrid_opt import HybridAdamW
from hybrid_opt.distributed import node
from hybrid_opt.testing import debug_view

PG_TIMEOUT_S = 20
RESULTS = {}  # the scenarios run so far (rank_gone's rank 1 saves them before it exits)


def shard(model, mesh):
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def kill_worker(opt) -> int:
    pid = opt.worker_pid
    os.kill(pid, signal.SIGKILL)  # not reaped here: the worker client notices the closed pipe
    return pid


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model = shard(C.build_model(), mesh)
    nvme = os.path.join(tmp, f"{name}-rank{rank}")
    os.makedirs(nvme)
    opt = HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=1.0,
        subgroup_numel=32,
        worker_share=0.5,
        offload_fraction=1.0,
        nvme_fraction=0.5,
        nvme_path=nvme,
    )
    out = dict(
        params=[],
        errors=[],
        restarts=[],
        worker_pids=[],
        killed=[],
        node=(node.local_rank(), node.local_world_size()),
    )
    out["worker_cpus"] = sorted(psutil.Process(opt.worker_pid).cpu_affinity())
    hook = None
    view = debug_view(opt)
    if name == "fail_speculation" and rank == 1:
        real, fired = view.host.stepping.speculate, []

        def failing(*args, **kwargs):
            if view.steps_taken == 1 and not fired:  # step 2's backward, once
                fired.append(True)
                raise OSError(5, "injected fault: the swap file could not be written")
            return real(*args, **kwargs)

        view.host.stepping.speculate = failing
    if name == "kill_backward" and rank == 1:

        def kill_in_backward(p):
            if view.steps_taken == 1 and not out["killed"]:
                out["killed"].append(kill_worker(opt))

        hook = model[2].weight.register_post_accumulate_grad_hook(kill_in_backward)
    for i, x in enumerate(C.batches()):
        opt.zero_grad()
        loss = C.loss_fn(model, C.local_batch(x, rank, world))
        loss.backward()
        if name == "rank_gone" and i == 1 and rank == 1:
            C.save_result(dict(RESULTS, **{name: out}))
            print("rank 1 exits without calling step()", flush=True)
            os._exit(0)
        t0 = time.monotonic()
        try:
            opt.step()
        except Exception as e:  # a rank that catches the error and goes on
            out["errors"].append(
                dict(
                    step=i,
                    type=type(e).__name__,
                    message=str(e),
                    ranks=getattr(e, "ranks", None),
                    seconds=time.monotonic() - t0,
                )
            )
            print(f"rank {rank} step {i}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if name == "rank_gone":
                break  # the group is broken: no collective can run any more
        out["params"].append([p.full_tensor().detach().clone() for p in model.parameters()])
        out["restarts"].append(view.host_stats["worker_restarts"])
        out["worker_pids"].append(opt.worker_pid)
        if name == "kill_between" and i == 0 and rank == 1:
            out["killed"].append(kill_worker(opt))
        if name == "nvme_lost" and i == 0 and rank == 1:
            # the writes behind step 1 land and no state stays in memory: step 2 reads the files
            view.drop_reads_ahead()
            files = glob.glob(os.path.join(nvme, "**", "*.state"), recursive=True)
            assert files, f"no swap files under {nvme}"
            for f in files:
                os.truncate(f, 0)
            out["truncated"] = len(files)
    if hook is not None:
        hook.remove()
    if name == "rank_gone":
        return out  # no close(): nothing more may wait on the broken group
    opt.close()
    return out


def record(out, i, e, t0, rank):
    out["errors"].append(
        dict(
            step=i,
            type=type(e).__name__,
            message=str(e),
            ranks=getattr(e, "ranks", None),
            seconds=time.monotonic() - t0,
        )
    )
    print(f"rank {rank} step {i}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def run_zero(name: str, rank: int, world: int) -> dict:
    out = dict(params=[], errors=[], steps=[])
    if name == "zero_init":
        for phase in ("A", "B"):
            model = C.build_model()
            opt = HybridAdamW(
                model.parameters(),
                lr=0.0,
                weight_decay=0.01,
                max_grad_norm=1.0,
                subgroup_numel=32,
                worker_share=0.5,
                offload_fraction=0.5,
                process_group=dist.group.WORLD,
            )
            if phase == "A" and rank == 1:
                debug_view(opt).ledger.rank_failure = RuntimeError(
                    "injected: a failure kept from an earlier step"
                )
            if phase == "A":
                (C.loss_fn(model, C.local_batch(C.batches()[0], rank, world)) * 0.0).backward()
            else:  # set by hand on both ranks, zero in rank 0's rows: its chunk of the mean is
                for p in model.parameters():  # zero (an "init step"), rank 1's is not
                    p.grad = torch.zeros_like(p)
                    p.grad[-(-p.shape[0] // 2) :] = 1.0
            t0 = time.monotonic()
            try:
                opt.step()
            except Exception as e:
                record(out, phase, e, t0, rank)
            out["steps"].append(list(debug_view(opt).param_steps))
            out["params"].append([p.detach().clone() for p in model.parameters()])
            opt.close()
        return out
    model = C.build_model()
    opt = HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=1.0,
        subgroup_numel=32,
        worker_share=0.5,
        offload_fraction=1.0,
        process_group=dist.group.WORLD,
    )
    if name == "zero_host_fails" and rank == 1:
        real = debug_view(opt).host.stepping.finish

        def failing(*args, **kwargs):
            if debug_view(opt).steps_taken == 2:  # step 2's host step, after the decision
                raise OSError(5, "injected fault: the host step failed")
            return real(*args, **kwargs)

        debug_view(opt).host.stepping.finish = failing
    for i, x in enumerate(C.batches()):
        opt.zero_grad()
        C.loss_fn(model, C.local_batch(x, rank, world)).backward()
        if name == "zero_check_fails" and i == 1 and rank == 1:
            with torch.no_grad():
                model[0].weight.data = model[0].weight.data.double()  # refused: cast
        t0 = time.monotonic()
        try:
            opt.step()
        except Exception as e:
            record(out, i, e, t0, rank)
            if name == "zero_check_fails":
                break
        out["params"].append([p.detach().clone() for p in model.parameters()])
    opt.close()
    return out


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = RESULTS
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[1:]:
            results[name] = (
                run_zero(name, rank, world) if name.startswith("zero_") else run(name, rank, world, tmp)
            )
            C.save_result(results)
    if "rank_gone" in results:
        sys.stdout.flush()
        os._exit(0)  # the group is broken: destroying it could wait on the dead rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
