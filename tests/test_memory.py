"""Memory the optimizer takes while it builds and moves its tiers: params that keep their own
memory in packed subgroups, the device budget (torch's caching allocator, the activations of "auto"), calibration sized by
the budget, and moves that check room first and lose nothing when they fail."""

import pytest
import torch
from test_optimizer import assert_state_close, make_batches, make_net, train
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.state import layout as L
from hybrid_opt.testing import debug_view


# ============================================================================= the layout
def _storages(params) -> list:
    return [p.untyped_storage().data_ptr() for p in params]


@pytest.mark.parametrize(
    "kw",
    [
        dict(offload_fraction=0.0),
        dict(offload_fraction=1.0),
        dict(offload_fraction=1.0, nvme_fraction=0.5),
        dict(offload_fraction=0.5, dtype=torch.bfloat16, store_param_remainders=True),
    ],
    ids=["device", "host", "nvme", "bf16-remainders"],
)
def test_the_optimizer_introduces_no_sharing(tmp_path, kw):
    """Params with storages of their own keep them: construction copies no param into a
    buffer of the optimizer's (a checkpointer's tied-weight detection, accelerate's
    save_state, would see them as shared), and training, state_dict and close leave every
    param in the memory it had."""
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = str(tmp_path)
    model = make_net(dtype)
    params = list(model.parameters())
    before = _storages(params)
    assert len(set(before)) == len(params)
    opt = HybridAdamW(params, lr=1e-2, subgroup_numel=64, **kw)
    try:
        assert any(len(s.slices) > 1 for s in debug_view(opt).subgroups)  # packed: params share subgroups
        assert _storages(params) == before
        train(model, opt, make_batches(3))
        opt.state_dict()
        assert _storages(params) == before
    finally:
        opt.close()
    assert _storages(params) == before


def test_subgroups_pack_each_bucket_with_one_short_subgroup_at_most():
    """A group's params of one (device, dtype) are cut over their concatenation: every
    subgroup but the bucket's last is full, slices tile each param once, and a small param
    shares a subgroup with its neighbours."""
    numels = [5, 300, 7, 7, 130, 1]
    params = [torch.zeros(n) for n in numels] + [torch.zeros(40, dtype=torch.bfloat16)]
    sgs = L.layout_group(params, 0, 10, subgroup_numel=64, first_subgroup=3)
    fp32 = [s for s in sgs if s.dtype == torch.float32]
    assert [s.numel for s in fp32] == [64] * 7 + [sum(numels) - 7 * 64]
    assert [s.numel for s in sgs if s.dtype == torch.bfloat16] == [40]
    assert [s.index for s in sgs] == list(range(3, 3 + len(sgs)))
    covered = {}
    for s in sgs:
        assert sum(sl.numel for sl in s.slices) == s.numel
        for sl in s.slices:
            assert (
                sl.view.untyped_storage().data_ptr()
                == params[sl.param_index - 10].untyped_storage().data_ptr()
            )
            covered.setdefault(sl.param_index, []).append((sl.param_offset, sl.numel))
    for k, p in enumerate(params):
        runs = sorted(covered[10 + k])
        assert runs[0][0] == 0 and sum(n for _, n in runs) == p.numel()
        assert all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:]))


@pytest.mark.parametrize("a, b", [(0, None), (3, 64), (0, 40), (9, 50)])
@pytest.mark.parametrize("skip", [(), (1,), (0, 2)])
def test_subgroup_write_puts_each_element_where_it_lives(a, b, skip):
    """Subgroup.write over a whole subgroup or a range cutting its slices, for all its slices or
    some (params without a grad left out, gaps in the source): each written element is the
    source's at its offset, every other element keeps its value (the source's views are made
    by one split over the pieces and the gaps between them)."""
    numels = [5, 30, 7, 7, 20]
    params = [torch.full((n,), -1.0) for n in numels]
    sg = L.layout_group(params, 0, 0, subgroup_numel=64, first_subgroup=0)[0]
    assert len(sg.slices) == 5
    end = sg.numel if b is None else b
    slices = [sl for k, sl in enumerate(sg.slices) if k not in skip] if skip else None
    for base in (1000.0, 2000.0):  # again: a whole write takes the cuts it made the first time
        src = torch.arange(end - a, dtype=torch.float32) + base
        sg.write(src, a, b, slices=slices)
        flat = torch.cat(params)
        for e in range(sg.numel):
            sl = next(sl for sl in sg.slices if sl.sub_offset <= e < sl.sub_offset + sl.numel)
            written = a <= e < end and sg.slices.index(sl) not in skip
            assert flat[e].item() == (base + e - a if written else -1.0), (base, e)


