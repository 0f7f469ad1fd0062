"""The scheduler: calibration and its cache, offload_fraction / nvme_fraction = "auto",
budgets, refits that move state between tiers without changing a bit."""

import copy
import dataclasses
import json
import os
import threading
import warnings

import pytest
import torch
from test_optimizer import assert_state_close, make_batches, make_net, train

from hybrid_opt import HybridAdamW
from hybrid_opt.placement import calibrate
from hybrid_opt.placement import cost_model as cm
from hybrid_opt.placement.scheduler import AutoPlanner, Decision, Sample
from hybrid_opt.testing import debug_view

SUBGROUP = 64

# synthetic rates (the shape of calibrate.rates()): deterministic plans whatever the machine
SLOW_HOST = dict(
    host_adam_gelems_per_s=0.001,
    device_adam_gbps=40.0,
    device_adam_gbps_with_worker=20.0,
    h2d_gbps=5.0,
    d2h_gbps=5.0,
    trainer_slowdown_with_worker=1.6,
    backward_slowdown_with_host_adam=1.1,
)
# a device tier so slow that the plan offloads everything it can
SLOW_DEVICE = dict(
    SLOW_HOST,
    host_adam_gelems_per_s=10.0,
    device_adam_gbps=1e-6,
    device_adam_gbps_with_worker=1e-6,
    trainer_slowdown_with_worker=1.0,
    backward_slowdown_with_host_adam=1.0,
    h2d_gbps=0.0,
    d2h_gbps=0.0,
)
WITH_NVME = dict(SLOW_DEVICE, nvme_read_gbps=1.0, nvme_write_gbps=1.0)


def _auto(model, calibration, params=None, **kw):
    kw.setdefault("lr", 1e-2)
    kw.setdefault("weight_decay", 0.1)
    return HybridAdamW(
        params or model.parameters(),
        offload_fraction=kw.pop("offload_fraction", "auto"),
        subgroup_numel=SUBGROUP,
        calibration=calibration,
        **kw,
    )


# ============================================================================= calibration
def test_calibration_measures_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_OPT_CACHE_DIR", str(tmp_path))
    first = calibrate.rates("cpu")
    for key in (
        "host_adam_gelems_per_s",
        "device_adam_gbps",
        "device_adam_gbps_with_worker",
        "h2d_gbps",
        "trainer_slowdown_with_worker",
        "backward_slowdown_with_host_adam",
    ):
        assert first[key] > 0, key
    assert first["trainer_slowdown_with_worker"] >= 1 and first["backward_slowdown_with_host_adam"] >= 1
    # split (worker_share 0.5): speculated on the worker's own cores, slower than on every core
    assert 0 < first["speculated_host_share"] <= 1
    assert os.path.exists(tmp_path / "calibration.json")

    def fail(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(calibrate, "measure", fail)
    assert calibrate.rates("cpu") == first
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: dict(SLOW_HOST))
    assert (
        calibrate.rates("cpu", refresh=True)["host_adam_gelems_per_s"] == SLOW_HOST["host_adam_gelems_per_s"]
    )


FORMATS = [
    (m, v, rem, dt, ams)
    for m in (torch.float32, torch.bfloat16, "q8")
    for v in (torch.float32, torch.bfloat16, "q8")
    for rem in (False, True)
    for dt in (torch.float32, torch.bfloat16)
    for ams in (False, True)
    if not (rem and dt == torch.float32)
]


@pytest.mark.parametrize("m, v, rem, dt, ams", FORMATS)
def test_the_format_factors_step_is_one_the_kernels_take(m, v, rem, dt, ams):
    """format_factor times a host step of each state format as the host tier steps it: every
    combination's tensors are ones its kernel accepts, and moves the bytes the cost model counts."""
    from hybrid_opt.state.state_format import StateFormat

    fmt = StateFormat(m, v, rem)
    kernel, args, kw = calibrate._format_tensors(fmt, dt, dt, ams, 4096)
    kernel(*args, **kw)
    held = [t for t in (*args, *kw.values()) if isinstance(t, torch.Tensor)]
    held += [t for x in (*args, *kw.values()) if isinstance(x, tuple) for t in x]
    moved = sum(
        t.numel() * t.element_size() * (1 if t is args[1] or t is kw.get("param_copy") else 2) for t in held
    )
    assert moved / 4096 == pytest.approx(fmt.adam_bytes(dt, dt.itemsize, ams), abs=0.01)


