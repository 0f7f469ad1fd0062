"""HybridAdamW on CUDA: the default configuration and what surrounds it, each beside
torch.optim.AdamW(foreach=False) stepping a copy of the same CUDA model.

Every test here is marked `gpu` (skipped without CUDA; tests/conftest.py). torch's model
gets our grads (cast to fp32, cloned) instead of running its own backward, so what is
compared is the optimizer alone: our params against torch's within fp32 rounding
(tests/tolerances.py); a bf16/fp16 model's fp32 master (state_dict()'s `master_param`) within
the fp32 tolerance and its params within their dtype's. What is promised bitwise (a step
skipped on overflow changes nothing) is asserted with torch.equal.

Not here (written beside): state_dict round trips on CUDA (test_gpu_checkpoint.py), a
pinning failure and the staging streams (test_gpu_staging.py), device memory
(test_gpu_memory.py).

Each test runs under the time limit tests/conftest.py sets for every `gpu` test. The models
are small: each test takes seconds on an H200.
"""

import copy

import pytest
import torch
from tolerances import ATOL, RTOL, assert_close
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view

pytestmark = pytest.mark.gpu

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
SUBGROUP = 1 << 16  # the small MLP's 427k elements: 7 subgroups
# synthetic rates in calibrate.rates()'s shape: "auto" plans without measuring this machine
RATES = dict(
    host_adam_gelems_per_s=1.0,
    device_adam_gbps=1000.0,
    device_adam_gbps_with_worker=900.0,
    h2d_gbps=20.0,
    d2h_gbps=20.0,
    trainer_slowdown_with_worker=1.05,
    backward_slowdown_with_host_adam=1.05,
)


# ============================================================================= helpers
def mlp(dtype=FP32, device="cuda", seed=0, width=512):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 64)
    )
    return model.to(device=device, dtype=dtype)


def batch(i, dtype=FP32, device="cuda", rows=32):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(rows, 256, generator=g), torch.randn(rows, 64, generator=g)
    return x.to(device=device, dtype=dtype), y.to(device)


def reference(model, **kw):
    """torch's AdamW on an fp32 copy of the same (possibly bf16/fp16) CUDA params."""
    ref_model = copy.deepcopy(model).float()
    return ref_model, torch.optim.AdamW(ref_model.parameters(), foreach=False, **kw)


def backward(model, i, scaler=None):
    x, y = batch(i, next(model.parameters()).dtype, next(model.parameters()).device)
    loss = nn.functional.mse_loss(model(x).float(), y)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def share_grads(model, ref_model):
    for p, q in zip(model.parameters(), ref_model.parameters()):
        q.grad = None if p.grad is None else p.grad.detach().float().clone()


def lockstep(model, opt, ref_model, ref, steps, *, start=0, clip=None, on_step=None):
    """Plain training loops side by side; torch clips with clip_grad_norm_ (ours through
    max_grad_norm). Returns torch's pre-clip norms."""
    norms = []
    for i in range(start, start + steps):
        opt.zero_grad()
        ref.zero_grad()
        backward(model, i)
        share_grads(model, ref_model)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)))
        ref.step()
        opt.step()
        if on_step is not None:
            on_step(i)
    return norms


def cpu(t):
    return t.detach().cpu()


def assert_matches_torch(model, opt, ref_model, dtype=FP32, msg=""):
    """Params within the model dtype's tolerance; for a bf16/fp16 model also our fp32 master
    within fp32's, and the param is its master rounded as torch casts."""
    sd = opt.state_dict() if dtype != FP32 else None
    for i, ((name, a), b) in enumerate(zip(model.named_parameters(), ref_model.parameters())):
        assert a.is_cuda
        assert_close(cpu(a).float(), cpu(b).to(dtype).float(), dtype=dtype, msg=f"{msg} {name}")
        if sd is not None:
            master = cpu(sd["state"][i]["master_param"])
            assert master.dtype == FP32
            assert_close(master, cpu(b), dtype=FP32, msg=f"{msg} master of {name}")
            assert torch.equal(master.to(dtype), cpu(a)), f"{msg} {name} is not its master rounded"


def moved(model, seed=0):
    """Guards against a comparison that passes because nothing trained."""
    init = mlp(next(model.parameters()).dtype, next(model.parameters()).device, seed)
    return any(not torch.equal(a, b) for a, b in zip(model.parameters(), init.parameters()))


