"""benchmarks/gpu_table.py's table, from sample JSONs shaped like what gpu_check.sh's steps
write (bench_gpu_kernels.py --json, bench_step.py --json, gpu_table.py memory --json): every
figure where its JSON has it, "missing" with the reason where a step failed, never an
exception. And gpu_check.sh itself: step limits within the 8 minutes, the peer study opt-in."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_table  # noqa: E402

KERNELS = [
    {"impl": "copy_bandwidth", "gb_per_s": 4000.0, "device": "H200"},
    {"impl": "gpu_kernels.fused_adam_", "numel": 16 << 20, "gb_per_s": 3400.0},
    {"impl": "torch.AdamW(fused=True)", "numel": 16 << 20, "gb_per_s": 1700.0},
    {"impl": "gpu_kernels.fused_adam_", "numel": 128 << 20, "gb_per_s": 3600.0},
    {"impl": "torch.AdamW(fused=True)", "numel": 128 << 20, "gb_per_s": 2400.0},
    {"impl": "gpu_kernels.fused_adam_ [1000 tensors]", "numel": 64 << 20, "gb_per_s": 3000.0},
    {"impl": "torch.AdamW(fused=True) [1000 tensors]", "numel": 64 << 20, "gb_per_s": 1000.0},
    {"impl": "gpu_kernels.fused_adam_ BLOCK=1024 ITERS=1 warps=4", "numel": 128 << 20, "gb_per_s": 1.0},
    {"impl": "gpu_kernels.grad_stats", "numel": 16 << 20, "gb_per_s": 2000.0},
]
STEP = [
    {"impl": "torch AdamW(fused=True), in process", "median_ms": 10.0},
    {
        "impl": "HybridAdamW offload 1.0, speculative=False",
        "median_ms": 30.0,
        "hidden_pct": 0.0,
        "worker_ms": 20.0,
    },
    {
        "impl": "HybridAdamW offload 1.0, speculative=True",
        "median_ms": 20.0,
        "hidden_pct": 61.4,
        "worker_ms": 20.0,
        "committed": 16,
        "redone": 0,
    },
]
MEMORY = [
    {"impl": "HybridAdamW", "offload": off, "peak_device_mb": mb, "params_mb": 128.0}
    for off, mb in ((0.0, 900.0), (0.5, 600.0), (1.0, 300.0))
] + [{"impl": "torch.AdamW(fused=True)", "offload": None, "peak_device_mb": 1000.0}]


def write(tmp_path, **files):
    for name, records in files.items():
        path = tmp_path / name
        path.write_text(records if isinstance(records, str) else json.dumps(records))


def rows(table: str) -> dict:
    out = {}
    for line in table.splitlines()[2:]:
        measure, value, source = [c.strip() for c in line.strip("|").split("|")]
        out[measure] = (value, source)
    return out


def test_full_table_has_every_figure(tmp_path):
    write(
        tmp_path,
        **{gpu_table.KERNELS_JSON: KERNELS, gpu_table.STEP_JSON: STEP, gpu_table.MEMORY_JSON: MEMORY},
    )
    table = gpu_table.assemble(str(tmp_path))
    assert table.splitlines()[0] == "| measure | value | from |"
    got = rows(table)
    assert got["fused_adam_ GB/s, 128M elements"][0] == (
        "3600 GB/s; 1.50x torch AdamW(fused=True) (2400 GB/s); 90% of D2D copy (4000 GB/s)"
    )
    assert got["fused_adam_ GB/s, 16M elements"][0].startswith("3400 GB/s; 2.00x")
    assert got["fused_adam_ GB/s, 64M elements [1000 tensors]"][0].startswith("3000 GB/s; 3.00x")
    assert not any("BLOCK" in k or "grad_stats" in k for k in got), "sweep / stats rows leaked in"
    hidden = [v for k, v in got.items() if k.startswith("host step hidden")]
    assert hidden == [("61% of a 20.0 ms host step (committed 16, redone 0)", "bench_step.json")]
    assert got["peak device memory, HybridAdamW offload 0"][0] == "900 MB (params 128 MB)"
    assert got["peak device memory, HybridAdamW offload 0.5"][0] == "600 MB (params 128 MB)"
    assert got["peak device memory, HybridAdamW offload 1"][0] == "300 MB (params 128 MB)"
    assert got["peak device memory, torch.AdamW(fused=True)"][0] == "1000 MB"
    assert "missing" not in table


@pytest.mark.parametrize("absent", [gpu_table.KERNELS_JSON, gpu_table.STEP_JSON, gpu_table.MEMORY_JSON])
def test_a_missing_json_leaves_a_missing_row_and_the_rest(tmp_path, absent):
    files = {gpu_table.KERNELS_JSON: KERNELS, gpu_table.STEP_JSON: STEP, gpu_table.MEMORY_JSON: MEMORY}
    del files[absent]
    write(tmp_path, **files)
    got = rows(gpu_table.assemble(str(tmp_path)))
    missing = {k: v for k, v in got.items() if v[0].startswith("missing")}
    assert len(missing) == 1, got
    ((value, source),) = missing.values()
    assert source == absent and f"no {absent}" in value and "gpu_check.log" in value
    others = {
        gpu_table.KERNELS_JSON: "fused_adam_ GB/s, 128M elements",
        gpu_table.STEP_JSON: "host step hidden under backward, HybridAdamW offload 1.0, speculative=True",
        gpu_table.MEMORY_JSON: "peak device memory, HybridAdamW offload 0.5",
    }
    for name, key in others.items():
        assert (key in got) == (name != absent), key


def test_unreadable_and_partial_jsons_say_why(tmp_path):
    write(
        tmp_path,
        **{
            gpu_table.KERNELS_JSON: '[{"impl": "copy_b',  # cut short by a killed step
            gpu_table.STEP_JSON: [{"impl": "HybridAdamW offload 1.0, speculative=False"}],
            gpu_table.MEMORY_JSON: MEMORY[:1],
        },
    )
    got = rows(gpu_table.assemble(str(tmp_path)))
    assert got["fused_adam_ GB/s vs torch and D2D copy"][0].startswith(
        "missing: bench_gpu_kernels.json unreadable (JSONDecodeError"
    )
    assert got["host step hidden under backward"][0] == "missing: no speculative=True row in bench_step.json"
    assert got["peak device memory, HybridAdamW offload 0"][0] == "900 MB (params 128 MB)"
    assert got["peak device memory, HybridAdamW offload 0.5"][0] == "missing: no offload 0.5 record"


def test_kernel_rows_without_a_baseline_still_show_ours(tmp_path):
    write(
        tmp_path,
        **{
            gpu_table.KERNELS_JSON: [
                r for r in KERNELS if r["impl"] not in ("copy_bandwidth", "torch.AdamW(fused=True)")
            ]
        },
    )
    got = rows(gpu_table.assemble(str(tmp_path)))
    assert got["fused_adam_ GB/s, 128M elements"][0] == (
        "3600 GB/s; torch AdamW(fused=True): missing; D2D copy: missing"
    )


def test_table_command_prints_it_and_exits_0_with_nothing_there(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_table.py"), "table", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("missing: no ") == 3 + 5  # the figures, then the goals


def test_memory_command_without_cuda_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the memory run is gpu_check.sh's")
    assert gpu_table.main(["memory", "--json", str(tmp_path / "m.json")]) == 0
    assert not (tmp_path / "m.json").exists()


def _steps(script: str) -> dict:
    """gpu_check.sh's `step NAME LIMIT ...` lines: name -> limit (s)."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*step (\S+) (\d+) ", script, re.M)}