def test_the_format_factor_is_measured_once_per_format_and_cached(tmp_path, monkeypatch):
    """fp32 state needs no measurement (the rates are its own); a q8 format's factor is a real
    measurement, at least 1.0, cached per format and thread count."""
    from hybrid_opt.state.state_format import Q8, StateFormat

    monkeypatch.setenv("HYBRID_OPT_CACHE_DIR", str(tmp_path))
    f32 = torch.float32
    assert calibrate.format_factor(StateFormat(), f32, f32, 2) == 1.0
    q8 = StateFormat(Q8, Q8, False)
    first = calibrate.format_factor_cached(q8, f32, f32, 1)
    assert first >= 1.0

    def fail(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(calibrate, "format_factor", fail)
    assert calibrate.format_factor_cached(q8, f32, f32, 1) == first
    with pytest.raises(AssertionError, match="measured again"):
        calibrate.format_factor_cached(q8, f32, f32, 2)  # another thread count: its own entry
    with pytest.raises(AssertionError, match="measured again"):
        calibrate.format_factor_cached(StateFormat(Q8, torch.bfloat16, False), f32, f32, 1)


def test_auto_measures_its_formats_factor_at_the_workers_cores(monkeypatch):
    """An "auto" planner that calibrates asks for its own state format, params' dtype, amsgrad and
    the host tier's worker cores, and hands the factor to the cost model."""
    from hybrid_opt.state.state_format import Q8, StateFormat

    asked = []
    monkeypatch.setattr(calibrate, "rates", lambda *a, **k: dict(SLOW_DEVICE, worker_cores=3))
    monkeypatch.setattr(calibrate, "format_factor_cached", lambda *a: asked.append(a) or 2.5)
    fmt = StateFormat(Q8, Q8, True)
    ap = _planner(calibration=None, model_bytes=2, state_bytes=16, state_format=fmt)
    assert asked == [(fmt, torch.bfloat16, torch.bfloat16, 3, True)]
    assert ap.machine().state_format_factor == 2.5
    assert "steps the state format 2.50x as long as its bytes say" in ap.choose().reason
    plain = _planner(calibration=dict(SLOW_DEVICE))
    assert "as long as its bytes say" not in plain.choose().reason


def test_unreadable_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_OPT_CACHE_DIR", str(tmp_path))
    (tmp_path / "calibration.json").write_text("{not json")
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: dict(SLOW_HOST))
    with pytest.warns(UserWarning, match="unreadable"):
        r = calibrate.rates("cpu")
    assert r["host_adam_gelems_per_s"] == SLOW_HOST["host_adam_gelems_per_s"]
    assert len(json.loads((tmp_path / "calibration.json").read_text())) == 1  # rewritten whole


def test_unwritable_cache_warns_and_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HYBRID_OPT_CACHE_DIR", str(blocker / "sub"))  # a dir under a file
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: dict(SLOW_HOST))
    with pytest.warns(UserWarning, match="cannot write the calibration cache"):
        assert calibrate.rates("cpu")["device_adam_gbps"] == SLOW_HOST["device_adam_gbps"]


def test_nvme_calibration_measures_the_disk_and_leaves_nothing(tmp_path):
    r = calibrate.measure_nvme(str(tmp_path))
    assert r["nvme_read_gbps"] > 0 and r["nvme_write_gbps"] > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_trainer_times_runs_each_condition_on_its_cores():
    """The three conditions of the trainer's slowdown factors, each timed by the caller's
    timer: every core; the trainer's cores alone; there with an Adam thread streaming."""
    split = [sorted(os.sched_getaffinity(0))[:1], sorted(os.sched_getaffinity(0))[1:]]
    before = (os.sched_getaffinity(0), torch.get_num_threads(), threading.active_count())
    seen = []

    def timer(run):
        run()
        seen.append((sorted(os.sched_getaffinity(0)), torch.get_num_threads(), threading.active_count()))
        return len(seen)

    assert calibrate.trainer_times(*split, timer=timer) == {"all": 1, "trainer": 2, "contended": 3}
    assert seen[0][:2] == (sorted(before[0]), len(before[0]))
    assert seen[1][:2] == (split[0], 1) and seen[1][2] == before[2]
    assert seen[2][:2] == (split[0], 1) and seen[2][2] == before[2] + 1  # Adam streams meanwhile
    assert (os.sched_getaffinity(0), torch.get_num_threads(), threading.active_count()) == before
    # an Adam stream that cannot run would make the contended time an uncontended one
    with pytest.raises(RuntimeError, match=r"Adam stream on cores \[4096\] failed"):
        calibrate.trainer_times(split[0], [4096], timer=timer)
    assert (os.sched_getaffinity(0), torch.get_num_threads(), threading.active_count()) == before
    assert calibrate.factors_of(1.0, 1.5, 1.8) == pytest.approx((1.5, 1.2))
    assert calibrate.factors_of(1.0, 0.9, 0.8) == (1.0, 1.0)  # never a speed-up from losing cores