def speculation_counts(opt):
    s = opt.stats["speculation"]
    assert s is not None, "no host-tier step was recorded"
    return s


# ============================================================================= the default
def test_default_configuration_speculates_from_a_pinned_arena_and_commits():
    """HybridAdamW(params) with every default (offload 1.0, speculative, exact rollback, 4Mi
    subgroups) on a 16.8M-element CUDA model: the host arena — banks and staging slots — is
    page-locked, grads are staged and stepped during backward, and validation commits them
    (none redone: no clipping, no scaler); the trajectory is torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    ref_model, ref = reference(model)
    init = [p.detach().clone() for p in model.parameters()]
    with HybridAdamW(model.parameters()) as opt:
        n_host = opt.plan.summary()["host"]["subgroups"]
        assert opt.plan.summary()["host"]["share"] == 1.0 and n_host >= 4, opt.plan
        assert opt.worker_pid is not None
        arena = debug_view(opt).host.arena
        assert arena.tensor(0, 1, torch.uint8).is_pinned(), "the host arena is not page-locked"
        assert debug_view(opt).host.staging_bytes > 0 and all(
            s.is_pinned() for s in debug_view(opt).host.io.slots
        )
        committed = 0
        for i in range(8):
            opt.zero_grad()
            ref.zero_grad()
            x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(i)).cuda()
            model(x).square().mean().backward()
            share_grads(model, ref_model)
            ref.step()
            opt.step()
            s = speculation_counts(opt)
            assert s["redone"] == 0 and s["dropped"] == 0, (i, s)
            assert s["committed"] + s["stepped"] == n_host, (i, s)
            committed += s["committed"]
        assert committed > 0, "no speculated step was ever committed"
        assert opt.stats["tiers"]["host"]["worker_s"] > 0
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
            assert_close(cpu(a), cpu(b), msg=name)
        assert opt.step_was_skipped is False
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), init)), "nothing trained"


@pytest.mark.parametrize("offload", [0.0, 0.5, 1.0])
def test_placements_match_torch(offload):
    model = mlp()
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    with HybridAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=offload, subgroup_numel=SUBGROUP
    ) as opt:
        assert opt.plan.summary()["device"]["share"] == pytest.approx(1.0 - offload, abs=0.2)
        lockstep(model, opt, ref_model, ref, 8)
        assert_matches_torch(model, opt, ref_model, msg=f"offload {offload}")
    assert moved(model)


def test_nvme_placement_matches_torch(tmp_path):
    """offload 0.5 with nvme 0.25: device, host and nvme tiers in one step."""
    model = mlp()
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        offload_fraction=0.5,
        nvme_fraction=0.25,
        nvme_path=str(tmp_path),
        subgroup_numel=SUBGROUP,
    ) as opt:
        shares = opt.plan.summary()
        assert (
            shares["device"]["subgroups"] and shares["host"]["subgroups"] and shares["nvme"]["subgroups"]
        ), opt.plan
        lockstep(model, opt, ref_model, ref, 8)
        nvme = opt.stats["tiers"]["nvme"]
        assert nvme["committed"] + nvme["redone"] + nvme["stepped"] == shares["nvme"]["subgroups"], nvme
        assert_matches_torch(model, opt, ref_model, msg="nvme")
    assert moved(model)


@pytest.mark.parametrize("offload", [0.5, 1.0])
def test_bf16_model_matches_torch_on_an_fp32_master(offload):
    model = mlp(BF16)
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    with HybridAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=offload, subgroup_numel=SUBGROUP
    ) as opt:
        lockstep(model, opt, ref_model, ref, 8)
        assert all(p.dtype == BF16 for p in model.parameters())
        assert_matches_torch(model, opt, ref_model, BF16, msg=f"bf16 offload {offload}")
    assert moved(model)


# ============================================================================= GradScaler
INF_STEP = 3


@pytest.mark.parametrize("offload", [0.5, 1.0])
def test_fp16_grad_scaler_skips_an_overflow_step_like_torch(offload):
    """An inf in one grad on one step: GradScaler("cuda") finds it, our step is skipped (params
    and state bitwise unchanged, step_was_skipped), the scale backs off exactly as torch's."""
    model = mlp(FP16)
    ref_model, ref = reference(model, lr=1e-3, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=2)
    scales, skipped = [], []
    with HybridAdamW(
        model.parameters(), lr=1e-3, weight_decay=0.1, offload_fraction=offload, subgroup_numel=SUBGROUP
    ) as opt:
        opt.attach_grad_scaler(scaler)
        for i in range(8):
            opt.zero_grad()
            ref.zero_grad()
            backward(model, i, scaler)
            if i == INF_STEP:
                # the first layer's weight: ready last in backward, so on the device tier at 0.5
                model[0].weight.grad.view(-1)[7] = float("inf")
                before_params = [p.detach().clone() for p in model.parameters()]
                # cloned: device-tier state tensors are views of the live state, as torch's are
                before_state = {
                    k: {key: cpu(torch.as_tensor(v)).clone() for key, v in st.items()}
                    for k, st in opt.state_dict()["state"].items()
                }
            share_grads(model, ref_model)  # scaled by `scaler`, whose scale ref_scaler tracks
            ref_scaler.scale(torch.ones((), device="cuda"))  # (its scale is made on first use)
            scaler.step(opt)
            scaler.update()
            ref_scaler.step(ref)
            ref_scaler.update()
            skipped.append(opt.step_was_skipped)
            scales.append((scaler.get_scale(), ref_scaler.get_scale()))
            if i == INF_STEP:
                assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters()))
                after = opt.state_dict()
                for k, st in before_state.items():
                    for key, v in st.items():
                        assert torch.equal(v, cpu(torch.as_tensor(after["state"][k][key]))), (k, key)
        assert skipped == [i == INF_STEP for i in range(8)]
        assert all(a == b for a, b in scales), scales
        assert scales[INF_STEP][0] < scales[INF_STEP - 1][0], "the scale did not back off"
        assert_matches_torch(model, opt, ref_model, FP16, msg=f"fp16 offload {offload}")
    assert moved(model)


