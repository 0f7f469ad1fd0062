"""A node's resources split between its ranks (issue #15 item 6): cores, free host memory,
nvme bandwidth, and nvme directories per global rank, from LOCAL_RANK / LOCAL_WORLD_SIZE /
RANK as torchrun sets them (hybrid_opt/distributed/node.py)."""

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import psutil
import pytest
import torch
from helpers import needs_public_dtensor

from hybrid_opt import swap
from hybrid_opt.distributed import node
from hybrid_opt.distributed.node import NodeInfo
from hybrid_opt.placement import scheduler
from hybrid_opt.worker.client import CoreSplit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(node, "_warned_shared_cores", False)


def _ranks(monkeypatch, local_rank, local_world_size, rank=None):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    if rank is not None:
        monkeypatch.setenv("RANK", str(rank))


# ------------------------------------------------------------------ who am I on this node


def test_node_info_reads_torchrun_variables_and_defaults_to_one_rank(monkeypatch):
    assert (node.local_rank(), node.local_world_size(), node.global_rank()) == (0, 1, None)
    _ranks(monkeypatch, 3, 4, rank=7)
    assert (node.local_rank(), node.local_world_size(), node.global_rank()) == (3, 4, 7)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, r"local rank 2 of 2 ranks per node"),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, r"0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "two"}, r"LOCAL_WORLD_SIZE='two' is not an integer"),
        ({"LOCAL_RANK": "1"}, r"LOCAL_RANK=1 but LOCAL_WORLD_SIZE is not set"),
    ],
)
def test_bad_launcher_variables_are_rejected_naming_them(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        node.info()


# ------------------------------------------------------------------ cores


@pytest.mark.parametrize("cores", [2, 8])
@pytest.mark.parametrize("ranks", [2, 4])
def test_core_slices_are_disjoint_across_local_ranks(cores, ranks):
    cpus = list(range(10, 10 + cores))  # fake core ids: not the machine's
    if cores < ranks:
        with pytest.warns(RuntimeWarning, match=f"{ranks} ranks on this node share {cores} cores"):
            slices = [node.core_slice(cpus, NodeInfo(r, ranks)) for r in range(ranks)]
        assert all(len(s) == 1 for s in slices)
        assert sorted(c for s in slices for c in s) == sorted(cpus * (ranks // cores))
        return
    slices = [node.core_slice(cpus, NodeInfo(r, ranks)) for r in range(ranks)]
    assert sorted(c for s in slices for c in s) == cpus  # disjoint and covering
    assert {len(s) for s in slices} == {cores // ranks}


def test_uneven_core_counts_give_the_first_ranks_one_more():
    slices = [node.core_slice(list(range(7)), NodeInfo(r, 3)) for r in range(3)]
    assert slices == [[0, 1, 2], [3, 4], [5, 6]]


def test_fewer_cores_than_ranks_warns_once():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for r in range(4):
            node.core_slice([0, 1], NodeInfo(r, 4))
    assert len([w for w in seen if "share 2 cores" in str(w.message)]) == 1


@pytest.mark.parametrize("cores,ranks", [(2, 2), (8, 2), (8, 4)])
def test_core_split_workers_of_different_ranks_never_share_cores(cores, ranks):
    allowed = list(range(cores))
    splits = [CoreSplit(0.5, allowed=allowed, node=NodeInfo(r, ranks)) for r in range(ranks)]
    workers = [set(s.worker) for s in splits]
    trainers = [set(s.trainer) for s in splits]
    for a in range(ranks):
        assert workers[a] and trainers[a]
        # each rank splits only its own slice
        assert workers[a] | trainers[a] == set(node.core_slice(allowed, NodeInfo(a, ranks)))
        for b in range(a + 1, ranks):
            assert not workers[a] & workers[b], (a, b, workers)
            assert not (workers[a] | trainers[a]) & (workers[b] | trainers[b])
    if cores // ranks >= 2:  # a slice of two or more cores is split between trainer and worker
        assert all(not (w & t) for w, t in zip(workers, trainers))
    else:  # one core each: trainer and worker share it, and the trainer is still pinned there
        assert all(s.pins and not s.separate for s in splits)


def test_a_step_the_trainer_waits_for_takes_every_core_of_the_ranks_slice_but_the_trainers_one():
    """Split on a 16-core host (the H200's): 8 worker cores during backward, 15 threads on all 16
    while step() waits (one core left to the trainer's thread); each of two ranks the same on its
    8; shared, all of them; named worker cores, or too few cores to widen, the worker's own."""
    one = NodeInfo(0, 1)
    split = CoreSplit(0.5, allowed=list(range(16)), node=one)
    assert len(split.worker) == 8 and split.waited_cores == list(range(16))
    assert split.waited_threads == 15 and split.widens
    assert "15 threads on cores 0-15 while step() waits" in split.describe()
    for r in range(2):
        rank = CoreSplit(0.5, allowed=list(range(16)), node=NodeInfo(r, 2))
        assert rank.waited_cores == list(range(8 * r, 8 * r + 8)) and rank.waited_threads == 7
    shared = CoreSplit(None, allowed=list(range(16)), node=one)
    assert shared.waited_threads == 16 and not shared.widens
    named = CoreSplit(None, worker_cores=[12, 13, 14, 15], allowed=list(range(16)), node=one)
    assert named.waited_threads == 0 and not named.widens
    two = CoreSplit(0.5, allowed=[0, 1], node=one)  # one worker core; the trainer keeps the other
    assert two.waited_threads == 0 and not two.widens and "while step() waits" not in two.describe()


def test_core_split_reads_the_node_from_the_environment(monkeypatch):
    _ranks(monkeypatch, 1, 2)
    split = CoreSplit(0.5, allowed=list(range(8)))
    assert (split.node.local_rank, split.node.local_world_size) == (1, 2)
    assert set(split.trainer) | set(split.worker) == {4, 5, 6, 7}
    # one rank: the whole allowed set, as before
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    one = CoreSplit(0.5, allowed=list(range(8)))
    assert set(one.trainer) | set(one.worker) == set(range(8)) and not one.sliced


# ------------------------------------------------------------------ host memory, nvme bandwidth


def test_default_host_budget_is_the_ranks_share_of_free_memory(monkeypatch):
    monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: 100e9)
    params = [torch.zeros(1000)]  # 4 kB, counted on a CPU-only host
    _, alone = scheduler.default_budgets(params, torch.device("cpu"), None, None)
    _ranks(monkeypatch, 1, 4)
    _, quarter = scheduler.default_budgets(params, torch.device("cpu"), None, None)
    assert alone == pytest.approx((100e9 + 4000) * (1 - scheduler.HEADROOM))
    assert quarter == pytest.approx((25e9 + 4000) * (1 - scheduler.HEADROOM))
    # an explicit budget is taken as it is
    assert scheduler.default_budgets(params, torch.device("cpu"), None, 7e9)[1] == 7e9


def test_default_spare_banks_count_the_ranks_share(monkeypatch):
    monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: 100 * scheduler.SPARE_SHARE**-1)
    alone = scheduler.default_spare_banks(1000, 1)
    _ranks(monkeypatch, 0, 4)
    assert alone == 100 and scheduler.default_spare_banks(1000, 1) == 25


def test_nvme_rates_the_cost_model_plans_with_are_the_ranks_share(monkeypatch):
    rates = dict(device_adam_gbps=10.0, host_adam_gelems_per_s=1.0, nvme_read_gbps=8.0, nvme_write_gbps=4.0)
    alone = scheduler.machine_from_rates(rates, "cpu")
    _ranks(monkeypatch, 1, 2)
    half = scheduler.machine_from_rates(rates, "cpu")
    assert (alone.nvme_read_gbps, alone.nvme_write_gbps) == (8.0, 4.0)
    assert (half.nvme_read_gbps, half.nvme_write_gbps) == (4.0, 2.0)


# ------------------------------------------------------------------ nvme directories per rank


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def _stale_dir(parent, pid) -> str:
    path = os.path.join(parent, f"{swap.PREFIX}{pid}-stale")
    os.makedirs(path)
    with open(os.path.join(path, "sg0.state"), "wb") as f:
        f.write(b"x")
    return path


def test_each_rank_swaps_in_its_own_directory_and_sweeps_only_there(tmp_path, monkeypatch):
    dead = _dead_pid()
    rank0_dir = tmp_path / "hybrid_opt-rank0"
    rank1_dir = tmp_path / "hybrid_opt-rank1"
    rank1_dir.mkdir(mode=0o700)
    rank0_dir.mkdir(mode=0o700)
    stale0 = _stale_dir(rank0_dir, dead)  # rank 0's leftover: not rank 1's to remove
    stale1 = _stale_dir(rank1_dir, dead)  # rank 1's own leftover
    stale_top = _stale_dir(tmp_path, dead)  # a non-distributed run's leftover
    _ranks(monkeypatch, 1, 2, rank=1)
    d = swap.SwapDir(str(tmp_path))
    try:
        assert os.path.dirname(d.path) == str(rank1_dir)
        assert d.swept == [stale1] and not os.path.exists(stale1)
        assert os.path.isdir(stale0) and os.path.isdir(stale_top)
        d.create(0, 4096)
        assert os.path.exists(os.path.join(str(rank1_dir), os.path.basename(d.path), "sg0.state"))
    finally:
        d.remove()
    assert not os.path.exists(d.path)
    # rank 3 of another node, first time on this disk: its directory is made, private
    monkeypatch.setenv("RANK", "3")
    d3 = swap.SwapDir(str(tmp_path))
    try:
        assert os.path.dirname(d3.path) == str(tmp_path / "hybrid_opt-rank3")
        assert os.stat(tmp_path / "hybrid_opt-rank3").st_mode & 0o777 == 0o700
        assert d3.swept == [] and os.path.isdir(stale0)
    finally:
        d3.remove()
    # not distributed: directly under nvme_path, sweeping there and leaving ranks' directories
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    plain = swap.SwapDir(str(tmp_path))
    try:
        assert os.path.dirname(plain.path) == str(tmp_path)
        assert plain.swept == [stale_top] and os.path.isdir(stale0)
    finally:
        plain.remove()


def test_a_live_ranks_directory_is_never_swept(tmp_path, monkeypatch):
    _ranks(monkeypatch, 0, 2, rank=0)
    live = swap.SwapDir(str(tmp_path))
    try:
        again = swap.SwapDir(str(tmp_path))  # a second tier of the same rank
        try:
            assert again.swept == [] and os.path.isdir(live.path)
        finally:
            again.remove()
    finally:
        live.remove()


# ------------------------------------------------------------------ two real ranks


RANK_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
from helpers import inputs, load, make_grads, make_states
from hybrid_opt.tiers.host import HostTier

numels = [4096, 8192]
tier = HostTier(numels, slot_numel=4096, timeout_s=30.0)
load(tier, make_states(numels))
grads = make_grads(numels)
for sg, g in enumerate(grads):  # the worker's thread pool runs
    tier.stepping.speculate(sg, g, inputs(1))
tier.stepping.finish({{sg: (g, inputs(1)) for sg, g in enumerate(grads)}})
trainer = {{}}
for tid in os.listdir("/proc/self/task"):
    try:
        trainer[tid] = sorted(os.sched_getaffinity(int(tid)))
    except OSError:
        pass
print(json.dumps(dict(worker=tier.client.pid, worker_cores=tier.cores.worker,
                      trainer_cores=tier.cores.trainer, trainer_threads=trainer)), flush=True)
sys.stdin.readline()  # the test reads the worker's affinity meanwhile
tier.close()
print("closed", flush=True)
"""


def _read_line(proc, deadline) -> str:
    """One line of a rank process's stdout, waiting at most until `deadline`."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"rank process {proc.pid} printed no line in time (got {buf!r})")
        if select.select([proc.stdout], [], [], min(left, 0.5))[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                proc.wait(timeout=10)
                raise RuntimeError(
                    f"rank process {proc.pid} exited with {proc.returncode}; its "
                    f"stderr: {proc.stderr.read().decode(errors='replace')[-3000:]}"
                )
            buf += chunk
    return buf.decode()


def _worker_thread_affinities(pid) -> dict:
    out = {}
    for t in psutil.Process(pid).threads():
        try:
            out[t.id] = set(psutil.Process(t.id).cpu_affinity())
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one per rank")
def test_two_ranks_on_one_node_pin_their_workers_to_disjoint_cores(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT.format(tests=TESTS)))
    procs = []
    try:
        for r in range(2):
            env = dict(os.environ, PYTHONPATH=REPO, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", RANK=str(r))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    cwd=tmp_path,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + 90
        reports = [json.loads(_read_line(p, deadline)) for p in procs]
        masks = [_worker_thread_affinities(rep["worker"]) for rep in reports]
        for rep, m in zip(reports, masks):
            assert m, f"worker {rep['worker']} has no threads to read"
            assert all(a == set(rep["worker_cores"]) for a in m.values()), (rep, m)
            # the rank's trainer threads stay inside its own slice too
            assert all(
                set(a) <= set(rep["trainer_cores"]) | set(rep["worker_cores"])
                for a in rep["trainer_threads"].values()
            ), rep
        union0 = set().union(*masks[0].values())
        union1 = set().union(*masks[1].values())
        assert not union0 & union1, f"workers of ranks 0 and 1 share cores: {union0} / {union1}"
        for p in procs:
            p.stdin.write(b"go\n")
            p.stdin.flush()
        for p in procs:
            assert _read_line(p, deadline).strip() == "closed"
            assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def test_a_node_group_and_an_initialised_default_group_take_precedence(tmp_path, monkeypatch):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    _ranks(monkeypatch, 1, 2, rank=5)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        assert node.global_rank() == 0  # the group's rank, not RANK
        assert node.local_world_size() == 2  # no node group declared: the variables
        node.set_node_group(dist.group.WORLD)
        assert (node.local_rank(), node.local_world_size()) == (0, 1)
    finally:
        node.set_node_group(None)
        dist.destroy_process_group()
    assert (node.local_rank(), node.local_world_size(), node.global_rank()) == (1, 2, 5)


@pytest.mark.parametrize("case", ["no_local_world_size", "no_local_env"])
def test_the_ranks_on_a_node_are_derived_from_torch_distributed_when_the_launcher_does_not_say(
    tmp_path, case
):
    """Lightning's DDP launcher sets LOCAL_RANK but no LOCAL_WORLD_SIZE (neither rank may raise or
    take the whole node); mp.spawn sets neither. Derived from torch.distributed: 2
    ranks on this node, each worker on cores of its own rank's share."""
    from dist_launch import DIST_MARKS, launch

    for mark in DIST_MARKS:
        if mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    res = [r[case] for r in launch("node_derive.py", str(tmp_path), case, timeout_s=90)]
    assert sorted(r["local_rank"] for r in res) == [0, 1]
    assert all(r["local_world_size"] == 2 and r["steps"] == 1 for r in res), res
    assert not set(res[0]["worker_cores"]) & set(res[1]["worker_cores"]), res
    assert not set(res[0]["trainer_cores"]) & set(res[1]["trainer_cores"]), res  # no rank takes the node


@needs_public_dtensor
def test_default_budgets_count_a_dtensor_params_local_shard(monkeypatch, tmp_path):
    """FSDP2: a rank holds its DTensor params' local shards; their global size would count every
    rank's memory as this rank's (a default budget too generous by the world size)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: 100e9)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        local = torch.zeros(1000)  # this rank's 4 kB of a param of 4 such shards (as on 4 ranks)
        meta = TensorMeta(torch.Size((4000,)), (1,), torch.float32)
        p = DTensor(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)
        assert p.numel() == 4000
        _, host = scheduler.default_budgets([p], torch.device("cpu"), None, None)
        assert host == pytest.approx((100e9 + 4000) * (1 - scheduler.HEADROOM), abs=1.0)  # not 16 kB
    finally:
        dist.destroy_process_group()