# ============================================================================= "auto" plans
@pytest.mark.parametrize("calibration,expect", [(SLOW_HOST, "device"), (SLOW_DEVICE, "host")])
def test_auto_places_by_rates_and_matches_torch(calibration, expect):
    model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = make_batches(12)
    with _auto(model, calibration) as opt:
        share = opt.plan.summary()
        assert share[expect]["share"] == 1.0, opt.plan
        assert "predicted step" in repr(opt.plan)
        train(model, opt, batches)
        train(ref_model, ref, batches)
        assert_state_close(opt.state_dict(), ref.state_dict())
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert set(opt.stats["predicted"]) >= {"step_s", "backward_s", "device_s", "worker_s"}
        assert set(opt.stats["measured"]) >= {"step_s", "backward_s", "device_s", "worker_s"}
        assert opt.stats["measured"]["backward_s"] > 0


def _add_unfrozen(model, opt):
    """Fine-tuning's unfreezing: fc2 joins the optimizer after a few steps."""
    opt.add_param_group(dict(params=list(model.fc2.parameters()), lr=5e-3))
    model.zero_grad()  # its grads accumulated while no optimizer owned it


def test_add_param_group_under_auto_lays_out_the_grown_model_and_matches_torch():
    model, ref_model = make_net(), make_net()
    first = lambda m: list(m.fc1.parameters()) + list(m.tiny)  # noqa: E731
    ref = torch.optim.AdamW(first(ref_model), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = make_batches(10)
    with _auto(model, SLOW_DEVICE, params=first(model)) as opt:
        assert opt.plan.summary()["host"]["share"] == 1.0
        train(model, opt, batches[:4])
        train(ref_model, ref, batches[:4])
        for m, o in ((model, opt), (ref_model, ref)):
            _add_unfrozen(m, o)
        # the whole grown model on the host, as "auto" would place it from the start
        assert opt.plan.summary()["host"]["share"] == 1.0, opt.plan
        assert opt.plan.reason.startswith("add_param_group: "), opt.plan.reason
        assert debug_view(opt).planner.total == sum(p.numel() for p in model.parameters())
        train(model, opt, batches[4:])
        train(ref_model, ref, batches[4:])
        assert_state_close(opt.state_dict(), ref.state_dict())


def test_add_param_group_without_room_to_lay_out_again_stays_on_the_device(monkeypatch):
    model, ref_model = make_net(), make_net()
    first = lambda m: list(m.fc1.parameters()) + list(m.tiny)  # noqa: E731
    ref = torch.optim.AdamW(first(ref_model), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = make_batches(8)
    with _auto(model, SLOW_DEVICE, params=first(model)) as opt:
        train(model, opt, batches[:3])
        train(ref_model, ref, batches[:3])
        monkeypatch.setattr(debug_view(opt).placement, "room_to_move", lambda target: False)
        with pytest.warns(UserWarning, match="stay on the device tier.*does not fit in free memory"):
            _add_unfrozen(model, opt)
        _add_unfrozen(ref_model, ref)
        n_new = sum(p.numel() for p in model.fc2.parameters())
        assert opt.plan.summary()["device"]["elements"] == n_new, opt.plan
        assert debug_view(opt).fractions[0] == pytest.approx(
            1 - n_new / sum(opt.plan.numels)
        )  # what a refit reads
        train(model, opt, batches[3:])
        train(ref_model, ref, batches[3:])
        assert_state_close(opt.state_dict(), ref.state_dict())


def test_add_param_group_past_the_host_budget_stays_on_the_device_and_says_why():
    model = make_net()
    first = list(model.fc1.parameters()) + list(model.tiny)
    with HybridAdamW(first, offload_fraction=1.0, subgroup_numel=SUBGROUP, spare_banks=1) as probe:
        need = probe.allocated_bytes["host"]  # the least this placement allocates: one spare bank
    with HybridAdamW(first, offload_fraction=1.0, subgroup_numel=SUBGROUP, host_memory_budget=need) as opt:
        assert opt.allocated_bytes["host"] == need
        with pytest.warns(UserWarning, match="stay on the device tier: .*host_memory_budget"):
            _add_unfrozen(model, opt)
        assert opt.plan.summary()["device"]["elements"] == sum(p.numel() for p in model.fc2.parameters())
        train(model, opt, make_batches(2))


def test_a_failed_layout_on_add_param_group_loses_nothing():
    """A bf16 model gets an fp16 group: one host tier cannot copy params back in both, so
    laying the grown model out fails before anything is touched — the old layout stays with
    its state bitwise and its worker, the new group stays on the device tier, and training
    goes on."""
    model = make_net(torch.bfloat16)
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=1.0, subgroup_numel=SUBGROUP) as opt:
        train(model, opt, make_batches(3))
        before = copy.deepcopy(opt.state_dict())
        worker = opt.worker_pid
        extra = torch.nn.Parameter(torch.randn(8, dtype=torch.float16))
        with pytest.warns(
            UserWarning,
            match="stay on the device tier: laying the tiers out again failed: "
            "TypeError: host-tier parameters must share one low-precision dtype",
        ):
            opt.add_param_group(dict(params=[extra]))
        after = opt.state_dict()
        for i, st in before["state"].items():
            for k, v in st.items():
                assert torch.equal(after["state"][i][k], v), (i, k)
        assert opt.plan.tiers.count("device") == 1 and opt.worker_pid == worker
        train(model, opt, make_batches(2))
        assert opt.stats["tiers"]["host"]["stepped"] + opt.stats["tiers"]["host"]["committed"] > 0


def test_auto_without_speculation_offloads_only_what_pays_after_backward():
    # a host tier a little slower than the device tier: worth it while it runs during
    # backward (speculation); when it starts at step(), its time adds to the device's
    rates = dict(
        SLOW_HOST,
        host_adam_gelems_per_s=1.0,
        device_adam_gbps_with_worker=40.0,
        trainer_slowdown_with_worker=1.0,
        backward_slowdown_with_host_adam=1.0,
        h2d_gbps=0.0,
        d2h_gbps=0.0,
    )
    shares = {}
    for speculative in (True, False):
        with _auto(make_net(), rates, speculative=speculative) as opt:
            shares[speculative] = opt.plan.summary()["host"]["share"]
            assert debug_view(opt).planner.workload().speculative is speculative
    assert shares[False] == 0 < shares[True], shares


def test_auto_on_the_real_calibration_runs():
    model = make_net()
    with HybridAdamW(model.parameters(), offload_fraction="auto", subgroup_numel=SUBGROUP) as opt:
        train(model, opt, make_batches(6))
        assert opt.plan.prediction is not None and opt.stats["predicted"]["step_s"] > 0


def test_auto_nvme_takes_what_the_host_budget_cannot_hold(tmp_path):
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])

    model, ref_model = mlp(), mlp()
    n = sum(p.numel() for p in model.parameters())
    wl = cm.Workload(params=float(n), model_bytes=4, grad_bytes=4, subgroup_numel=1024)
    budget = cm.memory_bytes(cm.Machine(gpus=0), wl, 1.0, 0.75, spare_banks=1)["host"] * 1.01
    assert cm.memory_bytes(cm.Machine(gpus=0), wl, 1.0, 0.0, spare_banks=1)["host"] > budget
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 64, generator=g) for _ in range(6)]
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        offload_fraction="auto",
        nvme_fraction="auto",
        nvme_path=str(tmp_path),
        spare_banks=1,
        subgroup_numel=1024,
        host_memory_budget=int(budget),
        calibration=WITH_NVME,
    ) as opt:
        assert opt.plan.summary()["nvme"]["share"] >= 0.7, opt.plan
        assert opt.plan.prediction.memory_bytes["host"] <= budget
        for m, o in ((model, opt), (ref_model, ref)):
            for x in xs:
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        assert_state_close(opt.state_dict(), ref.state_dict())