# ============================================================================= clipping
@pytest.mark.parametrize("offload", [0.0, 0.5, 1.0])
def test_max_grad_norm_is_clip_grad_norm(offload):
    """last_grad_norm is torch.nn.utils.clip_grad_norm_'s total norm within fp32 rounding, the
    clip bites, and the clipped trajectory is torch's."""
    max_norm = 0.05
    model = mlp()
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    ours_norms, coefs = [], []
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        offload_fraction=offload,
        max_grad_norm=max_norm,
        subgroup_numel=SUBGROUP,
    ) as opt:

        def record(_):
            ours_norms.append(opt.last_grad_norm)
            coefs.append(opt.stats["clip_coef"])

        ref_norms = lockstep(model, opt, ref_model, ref, 6, clip=max_norm, on_step=record)
        assert min(coefs) < 1.0, "clipping never bit: the test proves nothing"
        torch.testing.assert_close(
            torch.tensor(ours_norms, dtype=torch.float64),
            torch.tensor(ref_norms, dtype=torch.float64),
            rtol=RTOL[FP32],
            atol=ATOL[FP32],
        )
        assert_matches_torch(model, opt, ref_model, msg=f"clip offload {offload}")


# ============================================================================= moves
def test_replan_mid_training_keeps_matching_torch(tmp_path):
    """host -> mixed -> device -> host+nvme between steps; torch's trajectory throughout."""
    model = mlp()
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        offload_fraction=1.0,
        nvme_path=str(tmp_path),
        subgroup_numel=SUBGROUP,
    ) as opt:
        step = 0
        for off, nv in ((0.5, 0.0), (0.0, 0.0), (1.0, 0.5)):
            lockstep(model, opt, ref_model, ref, 3, start=step)
            step += 3
            assert_matches_torch(model, opt, ref_model, msg=f"before replan({off}, {nv})")
            opt.replan(off, nv)
            shares = opt.plan.summary()
            assert shares["device"]["share"] == pytest.approx(1.0 - off, abs=0.2), opt.plan
            assert (shares["nvme"]["subgroups"] > 0) == (nv > 0), opt.plan
        lockstep(model, opt, ref_model, ref, 3, start=step)
        assert_matches_torch(model, opt, ref_model, msg="after the last replan")
    assert moved(model)


