"""The cost model on synthetic rates, `best_plan`'s budgets and errors, and `hybrid-opt plan`."""
import json
import os
import re
import subprocess
import sys

import pytest

from hybrid_opt import planner
from hybrid_opt.cost_model import GB, Machine, Workload, best_plan, memory_bytes, predict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# round numbers: 1e9 params, 1 GPU, backward 1 s
MACHINE = Machine(gpus=1, gpu_mem_bytes=100 * GB, host_mem_bytes=1000 * GB, device_adam_gbps=1000,
                  host_adam_gelems_per_s=1.0, h2d_gbps=100, d2h_gbps=100,
                  nvme_read_gbps=10, nvme_write_gbps=10)
WORKLOAD = Workload(params=1e9, backward_seconds=1.0, subgroup_numel=1_000_000)


def _machine(**kw):
    return Machine(**{**vars(MACHINE), **kw})


def _workload(**kw):
    return Workload(**{**vars(WORKLOAD), **kw})


def test_doubling_host_rate_halves_host_compute():
    slow = predict(_machine(host_adam_gelems_per_s=1.0), WORKLOAD, 0.5)
    fast = predict(_machine(host_adam_gelems_per_s=2.0), WORKLOAD, 0.5)
    assert slow.breakdown["host_compute"] == pytest.approx(0.5)
    assert fast.breakdown["host_compute"] == pytest.approx(slow.breakdown["host_compute"] / 2)


def test_device_step_counts_bytes_moved_over_device_bandwidth():
    p = predict(MACHINE, WORKLOAD, 0.0)
    # 12 + 2 read, 12 + 2 written per element, 1e9 elements at 1000 GB/s
    assert p.breakdown["device_step"] == pytest.approx(28e9 / 1000e9)
    assert p.step_seconds == pytest.approx(p.breakdown["device_step"])
    assert p.iteration_seconds == pytest.approx(1.5 + p.step_seconds)


def test_nvme_io_is_pipelined_with_host_compute_max_not_sum():
    # compute-bound: nvme I/O hides under compute
    p = predict(_machine(host_adam_gelems_per_s=0.1, nvme_read_gbps=100, nvme_write_gbps=100),
                WORKLOAD, 1.0, 0.5)
    io, compute, link = p.breakdown["nvme_io"], p.breakdown["host_compute"], \
        p.breakdown["d2h"] + p.breakdown["h2d"]
    assert 0 < io < compute
    assert p.breakdown["host_work"] == pytest.approx(compute + link)
    # I/O-bound: compute hides under nvme I/O
    q = predict(_machine(host_adam_gelems_per_s=100.0, nvme_read_gbps=1, nvme_write_gbps=1),
                WORKLOAD, 1.0, 0.5)
    assert q.breakdown["nvme_io"] == pytest.approx(0.5e9 * 12 / 1e9 * 2)
    assert q.breakdown["host_work"] == pytest.approx(
        q.breakdown["nvme_io"] + q.breakdown["d2h"] + q.breakdown["h2d"])


def test_host_work_hides_under_backward_and_never_goes_negative():
    # fast host, long backward: all but the last subgroup's work hides; the params' copy back
    # waits for step()
    fast = predict(_machine(host_adam_gelems_per_s=100.0), _workload(backward_seconds=10.0), 1.0)
    assert fast.breakdown["host_exposed"] - fast.breakdown["h2d"] < 1e-3
    assert fast.step_seconds == pytest.approx(fast.breakdown["host_exposed"] + fast.breakdown["device_step"])
    assert fast.step_seconds >= 0 and fast.breakdown["host_hidden"] <= fast.breakdown["host_work"]
    # slow host: what exceeds backward is exposed, and never more than the host work
    slow = predict(_machine(host_adam_gelems_per_s=0.1), WORKLOAD, 1.0)
    assert slow.breakdown["host_exposed"] == pytest.approx(slow.breakdown["host_work"] - 1.0, rel=1e-2)
    for off in (0.0, 0.1, 0.5, 1.0):
        for bwd in (0.0, 1e-6, 1.0, 1e3):
            p = predict(MACHINE, _workload(backward_seconds=bwd), off)
            assert p.step_seconds >= 0
            assert 0 <= p.breakdown["host_exposed"] <= p.breakdown["host_work"] + 1e-12
            assert p.iteration_seconds >= p.forward_backward_seconds