def test_auto_without_nvme_path_keeps_nvme_at_zero():
    with _auto(make_net(), WITH_NVME, nvme_fraction="auto") as opt:
        assert opt.plan.summary()["nvme"]["subgroups"] == 0


def test_a_budget_too_small_says_how_much_is_needed():
    with pytest.raises(
        ValueError, match=r'"auto": no placement fits.*needs at least \d+\.\d GB of host memory'
    ):
        _auto(make_net(), SLOW_HOST, host_memory_budget=1000)


def test_fixed_fractions_with_a_budget_too_small_fail_clearly():
    with pytest.raises(ValueError, match="needs .* GB of host memory and host_memory_budget"):
        HybridAdamW(
            make_net().parameters(), offload_fraction=1.0, subgroup_numel=SUBGROUP, host_memory_budget=1000
        )


def test_fixed_fractions_size_the_spare_pool_from_memory():
    # speculating: a spare per host subgroup where memory allows (without, two: the next test)
    with HybridAdamW(
        make_net().parameters(), offload_fraction=1.0, subgroup_numel=SUBGROUP, speculative=True
    ) as opt:
        n_host = len(opt.plan.subgroups("host"))
        assert opt.plan.spare_banks == n_host  # they fit in a quarter of the free memory
        # the arena without spares and one bank, counted as the tiers will allocate them
        base = debug_view(opt).placement.bytes_of(dataclasses.replace(opt.plan, spare_banks=0))["host"]
        bank = debug_view(opt).placement.bytes_of(dataclasses.replace(opt.plan, spare_banks=1))["host"] - base
    assert bank == 4096  # 64 elements x 12 B, in whole pages (shm.PAGE)
    with HybridAdamW(
        make_net().parameters(),
        offload_fraction=1.0,
        subgroup_numel=SUBGROUP,
        host_memory_budget=int(base + 3.5 * bank),
        speculative=True,
    ) as opt:
        assert opt.plan.spare_banks == 3  # what the explicit budget leaves