def test_a_whole_write_follows_a_slice_to_new_memory():
    """A subgroup written whole keeps its cuts, and cuts anew once a slice views new memory
    (storage.py repoints it when the user gives the param new memory)."""
    params = [torch.zeros(5), torch.zeros(3)]
    (sg,) = L.layout_group(params, 0, 0, subgroup_numel=64, first_subgroup=0)
    sg.write(torch.ones(8))
    params[1].data = torch.zeros(3)  # new memory
    sg.repoint(sg.slices[1])
    sg.write(torch.full((8,), 2.0))
    assert torch.equal(params[0], torch.full((5,), 2.0)) and torch.equal(params[1], torch.full((3,), 2.0))


def test_subgroups_of_a_bucket_are_one_size():
    """As few subgroups as subgroup_numel allows, of one (aligned) size: 1000 elements at 300
    make 4 of 256 (the last 232), not 300, 300, 300, 100 — banks and files sized for the
    largest hold elements, not padding."""
    sgs = L.layout_group([torch.zeros(1000)], 0, 0, subgroup_numel=300, first_subgroup=0)
    assert [s.numel for s in sgs] == [256, 256, 256, 232]


@pytest.mark.parametrize(
    "numel, count", [(706, 1), (1 << 16, 1), (467_856, 8), (23_000_000, 8), (200_000_000, 48)]
)
def test_automatic_subgroup_numel_keeps_eight_subgroups_where_it_can(numel, count):
    """subgroup_numel=None: 8 subgroups on this rank (speculation overlaps backward subgroup by
    subgroup), none below 64Ki elements, none above 4Mi."""
    from hybrid_opt.placement.cost_model import DEFAULT_SUBGROUP_NUMEL

    size = L.auto_subgroup_numel(numel, DEFAULT_SUBGROUP_NUMEL)
    assert len(L.layout_group([torch.empty(numel, device="meta")], 0, 0, size, 0)) == count


def test_the_default_subgroup_numel_is_resolved_for_this_rank():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 400))  # 467,856 elements
    with HybridAdamW(model.parameters(), offload_fraction=1.0) as opt:
        assert len(debug_view(opt).subgroups) == 8 and opt.subgroup_numel == 65_536


def test_subgroup_reads_and_writes_its_slices_in_place():
    a, b = torch.arange(5.0), torch.arange(10.0, 13.0)
    (sg,) = L.layout_group([a, b], 0, 0, subgroup_numel=64, first_subgroup=0)
    assert torch.equal(sg.read(), torch.tensor([0.0, 1, 2, 3, 4, 10, 11, 12]))
    assert sg.read(1, 3).data_ptr() == a[1:].data_ptr()  # one slice: a view
    sg.write(torch.full((4,), -1.0), 3, 7)
    assert torch.equal(a, torch.tensor([0.0, 1, 2, -1, -1])) and torch.equal(b, torch.tensor([-1.0, -1, 12]))
    dst = torch.empty(8, dtype=torch.bfloat16)
    sg.read_into(dst)
    assert torch.equal(dst.float(), sg.read())
    sg.write(torch.zeros(8), slices=sg.slices[1:])  # only b's slice
    assert torch.equal(a, torch.tensor([0.0, 1, 2, -1, -1])) and torch.equal(b, torch.zeros(3))


