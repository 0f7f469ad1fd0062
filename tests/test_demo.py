"""The main job runs: a few demo steps over all three tiers, from a fresh interpreter."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "hybrid_opt", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_trains_over_every_tier_and_writes_its_loss_curve(tmp_path):
    out = _run(["demo", "--steps", "6", "--no-progress", "--layers", "2", "--out", str(tmp_path / "o")],
               tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for tier in ("| device |", "| host |", "| nvme |"):
        assert tier in text, text
    assert "torch AdamW: final loss" in text
    assert os.path.getsize(tmp_path / "o" / "demo_loss.png") > 1000
    # the nvme temporary directory is gone
    assert not [p for p in os.listdir(tmp_path) if p.startswith("hybrid_opt_demo_")]


def test_cli_lists_its_commands_and_rejects_unknown_ones(tmp_path):
    ok = _run(["--help"], tmp_path)
    assert ok.returncode == 0 and "demo" in ok.stdout
    bad = _run(["bogus"], tmp_path)
    assert bad.returncode == 2 and "usage" in bad.stdout