@pytest.mark.parametrize("bad", [-1, 1.5, "often", True])
def test_refit_every_is_checked(bad):
    with pytest.raises(ValueError, match="refit_every"):
        _auto(make_net(), SLOW_HOST, refit_every=bad)


# ============================================================================= refits
def test_replan_moves_state_without_changing_a_bit():
    """Moving every subgroup device -> host -> mixed -> device mid-training gives bitwise the
    same params and state as never moving (the same CPU kernel steps every tier)."""
    batches = make_batches(12)
    fixed_model, moved_model = make_net(), make_net()
    with (
        HybridAdamW(
            fixed_model.parameters(),
            lr=1e-2,
            weight_decay=0.1,
            max_grad_norm=0.5,
            offload_fraction=0.0,
            subgroup_numel=SUBGROUP,
        ) as fixed,
        _auto(moved_model, SLOW_HOST, max_grad_norm=0.5, refit_every=0) as moved,
    ):  # moves by replan() only
        assert moved.plan.summary()["device"]["share"] == 1.0
        worker_s = []
        for k, batch in enumerate(batches):
            if k in (3, 6, 9):
                moved.replan({3: 1.0, 6: 0.5, 9: 0.0}[k])
            train(fixed_model, fixed, [batch])
            train(moved_model, moved, [batch])
            worker_s += [t["worker_s"] for t in moved.stats["tiers"].values()]
        assert debug_view(moved).planner.moves == 3
        assert min(worker_s) >= 0 and max(worker_s) > 0  # per-tier stats survive the moves
        for a, b in zip(fixed_model.parameters(), moved_model.parameters()):
            assert torch.equal(a, b)
        assert_state_close(moved.state_dict(), fixed.state_dict(), exact=True)


def test_a_refit_that_pays_moves_and_numerics_stay_bitwise(monkeypatch):
    batches = make_batches(10)
    fixed_model, auto_model = make_net(), make_net()
    with (
        HybridAdamW(
            fixed_model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.0, subgroup_numel=SUBGROUP
        ) as fixed,
        _auto(auto_model, SLOW_HOST, refit_every=2) as opt,
    ):
        view = debug_view(opt)
        to_host = view.planner.predict(1.0, 0.0)
        monkeypatch.setattr(view.planner, "refit", lambda *a: Decision(1.0, 0.0, to_host, "test"))
        train(fixed_model, fixed, batches)
        train(auto_model, opt, batches)
        assert view.planner.moves >= 1 and opt.plan.summary()["host"]["share"] == 1.0
        assert opt.worker_pid is not None
        for a, b in zip(fixed_model.parameters(), auto_model.parameters()):
            assert torch.equal(a, b)
        assert_state_close(opt.state_dict(), fixed.state_dict(), exact=True)


def test_a_refit_whose_move_fails_keeps_the_plan_and_the_state(monkeypatch, tmp_path):
    """The refit's new layout cannot start (its swap directory does not exist: the path is
    under a file): the step warns, the old tiers come back with their state, and training
    goes on bitwise as if no refit had happened."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    batches = make_batches(8)
    fixed_model, auto_model = make_net(), make_net()
    with (
        HybridAdamW(
            fixed_model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.0, subgroup_numel=SUBGROUP
        ) as fixed,
        _auto(auto_model, SLOW_HOST, refit_every=2) as opt,
    ):
        view = debug_view(opt)
        opt.nvme_path = str(blocker / "swap")
        to_disk = view.planner.predict(1.0, 0.0)  # a prediction to carry; the layout is 1.0 / 1.0
        monkeypatch.setattr(view.planner, "refit", lambda *a: Decision(1.0, 1.0, to_disk, "test"))
        train(fixed_model, fixed, batches[:5])
        with pytest.warns(
            UserWarning,
            match="refit: moving to offload_fraction=1, nvme_fraction=1 failed; the plan stays as it was",
        ):
            train(auto_model, opt, batches[:5])
        assert opt.plan.summary()["device"]["share"] == 1.0 and view.host is None, opt.plan
        assert opt.plan.reason.startswith("refit: a move failed")
        monkeypatch.undo()
        train(fixed_model, fixed, batches[5:])
        train(auto_model, opt, batches[5:])
        for a, b in zip(fixed_model.parameters(), auto_model.parameters()):
            assert torch.equal(a, b)
        assert_state_close(opt.state_dict(), fixed.state_dict(), exact=True)


@pytest.mark.parametrize("measured", [False, True])
def test_a_move_that_would_not_fit_in_memory_is_skipped(monkeypatch, measured):
    """The plan's reason says why the move was skipped, also once backward is measured (the
    kept plan's prediction is then recorded with that reason, not with "refit: kept")."""
    from hybrid_opt.placement import scheduler

    model = make_net()
    with _auto(model, SLOW_HOST, refit_every=2) as opt:
        view = debug_view(opt)
        to_host = view.planner.predict(1.0, 0.0)
        monkeypatch.setattr(view.planner, "refit", lambda *a: Decision(1.0, 0.0, to_host, "test"))
        if measured:  # what the real refit sets from its samples
            monkeypatch.setattr(view.planner, "backward_s", 0.01)
        monkeypatch.setattr(scheduler, "_free_host_bytes", lambda: 0.0)
        train(model, opt, make_batches(6))
        assert view.planner.moves == 0 and opt.plan.summary()["device"]["share"] == 1.0
        assert "does not fit in free memory" in opt.plan.reason


