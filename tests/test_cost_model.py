"""The cost model on synthetic rates, `best_plan`'s budgets and errors, and `hybrid-opt plan`."""

import json
import os
import re
import subprocess
import sys

import pytest

from hybrid_opt.placement import cost_model as cm
from hybrid_opt.placement import plan_report
from hybrid_opt.placement.cost_model import (
    GB,
    NON_SPECULATIVE_SPARE_BANKS,
    SPARE_TOLERANCE,
    Machine,
    Workload,
    best_plan,
    memory_bytes,
    predict,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# round numbers: 1e9 params, 1 GPU, backward 1 s
MACHINE = Machine(
    gpus=1,
    gpu_mem_bytes=100 * GB,
    host_mem_bytes=1000 * GB,
    device_adam_gbps=1000,
    host_adam_gelems_per_s=1.0,
    h2d_gbps=100,
    d2h_gbps=100,
    nvme_read_gbps=10,
    nvme_write_gbps=10,
)
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
    p = predict(
        _machine(host_adam_gelems_per_s=0.1, nvme_read_gbps=100, nvme_write_gbps=100), WORKLOAD, 1.0, 0.5
    )
    io, compute, link = (
        p.breakdown["nvme_io"],
        p.breakdown["host_compute"],
        p.breakdown["d2h"] + p.breakdown["h2d"],
    )
    assert 0 < io < compute
    assert p.breakdown["host_work"] == pytest.approx(compute + link)
    # I/O-bound: compute hides under nvme I/O
    q = predict(
        _machine(host_adam_gelems_per_s=100.0, nvme_read_gbps=1, nvme_write_gbps=1), WORKLOAD, 1.0, 0.5
    )
    assert q.breakdown["nvme_io"] == pytest.approx(0.5e9 * 12 / 1e9 * 2)
    assert q.breakdown["host_work"] == pytest.approx(
        q.breakdown["nvme_io"] + q.breakdown["d2h"] + q.breakdown["h2d"]
    )


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


def test_a_split_worker_hides_at_its_own_cores_rate_and_steps_the_rest_at_every_cores():
    """speculated_host_share: split, the worker steps during backward on its own cores, at that
    share of host_adam's rate (a step on every core, as step() waits for it); what is left when
    backward ends runs at the full rate."""
    m = _machine(host_adam_gelems_per_s=0.1)
    half = _machine(host_adam_gelems_per_s=0.1, speculated_host_share=0.5)
    full_p, half_p = predict(m, WORKLOAD, 1.0), predict(half, WORKLOAD, 1.0)
    assert half_p.breakdown["host_work"] == pytest.approx(full_p.breakdown["host_work"])
    # the 1 s backward hides 1 s of work at the full rate, half that at half of it
    assert full_p.breakdown["host_hidden"] == pytest.approx(1.0, rel=2e-2)
    assert half_p.breakdown["host_hidden"] == pytest.approx(0.5, rel=2e-2)
    assert half_p.step_seconds == pytest.approx(full_p.step_seconds + 0.5, rel=1e-2)
    # a backward longer than the speculated work hides all but the last subgroup either way
    long = _workload(backward_seconds=1e3)
    assert predict(half, long, 1.0).breakdown["host_exposed"] == pytest.approx(
        predict(m, long, 1.0).breakdown["host_exposed"]
    )


def test_a_small_spare_pool_caps_the_work_hidden_under_backward():
    # exact rollback: a speculated step holds a spare bank until step(); 1000 subgroups of 1e6
    wl = _workload(backward_seconds=100.0)
    fast = _machine(host_adam_gelems_per_s=100.0)
    full = predict(fast, wl, 1.0)
    four = predict(fast, wl, 1.0, spare_banks=4)
    assert full.spare_banks == 1000 and four.spare_banks == 4
    h2d = full.breakdown["h2d"]
    assert full.breakdown["host_exposed"] - h2d < 1e-3
    assert four.breakdown["host_exposed"] - h2d == pytest.approx(
        (four.breakdown["host_work"] - h2d) * (1 - 4 / 1000)
    )
    assert four.memory_bytes["host"] < full.memory_bytes["host"]
    # rollback="inverse" needs no spares and hides it all
    inverse = predict(fast, _workload(backward_seconds=100.0, exact_rollback=False), 1.0, spare_banks=4)
    assert inverse.spare_banks == 0 and inverse.breakdown["host_exposed"] - h2d < 1e-3
    # best_plan takes the largest pool that fits the host budget where every spare hides work
    # (a bf16 model's bank: 12 B of state + its 2 B bf16 copy; 1 s of host work, 1 s backward)
    budget = _machine(
        host_adam_gelems_per_s=1.0,
        gpu_mem_bytes=5 * GB,
        host_mem_bytes=14e9 + 600 * 1e6 * 14 + 1e8,
        nvme_read_gbps=0.0,
        nvme_write_gbps=0.0,
    )
    p = best_plan(budget, _workload(backward_seconds=1.0), headroom=0.0, offload_choices=[1.0])
    assert 250 <= p.spare_banks < 1000 and p.memory_bytes["host"] <= budget.host_mem_bytes


def test_best_plan_keeps_only_the_spares_backward_can_fill():
    """A spare holds a speculated step until step(): where backward is short next to the host
    step (the H200's 201M bench: 2.7 against ~40 ms) the spares it cannot fill are memory for
    nothing; best_plan takes the fewest whose iteration is within SPARE_TOLERANCE of the largest
    pool's. Where backward is long, one per subgroup."""
    m = _machine(host_adam_gelems_per_s=1.0)  # 1 ms a subgroup of 1e6
    short = best_plan(m, _workload(backward_seconds=0.01), offload_choices=[1.0])
    full = predict(m, _workload(backward_seconds=0.01), 1.0)
    assert full.spare_banks == 1000 and 4 <= short.spare_banks <= 64
    assert short.iteration_seconds <= full.iteration_seconds * (1 + SPARE_TOLERANCE)
    assert short.memory_bytes["host"] < 0.6 * full.memory_bytes["host"]
    long = best_plan(m, _workload(backward_seconds=10.0), offload_choices=[1.0])
    assert long.spare_banks == 1000
    # without speculation two spares, as ever
    plain = best_plan(m, _workload(backward_seconds=10.0, speculative=False), offload_choices=[1.0])
    assert plain.spare_banks == NON_SPECULATIVE_SPARE_BANKS


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
        assert plan_report.main(argv) == 0
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
    state, bank, sub = 12, 14, 1000  # a host bank also holds the bf16 copy
    assert m["device"] == pytest.approx(0.25e9 * state + 1e9 * 4)
    assert m["host"] == pytest.approx(0.5e9 * bank + 4 * sub * bank + 4 * sub * 4 + 8 * sub * bank)
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
    assert fp32["device"] == pytest.approx(1e9 * (8 + 4 + 4))  # the fp32 param is the master


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
    assert p.offload_fraction == pytest.approx(0.45)  # the least offload that fits
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


@pytest.mark.parametrize(
    "text,value", [("70e9", 70e9), ("7B", 7e9), ("1.3e9", 1.3e9), ("350M", 350e6), ("7b", 7e9)]
)
def test_parse_count_accepts_the_usual_spellings(text, value):
    assert plan_report.parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize(
    "preset,params",
    [("h100-pcie5", "7B"), ("gh200", "13B"), ("8xh100-node", "70e9"), ("this-machine", "1.3e9")],
)
def test_planner_json_on_each_preset(preset, params, capsys):
    assert plan_report.main(["--params", params, "--preset", preset, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_step_seconds"] >= 0
    assert out["predicted_iteration_seconds"] >= out["predicted_step_seconds"]
    assert set(out["plan"]) >= {"offload_fraction", "nvme_fraction"}
    assert set(out["memory_bytes"]) == {"device", "host", "nvme"}
    assert "host_exposed" in out["breakdown"]


def test_planner_options_override_the_preset(capsys):
    # 7B does not fit 24 GB without a disk; with 200 GB and a faster host Adam it does. The GPU's
    # memory is given too: an H200's own 141 GB would hold the 7B's 112 GB of state at offload 0
    argv = ["--params", "7B", "--preset", "this-machine", "--host-mem", "24", "--gpu-mem", "24"]
    assert plan_report.main(argv + ["--nvme-drives", "0", "--json"]) == 1
    capsys.readouterr()
    assert (
        plan_report.main(
            [
                "--params",
                "7B",
                "--preset",
                "this-machine",
                "--host-mem",
                "200",
                "--host-adam",
                "4.6",
                "--nvme-drives",
                "0",
                "--backward-seconds",
                "1000",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["host_mem_bytes"] == 200 * GB
    assert out["machine"]["nvme_read_gbps"] == 0 and out["plan"]["nvme_fraction"] == 0
    assert out["breakdown"]["host_compute"] == pytest.approx(out["plan"]["offload_fraction"] * 7e9 / 4.6e9)


def test_planner_reports_when_nothing_fits(capsys):
    assert plan_report.main(["--params", "70e9", "--preset", "gh200"]) == 1
    assert "needs at least" in capsys.readouterr().err


def test_planner_rejects_a_bad_parameter_count(capsys):
    with pytest.raises(SystemExit) as e:
        plan_report.main(["--params", "seventy", "--json"])
    assert e.value.code == 2
    assert "not a parameter count" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,value",
    [
        ("80", 80e9),
        ("80GB", 80e9),
        ("80gb", 80e9),
        ("80 GB", 80e9),
        ("80GiB", 80 * 2**30),
        ("2TB", 2e12),
        ("2tib", 2 * 2**40),
        ("1.5TB", 1.5e12),
        ("512MB", 512e6),
        ("512MiB", 512 * 2**20),
        ("64KB", 64e3),
        ("64KiB", 65536),
        ("4096B", 4096),
    ],
)
def test_parse_size_takes_units_and_a_bare_number_is_gb(text, value):
    assert plan_report.parse_size(text) == pytest.approx(value)


def test_planner_memory_options_take_units(capsys):
    assert (
        plan_report.main(
            ["--params", "7B", "--preset", "h100-pcie5", "--gpu-mem", "80GiB", "--host-mem", "2TB", "--json"]
        )
        == 0
    )
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert machine["gpu_mem_bytes"] == 80 * 2**30
    assert machine["host_mem_bytes"] == 2e12
    # a bare number keeps its old meaning: GB
    assert (
        plan_report.main(
            ["--params", "7B", "--preset", "h100-pcie5", "--gpu-mem", "32", "--host-mem", "1500", "--json"]
        )
        == 0
    )
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert machine["gpu_mem_bytes"] == 32 * GB and machine["host_mem_bytes"] == 1500 * GB


@pytest.mark.parametrize(
    "option,text,message",
    [
        ("--gpu-mem", "8XB", r"--gpu-mem: '8XB' is not a size; use e\.g\. 80GB, 80GiB, 2TB"),
        ("--host-mem", "lots", r"--host-mem: 'lots' is not a size"),
        ("--gpu-mem", "80G B", r"--gpu-mem: '80G B' is not a size"),
        ("--host-mem", "0TB", r"--host-mem: must be > 0, got '0TB'"),
    ],
)
def test_planner_rejects_a_bad_size(option, text, message, capsys):
    with pytest.raises(SystemExit) as e:
        plan_report.main(["--params", "7B", option, text, "--json"])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_python_m_hybrid_opt_plan_prints_a_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_opt", "plan", "--params", "7B", "--preset", "gh200"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for text in ("plan: offload_fraction=", "memory per GPU", "predicted:", "where the time goes"):
        assert text in out.stdout


# ------------------------------------------------------------------ sharding, collectives, nodes
# (issue #15, "Planner"): --sharding zero|fsdp|none, NVLink / IB rates, per-node host figures

GOLDEN = os.path.join(REPO, "tests", "data", "planner_before_sharding.json")
NEW_MACHINE_KEYS = {
    "gpus_per_node",
    "nvlink_gbps",
    "ib_gbps",
    "shared_cores",
    "speculated_host_share",
    "state_format_factor",
}
NEW_WORKLOAD_KEYS = {"sharding", "bank_padding"}


def _run_planner(argv):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = plan_report.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_planner_without_sharding_prints_what_it_printed_before():
    """Outputs recorded before --sharding existed (tests/data): the summary and errors are
    byte-identical but for the `cores:` line (issue #37: the arrangement of the trainer's and
    the worker's cores) and a smaller spare pool (issue #35: only the spares backward can fill,
    SPARE_TOLERANCE; its host memory line with it); the JSON holds every old key with the same
    value, plus only the new machine/workload fields and `cores`, and on CPU-only machines no
    speculation ("auto"). The CPU-only cases plan no offload, so neither changes any of their
    figures. Every time figure is the same where the pool shrank."""
    with open(GOLDEN) as f:
        cases = json.load(f)["cases"]
    assert len(cases) >= 16 and any(c["rc"] == 1 for c in cases)
    for c in cases:
        rc, out, err = _run_planner(c["argv"])
        assert (rc, err) == (c["rc"], c["stderr"]), c["argv"]
        if "--json" not in c["argv"] or rc != 0:
            lines = out.splitlines(keepends=True)
            cores = [k for k, line in enumerate(lines) if line.startswith("cores: ")]
            offloads = rc == 0 and "offload_fraction=0.00," not in out
            assert len(cores) == int(offloads), (c["argv"], cores)
            lines = lines[: cores[0]] + lines[cores[0] + 1 :] if cores else lines
            assert _fewer_spares(c["stdout"].splitlines(keepends=True), lines) == c["stdout"], c["argv"]
            continue
        old, new = json.loads(c["stdout"]), json.loads(out)
        argv = c["argv"]
        cpu_only = "--gpus" in argv and argv[argv.index("--gpus") + 1] == "0"
        assert new.pop("cores").startswith("shared" if cpu_only else "split"), argv
        assert set(new["machine"]) - set(old["machine"]) == NEW_MACHINE_KEYS
        assert set(new["workload"]) - set(old["workload"]) == NEW_WORKLOAD_KEYS
        assert new["workload"]["sharding"] is None
        for key in NEW_MACHINE_KEYS:
            del new["machine"][key]
        del new["workload"]["sharding"]
        assert new["workload"].pop("bank_padding") == 1.0  # the planner counts no layout
        if cpu_only:  # speculative="auto" on shared cores: host steps after backward (#37)
            assert new["workload"]["speculative"] is False and old["workload"]["speculative"] is True
            new["workload"]["speculative"] = True
        if new["spare_banks"] != old["spare_banks"]:  # only the spares backward can fill (#35)
            assert new["spare_banks"] < old["spare_banks"] and new["workload"]["speculative"], c["argv"]
            assert new["memory_bytes"]["host"] < old["memory_bytes"]["host"], c["argv"]
            new["spare_banks"], new["memory_bytes"]["host"] = old["spare_banks"], old["memory_bytes"]["host"]
        assert new == old, c["argv"]


def _fewer_spares(old: list, new: list) -> str:
    """`new` with its `spare banks:` and host memory lines put back to `old`'s where they hold
    fewer spares and less host memory (SPARE_TOLERANCE); every other line as it is."""
    out = []
    for a, b in zip(old, new):
        if a != b and a.startswith("spare banks: ") and b.startswith("spare banks: "):
            assert int(b.split()[2]) < int(a.split()[2]), (a, b)
            b = a
        elif a != b and a.startswith("  host ") and b.startswith("  host "):
            assert float(b.split()[1]) < float(a.split()[1]), (a, b)
            b = a
        out.append(b)
    return "".join(out + new[len(old) :])


NODE = _machine(
    gpus=8,
    gpu_mem_bytes=1000 * GB,
    host_mem_bytes=8000 * GB,
    host_adam_gelems_per_s=8.0,
    nvlink_gbps=100.0,
    ib_gbps=100.0,
)


def test_fsdp_holds_what_the_default_holds_and_adds_the_collectives():
    legacy = predict(NODE, WORKLOAD, 0.5)
    fsdp = predict(NODE, _workload(sharding="fsdp"), 0.5)
    assert fsdp.memory_bytes == legacy.memory_bytes
    assert "collectives" not in legacy.breakdown
    # 1e9 params over 8 GPUs at 100 GB/s: all-gather x2 (2 B) + reduce-scatter (2 B), 7/8 each
    assert fsdp.breakdown["collectives"] == pytest.approx(3 * 2e9 * 7 / 8 / 100e9)
    assert fsdp.iteration_seconds >= legacy.iteration_seconds


def test_replicated_state_needs_n_times_the_host_memory_and_host_work():
    wl = _workload(exact_rollback=False)  # no spare banks: host memory is state + staging
    zero = predict(NODE, _workload(exact_rollback=False, sharding="zero"), 1.0)
    none = predict(NODE, _workload(exact_rollback=False, sharding="none"), 1.0)
    staging = cm.STAGING_SLOTS * wl.subgroup_numel * (wl.grad_bytes + wl.model_bytes)
    assert none.memory_bytes["host"] - staging == pytest.approx(8 * (zero.memory_bytes["host"] - staging))
    assert none.breakdown["host_compute"] == pytest.approx(8 * zero.breakdown["host_compute"])
    # zero and none hold the whole model copy and grads on every GPU; fsdp 1/8 of them
    fsdp = predict(NODE, _workload(exact_rollback=False, sharding="fsdp"), 1.0)
    assert zero.memory_bytes["device"] == none.memory_bytes["device"] == pytest.approx(1e9 * 4)
    assert fsdp.memory_bytes["device"] == pytest.approx(1e9 * 4 / 8)
    # host memory for the zero plan but not for eight copies: replicated does not fit
    room = _machine(
        **{
            **vars(NODE),
            "host_mem_bytes": 8 * 3 * zero.memory_bytes["host"],
            "nvme_read_gbps": 0,
            "nvme_write_gbps": 0,
            "gpu_mem_bytes": 5 * GB,
        }
    )
    assert (
        best_plan(room, _workload(exact_rollback=False, sharding="zero"), headroom=0.0).offload_fraction > 0
    )
    with pytest.raises(ValueError, match="needs at least .* GB of host memory per GPU"):
        best_plan(room, _workload(exact_rollback=False, sharding="none"), headroom=0.0)


def test_replicated_speculation_hides_nothing_under_ddp():
    # DDP's hooks fire before its all-reduce: every speculated step is redone
    wl = dict(backward_seconds=100.0)
    zero = predict(NODE, _workload(sharding="zero", **wl), 1.0)
    none = predict(NODE, _workload(sharding="none", **wl), 1.0)
    assert zero.breakdown["host_hidden"] > 0
    assert none.breakdown["host_hidden"] == 0
    assert none.breakdown["host_exposed"] == pytest.approx(none.breakdown["host_work"])


def test_collectives_time_grows_with_params_and_shrinks_with_rate():
    for sharding in cm.SHARDINGS:
        base = cm.collective_seconds(NODE, _workload(sharding=sharding))
        big = cm.collective_seconds(NODE, _workload(sharding=sharding, params=2e9))
        fast = cm.collective_seconds(
            _machine(**{**vars(NODE), "nvlink_gbps": 200.0}), _workload(sharding=sharding)
        )
        total = sum(base.values())
        assert total > 0
        assert sum(big.values()) == pytest.approx(2 * total)
        assert sum(fast.values()) == pytest.approx(total / 2)
    # ZeRO-2: reduce-scatter in backward, the updated params' all-gather after the step;
    # DDP: an all-reduce (2x a reduce-scatter) in backward
    zero = cm.collective_seconds(NODE, _workload(sharding="zero"))
    none = cm.collective_seconds(NODE, _workload(sharding="none"))
    assert zero == pytest.approx(
        {"forward": 0.0, "backward": 2e9 * 7 / 8 / 100e9, "after_step": 2e9 * 7 / 8 / 100e9}
    )
    assert none["backward"] == pytest.approx(2 * zero["backward"]) and none["after_step"] == 0
    # across nodes the ring runs at the node's IB share per GPU: 16 GPUs, 8 per node
    two_nodes = _machine(**{**vars(NODE), "gpus": 16, "gpus_per_node": 8})
    assert cm.link_gbps(two_nodes) == pytest.approx(100.0 / 8)
    assert cm.link_gbps(NODE) == 100.0
    # one GPU: nothing to exchange
    assert sum(cm.collective_seconds(MACHINE, _workload(sharding="fsdp")).values()) == 0


def test_collectives_beside_compute_cost_only_what_exceeds_it():
    slow_link = _machine(**{**vars(NODE), "nvlink_gbps": 0.1})
    long = predict(NODE, _workload(sharding="fsdp", backward_seconds=100.0), 0.0)
    assert long.breakdown["collectives"] > 0 and long.breakdown["collectives_exposed"] == 0
    short = predict(slow_link, _workload(sharding="fsdp", backward_seconds=1.0), 0.0)
    comm = cm.collective_seconds(slow_link, _workload(sharding="fsdp"))
    exposed = (comm["forward"] - 0.5) + (comm["backward"] - 1.0)
    assert short.breakdown["collectives_exposed"] == pytest.approx(exposed)
    assert short.iteration_seconds == pytest.approx(1.5 + exposed + short.step_seconds)
    # zero's all-gather of the updated params follows the step: exposed whole
    zero = predict(NODE, _workload(sharding="zero", backward_seconds=100.0), 0.0)
    after = cm.collective_seconds(NODE, _workload(sharding="zero"))["after_step"]
    assert zero.step_seconds == pytest.approx(zero.breakdown["device_step"] + after)


def test_host_figures_are_per_node_and_each_gpu_gets_its_share():
    one_node = predict(_machine(gpus=16), WORKLOAD, 1.0)
    two_nodes = predict(_machine(gpus=16, gpus_per_node=8), WORKLOAD, 1.0)
    # each GPU's rank gets 1/8 of its node's CPU Adam rate, not 1/16 of one machine's
    assert two_nodes.breakdown["host_compute"] == pytest.approx(one_node.breakdown["host_compute"] / 2)
    rc, out, _ = _run_planner(
        [
            "--params",
            "7B",
            "--preset",
            "8xh100-node",
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--host-mem",
            "2TB",
        ]
    )
    assert rc == 0
    assert "of 250.0 GB" in out and "per node, each shared by its 8 GPUs" in out


def test_planner_sharding_prints_its_assumption_and_the_collectives():
    rc, out, _ = _run_planner(["--params", "7B", "--preset", "8xh100-node", "--sharding", "zero"])
    assert rc == 0
    assert "sharding: zero: state sharded over the GPUs, whole model copy and grads on each" in out
    assert re.search(r"collectives \(exposed / total\)\s+\d+\.\d{3} / \d+\.\d{3}", out)
    rc, out, _ = _run_planner(
        ["--params", "7B", "--preset", "8xh100-node", "--sharding", "fsdp", "--nvlink-gbps", "45", "--json"]
    )
    d = json.loads(out)
    assert d["workload"]["sharding"] == "fsdp" and d["machine"]["nvlink_gbps"] == 45
    assert d["breakdown"]["collectives"] == pytest.approx(3 * 7e9 * 2 * 7 / 8 / 45e9)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--sharding", "ddp"], r"--sharding: invalid choice: 'ddp'"),
        (["--nvlink-gbps", "0"], r"--nvlink-gbps: must be > 0, got '0'"),
        (["--ib-gbps", "-5"], r"--ib-gbps: must be > 0, got '-5'"),
        (["--ib-gbps", "fast"], r"--ib-gbps: 'fast' is not a number"),
        (["--gpus-per-node", "0"], r"--gpus-per-node must be >= 1, got 0"),
        (
            ["--gpus", "12", "--gpus-per-node", "8"],
            r"--gpus \(12\) must be a multiple of --gpus-per-node \(8\)",
        ),
        (
            ["--gpus", "4", "--gpus-per-node", "8"],
            r"--gpus \(4\) must be a multiple of --gpus-per-node \(8\)",
        ),
        (["--gpus", "0", "--sharding", "zero"], r"--sharding and --gpus-per-node describe GPU ranks"),
    ],
)
def test_planner_rejects_bad_sharding_and_node_values(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        plan_report.main(["--params", "7B", "--preset", "8xh100-node"] + argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cost_model_rejects_bad_sharding_and_node_values():
    with pytest.raises(ValueError, match=r"sharding must be one of fsdp, zero, none .*'ddp'"):
        predict(NODE, _workload(sharding="ddp"), 0.5)
    with pytest.raises(ValueError, match=r"gpus \(8\) must be a multiple of gpus_per_node \(3\)"):
        best_plan(_machine(gpus=8, gpus_per_node=3), WORKLOAD)
    with pytest.raises(ValueError, match=r"nvlink_gbps must be > 0 to time the collectives"):
        predict(_machine(gpus=8, nvlink_gbps=0.0), _workload(sharding="zero"), 0.5)


# ------------------------------------------------------------------ compressed state (#16)
# bf16 moments and remainders (hybrid_opt/state_format.StateFormat): bytes per tier and per step

BF16, FP32 = "bf16", "fp32"


def _fmt(m=FP32, v=FP32, rem=False):
    import torch

    from hybrid_opt.state.state_format import StateFormat

    dt = {FP32: torch.float32, BF16: torch.bfloat16}
    return StateFormat(dt[m], dt[v], rem)


# (exp_avg, exp_avg_sq, remainders, model, amsgrad) -> device state, host bank, nvme file,
# Adam bytes moved, high half read per nvme element; counted by hand: master 4 (remainder 2;
# an fp32 param on the device: 0), moments 4 or 2 each, a bf16 bank's copy 2; Adam: master
# r+w 8 (remainders: bf16 param r+w 4 + remainder r+w 4), grad read (= model bytes), moments
# r+w, bf16 copy written 2 unless remainders
TIER_BYTES = [
    ((FP32, FP32, False, BF16, False), (12, 14, 12, 28, 0)),
    ((FP32, FP32, False, FP32, False), (8, 12, 12, 28, 0)),
    ((FP32, FP32, False, BF16, True), (16, 18, 16, 36, 0)),
    ((BF16, BF16, False, BF16, False), (8, 10, 8, 20, 0)),
    ((BF16, FP32, False, BF16, False), (10, 12, 10, 24, 0)),
    ((FP32, BF16, False, BF16, False), (10, 12, 10, 24, 0)),
    ((FP32, FP32, True, BF16, False), (10, 12, 10, 26, 2)),
    ((BF16, BF16, True, BF16, False), (6, 8, 6, 18, 2)),
    ((BF16, BF16, True, BF16, True), (8, 10, 8, 22, 2)),
    ((FP32, BF16, True, BF16, True), (10, 12, 10, 26, 2)),
    ((BF16, BF16, True, FP32, False), (4, 8, 8, 20, 0)),  # remainders: bf16 params only
    ((BF16, BF16, False, FP32, True), (6, 10, 10, 24, 0)),
]


@pytest.mark.parametrize("case,want", TIER_BYTES, ids=lambda c: "-".join(map(str, c)))
def test_bytes_per_param_per_tier_for_each_option_combination(case, want):
    m, v, rem, model, ams = case
    size = 4 if model == FP32 else 2
    wl = _workload(model_bytes=size, grad_bytes=size, amsgrad=ams, state_format=_fmt(m, v, rem))
    b = wl.tier_bytes()
    assert (b["device"], b["host"], b["nvme"], b["host_adam"], b["high_half"]) == want
    assert b["device_adam"] == b["host_adam"] == cm.device_bytes_per_element(wl)


def test_the_issue_targets_in_bytes():
    """#16: nvme files 6 B/param (fp32 state: 12), host bank <= 8, an Adam step 18 B (fp32: 28)."""
    both, plain = _fmt(BF16, BF16, True), _fmt()
    b, p = _workload(state_format=both).tier_bytes(), _workload(state_format=plain).tier_bytes()
    assert (
        (b["nvme"], p["nvme"]) == (6, 12) and b["host"] <= 8 and (b["host_adam"], p["host_adam"]) == (18, 28)
    )


def test_memory_per_tier_counts_the_format():
    wl = _workload(subgroup_numel=1000, state_format=_fmt(BF16, BF16, True))
    m = memory_bytes(MACHINE, wl, 0.75, 0.25, spare_banks=4)
    dev, bank, file, sub = 6, 8, 6, 1000
    assert m["device"] == pytest.approx(0.25e9 * dev + 1e9 * (2 + 2))
    assert m["host"] == pytest.approx(0.5e9 * bank + 4 * sub * bank + 4 * sub * (2 + 2) + 8 * sub * bank)
    assert m["nvme"] == pytest.approx(2 * 0.25e9 * file)


def test_compressed_state_moves_fewer_bytes_on_every_path():
    """Host Adam time in proportion to its bytes (18 vs 28), nvme I/O to the file's (6 vs 12),
    the device step to its bytes; the nvme tier's high half crosses D2H (2 B per nvme param)."""
    plain = predict(MACHINE, WORKLOAD, 1.0, 0.5)
    comp = predict(MACHINE, _workload(state_format=_fmt(BF16, BF16, True)), 1.0, 0.5)
    assert comp.breakdown["host_compute"] == pytest.approx(plain.breakdown["host_compute"] * 18 / 28)
    assert comp.breakdown["nvme_io"] == pytest.approx(plain.breakdown["nvme_io"] * 6 / 12)
    assert plain.breakdown["d2h"] == pytest.approx(1e9 * 2 / 100e9)
    assert comp.breakdown["d2h"] == pytest.approx((1e9 * 2 + 0.5e9 * 2) / 100e9)
    dev_plain, dev_comp = (
        predict(MACHINE, WORKLOAD, 0.0),
        predict(MACHINE, _workload(state_format=_fmt(BF16, BF16, True)), 0.0),
    )
    assert dev_comp.breakdown["device_step"] == pytest.approx(dev_plain.breakdown["device_step"] * 18 / 28)
    # bf16 moments without remainders: no high half to copy
    moments = predict(MACHINE, _workload(state_format=_fmt(BF16, BF16)), 1.0, 0.5)
    assert moments.breakdown["d2h"] == pytest.approx(plain.breakdown["d2h"])


def test_a_compressed_format_fits_more_params_in_the_same_budget():
    # 12 GB GPU: 4 GB of bf16 params + grads; plain state (12 B) must offload 45 %, 6 B fits whole
    m = _machine(gpu_mem_bytes=12 * GB, host_adam_gelems_per_s=0.01)
    plain = best_plan(m, WORKLOAD, headroom=0.1)
    comp = best_plan(m, _workload(state_format=_fmt(BF16, BF16, True)), headroom=0.1)
    assert plain.offload_fraction == pytest.approx(0.45) and comp.offload_fraction == 0.0
    # a host too small for plain banks (no nvme) holds the compressed ones
    small = _machine(gpu_mem_bytes=5 * GB, host_mem_bytes=10 * GB, nvme_read_gbps=0, nvme_write_gbps=0)
    with pytest.raises(ValueError, match="needs at least .* GB of host memory"):
        best_plan(small, WORKLOAD, headroom=0.0)
    fits = best_plan(small, _workload(state_format=_fmt(BF16, BF16, True)), headroom=0.0)
    assert fits.memory_bytes["host"] <= 10 * GB and fits.offload_fraction > 0.5


def test_workload_rejects_a_state_bytes_it_cannot_read():
    with pytest.raises(ValueError, match=r"state_bytes must be 12 or 16 .* give state_format= and amsgrad="):
        _workload(state_bytes=20)
    with pytest.raises(TypeError, match="state_format must be a hybrid_opt.state.state_format.StateFormat"):
        _workload(state_format="bf16")
    assert _workload(state_bytes=16).amsgrad and not _workload(state_bytes=12).amsgrad


def test_planner_flags_count_the_compressed_state(capsys):
    base = ["--params", "70e9", "--preset", "8xh100-node"]
    flags = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--store-param-remainders"]
    rc, out, _ = _run_planner(base + flags + ["--json"])
    assert rc == 0
    d = json.loads(out)
    assert d["bytes_per_param"] == {
        "device": 6,
        "host": 8,
        "nvme": 6,
        "host_adam": 18,
        "device_adam": 18,
        "high_half": 2,
    }
    assert (
        d["workload"]["exp_avg_dtype"],
        d["workload"]["exp_avg_sq_dtype"],
        d["workload"]["store_param_remainders"],
        d["workload"]["model_dtype"],
    ) == ("bf16", "bf16", True, "bf16")
    plain = json.loads(_run_planner(base + ["--json"])[1])
    assert plain["bytes_per_param"]["host"] == 14 and plain["workload"]["exp_avg_dtype"] == "fp32"
    # the issue's figure: most of the plain iteration is host Adam; compressed state is faster
    assert plain["breakdown"]["host_compute"] > 0.8 * plain["predicted_iteration_seconds"]
    assert d["predicted_iteration_seconds"] < 0.5 * plain["predicted_iteration_seconds"]
    # only one moment in bf16, the summary says which and its bytes
    rc, out, _ = _run_planner(base + ["--exp-avg-dtype", "bf16"])
    assert rc == 0 and "state: exp_avg bf16, exp_avg_sq fp32, fp32 master" in out
    assert "bytes per param: device 10, host bank 12 (spares alike), nvme file 10" in out
    rc, out, _ = _run_planner(base + flags)
    assert "master = bf16 param + int16 remainder" in out and "device 6, host bank 8" in out
    # remainders do nothing for an fp32 model
    fp32 = json.loads(_run_planner(base + ["--dtype", "fp32", "--store-param-remainders", "--json"])[1])
    assert fp32["bytes_per_param"]["high_half"] == 0 and fp32["bytes_per_param"]["nvme"] == 12


def test_planner_rejects_a_moment_dtype_it_has_no_kernel_for(capsys):
    with pytest.raises(SystemExit) as e:
        plan_report.main(["--params", "7B", "--exp-avg-dtype", "fp16"])
    assert e.value.code == 2
    assert re.search(r"--exp-avg-dtype: invalid choice: 'fp16'", capsys.readouterr().err)


def test_on_shared_cores_host_work_under_backward_hides_nothing():
    """Issue #37: on a CPU-only host the worker runs on the cores the backward runs on (the
    default arrangement there). Host work speculated during backward lengthens it by its own
    time, so the iteration is what stepping after backward costs; on cores of its own the
    same work hides."""
    cpu = dict(gpus=0, host_mem_bytes=1e12, nvme_read_gbps=0.0, nvme_write_gbps=0.0)
    shared = predict(_machine(shared_cores=True, **cpu), WORKLOAD, 1.0)
    split = predict(_machine(shared_cores=False, **cpu), WORKLOAD, 1.0)
    after = predict(_machine(shared_cores=True, **cpu), _workload(speculative=False), 1.0)
    b = shared.breakdown
    assert b["host_hidden"] > 0 and b["backward_contention"] == pytest.approx(b["host_hidden"])
    assert split.breakdown["backward_contention"] == 0.0
    assert shared.iteration_seconds == pytest.approx(after.iteration_seconds)
    assert split.iteration_seconds < shared.iteration_seconds
    assert cm.arrangement(_machine(shared_cores=True, **cpu)).startswith("shared")
    assert cm.arrangement(_machine(gpus=1)).startswith("split")


def test_on_shared_cores_no_grad_is_copied():
    """Issue #37: sharing its cores, the trainer runs the host and nvme tiers' steps itself
    (tiers/inline_steps.py), reading the grads where backward left them: the plan counts no
    grads' copy. Split, the worker steps them and every offloaded grad is copied."""
    cpu = dict(gpus=0, host_mem_bytes=1e12)
    for nv in (0.0, 0.5):
        shared = predict(_machine(shared_cores=True, **cpu), WORKLOAD, 1.0, nv)
        split = predict(_machine(shared_cores=False, **cpu), WORKLOAD, 1.0, nv)
        assert shared.breakdown["d2h"] == 0.0 < split.breakdown["d2h"]  # fp32 params: no high halves


def test_the_planner_says_which_arrangement_of_cores_it_planned_for():
    rc, out, _ = _run_planner(["--params", "8e9", "--gpus", "0", "--host-mem", "64GB", "--nvme-drives", "1"])
    assert rc == 0 and "offload_fraction=0.00," not in out
    assert "\ncores: shared: the params live on the CPU" in out
    rc, out, _ = _run_planner(["--params", "8e9", "--gpus", "1", "--json"])
    assert rc == 0 and json.loads(out)["cores"].startswith("split: the worker steps on cores of its own")


def test_a_format_slower_than_its_bytes_takes_longer_on_the_cpu_only():
    """state_format_factor (calibrate.format_factor: q8 moments are compute-bound on many CPUs)
    scales the host tiers' compute and, without a GPU, the device tier's step (the CPU's cores); a
    GPU's device step keeps its bytes' time."""
    for gpus in (1, 0):
        plain = predict(_machine(gpus=gpus), WORKLOAD, 0.5)
        slow = predict(_machine(gpus=gpus, state_format_factor=2.5), WORKLOAD, 0.5)
        assert slow.breakdown["host_compute"] == pytest.approx(2.5 * plain.breakdown["host_compute"])
        want = plain.breakdown["device_step"] * (2.5 if gpus == 0 else 1.0)
        assert slow.breakdown["device_step"] == pytest.approx(want)
        assert plain.breakdown["device_step"] > 0


def test_the_planner_on_this_machine_counts_how_fast_its_cpu_steps_the_format(monkeypatch):
    """`--preset this-machine` asks calibrate how much longer than its bytes the chosen format steps
    here (for the params' dtype), says so, and the predicted step grows by it."""
    import torch

    from hybrid_opt.placement import calibrate

    asked = []
    factor = {"q8": 2.5}

    def fake(fmt, dt, gdt, threads, amsgrad):
        asked.append((fmt.exp_avg_dtype, dt, gdt, amsgrad))
        return factor["q8"]

    monkeypatch.setattr(calibrate, "format_factor_cached", fake)
    argv = [
        "--params",
        "1e9",
        "--preset",
        "this-machine",
        "--exp-avg-dtype",
        "q8",
        "--exp-avg-sq-dtype",
        "q8",
    ]
    rc, out, _ = _run_planner(argv + ["--backward-seconds", "1"])
    assert rc == 0 and asked == [("q8", torch.bfloat16, torch.bfloat16, False)]
    assert "this CPU steps it 2.50x as long as its bytes say" in out
    slow = json.loads(_run_planner(argv + ["--backward-seconds", "1", "--json"])[1])
    factor["q8"] = 1.0
    rc, out, _ = _run_planner(argv + ["--backward-seconds", "1"])
    assert "as long as its bytes say" not in out
    fast = json.loads(_run_planner(argv + ["--backward-seconds", "1", "--json"])[1])
    assert slow["predicted_step_seconds"] > 1.5 * fast["predicted_step_seconds"]