def test_a_small_spare_pool_caps_the_work_hidden_under_backward():
    # exact rollback: a speculated step holds a spare bank until step(); 1000 subgroups of 1e6
    wl = _workload(backward_seconds=100.0)
    fast = _machine(host_adam_gelems_per_s=100.0)
    full = predict(fast, wl, 1.0)
    four = predict(fast, wl, 1.0, spare_banks=4)
    assert full.spare_banks == 1000 and four.spare_banks == 4
    h2d = full.breakdown["h2d"]
    assert full.breakdown["host_exposed"] - h2d < 1e-3
    assert four.breakdown["host_exposed"] - h2d == pytest.approx((four.breakdown["host_work"] - h2d) * (1 - 4 / 1000))
    assert four.memory_bytes["host"] < full.memory_bytes["host"]
    # rollback="inverse" needs no spares and hides it all
    inverse = predict(fast, _workload(backward_seconds=100.0, exact_rollback=False), 1.0, spare_banks=4)
    assert inverse.spare_banks == 0 and inverse.breakdown["host_exposed"] - h2d < 1e-3
    # best_plan takes the largest pool that fits the host budget
    budget = _machine(host_adam_gelems_per_s=100.0, gpu_mem_bytes=5 * GB,
                      host_mem_bytes=12e9 + 600 * 1e6 * 12 + 1e8)
    p = best_plan(budget, wl, headroom=0.0)
    assert 250 <= p.spare_banks < 1000 and p.memory_bytes["host"] <= budget.host_mem_bytes


def test_without_speculation_nothing_hides_and_backward_is_not_contended():
    cpu = _machine(gpus=0, backward_slowdown_with_host_adam=1.5, host_adam_gelems_per_s=100.0)
    wl = _workload(backward_seconds=100.0)
    spec, seq = predict(cpu, wl, 0.5), predict(cpu, _workload(backward_seconds=100.0, speculative=False), 0.5)
    assert spec.breakdown["host_exposed"] == pytest.approx(spec.breakdown["h2d"], abs=1e-3)
    assert spec.breakdown["backward_contention"] > 0
    assert seq.breakdown["host_exposed"] == pytest.approx(seq.breakdown["host_work"])
    assert seq.breakdown["host_hidden"] == 0 and seq.breakdown["backward_contention"] == 0
    assert seq.step_seconds == pytest.approx(seq.breakdown["device_step"] + seq.breakdown["host_work"])
    # the planner's flag: the same machine plans with no hiding
    args = ["--params", "7B", "--preset", "h100-pcie5", "--json"]
    hidden = json.loads(_plan_json(args))
    plain = json.loads(_plan_json(args + ["--no-speculation"]))
    assert hidden["breakdown"]["host_hidden"] > 0 and plain["breakdown"]["host_hidden"] == 0


def _plan_json(argv) -> str:
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert planner.main(argv) == 0
    return buf.getvalue()


def test_contention_lengthens_backward_on_shared_memory_hosts():
    cpu = _machine(gpus=0, backward_slowdown_with_host_adam=1.5)
    p = predict(cpu, WORKLOAD, 1.0)
    assert p.breakdown["backward_contention"] == pytest.approx(p.breakdown["host_hidden"] / 3)
    assert predict(_machine(gpus=0), WORKLOAD, 1.0).breakdown["backward_contention"] == 0