def test_gpu_check_fits_eight_minutes_and_makes_the_peer_study_opt_in():
    script = open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")).read()
    steps = _steps(script)
    assert {"gpu-tests", "benchmark", "end-to-end", "memory", "table"} <= set(steps), steps
    grace = int(re.search(r"--kill-after=(\d+)", script).group(1))
    default = {
        k: v
        for k, v in steps.items()
        if k not in ("peers", "torchao", "worker-rate", "sweep", "cuda-suite-long")
    }
    assert sum(default.values()) + grace * len(default) <= 8 * 60, default
    assert re.search(r'if \[\[ "\$\{PEERS:-0\}" == 1 \]\]', script), "the peer study must be opt-in (PEERS=1)"
    assert re.search(r'if \[\[ "\$\{SUITE:-0\}" == 1 \]\]', script), (
        "the long CUDA suite must be opt-in (SUITE=1)"
    )
    assert "gpu_table.py table" in script and "gpu_table.py memory" in script


PEERS = [
    {
        "impl": "device only: torch AdamW(fused=True)",
        "median_ms": 4.5,
        "peak_device_mb": 3139.0,
        "host_bytes_per_param": 0.0,
    },
    {
        "impl": "torchao CPUOffloadOptimizer(AdamW fused)",
        "median_ms": 70.0,
        "peak_device_mb": 1602.0,
        "host_bytes_per_param": 16.0,
    },
    {
        "impl": "HybridAdamW offload 0",
        "median_ms": 4.5,
        "peak_device_mb": 3139.0,
        "host_bytes_per_param": 0.0,
    },
    {
        "impl": "HybridAdamW offload 1",
        "median_ms": 60.0,
        "peak_device_mb": 1700.0,
        "host_bytes_per_param": 13.0,
    },
]


