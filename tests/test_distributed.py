"""HybridAdamW / HybridAdam under torch.distributed (gloo, 2 ranks on this machine): FSDP2
with uneven shards and an HSDP (2, 1) mesh, one decision for all ranks (clipping norm, a
GradScaler overflow on one rank), DCP checkpoints 2 -> 2 and 2 -> 1, DCP's lr-0 step on a
fresh optimizer, and the warning for replicated plain params.

Each launch (tests/dist_launch.py) runs one rank script over several configurations, so the
whole module costs two torchrun launches (about 25 s here); each is bounded and kills every
rank and worker when it overruns.
"""

import os
import sys

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch
from tolerances import DIST_RTOL

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402

pytestmark = DIST_MARKS

TRAIN = [
    "adamw_1d_nvme",
    "adam_1d_host",
    "adamw_hsdp_nvme",
    "adam_hsdp_host",
    "adamw_cpu_offload",
    "adamw_swap_load",
]
CLIP = {
    "adamw_1d_nvme": 1.0,
    "adam_1d_host": 1.0,
    "adamw_hsdp_nvme": 0.5,
    "adam_hsdp_host": 1.0,
    "adamw_cpu_offload": 1.0,
    "adamw_swap_load": 1.0,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_train")
    return launch(
        "fsdp_train.py",
        str(out),
        *TRAIN,
        "adamw_overflow",
        "adamw_noclip",
        "plain_warn",
        "adamw_mixed_precision",
        timeout_s=150,
    )


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_dcp")
    ckpt = os.path.join(str(out), "ckpt")
    return ckpt, launch("fsdp_dcp.py", str(out), ckpt, timeout_s=150)


def _assert_trajectory(params_per_step, ref_params, what):
    for step, (ours, ref) in enumerate(zip(params_per_step, ref_params)):
        for k, (a, b) in enumerate(zip(ours, ref)):
            err = C.rel_err(a, b)
            assert err <= DIST_RTOL, f"{what}: step {step} param {k}: relative error {err:.2e}"


@pytest.mark.parametrize("name", TRAIN)
def test_fsdp2_matches_single_process_torch(trained, name):
    """Every rank's params (gathered) follow torch.optim.AdamW / Adam on the global batch with
    clip_grad_norm_, and last_grad_norm is the full model's norm, the same float on every rank.
    Also with FSDP2's CPUOffloadPolicy, and after the model was loaded with assign=True under
    swap_tensors (new shard memory: the optimizer re-points its subgroups, never the params)."""
    kind = "AdamW" if name.startswith("adamw") else "Adam"
    ref_params, ref_norms = C.reference(kind, max_grad_norm=CLIP[name])
    for rank, res in enumerate(trained):
        _assert_trajectory(res[name]["params"], ref_params, f"{name} rank {rank}")
        for ours, ref in zip(res[name]["norms"], ref_norms):
            assert ours == pytest.approx(ref, rel=1e-5)
    assert trained[0][name]["norms"] == trained[1][name]["norms"]  # bitwise: one decision


def test_fsdp2_mixed_precision_matches_torch_under_the_same_policy(trained):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded params stay fp32
    (they are the masters: no separate master copy) and HybridAdamW follows torch.optim.AdamW
    run over an identical FSDP2 model with the same policy and batches (clip_grad_norm_ on the
    DTensor grads), within the distributed tolerance; the clipping norms agree."""
    for rank, res in enumerate(trained):
        r = res["adamw_mixed_precision"]
        assert r["param_dtypes"] == ["torch.float32"] * len(r["param_dtypes"])
        _assert_trajectory(r["params"], r["torch_params"], f"mixed precision rank {rank}")
        for ours, ref in zip(r["norms"], r["torch_norms"]):
            assert ours == pytest.approx(ref, rel=1e-5)
        moved = [C.rel_err(a, b) for a, b in zip(r["params"][-1], r["params"][0])]
        assert min(moved) > 0  # the trajectory is not flat: the comparison can tell


def test_fsdp2_shards_are_uneven_and_hsdp_replicates(trained):
    """The odd-sized layer is split unevenly (the test exercises FSDP2's padded shards), and the
    (2, 1) mesh holds every param replicated on dim 0, sharded (whole) on dim 1."""
    r0, r1 = trained[0]["adamw_1d_nvme"], trained[1]["adamw_1d_nvme"]
    full = [p.numel() for p in C.build_model().parameters()]
    assert [a + b for a, b in zip(r0["local_numels"], r1["local_numels"])] == full
    assert r0["local_numels"] != r1["local_numels"]
    hsdp = trained[0]["adamw_hsdp_nvme"]
    assert all(pl == ("R", "S(0)") for pl in hsdp["placements"])
    assert hsdp["local_numels"] == full  # without counting replicas once, the norm would be √2 too big


def test_plan_says_it_is_the_ranks_share(trained, zero_trained):
    """opt.plan and repr(opt) on each rank describe that rank's share: its rank, the world and
    the elements it lays out of the model's (FSDP2 local shards, HSDP's replica holds them all,
    process_group's dim-0 chunks)."""
    total = sum(p.numel() for p in C.build_model().parameters())
    for rank in range(2):
        cases = [
            (trained[rank]["adamw_1d_nvme"], sum(trained[rank]["adamw_1d_nvme"]["local_numels"])),
            (trained[rank]["adamw_hsdp_nvme"], total),
            (zero_trained[rank]["adamw_nvme"], zero_trained[rank]["adamw_nvme"]["state_numel"]),
        ]
        for res, mine in cases:
            note = f"rank {rank} of 2: its share, {mine} of {total} elements"
            assert res["plan"].startswith(f"Plan({note}; device: "), res["plan"]
            assert note in res["opt_repr"]


def test_speculation_starts_from_fsdp2_hooks(trained):
    """Host subgroups are stepped during backward from FSDP2's post-reduce-scatter hooks and
    committed (clipping does not bite here), none redone."""
    for res in trained:
        for name in TRAIN:
            # swap_tensors drops a Parameter's hooks: the first step() re-adopts the shards and
            # hooks them again, so speculation resumes from the second step
            specs = res[name]["speculation"][1 if name == "adamw_swap_load" else 0 :]
            for spec in specs:
                assert spec["committed"] >= 1 and spec["redone"] == 0, (name, spec)
        assert res["adamw_swap_load"]["speculation"][0]["stepped"] >= 1


def test_overflow_on_one_rank_skips_every_rank(trained):
    """An inf in rank 1's local grads only: both ranks skip that step (speculated steps
    dropped), the attached GradScaler's scale stays equal on both, and the trajectory is
    torch's with that step skipped."""
    r0, r1 = trained[0]["adamw_overflow"], trained[1]["adamw_overflow"]
    assert r0["skipped"] == r1["skipped"] == [False, True, False, False]
    assert r0["scales"] == r1["scales"] == [256.0, 128.0, 128.0, 128.0]
    assert r0["speculation"][1]["dropped"] >= 1 and r0["speculation"][1]["committed"] == 0
    ref_params, _ = C.reference("AdamW", max_grad_norm=1.0, skip={1})
    for rank, res in enumerate((r0, r1)):
        _assert_trajectory(res["params"], ref_params, f"overflow rank {rank}")


def test_collectives_per_step(trained):
    """One all_reduce per step where the decision needs one (clipping or a scaler), none
    otherwise."""
    for res in trained:
        for name in TRAIN + ["adamw_overflow"]:
            assert res[name]["all_reduces"] == [1] * C.STEPS, name
        assert res["adamw_noclip"]["all_reduces"] == [0] * C.STEPS
        ref_params, _ = C.reference("AdamW")
        _assert_trajectory(res["adamw_noclip"]["params"], ref_params, "no clipping")


def test_plain_params_under_dist_warn_once_naming_process_group(trained):
    for res in trained:
        msgs = [m for m in res["plain_warn"]["warnings"] if "process_group" in m]
        assert len(msgs) == 1, res["plain_warn"]["warnings"]
        assert "replicated" in msgs[0]
        for name in TRAIN:  # FSDP2's DTensor params are sharded: no warning
            assert not [m for m in res[name]["warnings"] if "process_group" in m]


def test_dcp_state_is_dtensors_like_the_params(checkpointed):
    """get_optimizer_state_dict gives DTensor moments placed like the params (as torch.optim.
    AdamW's under FSDP2) and plain step counts; the full state dict (cpu_offload) plain tensors."""
    _, (r0, r1) = checkpointed
    for res in (r0, r1):
        assert res["kinds"] == {
            "step": ("Tensor", ()),
            "exp_avg": ("DTensor", ("S(0)",)),
            "exp_avg_sq": ("DTensor", ("S(0)",)),
        }
    assert r0["full_kinds"] == ["Tensor"]


def test_dcp_save_2_load_2_resumes_bitwise(checkpointed):
    """Saved at 2 ranks from offload 0.5 + nvme 0.25, loaded at 2 ranks into offload 1.0: the
    resumed steps are the uninterrupted ones, bit for bit (same kernels, same state)."""
    _, ranks = checkpointed
    for res in ranks:
        for a, b in zip(res["resumed"], res["uninterrupted"]):
            assert torch.equal(a, b)


def test_load_state_dict_takes_full_tensors_for_dtensor_params(checkpointed):
    """load_state_dict given plain full-size state (a gathered state_dict) under FSDP2: each
    rank loads its own slice of each tensor (uneven shards included) and resumes bitwise."""
    _, ranks = checkpointed
    for res in ranks:
        for a, b in zip(res["resumed_from_full"], res["uninterrupted"]):
            assert torch.equal(a, b)


def test_dcp_init_step_on_fresh_fsdp2_optimizer(checkpointed):
    """get_optimizer_state_dict on a fresh optimizer runs DCP's lr-0 step: torch's state (step
    1, zero moments, global shapes) and params unchanged."""
    _, ranks = checkpointed
    shapes = {n: tuple(p.shape) for n, p in C.build_model().named_parameters()}
    for res in ranks:
        assert set(res["fresh_state"]) == set(shapes)
        for name, st in res["fresh_state"].items():
            assert float(st["step"]) == 1.0
            for k in ("exp_avg", "exp_avg_sq"):
                assert tuple(st[k].shape) == shapes[name] and not st[k].any()
        for a, b in zip(res["before"], res["after_init"]):
            assert torch.equal(a, b)


def _resume_in_one_process(ckpt: str, ranks: list, into: str) -> None:
    """Loads the 2-rank checkpoint in one plain process (no torch.distributed) into a plain
    HybridAdamW or torch.optim.AdamW (dcp.load resharding the DTensor state), or from the full
    state dict, trains the remaining batches and checks the uninterrupted trajectory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from hybrid_opt import HybridAdamW

    model = C.build_model()
    if into == "torch.optim.AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=0.01, foreach=False)
    else:
        opt = HybridAdamW(
            model.parameters(),
            lr=C.LR,
            weight_decay=0.01,
            max_grad_norm=1.0,
            subgroup_numel=32,
            offload_fraction=0.5,
        )
    try:
        if into == "full_state_dict":
            full = torch.load(ckpt + "-full.pt", weights_only=True)
            model.load_state_dict(full["model"])
            set_optimizer_state_dict(model, opt, full["optim"])
        else:
            sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=ckpt)
            model.load_state_dict(sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
        for x in C.batches()[2:]:
            opt.zero_grad()
            C.loss_fn(model, x).backward()
            if isinstance(opt, torch.optim.AdamW):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    finally:
        if hasattr(opt, "close"):
            opt.close()
    for k, (a, b) in enumerate(zip(model.parameters(), ranks[0]["uninterrupted"])):
        err = C.rel_err(a.detach(), b)
        assert err <= DIST_RTOL, f"param {k}: relative error {err:.2e}"


@pytest.mark.parametrize("into", ["HybridAdamW", "torch.optim.AdamW", "full_state_dict"])
def test_dcp_save_2_load_1(checkpointed, into):
    """The 2-rank checkpoint loads in one plain process (no torch.distributed) into a plain
    HybridAdamW, into torch.optim.AdamW (dcp.load resharding the DTensor state), or from the
    full state dict, and resumes on the uninterrupted trajectory."""
    _resume_in_one_process(*checkpointed, into)


@pytest.mark.gpu
@pytest.mark.whole_gpu  # a torchrun launch on the GPU: one at a time
def test_fsdp2_on_cuda_one_rank(tmp_path):
    """FSDP2 on a CUDA mesh (one rank per GPU; the GPU machine has one): DTensor shards on the
    GPU, the device tier's Triton step and the host tier's staged CUDA grads, against torch on
    the same batch; an overflow step skipped with the scaler on the GPU."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA device")
    names = ["adamw_1d_nvme", "adam_1d_host", "adamw_overflow", "adamw_noclip"]
    (res,) = launch(
        "fsdp_train.py", str(tmp_path), *names, nproc=1, timeout_s=80, env={"DIST_DEVICE": "cuda"}
    )
    for name, clip, skip in (
        ("adamw_1d_nvme", 1.0, ()),
        ("adam_1d_host", 1.0, ()),
        ("adamw_overflow", 1.0, ()),
        ("adamw_noclip", None, ()),
    ):
        kind = "AdamW" if name.startswith("adamw") else "Adam"
        ref_params, _ = C.reference(kind, max_grad_norm=clip, skip=skip)
        # one rank: its local batch is the global batch; the overflow is injected on rank 1 only
        _assert_trajectory(res[name]["params"], ref_params, f"cuda {name}")
        assert res[name]["all_reduces"] == [0] * C.STEPS  # a world of 1 needs no collective


def test_launch_past_its_deadline_kills_ranks_and_workers(tmp_path):
    """The harness's bound: a launch that never ends fails at its deadline with the ranks'
    output, and every rank and HybridAdamW worker under it (in sessions of their own) is gone."""
    from helpers import wait_gone

    with pytest.raises(pytest.fail.Exception, match=r"(?s)no result within 20 s .*rank \d blocking"):
        launch("hang.py", str(tmp_path), timeout_s=20)
    pids = [int((tmp_path / f"worker{r}.pid").read_text()) for r in range(2)]
    for pid in pids:
        assert wait_gone(pid, 5), f"worker {pid} outlived the killed launch"


# ---------------------------------------------------------------- process_group (ZeRO-2 style)
ZERO_TRAIN = {  # name: (optimizer, clip, steps skipped)
    "adamw_nvme": ("AdamW", 1.0, ()),
    "adam_host": ("Adam", 1.0, ()),
    "adamw_host_noclip": ("AdamW", None, ()),
    "adamw_overflow": ("AdamW", 1.0, (1,)),
    "adamw_accum": ("AdamW", 1.0, ()),
    "adamw_accum_noflag": ("AdamW", 1.0, ()),
    "adamw_ddp": ("AdamW", None, ()),
    "adamw_sync": ("AdamW", None, ()),
    "adamw_sd_close": ("AdamW", None, ()),
    "adamw_sync_rs": ("AdamW", None, ()),
    "adamw_overlap_ar": ("AdamW", None, ()),
    "adamw_commit_order": ("AdamW", 1.0, ()),
}


@pytest.fixture(scope="module")
def zero_trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_train")
    return launch(
        "zero_train.py",
        str(out),
        *ZERO_TRAIN,
        "adamw_load",
        "adamw_unused",
        "adamw_unused_direct",
        "adamw_unused_lazy",
        "adamw_unused_direct_lazy",
        timeout_s=180,
    )


@pytest.fixture(scope="module")
def zero_checkpointed(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_dcp")
    ckpt = os.path.join(str(out), "ckpt")
    return ckpt, launch("zero_dcp.py", str(out), ckpt, timeout_s=150)


@pytest.mark.parametrize("name", list(ZERO_TRAIN))
def test_process_group_matches_single_process_torch(zero_trained, name):
    """process_group=WORLD over plain params (each rank steps its dim-0 chunks, all-gathers
    them): every rank's own params follow torch.optim.AdamW / Adam on the global batch with
    clip_grad_norm_ — HybridAdamW at offload 0.5 + nvme 0.25 and HybridAdam at offload 1.0,
    with a one-rank GradScaler overflow (skipped by both), with accumulation over two
    micro-batches (with the boundary flag, and without: each backward reduces the accumulated
    grads again), and under a DDP wrapper too; last_grad_norm is the full
    model's norm, the same float on both ranks."""
    kind, clip, skip = ZERO_TRAIN[name]
    ref_params, ref_norms = C.reference(kind, max_grad_norm=clip, skip=skip)
    for rank, res in enumerate(zero_trained):
        _assert_trajectory(res[name]["params"], ref_params, f"{name} rank {rank}")
        if clip is not None:
            for step, (ours, ref) in enumerate(zip(res[name]["norms"], ref_norms)):
                if step not in skip:
                    assert ours == pytest.approx(ref, rel=1e-5)
    assert zero_trained[0][name]["norms"] == zero_trained[1][name]["norms"]


def test_process_group_param_unused_on_one_rank_keeps_the_collectives_in_order(zero_trained):
    """The last layer's bias is unused on rank 1 (4 buckets; its bucket is the first in issue
    order): rank 1 issues that bucket in step(), and its other buckets only after it, so both
    ranks' reduce-scatters pair in order; the bias's grad is rank 0's halved on both ranks
    (DDP's find_unused_parameters), and at the last step, unused on both, it keeps grad None
    and is not stepped — torch.optim.AdamW on the mean of the ranks' losses."""
    ref_params, ref_norms = C.reference_bias_unused("AdamW", max_grad_norm=1.0)
    for rank, res in enumerate(zero_trained):
        assert res["adamw_unused"]["buckets"] == 4
        _assert_trajectory(res["adamw_unused"]["params"], ref_params, f"adamw_unused rank {rank}")
        assert res["adamw_unused"]["norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert torch.equal(ref_params[-1][-1], ref_params[-2][-1])  # the bias not stepped at the last
    for a, b in zip(
        zero_trained[0]["adamw_unused"]["params"][-1], zero_trained[1]["adamw_unused"]["params"][-1]
    ):
        assert torch.equal(a, b)


def test_process_group_param_unused_on_one_rank_in_a_bucket_reduced_from_its_grad(zero_trained):
    """The middle Linear is unused on rank 1: its weight (6 rows, even over 2 ranks) is a bucket
    reduced straight from p.grad on rank 0 and from zeros on rank 1 (its has-grad count in a
    collective of its own); both ranks get the averaged grad and follow torch.optim.AdamW on
    the mean of the ranks' losses, bitwise equal to each other."""
    ref_params, ref_norms = C.reference_layer_unused("AdamW", max_grad_norm=1.0)
    for rank, res in enumerate(zero_trained):
        assert res["adamw_unused_direct"]["direct"] == [False, True, False, False]
        _assert_trajectory(
            res["adamw_unused_direct"]["params"], ref_params, f"adamw_unused_direct rank {rank}"
        )
        assert res["adamw_unused_direct"]["norms"] == pytest.approx(ref_norms, rel=1e-5)
    for a, b in zip(
        zero_trained[0]["adamw_unused_direct"]["params"][-1],
        zero_trained[1]["adamw_unused_direct"]["params"][-1],
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, unused", [("adamw_unused", [5]), ("adamw_unused_direct", [2, 3])])
def test_process_group_has_grad_counts_read_lazily_in_step(zero_trained, name, unused):
    """The has-grad counts read lazily (CUDA's way, forced on gloo): a bucket whose params all
    have their grads reads none; those of buckets holding a param unused on this rank are kept
    on the device through backward and read in step() in one copy — no read in backward (the
    eager path, gloo's default, reads one per such bucket there) — and the run is bitwise the
    eager one's (params after every step), on both ranks. The unused params' zero grads appear
    in step(), not at the end of backward (None in between: the documented CUDA difference)."""
    for rank, res in enumerate(zero_trained):
        eager, lazy = res[name], res[name + "_lazy"]
        for step in range(C.STEPS):
            for a, b in zip(eager["params"][step], lazy["params"][step]):
                assert torch.equal(a, b), (name, rank, step)
        before = [0] + lazy["count_reads_after_step"][:-1]
        assert lazy["count_reads_after_backward"] == before, (rank, lazy)  # none in backward
        reads = [a - b for a, b in zip(lazy["count_reads_after_step"], lazy["count_reads_after_backward"])]
        assert all(r <= 1 for r in reads), reads  # at most one copy a step
        if rank == 1:  # unused there at every step: one read a step, its grads None until step()
            assert reads == [1] * C.STEPS
            assert all(
                [i for i, none in enumerate(g) if none] == unused for g in lazy["grad_none_after_backward"]
            )
            assert eager["count_reads_after_backward"][0] >= 1  # eager: read in backward
            assert not any(any(g) for g in eager["grad_none_after_backward"][:-1])
    assert res["adamw_sync"]["zero"]["count_reads"] == 0  # every param has its grad: no read


def test_process_group_gathers_start_as_their_buckets_commit(zero_trained):
    """The params' gathers are launched inside step() as the host tier commits the subgroups
    holding their chunks, not after the whole step: each bucket right after the later of the
    commit that completes its subgroups here and the launch of the bucket before it in the one
    gather order (param order, the same on both ranks). On rank 0 (commits in subgroup order
    unless a speculation was deferred) the first bucket goes out while later subgroups still
    commit; rank 1 drops its first subgroup's speculation, so commits it in step(), after
    the speculated ones, and launches nothing before it. Params follow torch
    (test_process_group_matches_single_process_torch) and are bitwise equal on both ranks."""
    runs = [res["adamw_commit_order"] for res in zero_trained]
    buckets = runs[0]["bucket_params"]
    order = list(reversed(range(len(buckets))))
    assert len(buckets) == 4
    for rank, run in enumerate(runs):
        early = []
        sgs_of = [{i for i, ps in enumerate(run["sg_params"]) if set(ps) & set(b)} for b in buckets]
        assert len(run["events"]) == C.STEPS
        for step, events in enumerate(run["events"]):
            gathers = [b for kind, b in events if kind == "gather"]
            commits = [i for kind, i in events if kind == "commit"]
            assert gathers == order, (rank, step, events)
            assert sorted(commits) == list(range(len(run["sg_params"])))
            prev = -1
            for b in order:  # as soon as its commits and the bucket before it allow, not later
                done = max(events.index(("commit", i)) for i in sgs_of[b])
                assert events.index(("gather", b)) == max(done, prev) + 1, (rank, step, b, events)
                prev = events.index(("gather", b))
            first_gather = events.index(("gather", order[0]))
            last_commit = max(t for t, (kind, _) in enumerate(events) if kind == "commit")
            early.append(first_gather < last_commit)  # overlapping the remaining commits
            if rank == 1:  # (which subgroup commits last depends on timing; this does not)
                assert first_gather > events.index(("commit", 0)), events
        spec = run["speculation"]
        assert all(s["stepped"] >= rank for s in spec), spec  # rank 1: its first subgroup
        if rank == 0:
            assert any(early), run["events"]
    for a, b in zip(runs[0]["params"][-1], runs[1]["params"][-1]):
        assert torch.equal(a, b)


def test_process_group_waits_on_cuda_are_the_streams_not_the_hosts():
    """On CUDA our collectives are waited for without a timeout — the current stream waits
    (NCCL's wait with a timeout blocks the host until the collective is done); elsewhere
    bounded by the group's timeout. (The wait itself on NCCL needs a GPU: not run here.)"""
    import datetime

    from hybrid_opt.distributed.zero import wait_collective

    timeout = datetime.timedelta(seconds=7)
    calls = []

    class Work:
        def wait(self, **kw):
            calls.append(kw)
            return True

    wait_collective(Work(), "a reduction", timeout, True)
    wait_collective(Work(), "a reduction", timeout)
    assert calls == [{}, {"timeout": timeout}]


def test_process_group_failed_wait_names_its_bound():
    """A failed wait's message names the bound that applied: the process group's timeout, on
    gloo the host's wait, on CUDA (no timeout passed: the stream waits) NCCL's watchdog."""
    import datetime

    from hybrid_opt.distributed.zero import wait_collective

    class Failed:
        def wait(self, **kw):
            raise RuntimeError("NCCL communicator was aborted")

    for cuda in (True, False):
        with pytest.raises(RuntimeError, match=r"within the process group's timeout \(7 s\) or failed"):
            wait_collective(Failed(), "a reduction", datetime.timedelta(seconds=7), cuda)


@pytest.mark.gpu
@pytest.mark.whole_gpu  # a torchrun launch on the GPU: one at a time
def test_process_group_on_cuda_one_rank(tmp_path):
    """process_group over NCCL on one GPU (the GPU machine has one): reduce-scatter /
    all-gather, gathers launched as step() commits, waited for by the stream; params follow
    torch on the global batch. The has-grad counts are lazy on CUDA: none read while every
    param has its grad, and the last step's unused bias (adamw_unused: unused on every rank
    there) read in step(), once — never in backward."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA device")
    names = ["adamw_sync", "adamw_host_noclip", "adamw_nvme", "adamw_unused"]
    (res,) = launch(
        "zero_train.py", str(tmp_path), *names, nproc=1, timeout_s=80, env={"DIST_DEVICE": "cuda"}
    )
    for name in names[:3]:
        _, clip, skip = ZERO_TRAIN[name]
        ref_params, _ = C.reference("AdamW", max_grad_norm=clip, skip=skip)
        _assert_trajectory(res[name]["params"], ref_params, f"cuda {name}")
        assert res[name]["zero"]["collectives"] == "reduce_scatter"
        assert res[name]["zero"]["count_reads"] == 0
    ref_params, _ = C.reference_bias_unused("AdamW", world=1, max_grad_norm=1.0)
    unused = res["adamw_unused"]
    _assert_trajectory(unused["params"], ref_params, "cuda adamw_unused")
    assert unused["count_reads_after_backward"] == [0] * C.STEPS
    assert unused["count_reads_after_step"] == [0] * (C.STEPS - 1) + [1]


def test_process_group_forward_right_after_step_sees_updated_params(zero_trained):
    """overlap_param_gather=True: the params' all-gathers (4 buckets here) are launched at the
    end of step() and not waited there; a forward right after step() lands each bucket in the
    forward pre-hook of the module holding its params: its outputs and the params after it are
    bitwise those of the default run, whose step() lands every gather before it returns."""
    for rank, res in enumerate(zero_trained):
        over, sync = res["adamw_host_noclip"], res["adamw_sync"]
        assert over["buckets"] == sync["buckets"] == 4
        assert over["pending_after_step"] == [4] * C.STEPS
        assert sync["pending_after_step"] == [0] * C.STEPS  # the default: landed in step()
        assert over["zero"]["all_gathers_landed_in_forward"] == 4 * C.STEPS
        assert sync["zero"]["all_gathers_landed_in_forward"] == 0
        for step in range(C.STEPS):
            assert torch.equal(over["probe"][step], sync["probe"][step]), (rank, step)
            for a, b in zip(over["params"][step], sync["params"][step]):
                assert torch.equal(a, b), (rank, step)


def test_process_group_collective_paths_give_the_same_bits(zero_trained):
    """gloo's default (all_to_all_single of the rank segments, summed by their owner; params
    broadcast from each chunk's owner), reduce-scatter + all-gather (NCCL's path) and
    all_reduce + broadcasts (a backend without reduce-scatter): the same params bit for bit,
    the 4 buckets (one of 3 params, an even and two uneven single params) landing in the
    params directly (default) or through their staging buffers (overlap); and every bucket's
    buffers are allocated once, at the first step (no first touch per step)."""
    for rank, res in enumerate(zero_trained):
        assert res["adamw_sync"]["zero"]["collectives"] == "all_to_all"
        assert res["adamw_sync_rs"]["zero"]["collectives"] == "reduce_scatter"
        assert res["adamw_overlap_ar"]["zero"]["collectives"] == "all_reduce"
        for name in ("adamw_sync_rs", "adamw_overlap_ar"):
            assert res[name]["buckets"] == 4
            for step in range(C.STEPS):
                for a, b in zip(res[name]["params"][step], res["adamw_sync"]["params"][step]):
                    assert torch.equal(a, b), (name, rank, step)
        for name in ZERO_TRAIN:
            grown = res[name]["buffer_bytes"]
            assert grown[0] > 0 and grown == [grown[0]] * len(grown), (name, grown)


def test_process_group_state_dict_and_close_land_the_gathers(zero_trained):
    """Params read right after step() + opt.state_dict() (steps 0-2) or + opt.close() (the
    last step), before any forward, are the current ones, bitwise; and a model.load_state_dict
    between step() and the next forward keeps the loaded values (the stale gather is dropped)."""
    for rank, res in enumerate(zero_trained):
        sd, sync = res["adamw_sd_close"], res["adamw_sync"]
        assert sd["pending_after_step"] == [4] * C.STEPS
        assert sd["zero"]["all_gathers_landed_in_forward"] == 0
        for step in range(C.STEPS):
            for a, b in zip(sd["params"][step], sync["params"][step]):
                assert torch.equal(a, b), (rank, step)
        loaded = res["adamw_load"]
        assert loaded["pending_after_step"][-1] == 4
        for j, p in enumerate(loaded["params"][-1]):
            assert torch.equal(p, torch.full_like(p, 0.25 + j)), (rank, j)


def test_process_group_overflow_on_one_rank_skips_every_rank(zero_trained):
    """An inf in rank 1's local grads only: the plain GradScaler's found_inf is made global, so
    both ranks skip step 1, no param is gathered, and the scales stay equal."""
    r0, r1 = (res["adamw_overflow"] for res in zero_trained)
    assert r0["skipped"] == r1["skipped"] == [False, True, False, False]
    assert r0["scales"] == r1["scales"] == [256.0, 128.0, 128.0, 128.0]
    assert r0["zero"]["all_gathers"] == r1["zero"]["all_gathers"] == 3


def test_process_group_speculation_commits_from_reduced_chunks(zero_trained):
    """Speculation starts from the reduce-scattered chunk (not the raw local grad, as under
    DDP): >= 90 % of host steps are committed (not redone, not stepped late)."""
    for rank, res in enumerate(zero_trained):
        spec = res["adamw_host_noclip"]["speculation"]
        committed = sum(s["committed"] for s in spec)
        total = sum(s["committed"] + s["redone"] + s["stepped"] for s in spec)
        assert committed / total >= 0.9, (rank, spec)


def test_process_group_state_is_one_copy_across_ranks(zero_trained):
    """Each rank lays out and keeps state for its dim-0 chunks only (torch.chunk sizes: 7 / 6
    rows of the odd layer): the ranks' state elements sum to one copy of the model."""
    total = sum(p.numel() for p in C.build_model().parameters())
    for name in ZERO_TRAIN:
        kept = [res[name]["state_numel"] for res in zero_trained]
        assert sum(kept) == total and all(k < total for k in kept), (name, kept)
        assert [res[name]["laid_out"] for res in zero_trained] == kept
        # opt.stats' tier bytes (fp32 master + two moments; an fp32 param on the device tier
        # is its own master): one copy across the ranks
        device = sum(res[name]["device_elements"] for res in zero_trained)
        assert sum(res[name]["state_bytes"] for res in zero_trained) == 12 * total - 4 * device


def test_process_group_warns_once_under_ddp(zero_trained):
    """Grads already averaged (a DDP wrapper) are detected on the first reduction: one warning;
    none without DDP."""
    for res in zero_trained:
        msgs = [m for m in res["adamw_ddp"]["warnings"] if "DistributedDataParallel" in m]
        assert len(msgs) == 1, res["adamw_ddp"]["warnings"]
        for name in ZERO_TRAIN:
            if name != "adamw_ddp":
                assert not [
                    m for m in res[name]["warnings"] if "DistributedDataParallel" in m or "replicated" in m
                ]


def test_process_group_dcp_state_is_shard0_dtensors(zero_checkpointed):
    """get_optimizer_state_dict gives Shard(0) DTensors over the group's mesh, chunked as FSDP2
    would shard the param (13 rows: 7 on rank 0, 6 on rank 1)."""
    _, (r0, r1) = zero_checkpointed
    assert r0["kinds"]["exp_avg"] == ("DTensor", ("S(0)",), (7, 12))
    assert r1["kinds"]["exp_avg"] == ("DTensor", ("S(0)",), (6, 12))


def test_process_group_dcp_2_to_2_and_full_load_resume_bitwise(zero_checkpointed):
    """DCP 2 -> 2 (into offload 1.0, after DCP's lr-0 init step) and load_state_dict of the
    gathered full-size state both resume on the uninterrupted trajectory bit for bit."""
    _, ranks = zero_checkpointed
    for res in ranks:
        for key in ("resumed", "resumed_from_full"):
            for a, b in zip(res[key], res["uninterrupted"]):
                assert torch.equal(a, b), key


@pytest.mark.parametrize("into", ["HybridAdamW", "torch.optim.AdamW"])
def test_process_group_dcp_save_2_load_1(zero_checkpointed, into):
    """The 2-rank process_group checkpoint loads in one plain process into HybridAdamW or
    torch.optim.AdamW and resumes on the uninterrupted trajectory."""
    _resume_in_one_process(*zero_checkpointed, into)
