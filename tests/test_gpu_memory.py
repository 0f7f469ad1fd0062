"""Device memory on CUDA: what building, calibrating and moving the tiers take, and "auto"
planning the device tier beside the activations.

Every test is marked `gpu` (skipped without CUDA; tests/conftest.py); the CPU side of the
same logic, with injected memory figures, is tests/test_memory.py. Figures come from torch's
allocator (memory_allocated / max_memory_allocated after reset_peak_memory_stats), so they
count this process's tensors only. Each test runs under the time limit tests/conftest.py
sets for every `gpu` test.
"""

import pytest
import torch
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view

# whole_gpu: these measure and fill the GPU's memory; gpu_check.sh runs them one at a time
pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu]

MiB, GiB = 1 << 20, 1 << 30
# "auto" plans from these instead of measuring: a GPU Adam far faster than the host's, so any
# state that fits goes to the device
RATES = dict(
    host_adam_gelems_per_s=1.0,
    device_adam_gbps=3000.0,
    h2d_gbps=20.0,
    d2h_gbps=20.0,
    trainer_slowdown_with_worker=1.0,
    backward_slowdown_with_host_adam=1.0,
)


@pytest.fixture(autouse=True)
def _release_cached_blocks():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _peak_since(fn):
    """(result of fn(), bytes allocated at fn's peak above what was allocated before it)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def test_construction_copies_no_parameter():
    """512 MiB of parameters, state on the host: building the optimizer allocates nothing of
    the model's size on the GPU (the params keep their own memory; no flat buffer)."""
    params = [nn.Parameter(torch.randn(16 * MiB, device="cuda")) for _ in range(8)]  # 64 MiB each
    ptrs = [p.data_ptr() for p in params]
    opt, extra = _peak_since(lambda: HybridAdamW(params, offload_fraction=1.0, speculative=False))
    try:
        assert extra <= 16 * MiB, f"construction took {extra / MiB:.0f} MiB of GPU memory"
        assert [p.data_ptr() for p in params] == ptrs
    finally:
        opt.close()


def test_the_default_device_budget_counts_torchs_cached_blocks():
    from hybrid_opt.placement import scheduler

    block = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    del block  # back in torch's cache: reserved, not allocated, not free to the driver
    m = scheduler.cuda_memory(torch.device("cuda"))
    assert m["reserved"] - m["allocated"] >= GiB
    avail = scheduler.available_device_bytes(m["free"], m["reserved"], m["allocated"])
    assert avail >= m["free"] + GiB
    device_budget, _ = scheduler.default_budgets([], torch.device("cuda"), None, GiB)
    assert device_budget >= (m["free"] + GiB) * (1 - scheduler.HEADROOM) * 0.999


def test_calibration_stays_within_the_memory_it_is_allowed():
    from hybrid_opt.placement import calibrate

    allowed = 64 * MiB
    rates, extra = _peak_since(lambda: calibrate._cuda_rates(torch.device("cuda"), allowed))
    assert rates["device_adam_gbps"] > 0 and rates["device_measure_numel"] == allowed // 16
    assert extra <= allowed + MiB, f"calibration took {extra / MiB:.0f} MiB, allowed {allowed / MiB:.0f}"


def _mlp(width=2048, depth=4, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)]).to("cuda", dtype)


def _train(model, opt, steps, batch=64):
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(batch, model[0].in_features, device="cuda", dtype=model[0].weight.dtype)
        model(x).float().square().mean().backward()
        opt.step()


def test_a_move_off_the_device_copies_state_to_the_host_not_on_the_device():
    """All state on the device, then replan(1.0): the state leaves through host memory — the
    device holds nothing extra while it moves (a clone on the device would add all of it)."""
    model = _mlp()
    n = sum(p.numel() for p in model.parameters())
    with HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=0.0, subgroup_numel=1 << 20) as opt:
        _train(model, opt, 2)
        _, extra = _peak_since(lambda: opt.replan(1.0))
        assert opt.plan.summary()["host"]["share"] == 1.0
        assert extra <= 16 * MiB, (
            f"the move took {extra / MiB:.0f} MiB of device memory (state: {8 * n / MiB:.0f} MiB)"
        )
        _, extra = _peak_since(lambda: opt.replan(0.0))  # back: exactly the moments arrive
        assert extra <= 8 * n + 16 * MiB
        _train(model, opt, 2)