# bench_worker_rate.py's rows, at the H200's figures of 2026-12-04 (the worker on 8 of 16 cores)
WORKER_RATE = [
    {"impl": "in_process", "gelems_per_s": 4.96, "vs_in_process": 1.0, "grads_on": "cuda"},
    {"impl": "split", "gelems_per_s": 2.75, "vs_in_process": 0.5544, "grads_on": "cuda"},
]


def test_goals_give_each_goal_its_figure_and_verdict(tmp_path):
    kernels = KERNELS + [
        {"impl": "gpu_kernels.grad_stats", "numel": 16 << 20, "median_ms": 0.05},
        {"impl": "torch._foreach_norm", "numel": 16 << 20, "median_ms": 0.06},
        {"impl": "gpu_kernels.grad_stats [1000 tensors]", "numel": 64 << 20, "median_ms": 2.0},
        {"impl": "torch._foreach_norm [1000 tensors]", "numel": 64 << 20, "median_ms": 1.0},
    ]
    step = [dict(r, fwd_bwd_ms=30.0) for r in STEP]
    listed = kernels + [
        {"impl": "gpu_kernels.FusedAdam.step [1000 tensors]", "numel": 64 << 20, "gb_per_s": 3700.0}
    ]
    write(tmp_path, **{gpu_table.KERNELS_JSON: listed})
    assert rows(gpu_table.goals(str(tmp_path)))["fused_adam_ >= 90% of D2D copy, a list"] == (
        "92% (3700 of 4000 GB/s; 64M gpu_kernels.FusedAdam.step [1000 tensors])",
        "pass",
    )
    write(
        tmp_path,
        **{
            gpu_table.KERNELS_JSON: kernels,
            gpu_table.STEP_JSON: step,
            gpu_table.MEMORY_JSON: MEMORY,
            gpu_table.PEERS_JSON: PEERS,
            gpu_table.WORKER_RATE_JSON: WORKER_RATE,
        },
    )
    table = gpu_table.goals(str(tmp_path))
    assert table.splitlines()[0] == "| goal | measured | verdict |"
    got = rows(table)
    assert got["fused_adam_ >= 90% of D2D copy, one tensor"] == (
        "90% (3600 of 4000 GB/s; 128M gpu_kernels.fused_adam_)",
        "pass",
    )
    assert got["fused_adam_ >= 90% of D2D copy, a list"] == (
        "75% (3000 of 4000 GB/s; 64M gpu_kernels.fused_adam_ [1000 tensors])",
        "FAIL",
    )
    assert got["grad_stats >= torch._foreach_norm, 16M"] == ("1.20x its speed", "pass")
    assert got["grad_stats >= torch._foreach_norm, 64M [1000 tensors]"] == ("0.50x its speed", "FAIL")
    assert got["peak device memory at offload 0 <= torch fused AdamW's"] == (
        "0.900x (900 vs 1000 MB)",
        "pass",
    )
    assert got["speculation never slower than without (iteration)"] == ("0.667x (20.0 vs 30.0 ms)", "pass")
    assert got["speculation hides >= 80% of the host step (backward longer than it)"] == ("61%", "FAIL")
    assert got["iteration at offload 0 <= 1.02x torch fused AdamW's"] == ("1.00x (4.5 vs 4.5 ms)", "pass")
    assert got["iteration at offload 1.0 <= 0.8x torchao CPUOffloadOptimizer's"] == (
        "0.86x (60.0 vs 70.0 ms)",
        "FAIL",
    )
    assert got["peak device MB at offload 1.0 <= torchao's"] == ("1700.0 vs 1602.0", "FAIL")
    assert got["host B/param at offload 1.0 <= torchao's"] == ("13.0 vs 16.0", "pass")
    assert got["worker's waited host step >= 90% of the in-process kernel's rate"] == (
        "0.55x (2.75 vs 4.96 G elem/s, grads on cuda)",
        "FAIL",
    )
    write(tmp_path, **{gpu_table.WORKER_RATE_JSON: [dict(r, vs_in_process=0.95) for r in WORKER_RATE]})
    assert (
        rows(gpu_table.goals(str(tmp_path)))[
            "worker's waited host step >= 90% of the in-process kernel's rate"
        ][1]
        == "pass"
    )


def test_goals_say_what_was_not_measured(tmp_path):
    write(tmp_path, **{gpu_table.STEP_JSON: STEP})  # no kernels, memory or peers; no fwd_bwd_ms
    got = rows(gpu_table.goals(str(tmp_path)))
    assert got["kernels at the roof"][1] == "-" and got["kernels at the roof"][0].startswith("missing: no ")
    assert got["iteration vs torch and torchao (PEERS=1)"][0].startswith("missing: no bench_peers.json")
    assert got["the worker's waited step vs the in-process kernel (PEERS=1)"][0].startswith(
        "missing: no bench_worker_rate.json"
    )
    assert got["speculation never slower than without (iteration)"][1] == "pass"