def test_a_non_contiguous_param_gets_contiguous_memory_of_its_own():
    """A slice is one 1-D range of a param's memory: a transposed (channels_last-like) param
    is given contiguous memory of its own, its values and shape kept, and trains as torch."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 4).t())  # stride (1, 4)
    ref = nn.Parameter(w.detach().clone())
    assert not w.is_contiguous()
    with HybridAdamW([w], lr=1e-2, offload_fraction=1.0) as opt:
        assert w.is_contiguous() and w.shape == (4, 6)
        assert torch.equal(w.detach(), ref.detach())
        torch_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
        for _ in range(3):
            g = torch.randn(4, 6)
            w.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            torch_opt.step()
        assert torch.allclose(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)


def test_any_subgroup_size_trains_bitwise_the_same():
    """Where subgroups end changes nothing: Adam is elementwise and the norm is per param."""
    batches = make_batches(6)
    results = []
    for numel in (64, 200, 333):
        model = make_net()
        with HybridAdamW(
            model.parameters(),
            lr=1e-2,
            weight_decay=0.1,
            offload_fraction=0.5,
            max_grad_norm=0.5,
            subgroup_numel=numel,
        ) as opt:
            train(model, opt, batches)
            results.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
    for params, sd in results[1:]:
        for x, y in zip(results[0][0], params):
            assert torch.equal(x, y)
        assert_state_close(sd, results[0][1], exact=True)


# ============================================================================= moves
SUBGROUP = 64


def _pair(dtype=torch.float32, offload=0.5, **kw):
    """(model, optimizer) to move, and a reference that never moves: every tier steps with the
    same CPU kernel, so the two stay bitwise equal whatever the moves."""
    ref_model, model = make_net(dtype), make_net(dtype)
    ref = HybridAdamW(
        ref_model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=offload, subgroup_numel=SUBGROUP
    )
    opt = HybridAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=offload, subgroup_numel=SUBGROUP, **kw
    )
    return ref_model, ref, model, opt


def _snapshot(opt):
    return {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}


def _assert_same(opt, snap):
    now = opt.state_dict()["state"]
    assert set(now) == set(snap)
    for i, st in snap.items():
        for k, v in st.items():
            assert torch.equal(now[i][k], v), (i, k)


def _fail_host_tier(monkeypatch):
    from hybrid_opt.placement import placement

    def boom(*a, **k):
        raise RuntimeError("injected: the worker process did not start")

    monkeypatch.setattr(placement, "HostTier", boom)


def _fail_host_load(monkeypatch):
    from hybrid_opt.tiers.host import HostTier

    real, calls = HostTier.load_state, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # mid-way through filling the new tier
            raise OSError("injected: the swap file could not be written")
        return real(self, *a, **k)

    monkeypatch.setattr(HostTier, "load_state", flaky)


def _fail_device_tier(monkeypatch):
    from hybrid_opt.placement import moves

    real = moves.DeviceTier

    def oom(sgs, *a, **k):
        if sgs:
            raise torch.OutOfMemoryError("injected: CUDA out of memory allocating the device tier")
        return real(sgs, *a, **k)

    monkeypatch.setattr(moves, "DeviceTier", oom)


def _fail_after_device_alloc(monkeypatch):
    """The device tier allocated, then the copy into it fails: what it allocated must go."""
    from hybrid_opt.placement import moves

    real = moves.DeviceTier

    def late(sgs, *a, **k):
        tier = real(sgs, *a, **k)
        if sgs:
            raise RuntimeError("injected: device-side copy failed")
        return tier

    monkeypatch.setattr(moves, "DeviceTier", late)


def _no_host_room(monkeypatch):
    from hybrid_opt.placement import scheduler

    monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: 0.0)


FAILURES = {
    "host_tier": (_fail_host_tier, RuntimeError),
    "host_load": (_fail_host_load, OSError),
    "device_tier": (_fail_device_tier, torch.OutOfMemoryError),
    "device_alloc_then_copy": (_fail_after_device_alloc, RuntimeError),
    "no_host_room": (_no_host_room, MemoryError),
}


@pytest.mark.parametrize("target", [0.25, 1.0], ids=["more_on_device", "all_on_host"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_move_that_fails_at_any_point_leaves_the_optimizer_as_it_was(monkeypatch, failure, target):
    """replan() from a mixed placement fails at each point of the move in turn (a worker that
    does not start, a host tier that fails mid-fill, the device out of memory before or after
    allocating, no host room): the error is raised, the plan, the worker and every state
    tensor are as before (torch.equal), and training goes on bitwise with the reference that
    never moved; the same move then succeeds and still changes no bit."""
    inject, error = FAILURES[failure]
    if target == 1.0 and failure.startswith("device"):
        pytest.skip("nothing arrives on the device in this move")
    batches = make_batches(9)
    ref_model, ref, model, opt = _pair(offload=0.5)
    view = debug_view(opt)
    with ref, opt:
        train(ref_model, ref, batches[:3])
        train(model, opt, batches[:3])
        snap, tiers, worker = _snapshot(opt), list(opt.plan.tiers), opt.worker_pid
        with monkeypatch.context() as m:
            inject(m)
            with pytest.raises(error, match="injected|does not fit|needs"):
                opt.replan(target)
        assert opt.plan.tiers == tiers and opt.worker_pid == worker
        assert view.host is not None and view.host.client is not None
        _assert_same(opt, snap)
        train(ref_model, ref, batches[3:6])
        train(model, opt, batches[3:6])
        opt.replan(target)
        assert view.fractions[0] == pytest.approx(target, abs=0.15) and opt.plan.tiers != tiers
        train(ref_model, ref, batches[6:])
        train(model, opt, batches[6:])
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
        assert_state_close(opt.state_dict(), ref.state_dict(), exact=True)


def _swapped(plan):
    """The plan with its device and host subgroups swapped: a move where some subgroups leave
    the device while others arrive (add_param_group's can)."""
    import dataclasses

    from hybrid_opt.placement.plan import DEVICE, HOST

    tiers = [HOST if t == DEVICE else DEVICE for t in plan.tiers]
    order = [i for i, t in enumerate(tiers) if t != DEVICE]
    return dataclasses.replace(plan, tiers=tiers, numels=list(plan.numels), speculation_order=order)


def _fake_cuda(monkeypatch, opt, free):
    """The CUDA paths of a move on CPU tensors, with `free` bytes available on the "device"."""
    from hybrid_opt.placement import scheduler

    monkeypatch.setattr(debug_view(opt).layout, "cuda", lambda: True)
    monkeypatch.setattr(
        scheduler,
        "cuda_memory",
        lambda device: {"free": float(free), "total": 1e12, "reserved": 0.0, "allocated": 0.0, "peak": 0.0},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fail", [False, True], ids=["succeeds", "arrivals_fail"])
def test_a_move_that_needs_the_leaving_memory_frees_it_first_and_puts_it_back_on_failure(
    monkeypatch, dtype, fail
):
    """Subgroups leave the device while others arrive, and the arriving fit only in what the
    leaving free: the leaving are let go first. If the arriving then fail to allocate, the
    leaving come back from their host copies: every state tensor as before, training bitwise."""
    from hybrid_opt.placement import moves

    batches = make_batches(8)
    ref_model, ref, model, opt = _pair(dtype, offload=0.5)
    view = debug_view(opt)
    with ref, opt:
        train(ref_model, ref, batches[:3])
        train(model, opt, batches[:3])
        snap, before = _snapshot(opt), opt.plan
        plan = _swapped(before)
        m = view.placement.move_memory(plan)
        assert m["leaving"] > 0 and m["arriving"] > 0
        _fake_cuda(monkeypatch, opt, free=m["arriving"] // 2)  # fits only with the leaving gone
        released = []
        real = moves.DeviceTier

        def device_tier(sgs, amsgrad, *state_format):
            if not released:  # the arrivals: the leaving were let go just before
                released.extend(i for i in view.device.subgroups if i not in view.device.state)
                if fail:
                    raise torch.OutOfMemoryError("injected: CUDA out of memory")
            return real(sgs, amsgrad, *state_format)

        monkeypatch.setattr(moves, "DeviceTier", device_tier)
        assert view.placement.room_shortfall(plan) is None
        if fail:
            with pytest.raises(torch.OutOfMemoryError):
                view.placement.relayout(plan)
            assert opt.plan is before
        else:
            view.placement.relayout(plan)
            assert opt.plan.tiers == plan.tiers
        assert sorted(released) == sorted(i for i, t in enumerate(before.tiers) if t == "device")
        monkeypatch.undo()
        _assert_same(opt, snap)
        train(ref_model, ref, batches[3:])
        train(model, opt, batches[3:])
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
        assert_state_close(opt.state_dict(), ref.state_dict(), exact=True)


def test_a_move_the_device_cannot_hold_is_refused_before_anything_changes(monkeypatch):
    """The device room check: the subgroups arriving on the device must fit in what is free
    there (torch's cached blocks included) plus what the leaving ones free."""
    ref_model, ref, model, opt = _pair(offload=1.0)
    view = debug_view(opt)
    with ref, opt:
        train(model, opt, make_batches(2))
        snap, worker = _snapshot(opt), opt.worker_pid
        plan = view.placement.plan_for(_fixed(0.0))
        need = view.placement.move_memory(plan)["arriving"]
        assert (
            need == sum(p.numel() for p in model.parameters()) * 8
        )  # fp32: m and v; the param is the master
        _fake_cuda(monkeypatch, opt, free=need - 1)
        with pytest.raises(MemoryError, match="need .* GB of device memory"):
            opt.replan(0.0)
        assert opt.worker_pid == worker and opt.plan.summary()["host"]["share"] == 1.0
        _assert_same(opt, snap)
        _fake_cuda(monkeypatch, opt, free=need)
        assert view.placement.room_to_move(_fixed(0.0))


def _fixed(off, nv=0.0):
    from hybrid_opt.placement.placement import Fixed

    return Fixed(off, nv)


def test_room_to_move_counts_the_state_copied_out_and_the_new_host_tier(monkeypatch):
    """Host memory a move needs: the state leaving the device (copied out, 12 B/element) and
    the new host tier beside the old — its arena exactly, as the OS reports it once made; on a
    CPU-only host also the device tier's arrivals."""
    from hybrid_opt.placement import scheduler

    ref_model, ref, model, opt = _pair(offload=0.0)
    view = debug_view(opt)
    with ref, opt:
        n = sum(p.numel() for p in model.parameters())
        to_host = view.placement.plan_for(_fixed(1.0))
        m = view.placement.move_memory(to_host)
        tier = m["host_need"] - 12 * n  # the new host tier's arena, counted before it exists
        assert m["arriving"] == 0
        # (the plan held fixed: its spare pool is sized from the free memory too)
        monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: m["host_need"] / 0.9 * 1.001)
        assert view.placement.room_shortfall(to_host) is None
        monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: m["host_need"] / 0.9 * 0.999)
        assert "needs" in view.placement.room_shortfall(to_host)
        monkeypatch.undo()
        opt.replan(1.0)
        assert opt.plan.spare_banks == to_host.spare_banks
        assert opt.allocated_bytes["host"] == tier  # what the OS reports of the arena it made
        back = view.placement.move_memory(view.placement.plan_for(_fixed(0.0)))
        assert back["host_need"] == 8 * n and back["leaving"] == 0  # the device tier is host memory here


# ============================================================================= device budget
GiB = 1 << 30


def test_available_device_memory_counts_torchs_cached_blocks():
    from hybrid_opt.placement.scheduler import available_device_bytes

    # the driver has 10 GiB free; torch reserved 8 GiB of which tensors use 5: 13 GiB can be had
    assert available_device_bytes(10 * GiB, 8 * GiB, 5 * GiB) == 13 * GiB
    assert available_device_bytes(10 * GiB, 5 * GiB, 5 * GiB) == 10 * GiB
    assert available_device_bytes(0, 0, 0) == 0


def test_default_device_budget_on_cuda_includes_the_cached_blocks(monkeypatch):
    from hybrid_opt.placement import scheduler

    params = [torch.zeros(1 << 20)]  # 4 MiB of params, no grads
    monkeypatch.setattr(
        scheduler,
        "cuda_memory",
        lambda device: {
            "free": 10.0 * GiB,
            "total": 80.0 * GiB,
            "reserved": 8.0 * GiB,
            "allocated": 5.0 * GiB,
            "peak": 6.0 * GiB,
        },
    )
    device, _ = scheduler.default_budgets(params, torch.device("cuda"), None, 1 << 30)
    assert device == pytest.approx((13 * GiB + 4 * (1 << 20)) * (1 - scheduler.HEADROOM))
    assert (
        scheduler.default_budgets(params, torch.device("cuda"), 123, 1 << 30)[0] == 123
    )  # explicit: as given


def test_measured_device_budget_leaves_the_iterations_peak_free():
    """After iterations with everything off the device: the driver has 20 GiB free, torch holds
    30 GiB (24 GiB allocated now), the peak was 28 GiB (activations) and the model copy and
    grads (4 GiB) are inside it. At the peak 20 + 30 - 28 = 22 GiB were still free; 10 % of
    what the placement could use (20 + 6 + 4 = 30 GiB) is kept: state may take 19 GiB."""
    from hybrid_opt.placement.scheduler import measured_device_budget

    budget = measured_device_budget(
        free=20 * GiB, reserved=30 * GiB, allocated=24 * GiB, peak=28 * GiB, counted=4 * GiB, floor=4 * GiB
    )
    assert budget == pytest.approx(4 * GiB + 22 * GiB - 3 * GiB)
    # a peak that left no room: the budget is the model copy and grads alone (all state off)
    assert (
        measured_device_budget(
            free=0, reserved=30 * GiB, allocated=24 * GiB, peak=30 * GiB, counted=4 * GiB, floor=4 * GiB
        )
        == 4 * GiB
    )
    # state already on the device (counted) is inside the peak and planned again
    assert measured_device_budget(
        free=10 * GiB, reserved=30 * GiB, allocated=30 * GiB, peak=30 * GiB, counted=16 * GiB, floor=4 * GiB
    ) == pytest.approx(16 * GiB + 10 * GiB - 2.6 * GiB)


FAST_DEVICE = dict(
    host_adam_gelems_per_s=0.5,
    device_adam_gbps=4000.0,
    h2d_gbps=50.0,
    d2h_gbps=50.0,
    trainer_slowdown_with_worker=1.0,
    backward_slowdown_with_host_adam=1.0,
)


def _cuda_planner(**kw):
    from hybrid_opt.placement.scheduler import AutoPlanner

    base = dict(
        numels=[1 << 20] * 8,
        ready_ranks=list(range(7, -1, -1)),
        device=torch.device("cuda"),
        model_bytes=2,
        state_bytes=12,
        subgroup_numel=1 << 20,
        device_budget=64.0 * GiB,
        host_budget=64.0 * GiB,
        calibration=dict(FAST_DEVICE),
    )
    base.update(kw)
    return AutoPlanner(**base)


def test_auto_on_cuda_keeps_state_off_the_device_until_the_peak_is_measured():
    """A GPU Adam 8000x faster than the host's: with room, every state belongs on the device.
    Measured from the peak, it stays on the host until an iteration's peak is known, then goes
    to the device only within what that peak leaves."""
    assert _cuda_planner().choose().offload_fraction == 0.0  # an explicit budget: planned at once
    ap = _cuda_planner(device_from_peak=True)
    first = ap.choose()
    assert first.offload_fraction == 1.0 and "until the first iterations' peak" in first.reason
    counted = 8 * (1 << 20) * 4  # bf16 model copy and grads
    state = 8 * (1 << 20) * 12
    # the peak left room for half the state, with 10 % of what the placement could use kept
    # free: 0.9 (free + counted) >= state / 2 + counted
    free = (state / 2 + counted) / 0.9 - counted + 1
    ap.observe_device_memory(
        {
            "free": free,
            "reserved": 40.0 * GiB,
            "allocated": 40.0 * GiB,
            "peak": 40.0 * GiB,
            "total": 80.0 * GiB,
        },
        counted=counted,
        floor=counted,
    )
    assert not ap.device_peak_pending
    assert ap.choose().offload_fraction == 0.5
    # no room beside the activations: everything stays on the host
    ap.observe_device_memory(
        {
            "free": 0.0,
            "reserved": 40.0 * GiB,
            "allocated": 40.0 * GiB,
            "peak": 40.0 * GiB,
            "total": 80.0 * GiB,
        },
        counted=counted,
        floor=counted,
    )
    assert ap.choose().offload_fraction == 1.0


def test_refits_feed_the_measured_device_memory_to_auto(monkeypatch):
    """The optimizer's side (CUDA figures injected on a CPU host): at each refit the planner
    gets the memory now, the cost model's device bytes of the plan that ran and of the model
    copy and grads alone; on a CPU-only host nothing of this runs."""
    from hybrid_opt.placement import scheduler

    model = make_net()
    with HybridAdamW(
        model.parameters(),
        offload_fraction="auto",
        subgroup_numel=SUBGROUP,
        refit_every=3,
        calibration=dict(FAST_DEVICE),
    ) as opt:
        view = debug_view(opt)
        assert not view.planner.device_from_peak  # CPU: behaviour unchanged
        seen = []
        monkeypatch.setattr(
            scheduler,
            "cuda_memory",
            lambda device: {
                "free": 1.0 * GiB,
                "total": 8.0 * GiB,
                "reserved": 2.0 * GiB,
                "allocated": 1.0 * GiB,
                "peak": 1.5 * GiB,
            },
        )
        real = view.planner.observe_device_memory
        monkeypatch.setattr(
            view.planner,
            "observe_device_memory",
            lambda mem, counted, floor: seen.append((counted, floor)) or real(mem, counted, floor),
        )
        train(model, opt, make_batches(4))
        assert seen == []
        view.planner.device_from_peak = view.planner.device_peak_pending = True
        train(model, opt, make_batches(4))
        assert len(seen) == 1 and not view.planner.device_peak_pending  # the refit at step 6
        counted, floor = seen[0]
        assert counted == view.placement.modelled_bytes(*view.fractions, opt.plan.spare_banks)["device"]
        assert floor == view.placement.modelled_bytes(1.0, 0.0, opt.plan.spare_banks)["device"]
        assert view.planner.device_budget == pytest.approx(
            scheduler.measured_device_budget(1.0 * GiB, 2.0 * GiB, 1.0 * GiB, 1.5 * GiB, counted, floor)
        )


# ============================================================================= calibration
def test_calibration_takes_at_most_a_tenth_of_the_device_budget_and_what_it_leaves():
    from hybrid_opt.placement import calibrate

    assert calibrate.device_bytes_allowed(80 * GiB, 10 * GiB) == 8 * GiB  # 10 % of the budget
    assert calibrate.device_bytes_allowed(10 * GiB, 9.5 * GiB) == GiB // 2  # what it leaves
    assert calibrate.device_bytes_allowed(10 * GiB, 11 * GiB) == 0
    full = calibrate.cuda_measure_sizes(None)
    assert full == (calibrate.CUDA_ADAM_NUMEL, calibrate.CUDA_COPY_NUMEL)
    assert full[0] * 16 == GiB and full[1] * 4 == GiB // 4  # no budget: 1 GiB, then 256 MiB
    assert calibrate.cuda_measure_sizes(8 * GiB) == full
    adam, copy = calibrate.cuda_measure_sizes(64 << 20)
    assert adam * 16 <= 64 << 20 and copy * 4 <= 64 << 20 and adam == (64 << 20) // 16
    assert calibrate.cuda_measure_sizes(0) == (1, 1)


def test_cuda_calibration_is_sized_by_the_budget_and_measured_again_when_more_is_allowed(
    tmp_path, monkeypatch
):
    from hybrid_opt.placement import calibrate

    monkeypatch.setenv("HYBRID_OPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "machine_key", lambda device: "gpu-box")
    asked = []

    def cuda_rates(device, device_bytes=None):
        asked.append(device_bytes)
        n = calibrate.cuda_measure_sizes(device_bytes)[0]
        return dict(device_adam_gbps=float(n), device_measure_numel=n, h2d_gbps=1.0, d2h_gbps=1.0)

    monkeypatch.setattr(calibrate, "_cuda_rates", cuda_rates)
    monkeypatch.setattr(
        calibrate,
        "measure",
        lambda device, share, device_bytes=None: dict(
            host_adam_gelems_per_s=1.0, **cuda_rates(device, device_bytes)
        ),
    )
    small = calibrate.rates("cuda", device_bytes=16 << 20)
    assert asked == [16 << 20] and small["device_measure_numel"] == 1 << 20
    assert calibrate.rates("cuda", device_bytes=16 << 20) == small and len(asked) == 1  # cached
    bigger = calibrate.rates("cuda", device_bytes=GiB)  # a larger budget now: measured again
    assert asked[-1] == GiB and bigger["device_measure_numel"] == calibrate.CUDA_ADAM_NUMEL
    assert calibrate.rates("cuda", device_bytes=16 << 20)["device_measure_numel"] == calibrate.CUDA_ADAM_NUMEL
    assert len(asked) == 2


def test_auto_on_cuda_calibrates_within_its_device_budget(monkeypatch):
    from hybrid_opt.placement import calibrate

    got = {}

    def rates(device, nvme_path=None, worker_share=0.5, *, refresh=False, device_bytes=None):
        got["device_bytes"] = device_bytes
        return dict(FAST_DEVICE)

    monkeypatch.setattr(calibrate, "rates", rates)
    _cuda_planner(calibration=None, device_budget=10.0 * GiB)
    assert got["device_bytes"] == GiB  # 10 % of it (the bf16 model copy and grads are 32 MiB)
    _cuda_planner(calibration=None, device_budget=34.0 * (1 << 20))
    assert got["device_bytes"] == 2 << 20  # what 34 MiB leaves beside 32 MiB (less than 10 %)
    _cuda_planner(calibration=None, device=torch.device("cpu"))
    assert got["device_bytes"] is None


def test_a_checkpoint_that_needs_amsgrad_and_a_host_tier_that_cannot_start_changes_nothing(monkeypatch):
    """load_state_dict of an amsgrad checkpoint lays the tiers out again with the running max;
    when the new host tier cannot start, it raises and the optimizer is as it was, without the
    amsgrad layout, and trains on; loaded again, the checkpoint takes."""
    batches = make_batches(6)
    ref_model, ref, model, opt = _pair(offload=0.5)
    donor_model = make_net()
    donor = torch.optim.AdamW(donor_model.parameters(), lr=1e-2, amsgrad=True, foreach=False)
    train(donor_model, donor, batches[:2])
    with ref, opt:
        train(ref_model, ref, batches[:3])
        train(model, opt, batches[:3])
        snap, worker = _snapshot(opt), opt.worker_pid
        with monkeypatch.context() as m:
            _fail_host_tier(m)
            with pytest.raises(RuntimeError, match="injected"):
                opt.load_state_dict(donor.state_dict())
        assert not debug_view(opt).amsgrad and opt.worker_pid == worker
        assert all("max_exp_avg_sq" not in st for st in debug_view(opt).device.state.values())
        _assert_same(opt, snap)
        train(ref_model, ref, batches[3:])
        train(model, opt, batches[3:])
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
        opt.load_state_dict(donor.state_dict())
        assert debug_view(opt).amsgrad and opt.worker_pid != worker
        assert_state_close(opt.state_dict(), donor.state_dict())