def test_memory_accounting_sums_per_tier():
    wl = _workload(subgroup_numel=1000)
    none = memory_bytes(MACHINE, wl, 0.0, 0.0, spare_banks=4)
    assert none == {"device": 1e9 * (12 + 2 + 2), "host": 0.0, "nvme": 0.0}
    m = memory_bytes(MACHINE, wl, 0.75, 0.25, spare_banks=4)
    state, sub = 12, 1000
    assert m["device"] == pytest.approx(0.25e9 * state + 1e9 * 4)
    assert m["host"] == pytest.approx(0.5e9 * state + 4 * sub * state + 4 * sub * 4 + 8 * sub * state)
    assert m["nvme"] == pytest.approx(2 * 0.25e9 * state)
    # state is partitioned over the GPUs
    eight = memory_bytes(_machine(gpus=8), wl, 0.0, 0.0)
    assert eight["device"] == pytest.approx(none["device"] / 8)
    # no GPU: everything lives on the host
    cpu = memory_bytes(_machine(gpus=0), wl, 1.0, 0.0, spare_banks=4)
    assert cpu["device"] == 0 and cpu["host"] > 1e9 * (12 + 4)


def test_amsgrad_and_fp32_change_state_bytes():
    ams = memory_bytes(MACHINE, _workload(state_bytes=16), 0.0, 0.0)
    assert ams["device"] == pytest.approx(1e9 * (16 + 4))
    fp32 = memory_bytes(MACHINE, _workload(model_bytes=4, grad_bytes=4), 0.0, 0.0)
    assert fp32["device"] == pytest.approx(1e9 * (8 + 4 + 4))   # the fp32 param is the master


def test_a_gpu_with_room_for_everything_keeps_everything_on_it():
    # a slow host cannot hide its work: offloading only adds time
    p = best_plan(_machine(host_adam_gelems_per_s=0.01), WORKLOAD)
    assert (p.offload_fraction, p.nvme_fraction) == (0.0, 0.0)


def test_best_plan_offloads_what_hides_when_the_host_is_fast_enough():
    # a slow device step (2.8 s) that a fast host can take under a 10 s backward
    m, wl = _machine(device_adam_gbps=10, host_adam_gelems_per_s=10.0), _workload(backward_seconds=10.0)
    p = best_plan(m, wl)
    assert p.offload_fraction > 0.5
    assert p.iteration_seconds < predict(m, wl, 0.0).iteration_seconds - 2.0


def test_best_plan_respects_device_and_host_budgets():
    # device: 4 GB of model+grads and 12 GB of state; 10.8 GB usable holds 6.8 GB of state
    m = _machine(gpu_mem_bytes=12 * GB, host_mem_bytes=1000 * GB, host_adam_gelems_per_s=0.01)
    p = best_plan(m, WORKLOAD, headroom=0.1)
    assert p.memory_bytes["device"] <= 10.8 * GB
    assert p.offload_fraction == pytest.approx(0.45)   # the least offload that fits
    # host too small for the state: the rest goes to nvme
    m2 = _machine(gpu_mem_bytes=5 * GB, host_mem_bytes=5 * GB)
    q = best_plan(m2, WORKLOAD, headroom=0.0)
    assert q.memory_bytes["host"] <= 5 * GB and q.memory_bytes["device"] <= 5 * GB
    assert q.nvme_fraction > 0


def test_best_plan_says_how_much_memory_is_needed_when_nothing_fits():
    with pytest.raises(ValueError, match=r"needs at least 4\.4 GB of GPU memory .*have 3\.0 GB"):
        best_plan(_machine(gpu_mem_bytes=3 * GB), WORKLOAD, headroom=0.1)
    no_nvme = _machine(gpu_mem_bytes=5 * GB, host_mem_bytes=5 * GB, nvme_read_gbps=0, nvme_write_gbps=0)
    with pytest.raises(ValueError, match=r"needs at least \d+\.\d GB of host memory .*have 5\.0 GB"):
        best_plan(no_nvme, WORKLOAD, headroom=0.0)


def test_predict_rejects_impossible_placements():
    with pytest.raises(ValueError, match="nvme_fraction <= offload_fraction"):
        predict(MACHINE, WORKLOAD, 0.2, 0.5)
    with pytest.raises(ValueError, match="no nvme rates"):
        predict(_machine(nvme_read_gbps=0), WORKLOAD, 1.0, 0.5)


@pytest.mark.parametrize("text,value", [("70e9", 70e9), ("7B", 7e9), ("1.3e9", 1.3e9),
                                        ("350M", 350e6), ("7b", 7e9)])