def test_a_device_out_of_memory_during_a_move_leaves_the_optimizer_as_it_was(monkeypatch):
    """The room check bypassed and the device filled: the move's allocation runs out of device
    memory for real. The error is raised, what it allocated is freed, and the optimizer goes on
    with the plan, worker and state it had."""
    model = _mlp()
    with HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=1.0, subgroup_numel=1 << 20) as opt:
        _train(model, opt, 2)
        before = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
        worker, tiers = opt.worker_pid, list(opt.plan.tiers)
        monkeypatch.setattr(debug_view(opt).placement, "room_shortfall", lambda plan: None)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(max(0, free - 64 * MiB), dtype=torch.uint8, device="cuda")
        try:
            allocated = torch.cuda.memory_allocated()
            with pytest.raises(torch.OutOfMemoryError):
                opt.replan(0.0)
            assert torch.cuda.memory_allocated() == allocated, "the failed move's allocations were kept"
        finally:
            del filler
        monkeypatch.undo()
        assert opt.worker_pid == worker and opt.plan.tiers == tiers
        now = opt.state_dict()["state"]
        for i, st in before.items():
            for k, v in st.items():
                assert torch.equal(now[i][k].cpu(), v.cpu()), (i, k)
        _train(model, opt, 2)


def test_auto_trains_a_model_whose_activations_need_more_than_the_headroom_at_construction():
    """Free device memory at construction: the iteration's transient (activations, grads) plus
    half the optimizer state. Budgeted from that free memory, "auto" would put every state on
    the device (it fits, and the GPU's Adam is far faster) and the first forward would run out
    of memory. Budgeted from the measured peak, it starts with the state on the host and a refit
    moves to the device only what fits beside the activations: training runs without OOM."""
    from hybrid_opt.placement import scheduler

    width, depth, batch = 4096, 8, 16384
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=False), nn.ReLU()]
    torch.manual_seed(0)
    model = nn.Sequential(*layers).to("cuda", torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        model(x).float().square().mean().backward()

    _, transient = _peak_since(fwd_bwd)  # activations, grads, temporaries
    model.zero_grad(set_to_none=True)
    state = 12 * n  # bf16 params: fp32 master and two moments on the device tier
    torch.cuda.empty_cache()
    m = scheduler.cuda_memory(torch.device("cuda"))
    avail = scheduler.available_device_bytes(m["free"], m["reserved"], m["allocated"])
    headroom = transient + state // 2
    filler = torch.empty(int(avail - headroom), dtype=torch.uint8, device="cuda")
    try:
        # the scenario: the construction-time budget holds every state on the device...
        budget_then, _ = scheduler.default_budgets(
            list(model.parameters()), torch.device("cuda"), None, 64 * GiB
        )
        assert budget_then >= 4 * n + state, (
            "the test's premise: construction-time auto would put all state on the device"
        )
        # ...where it would not leave the iteration its transient (headroom = transient + state / 2)
        # two spare banks: a small pinned arena (this test is about device memory)
        with HybridAdamW(
            model.parameters(),
            lr=1e-4,
            offload_fraction="auto",
            refit_every=3,
            calibration=dict(RATES),
            subgroup_numel=1 << 22,
            spare_banks=2,
        ) as opt:
            assert opt.plan.summary()["host"]["share"] == 1.0, opt.plan
            assert debug_view(opt).planner.device_peak_pending
            for _ in range(7):
                opt.zero_grad(set_to_none=True)
                fwd_bwd()
                opt.step()
            assert not debug_view(opt).planner.device_peak_pending
            device_now = debug_view(opt).placement.modelled_bytes(
                *debug_view(opt).fractions, opt.plan.spare_banks
            )["device"]
            assert device_now <= debug_view(opt).planner.device_budget
            print(
                f"\nheadroom {headroom / GiB:.2f} GiB, transient {transient / GiB:.2f} GiB, state "
                f"{state / GiB:.2f} GiB; measured budget {debug_view(opt).planner.device_budget / GiB:.2f} GiB; "
                f"plan {opt.plan}"
            )
    finally:
        del filler
