"""The main job runs: a few demo steps over all three tiers, from a fresh interpreter."""

import os
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", "hybrid_opt", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_trains_over_every_tier_and_writes_its_loss_curve(tmp_path):
    out = _run(
        ["demo", "--steps", "6", "--no-progress", "--layers", "2", "--out", str(tmp_path / "o")], tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for tier in ("| device |", "| host |", "| nvme |"):
        assert tier in text, text
    assert "torch AdamW: final loss" in text
    # issue #37: where the time went, both runs, the worker's time and the cores' arrangement
    assert "wall time: HybridAdamW" in text and "torch AdamW" in text.split("Where the time goes")[1]
    # a CPU-only host: the trainer steps the host tier itself (tiers/inline_steps.py)
    whose = "of the worker's time" if torch.cuda.is_available() else "of steps in the trainer"
    assert "host and nvme tiers:" in text and whose in text and "; step() waited" in text
    assert "\n  cores: " in text
    assert os.path.getsize(tmp_path / "o" / "demo_loss.png") > 1000
    # the nvme temporary directory is gone
    assert not [p for p in os.listdir(tmp_path) if p.startswith("hybrid_opt_demo_")]


def test_cli_lists_its_commands_and_rejects_unknown_ones(tmp_path):
    ok = _run(["--help"], tmp_path)
    assert ok.returncode == 0 and "demo" in ok.stdout
    bad = _run(["bogus"], tmp_path)
    assert bad.returncode == 2 and "usage" in bad.stdout


def _row(text, tier):
    import re

    m = re.search(rf"^\| {tier} \| (\d+) \| ([\d.]+) \| ([\d.]+|-) \|", text, re.M)
    assert m, text
    return m.group(3)


def test_demo_takes_the_compressed_state_options_and_prints_bytes_per_param(tmp_path):
    """#16: bf16 model, bf16 moments and remainders: 6 B/param on the device, 8 in a host bank
    (remainder 2 + bf16 copy 2 + moments 4), 6 in an nvme file; the plain fp32 run beside it:
    8 (the fp32 param is its own master), 12 and 12."""
    out = _run(
        [
            "demo",
            "--steps",
            "4",
            "--no-progress",
            "--layers",
            "1",
            "--no-baseline",
            "--out",
            str(tmp_path / "o"),
            "--dtype",
            "bf16",
            "--exp-avg-dtype",
            "bf16",
            "--exp-avg-sq-dtype",
            "bf16",
            "--store-param-remainders",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exp_avg bf16, exp_avg_sq bf16, remainders True" in out.stdout
    assert [_row(out.stdout, t) for t in ("device", "host", "nvme")] == ["6.0", "8.0", "6.0"]
    plain = _run(
        [
            "demo",
            "--steps",
            "2",
            "--no-progress",
            "--layers",
            "1",
            "--no-baseline",
            "--out",
            str(tmp_path / "p"),
        ],
        tmp_path,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert [_row(plain.stdout, t) for t in ("device", "host", "nvme")] == ["8.0", "12.0", "12.0"]


def test_tier_state_bytes_counts_each_subgroup_by_its_dtype_and_tier():
    from types import SimpleNamespace

    import torch

    from hybrid_opt.demo import tier_state_bytes
    from hybrid_opt.state.state_format import StateFormat

    sg = lambda i, n, dt: SimpleNamespace(index=i, numel=n, dtype=dt, quantized=False)  # noqa: E731
    subgroups = [
        sg(0, 100, torch.bfloat16),
        sg(1, 10, torch.float32),
        sg(2, 100, torch.bfloat16),
        sg(3, 100, torch.bfloat16),
    ]
    fmt = StateFormat(torch.bfloat16, torch.bfloat16, True)
    got = tier_state_bytes(subgroups, ["device", "device", "host", "nvme"], fmt)
    # an fp32 norm beside bf16 weights keeps its own master: moments only on the device
    assert got["device"] == {"elements": 110, "state_bytes": 100 * 6 + 10 * 4}
    assert got["host"] == {"elements": 100, "state_bytes": 100 * 8}
    assert got["nvme"] == {"elements": 100, "state_bytes": 100 * 6}
    amsgrad = tier_state_bytes(subgroups, ["host"] * 4, StateFormat(), amsgrad=True)
    assert amsgrad["host"]["state_bytes"] == 300 * (4 + 12 + 2) + 10 * 16


def test_the_time_summary_names_the_cost_and_the_arrangement():
    from hybrid_opt.demo import time_summary

    def tier(n, worker, waited, trainer=0.0):
        return dict(subgroups=n, worker_s=worker, trainer_wait_s=waited, trainer_s=trainer)

    totals = {"device": tier(1, 0.0, 0.0, trainer=0.5), "host": tier(2, 2.0, 0.5), "nvme": tier(1, 1.0, 0.5)}
    text = time_summary(
        totals, 100, [0.05] * 100, 5.0, [0.04] * 100, 4.0, "shared: the trainer keeps all 2 cores", clipped=7
    )
    assert "HybridAdamW 5.0 s, torch AdamW 4.0 s (1.25x)" in text
    assert "median iteration 50.0 ms against 40.0 ms (+10.0 ms)" in text
    assert "device tier: 5.00 ms" in text
    assert "host and nvme tiers: 30.00 ms of the worker's time; step() waited 10.00 ms" in text
    assert "on a GPU host the worker has cores of its own" in text
    # shared cores: speculative="auto" speculates nothing, so clipping redoes nothing
    assert "in step() on this host" in text and "clipping" not in text
    split = time_summary(totals, 100, [0.05] * 100, 5.0, None, None, "split: the trainer on cores 0", 0)
    assert "GPU host" not in split and "clipping" not in split and "torch" not in split
    split = time_summary(totals, 100, [0.05] * 100, 5.0, None, None, "split: the trainer on cores 0", 7)
    assert "clipping bit in 7 of 100 steps: a speculated step is redone then" in split
    # a CPU-only host without nvme: the trainer ran the waited host steps itself (HostTier.inline)
    own = time_summary(totals, 100, [0.05] * 100, 5.0, None, None, "shared: x", 0, trainer_steps=True)
    assert (
        "30.00 ms of steps in the trainer (speculated ones, and nvme's reads and writes, at the worker)"
        in own
    )


def test_the_time_summary_gives_each_phase_of_both_runs_and_the_workers_cpu():
    """Where the time goes (issue #37, item 3): each phase of the iteration against torch's, the
    worker's CPU beside its tasks' time, and on shared cores that nothing ran hidden."""
    from hybrid_opt.demo import phase_medians, time_summary

    totals = {
        "device": dict(subgroups=1, worker_s=0.0, trainer_wait_s=0.0, trainer_s=0.1),
        "nvme": dict(subgroups=2, worker_s=0.8, trainer_wait_s=0.2),
    }
    hybrid = phase_medians([(0.013, 0.032, 0.002)] * 9 + [(0.5, 0.5, 0.5)])
    torch_ = phase_medians([(0.013, 0.025, 0.003)] * 10)
    assert hybrid == (13.0, 32.0, 2.0) and torch_ == (13.0, 25.0, 3.0)
    text = time_summary(
        totals,
        100,
        [0.047] * 100,
        4.7,
        [0.041] * 100,
        4.1,
        "shared: the trainer keeps all 2 cores",
        0,
        phases=hybrid,
        base_phases=torch_,
        worker_cpu_s=0.35,
    )
    assert "median ms: forward 13.0 against 13.0 (+0.0); backward 32.0 against 25.0 (+7.0)" in text
    assert "step() 2.0 against 3.0 (-1.0)" in text
    assert "the worker's CPU: 3.50 ms per step" in text
    assert "tiers in step() on this host (here backward +7.0 ms against torch's)" in text
    alone = time_summary(totals, 100, [0.047] * 100, 4.7, None, None, "split: the trainer on cores 0", 0)
    assert "median ms" not in alone and "worker's CPU" not in alone and "hidden" not in alone


def test_process_cpu_s_reads_a_process_cpu_time():
    from hybrid_opt.demo import process_cpu_s

    t0 = process_cpu_s(os.getpid())
    if t0 is None:
        pytest.skip("no /proc here")
    end = time.process_time() + 0.05
    while time.process_time() < end:  # spends CPU the count must see
        pass
    assert process_cpu_s(os.getpid()) >= t0 + 0.03
    assert process_cpu_s(2**22 + 12345) is None