def _planner(**kw):
    numels = [100] * 10
    base = dict(
        numels=numels,
        ready_ranks=list(range(9, -1, -1)),
        device=torch.device("cpu"),
        model_bytes=4,
        state_bytes=12,
        subgroup_numel=100,
        device_budget=1e12,
        host_budget=1e12,
        refit_every=10,
        calibration=dict(
            SLOW_DEVICE, device_adam_gbps=1e-5, device_adam_gbps_with_worker=1e-5, host_adam_gelems_per_s=1e-6
        ),
    )
    base.update(kw)
    return AutoPlanner(**base)


def _sample(backward_s, **kw):
    s = dict(
        backward_s=backward_s,
        step_s=0.0,
        device_s=0.0,
        host_wait_s=0.0,
        device_elements=0,
        host_worker_s=0.0,
        host_elements=0,
        hidden_s=0.0,
    )
    s.update(kw)
    return Sample(**s)


def _hiding_planner(**kw):
    """Device-only step 2.8 s; the host would take 5 s for all of it: only worth it hidden."""
    return _planner(
        calibration=dict(
            SLOW_DEVICE, device_adam_gbps=1e-5, device_adam_gbps_with_worker=1e-5, host_adam_gelems_per_s=2e-7
        ),
        **kw,
    )


def test_refit_uses_measured_backward():
    """Before any step, backward is assumed as long as a device-only step (2.8 s here): about
    half the state hides under it on the slower host tier. A measured backward of 1 ms hides
    nothing: the refit says to move everything back to the faster device tier."""
    ap = _hiding_planner()
    first = ap.choose()
    assert 0.3 < first.offload_fraction < 1.0
    for _ in range(6):
        ap.observe(_sample(backward_s=0.001))
    d = ap.refit(first.offload_fraction, first.nvme_fraction)
    assert d is not None and d.offload_fraction == 0.0
    assert ap.backward_s == pytest.approx(0.001)
    assert d.prediction.iteration_seconds < d.current.iteration_seconds


def test_refit_does_not_move_for_a_gain_below_the_move_cost():
    ap = _hiding_planner(refit_every=1)
    first = ap.choose()
    ap.move_cost_s = 1e9
    for _ in range(6):
        ap.observe(_sample(backward_s=0.001))
    assert ap.refit(first.offload_fraction, first.nvme_fraction) is None


def test_refit_takes_the_host_rate_from_measured_worker_time():
    ap = _planner()
    ap.observe(_sample(0.1))  # the first sample (page faults) is dropped
    for _ in range(3):
        ap.observe(_sample(0.1, host_worker_s=2.0, host_elements=1000))
    ap.refit(0.5, 0.0)
    assert ap.rates["host_adam_gelems_per_s"] == pytest.approx(1000 / 2.0 / 1e9)
    assert ap.calibration["host_adam_gelems_per_s"] == 1e-6  # the calibration itself stays


def _compressed():
    from hybrid_opt.state.state_format import StateFormat

    return StateFormat(torch.bfloat16, torch.bfloat16, True)


def test_the_planner_counts_its_state_format():
    """state_format= (the optimizer's, #16): the workload it plans with counts those bytes."""
    plain, comp = _planner(model_bytes=2), _planner(model_bytes=2, state_format=_compressed())
    assert plain.workload().tier_bytes()["host"] == 14 and comp.workload().tier_bytes()["host"] == 8
    assert comp.workload().tier_bytes()["nvme"] == 6
    # remainders only for bf16 params: a 2-byte fp16 model keeps its fp32 master
    fp16 = _planner(model_bytes=2, model_dtype=torch.float16, state_format=_compressed())
    assert fp16.workload().tier_bytes()["device"] == 8 and fp16.workload().tier_bytes()["high_half"] == 0
    ams = _planner(model_bytes=2, state_bytes=16, state_format=_compressed())
    assert ams.workload().amsgrad and ams.workload().tier_bytes()["device"] == 8