def test_parse_count_accepts_the_usual_spellings(text, value):
    assert planner.parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("preset,params", [("h100-pcie5", "7B"), ("gh200", "13B"),
                                           ("8xh100-node", "70e9"), ("this-machine", "1.3e9")])
def test_planner_json_on_each_preset(preset, params, capsys):
    assert planner.main(["--params", params, "--preset", preset, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_step_seconds"] >= 0
    assert out["predicted_iteration_seconds"] >= out["predicted_step_seconds"]
    assert set(out["plan"]) >= {"offload_fraction", "nvme_fraction"}
    assert set(out["memory_bytes"]) == {"device", "host", "nvme"}
    assert "host_exposed" in out["breakdown"]


def test_planner_options_override_the_preset(capsys):
    # 7B does not fit 24 GB without a disk; with 200 GB and a faster host Adam it does
    assert planner.main(["--params", "7B", "--preset", "this-machine", "--host-mem", "24",
                         "--nvme-drives", "0", "--json"]) == 1
    capsys.readouterr()
    assert planner.main(["--params", "7B", "--preset", "this-machine", "--host-mem", "200",
                         "--host-adam", "4.6", "--nvme-drives", "0", "--backward-seconds", "1000",
                         "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["host_mem_bytes"] == 200 * GB
    assert out["machine"]["nvme_read_gbps"] == 0 and out["plan"]["nvme_fraction"] == 0
    assert out["breakdown"]["host_compute"] == pytest.approx(out["plan"]["offload_fraction"] * 7e9 / 4.6e9)


def test_planner_reports_when_nothing_fits(capsys):
    assert planner.main(["--params", "70e9", "--preset", "gh200"]) == 1
    assert "needs at least" in capsys.readouterr().err


def test_planner_rejects_a_bad_parameter_count(capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(["--params", "seventy", "--json"])
    assert e.value.code == 2
    assert "not a parameter count" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("80", 80e9), ("80GB", 80e9), ("80gb", 80e9),
                                        ("80 GB", 80e9), ("80GiB", 80 * 2 ** 30),
                                        ("2TB", 2e12), ("2tib", 2 * 2 ** 40), ("1.5TB", 1.5e12),
                                        ("512MB", 512e6), ("512MiB", 512 * 2 ** 20),
                                        ("64KB", 64e3), ("64KiB", 65536), ("4096B", 4096)])
def test_parse_size_takes_units_and_a_bare_number_is_gb(text, value):
    assert planner.parse_size(text) == pytest.approx(value)


def test_planner_memory_options_take_units(capsys):
    assert planner.main(["--params", "7B", "--preset", "h100-pcie5", "--gpu-mem", "80GiB",
                         "--host-mem", "2TB", "--json"]) == 0
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert machine["gpu_mem_bytes"] == 80 * 2 ** 30
    assert machine["host_mem_bytes"] == 2e12
    # a bare number keeps its old meaning: GB
    assert planner.main(["--params", "7B", "--preset", "h100-pcie5", "--gpu-mem", "32",
                         "--host-mem", "1500", "--json"]) == 0
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert machine["gpu_mem_bytes"] == 32 * GB and machine["host_mem_bytes"] == 1500 * GB


@pytest.mark.parametrize("option,text,message", [
    ("--gpu-mem", "8XB", r"--gpu-mem: '8XB' is not a size; use e\.g\. 80GB, 80GiB, 2TB"),
    ("--host-mem", "lots", r"--host-mem: 'lots' is not a size"),
    ("--gpu-mem", "80G B", r"--gpu-mem: '80G B' is not a size"),
    ("--host-mem", "0TB", r"--host-mem: must be > 0, got '0TB'")])
def test_planner_rejects_a_bad_size(option, text, message, capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(["--params", "7B", option, text, "--json"])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_python_m_hybrid_opt_plan_prints_a_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "hybrid_opt", "plan", "--params", "7B",
                          "--preset", "gh200"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for text in ("plan: offload_fraction=", "memory per GPU", "predicted:", "where the time goes"):
        assert text in out.stdout