def test_automatic_refit_moves_and_keeps_matching_torch(monkeypatch):
    """offload_fraction="auto" with refit_every=2: the scheduler's own refit runs on the
    measured CUDA times; where it keeps the plan the test makes it move anyway (to the other
    end of the range), so a move on CUDA happens mid-training in either case."""
    from hybrid_opt.placement.scheduler import Decision

    model = mlp()
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        offload_fraction="auto",
        refit_every=2,
        calibration=dict(RATES),
        subgroup_numel=SUBGROUP,
    ) as opt:
        real_refit = debug_view(opt).planner.refit
        decisions = []

        def refit(off, nv, *rest):
            d = real_refit(off, nv, *rest)
            decisions.append(d)
            if d is None and not any(isinstance(x, Decision) and x.reason == "test" for x in decisions):
                target = 1.0 if off < 0.5 else 0.0
                d = Decision(target, 0.0, debug_view(opt).planner.predict(target, 0.0), "test")
                decisions.append(d)
            return d

        monkeypatch.setattr(debug_view(opt).planner, "refit", refit)
        lockstep(model, opt, ref_model, ref, 12)
        assert decisions, "no refit was due in 12 steps with refit_every=2"
        assert debug_view(opt).planner.moves >= 1, (decisions, opt.plan)
        assert "predicted" in opt.stats
        assert_matches_torch(model, opt, ref_model, msg="after refits")
    assert moved(model)


def test_host_params_reach_the_model_with_one_sync_a_step(tmp_path, monkeypatch):
    """The copies of committed params into the model: from a resident subgroup's bank queued
    without a wait (the bank keeps its bytes until step() returns), from an nvme subgroup's bank
    waited for at once (a later step may take that bank back); every copy has landed when
    step() returns, and the trajectory is torch's."""
    from hybrid_opt.state.layout import Subgroup

    calls = []
    real = Subgroup.write

    def spy(self, src, a=0, b=None, slices=None, non_blocking=False):
        calls.append((self.index, non_blocking))
        return real(self, src, a, b, slices=slices, non_blocking=non_blocking)

    monkeypatch.setattr(Subgroup, "write", spy)
    model = mlp()
    ref_model, ref = reference(model, lr=1e-3)
    opt = HybridAdamW(
        model.parameters(),
        lr=1e-3,
        offload_fraction=1.0,
        nvme_fraction=0.5,
        nvme_path=str(tmp_path),
        subgroup_numel=SUBGROUP,
        speculative=False,
    )
    with opt:
        view = debug_view(opt)
        nvme = {sg for sg in view.host_subgroups() if view.on_nvme(sg)}
        assert nvme and set(view.host_subgroups()) - nvme
        for i in range(3):
            del calls[:]
            lockstep(model, opt, ref_model, ref, 1, start=i)
            assert torch.cuda.current_stream().query(), "a copy into the model was still in flight"
            assert calls and all(lazy == (sg not in nvme) for sg, lazy in calls), calls
        assert_matches_torch(model, opt, ref_model)


# ============================================================================= two GPUs
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("offload", [0.5, 1.0])
def test_params_on_a_non_current_device(offload):
    """The model on cuda:1 while cuda:0 is current: every tier works on cuda:1 (its streams,
    its pinned copies) and nothing of ours is allocated on cuda:0."""
    torch.cuda.set_device(0)
    model = mlp(device="cuda:1")
    ref_model, ref = reference(model, lr=1e-2, weight_decay=0.1)
    torch.cuda.synchronize(0)
    on_0 = torch.cuda.memory_allocated(0)
    with HybridAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=offload, subgroup_numel=SUBGROUP
    ) as opt:
        lockstep(model, opt, ref_model, ref, 6)
        assert torch.cuda.current_device() == 0
        assert all(p.device == torch.device("cuda:1") for p in model.parameters())
        # pinned in cuda:1's context (cudaHostRegister would make a context on cuda:0)
        assert debug_view(opt).host.arena.pinned and debug_view(opt).host.arena._pin_device == torch.device(
            "cuda:1"
        )
        if offload < 1.0:
            assert opt.plan.summary()["device"]["subgroups"] > 0
        assert_matches_torch(model, opt, ref_model, msg=f"cuda:1 offload {offload}")
        torch.cuda.synchronize(0)
        assert torch.cuda.memory_allocated(0) == on_0, (
            "the optimizer allocated on the current device, not the params'"
        )
    assert moved(model)