def test_a_compressed_state_keeps_more_on_a_device_budget():
    """A GPU whose budget holds the bf16 model, its grads and 6 B/param of state but not 12:
    the plain format offloads half, the compressed one keeps every subgroup on the device."""
    kw = dict(
        numels=[1000] * 10,
        ready_ranks=list(range(9, -1, -1)),
        model_bytes=2,
        device=torch.device("cuda"),
        calibration=dict(SLOW_HOST),
        subgroup_numel=1000,
        device_budget=1e4 * 4 + 1e4 * 6 + 1e4,
        host_budget=1e12,
    )
    plain, comp = _planner(**kw).choose(), _planner(state_format=_compressed(), **kw).choose()
    assert plain.offload_fraction == 0.5 and comp.offload_fraction == 0.0
    assert comp.prediction.memory_bytes["device"] <= kw["device_budget"]


def test_refit_keeps_the_host_rate_at_the_reference_bytes():
    """A compressed host step moves 18 B/element, not 28: the rate measured on it is stored as
    the 28 B rate the cost model divides by, so it predicts the same time for the same step."""
    ap = _planner(model_bytes=2, state_format=_compressed())
    ap.observe(_sample(0.1))
    for _ in range(3):
        ap.observe(_sample(0.1, host_worker_s=2.0, host_elements=1000))
    ap.refit(0.5, 0.0)
    assert ap.rates["host_adam_gelems_per_s"] == pytest.approx(1000 / 2.0 / 1e9 * 18 / 28)
    m = ap.machine()
    per_elem = (
        ap.workload().tier_bytes()["host_adam"]
        / cm.HOST_ADAM_REFERENCE_BYTES
        / (m.host_adam_gelems_per_s * 1e9)
    )
    assert per_elem * 1000 == pytest.approx(2.0)


def test_refit_keeps_the_rates_at_fp32_states_speed_where_the_format_is_slower():
    """With a state_format_factor (the format's speed against its bytes, measured by calibrate), a
    refit stores the host and the CPU's device rates as fp32 state's: the cost model multiplies the
    factor back in, so it predicts the time the samples took, not that time twice over."""
    cal = dict(
        SLOW_DEVICE, device_adam_gbps=1e-5, device_adam_gbps_with_worker=1e-5, host_adam_gelems_per_s=1e-6
    )
    ap = _planner(model_bytes=2, state_format=_compressed(), calibration=dict(cal, state_format_factor=2.5))
    ap.observe(_sample(0.1))
    for _ in range(3):
        ap.observe(_sample(0.1, host_worker_s=2.0, host_elements=1000, device_s=0.5, device_elements=400))
    ap.refit(0.5, 0.0)
    m, wl = ap.machine(), ap.workload()
    assert m.state_format_factor == 2.5
    host_per_elem = (
        wl.tier_bytes()["host_adam"] / cm.HOST_ADAM_REFERENCE_BYTES / (m.host_adam_gelems_per_s * 1e9)
    )
    assert host_per_elem * m.state_format_factor * 1000 == pytest.approx(2.0)
    device_per_elem = cm.device_bytes_per_element(wl) / (m.device_adam_gbps_with_worker * 1e9)
    assert device_per_elem * m.state_format_factor * 400 == pytest.approx(0.5)


def test_refit_on_cuda_takes_the_device_rate_from_gpu_time_and_overhead_from_host_time():
    """On CUDA device_s is GPU time (events) and the trainer only launches: the device rate
    comes from GPU time, and the step's overhead subtracts the trainer's own time in the
    device step, not the GPU's (which would clamp the overhead to 0)."""
    ap = _planner(device=torch.device("cuda"))
    ap.observe(_sample(0.1))  # the first sample is dropped
    for _ in range(3):
        ap.observe(_sample(0.1, step_s=0.05, device_s=0.2, device_host_s=0.01, device_elements=1000))
    ap.refit(0.0, 0.0)
    per_elem = cm.device_bytes_per_element(ap.workload())
    assert ap.rates["device_adam_gbps"] == pytest.approx(1000 * per_elem / 0.2 / 1e9)
    assert ap.overhead_s == pytest.approx(0.04)


def test_refit_schedule():
    ap = _planner(refit_every=50)
    assert [k for k in range(1, 200) if ap.due(k)] == [5, 55, 105, 155]
    assert not any(_planner(refit_every=0).due(k) for k in range(1, 100))


def test_candidates_are_subgroup_boundaries():
    ap = _planner(numels=[10, 30, 60], ready_ranks=[2, 1, 0])
    assert ap._boundaries() == [0.0, 0.6, 0.9, 1.0]
    many = _planner(numels=[1] * 1000, ready_ranks=list(range(1000)))
    b = many._boundaries()
    assert len(b) <= 49 and b[0] == 0.0 and b[-1] == 1.0 and b == sorted(b)


