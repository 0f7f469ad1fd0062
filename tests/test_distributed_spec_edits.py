"""Speculated host steps under FSDP2 see the user's in-place edits of the DTensor grads between
backward and step() (hybrid_opt/distributed/grad_edits.py): torch's foreach in-place ops on DTensors —
clip_grad_norm_, a GradScaler's unscale_ — bump no version counter, and `dtensor.mul_` only
the DTensor's, so speculation records the DTensor's version and a content fingerprint (the
sum of squares of the grads stepped) and redoes a step whose grads changed.

One 2-rank gloo launch (tests/dist_scripts/fsdp_spec_edits.py) against torch.optim.AdamW on
the same FSDP2 model; the rest runs in this process on a 1-rank gloo group (FSDP2 params are
DTensors there too), so the fingerprint logic — the worker's piece sums on CPU, and the device
path (gpu_kernels.grad_stats, run by Triton's interpreter on CPU tensors) — is tested here.
"""

import sys

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch
from tolerances import DIST_RTOL, RTOL

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402

from hybrid_opt.testing import debug_view

pytestmark = DIST_MARKS

EDITED = ["clip_host", "clip_nvme", "unscale_host", "unscale_nvme", "mul_host"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_spec_edits")
    return launch("fsdp_spec_edits.py", str(out), *EDITED, "noedit_host", timeout_s=150)


def _assert_matches(params, ref, rtol, what):
    for step, (ours, theirs) in enumerate(zip(params, ref)):
        for k, (a, b) in enumerate(zip(ours, theirs)):
            err = C.rel_err(a, b)
            assert err <= rtol, f"{what}: step {step} param {k}: relative error {err:.2e}"


@pytest.mark.parametrize("name", EDITED)
def test_fsdp2_grads_edited_in_place_before_step_match_torch(launched, name):
    """clip_grad_norm_ that bites, a user's GradScaler unscale_, a DTensor sign flip: every
    rank follows torch.optim.AdamW on the same FSDP2 model (before the fix: 9.4e-3 relative
    after 4 steps with clipping, 5.4e-2 with unscale_), and speculation redid the stale steps
    (a sign flip keeps the sum of squares: only the DTensor's version sees it, at every step)."""
    for rank, res in enumerate(launched):
        r = res[name]
        _assert_matches(r["params"], r["torch_params"], DIST_RTOL, f"{name} rank {rank}")
        redone = [s["redone"] for s in r["speculation"]]
        assert sum(redone) > 0, f"{name} rank {rank}: no speculated step was redone: {r['speculation']}"
        if name == "mul_host":
            assert all(s["committed"] == 0 for s in r["speculation"]), r["speculation"]
        # a step may still commit: the worker read that subgroup's grads after the user's edit
        # (remote gather), so it stepped the edited grads and their fingerprint matches


def test_fsdp2_unedited_grads_commit_every_speculation(launched):
    """No edit: the fingerprint never redoes a step (no false positives), and the result is
    torch's."""
    for rank, res in enumerate(launched):
        r = res["noedit_host"]
        _assert_matches(r["params"], r["torch_params"], DIST_RTOL, f"noedit rank {rank}")
        for s in r["speculation"]:
            assert s["redone"] == 0 and s["committed"] > 0, r["speculation"]


@pytest.mark.gpu
def test_fsdp2_on_cuda_edited_grads_match_torch(tmp_path):
    """CUDA DTensor grads (one rank per GPU; the GPU machine has one): the launch fingerprint
    is gpu_kernels.grad_stats queued on the device in the grad hook, compared on the device at
    step() and read with the step's scalars. Clipping and a user's unscale_ redo the stale
    steps and match torch.optim.AdamW on the same FSDP2 model; unedited grads commit."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA device")
    names = ["clip_host", "unscale_host", "noedit_host"]
    (res,) = launch(
        "fsdp_spec_edits.py", str(tmp_path), *names, nproc=1, timeout_s=80, env={"DIST_DEVICE": "cuda"}
    )
    for name in names:
        r = res[name]
        _assert_matches(r["params"], r["torch_params"], DIST_RTOL, f"cuda {name}")
        if name == "noedit_host":
            assert all(s["redone"] == 0 and s["committed"] > 0 for s in r["speculation"]), r["speculation"]
        else:
            assert sum(s["redone"] for s in r["speculation"]) > 0, r["speculation"]


# ---------------------------------------------------------------- one process, 1-rank group


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _fsdp2(mesh, model):
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _edit(model, edit, scaler, opt):
    grads = [p.grad for p in model.parameters()]
    if edit == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    elif edit == "foreach_mul":
        torch._foreach_mul_(grads, 0.5)
    elif edit == "neg":
        with torch.no_grad():
            for g in grads:
                g.mul_(-1.0)
    elif edit == "unscale":
        scaler.unscale_(opt)


def _train(mesh, make_opt, edit, steps=C.STEPS):
    model = _fsdp2(mesh, C.build_model())
    opt = make_opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if edit == "unscale" else None
    outcomes = []
    try:
        for x in C.batches(steps):
            opt.zero_grad()
            loss = C.loss_fn(model, x)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            _edit(model, edit, scaler, opt)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            stats = getattr(opt, "stats", None)
            outcomes.append(dict(stats["speculation"]) if stats is not None else None)
        return [p.full_tensor().detach().clone() for p in model.parameters()], outcomes
    finally:
        if hasattr(opt, "close"):
            opt.close()


def _hybrid(**kw):
    from hybrid_opt import HybridAdamW

    return lambda model: HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        offload_fraction=1.0,
        subgroup_numel=32,
        worker_share=0.5,
        **kw,
    )


@pytest.fixture(params=["worker_sums", "device_path"])
def fingerprint_path(request, monkeypatch):
    """worker_sums: CPU grads, the worker's piece sums; device_path: the CUDA logic
    (gpu_kernels.grad_stats queued at launch, compared on the device, read with step()'s
    scalars) forced on CPU tensors — Triton's interpreter runs the kernel."""
    if request.param == "device_path":
        if torch.cuda.is_available():
            # the kernels here compile for the GPU, and CPU tensors are not theirs; the path
            # runs for real on CUDA tensors in test_fsdp2_on_cuda_edited_grads_match_torch
            pytest.skip(
                "a CUDA device is here: the device path runs on CUDA tensors "
                "(test_fsdp2_on_cuda_edited_grads_match_torch), not forced on CPU ones"
            )
        import hybrid_opt.distributed.grad_edits as GE

        monkeypatch.setattr(GE, "on_device", lambda grad: True)
    return request.param


@pytest.mark.parametrize("edit", ["clip", "foreach_mul", "neg", "unscale"])
def test_edited_dtensor_grads_speculative_equals_sequential_bitwise(one_rank, fingerprint_path, edit):
    """The bitwise promise holds with edits no version counter sees: speculative=True gives
    the bits of speculative=False (which never speculates), within fp32 rounding of
    torch.optim.AdamW(foreach=False), and speculated steps were redone."""
    spec, outcomes = _train(one_rank, _hybrid(), edit)
    seq, _ = _train(one_rank, _hybrid(speculative=False), edit)
    ref, _ = _train(
        one_rank, lambda m: torch.optim.AdamW(m.parameters(), lr=C.LR, weight_decay=0.01, foreach=False), edit
    )
    for k, (a, b, r) in enumerate(zip(spec, seq, ref)):
        assert torch.equal(a, b), f"{edit}: param {k} differs from speculative=False"
        assert C.rel_err(a, r) <= RTOL[torch.float32], f"{edit}: param {k} vs torch"
    assert sum(o["redone"] for o in outcomes) > 0, outcomes
    if edit == "neg":  # the sum of squares is unchanged: the DTensor's version sees it, always
        assert all(o["committed"] == 0 for o in outcomes), outcomes


def test_unedited_dtensor_grads_commit(one_rank, fingerprint_path):
    """No edit: every speculated step commits (the fingerprint is bitwise reproducible, no
    false redo), and the bits are speculative=False's."""
    spec, outcomes = _train(one_rank, _hybrid(), None)
    seq, _ = _train(one_rank, _hybrid(speculative=False), None)
    assert all(torch.equal(a, b) for a, b in zip(spec, seq))
    for o in outcomes:
        assert o["redone"] == 0 and o["committed"] > 0, outcomes


@pytest.mark.parametrize("remote", ["1", "0"])
def test_piece_sums_are_the_workers_bitwise_and_see_a_foreach_edit(one_rank, monkeypatch, remote):
    """A DTensor param whose subgroup is stepped in several pieces (staging slots of 1024
    elements; remote gather by the worker, or staged by the trainer): the live grads' piece
    sums equal the worker's bitwise; after torch._foreach_mul_ on the DTensor grad — which
    moves neither version counter — they differ, and step() redoes the subgroup."""
    import hybrid_opt.tiers.arena_plan as arena_plan
    from hybrid_opt import HybridAdamW
    from hybrid_opt.distributed.grad_edits import live_piece_sums
    from hybrid_opt.speculation import gatherer_of

    monkeypatch.setattr(arena_plan, "DEFAULT_SLOT_NUMEL", 1024)  # the slots sized there (arena_plan.py)
    monkeypatch.setenv("HYBRID_OPT_REMOTE_GATHER", remote)
    torch.manual_seed(0)
    model = _fsdp2(one_rank, torch.nn.Sequential(torch.nn.Linear(40, 70)))
    opt = HybridAdamW(
        model.parameters(), lr=C.LR, offload_fraction=1.0, subgroup_numel=4096, worker_share=0.5
    )
    try:
        w = model[0].weight
        model(torch.randn(5, 40)).square().mean().backward()
        sg = next(s for s in debug_view(opt).subgroups if any(sl.param is w for sl in s.slices))
        pieces = debug_view(opt).host.stepping.piece_stats(sg.index)
        assert pieces is not None and len(pieces) == 3  # 2800 elements: 1024 + 1024 + 752
        live = live_piece_sums(gatherer_of(sg), pieces, debug_view(opt).host.grad_dtype)
        assert live == [s for _, _, s in pieces]
        versions = (w.grad._version, w.grad._local_tensor._version)
        torch._foreach_mul_([w.grad], 0.5)
        # the torch behaviour this guards against: no version counter moved
        assert (w.grad._version, w.grad._local_tensor._version) == versions
        edited = live_piece_sums(gatherer_of(sg), pieces, debug_view(opt).host.grad_dtype)
        assert all(a != b for a, (_, _, b) in zip(edited, pieces))
        opt.step()
        assert debug_view(opt).outcomes[sg.index] == "redone"
    finally:
        opt.close()


def test_live_piece_sums_gathers_pieces_it_cannot_read_in_place():
    """A piece spanning two grads, or a grad of another dtype than the staging slots, is
    summed from the bytes staging would write (a gather into a buffer of the slot dtype)."""
    import cpu_kernels
    from hybrid_opt.distributed.grad_edits import live_piece_sums
    from hybrid_opt.speculation import gatherer_of
    from hybrid_opt.state.layout import ParamSlice, Subgroup

    a = torch.nn.Parameter(torch.zeros(300))
    b = torch.nn.Parameter(torch.zeros(200, dtype=torch.bfloat16))
    a.grad = torch.randn(300)
    b.grad = torch.randn(200).to(torch.bfloat16)
    sg = Subgroup(
        0,
        0,
        500,
        torch.float32,
        torch.device("cpu"),
        [ParamSlice(0, a, 0, 0, 300), ParamSlice(1, b, 0, 300, 200)],
    )
    pieces = [(0, 256, None), (256, 128, None), (384, 116, None)]
    got = live_piece_sums(gatherer_of(sg), pieces, torch.float32)
    staged = torch.cat([a.grad, b.grad.float()])
    assert got == [cpu_kernels.grad_stats(staged[o : o + n].contiguous())[0] for o, n, _ in pieces]