def test_cpu_only_offload_costs_the_trainer_cores():
    m = cm.Machine(
        gpus=0,
        device_adam_gbps=40,
        device_adam_gbps_with_worker=20,
        host_adam_gelems_per_s=1,
        h2d_gbps=0,
        d2h_gbps=0,
        trainer_slowdown_with_worker=1.5,
    )
    wl = cm.Workload(params=1e8, backward_seconds=1.0)
    none, some = cm.predict(m, wl, 0.0), cm.predict(m, wl, 0.5)
    assert none.forward_backward_seconds == pytest.approx(1.5)
    assert some.forward_backward_seconds == pytest.approx(1.5 * 1.5)
    assert some.breakdown["device_step"] == pytest.approx(0.5e8 * 28 / 20e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cm.best_plan(m, wl).offload_fraction == 0.0


# ============================================================================= on a GPU
@pytest.mark.gpu
def test_cuda_calibration_and_auto_match_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_OPT_CACHE_DIR", str(tmp_path))
    r = calibrate.rates("cuda")
    assert r["device_adam_gbps"] > 0 and r["h2d_gbps"] > 0 and r["d2h_gbps"] > 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    ref_model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    ref_model.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    with HybridAdamW(model.parameters(), lr=1e-3, offload_fraction="auto", subgroup_numel=4096) as opt:
        assert opt.plan.prediction is not None
        x = torch.randn(32, 256, device="cuda")
        for _ in range(8):
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_calibrates_under_the_arrangement_its_host_tier_gets(monkeypatch):
    """Issue #37: "auto" measures the host rate under the arrangement the host tier will have:
    a CPU-only host's shared cores (worker_share None), a GPU host's split (0.5), or the share
    asked for; and its reason says which arrangement it chose."""
    got = []

    def rates(device, nvme_path=None, worker_share=0.5, *, refresh=False, device_bytes=None):
        got.append((torch.device(device).type, worker_share))
        return dict(
            SLOW_DEVICE,
            device_adam_gbps=1e-5,
            device_adam_gbps_with_worker=1e-5,
            host_adam_gelems_per_s=1e-6,
            shared_cores=worker_share is None,
        )

    monkeypatch.setattr(calibrate, "rates", rates)
    shared = _planner(calibration=None)
    _planner(calibration=None, worker_share=0.25)
    _planner(calibration=None, device=torch.device("cuda"), device_budget=1e12)
    assert got == [("cpu", None), ("cpu", 0.25), ("cuda", 0.5)]
    assert shared.machine().shared_cores
    d = shared.choose()
    assert d.offload_fraction > 0 and "cores shared: the params live on the CPU" in d.reason, d.reason


def test_calibration_caches_the_shared_arrangement_under_its_own_key(monkeypatch, tmp_path):
    measured = []

    def measure(device, worker_share=0.5, device_bytes=None):
        measured.append(worker_share)
        return {"host_adam_gelems_per_s": 1.0, "device_adam_gbps": 1.0, "shared_cores": worker_share is None}

    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(calibrate, "cache_path", lambda: str(tmp_path / "rates.json"))
    assert calibrate.rates("cpu", worker_share=None)["shared_cores"]
    assert not calibrate.rates("cpu", worker_share=0.5)["shared_cores"]
    assert calibrate.rates("cpu", worker_share=None)["shared_cores"]  # cached, not the split's
    assert measured == [None, 0.5]
    keys = json.load(open(tmp_path / "rates.json"))
    assert any(k.endswith("-wshared") for k in keys) and any(k.endswith("-w0.5") for k in keys)


def test_without_speculation_the_spare_pool_is_two_banks_or_what_the_budget_leaves():
    """speculative="auto" on this CPU-only host steps the host tier in step(): no step waits for
    validation, so two spare banks do (a step writes one, the next stages into the other), and
    one where the host budget leaves room for one only."""
    with HybridAdamW(make_net().parameters(), offload_fraction=1.0, subgroup_numel=SUBGROUP) as opt:
        assert len(opt.plan.subgroups("host")) > 2 and opt.plan.spare_banks == 2
        base = debug_view(opt).placement.bytes_of(dataclasses.replace(opt.plan, spare_banks=0))["host"]
        bank = debug_view(opt).placement.bytes_of(dataclasses.replace(opt.plan, spare_banks=1))["host"] - base
    budget = int(base + 1.5 * bank)
    with HybridAdamW(
        make_net().parameters(), offload_fraction=1.0, subgroup_numel=SUBGROUP, host_memory_budget=budget
    ) as opt:
        assert opt.plan.spare_banks == 1 and opt.allocated_bytes["host"] <= budget
