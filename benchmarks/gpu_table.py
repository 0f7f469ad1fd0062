"""The GPU check's summary: peak device memory per placement, and one table of the figures.

    python benchmarks/gpu_table.py memory --json OUT/gpu_memory.json [--steps 5]
    python benchmarks/gpu_table.py table OUT_DIR

`memory` (CUDA only) trains a small model for a few steps at offload 0, 0.5 and 1 (and with
torch.optim.AdamW(fused=True) for comparison), each from a reset peak, and writes one record per
run: {"impl", "offload", "peak_device_mb", "params_mb", "steps", "device"}, where
peak_device_mb is torch.cuda.max_memory_allocated over optimizer construction and training.

`table` reads what benchmarks/gpu_check.sh's steps wrote into OUT_DIR —
bench_gpu_kernels.json (fused_adam_ GB/s, torch.AdamW(fused=True) and the device-to-device
copy bandwidth of the same run), bench_step.json (the share of the host step hidden under
backward with speculation on) and gpu_memory.json — and prints one markdown table. A JSON that
is missing, unreadable or lacks the records a row needs gives that row "missing" with the
reason (the step that writes it failed or did not run: see gpu_check.log), never an exception:
the table is printed at the end of the check whatever failed before it. A second table gives
each of issue #35's goals with its measured value and pass / FAIL (or "-" where the check did
not measure it: the peer goals need PEERS=1's bench_peers.json). The table step's own exit
status stays 0: a goal not met is a figure to work on, a failed step is a check that broke.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

KERNELS_JSON, STEP_JSON, MEMORY_JSON = "bench_gpu_kernels.json", "bench_step.json", "gpu_memory.json"
OURS_ADAM, TORCH_ADAM, COPY = "gpu_kernels.fused_adam_", "torch.AdamW(fused=True)", "copy_bandwidth"
PREPARED_ADAM = "gpu_kernels.FusedAdam.step"
PLACEMENTS = (0.0, 0.5, 1.0)
MB = 2**20


# ------------------------------------------------------------------------------------------
# the table (no torch needed: CI tests it with sample JSONs)
# ------------------------------------------------------------------------------------------
class Missing(Exception):
    """A figure the table cannot show, with the reason it prints instead."""


def load(out_dir: str, name: str) -> list:
    path = os.path.join(out_dir, name)
    if not os.path.exists(path):
        raise Missing(f"no {name} (its step failed or did not run; see gpu_check.log)")
    try:
        with open(path) as f:
            records = json.load(f)
    except (OSError, ValueError) as e:
        raise Missing(f"{name} unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise Missing(f"{name} is not a list of records")
    return records


def _human(n: int) -> str:
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def kernel_rows(records: list) -> list:
    """fused_adam_ against torch's fused AdamW and the copy bandwidth, per size of the run
    (single tensors, and the list case "[N tensors]"); the launch sweep's rows are left out."""
    copy = next((r.get("gb_per_s") for r in records if r.get("impl") == COPY), None)
    torch_by_job = {
        (r["impl"].replace(TORCH_ADAM, ""), r.get("numel")): r
        for r in records
        if str(r.get("impl", "")).startswith(TORCH_ADAM)
    }
    rows = []
    for r in records:
        impl = str(r.get("impl", ""))
        suffix = impl[len(OURS_ADAM) :]
        if not impl.startswith(OURS_ADAM) or (suffix and not suffix.startswith(" [")):
            continue
        base = torch_by_job.get((suffix, r.get("numel")))
        ours = r.get("gb_per_s")
        what = f"fused_adam_ GB/s, {_human(r.get('numel', 0))} elements{suffix}"
        if ours is None:
            rows.append((what, "missing: the record has no gb_per_s", KERNELS_JSON))
            continue
        parts = [f"{ours:.0f} GB/s"]
        parts.append(
            f"{ours / base['gb_per_s']:.2f}x torch AdamW(fused=True) ({base['gb_per_s']:.0f} GB/s)"
            if base and base.get("gb_per_s")
            else "torch AdamW(fused=True): missing"
        )
        parts.append(
            f"{100 * ours / copy:.0f}% of D2D copy ({copy:.0f} GB/s)" if copy else "D2D copy: missing"
        )
        rows.append((what, "; ".join(parts), KERNELS_JSON))
    if not rows:
        raise Missing(f"no {OURS_ADAM} record in {KERNELS_JSON}")
    return rows


def hidden_rows(records: list) -> list:
    """The speculation study's speculative=True row: % of the worker's time hidden under backward."""
    rows = []
    for r in records:
        impl = str(r.get("impl", ""))
        if "speculative=True" not in impl:
            continue
        pct, worker = r.get("hidden_pct"), r.get("worker_ms")
        value = (
            "missing: no hidden_pct in the record"
            if pct is None
            else f"{pct:.0f}% of a {worker:.1f} ms host step"
            if worker is not None
            else f"{pct:.0f}%"
        )
        if pct is not None and r.get("committed") is not None:
            value += f" (committed {r['committed']}, redone {r.get('redone', 0)})"
        rows.append((f"host step hidden under backward, {impl}", value, STEP_JSON))
    if not rows:
        raise Missing(f"no speculative=True row in {STEP_JSON}")
    return rows


def memory_rows(records: list) -> list:
    rows = []
    for off in PLACEMENTS:
        r = next((r for r in records if r.get("impl") == "HybridAdamW" and r.get("offload") == off), None)
        what = f"peak device memory, HybridAdamW offload {off:g}"
        if r is None or r.get("peak_device_mb") is None:
            rows.append((what, f"missing: no offload {off:g} record", MEMORY_JSON))
        else:
            rows.append(
                (what, f"{r['peak_device_mb']:.0f} MB (params {r.get('params_mb', 0):.0f} MB)", MEMORY_JSON)
            )
    ref = next((r for r in records if r.get("impl") == TORCH_ADAM), None)
    if ref is not None and ref.get("peak_device_mb") is not None:
        rows.append((f"peak device memory, {TORCH_ADAM}", f"{ref['peak_device_mb']:.0f} MB", MEMORY_JSON))
    return rows


# ------------------------------------------------------------------------------------------
# issue #35's goals, each measured, pass or fail
# ------------------------------------------------------------------------------------------
PEERS_JSON = "bench_peers.json"
WORKER_RATE_JSON = "bench_worker_rate.json"  # PEERS=1: benchmarks/bench_worker_rate.py
WORKER_RATE_SHARE = 0.9  # the worker's waited step reaches the in-process kernel's rate, within noise
TORCH_ROW, TORCHAO_ROW = "device only: torch AdamW(fused=True)", "torchao CPUOffloadOptimizer"
ROOF = 0.90  # of the D2D copy bandwidth measured in the same run


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def kernel_goals(records: list) -> list:
    """fused_adam_ at >= 90 % of the copy bandwidth (the largest single tensor, and the list);
    grad_stats at least torch._foreach_norm's speed at every size."""
    copy = next((r.get("gb_per_s") for r in records if r.get("impl") == COPY), None)
    if not copy:
        raise Missing(f"no copy bandwidth in {KERNELS_JSON}")
    rows = []
    ours = [r for r in records if r.get("impl") == OURS_ADAM and r.get("gb_per_s")]
    # a list: the better of fused_adam_ (checks every tensor each call) and FusedAdam.step
    listed = [
        r
        for r in records
        if r.get("gb_per_s")
        and any(str(r.get("impl", "")).startswith(prefix + " [") for prefix in (OURS_ADAM, PREPARED_ADAM))
    ]
    listed.sort(key=lambda r: -r["gb_per_s"])
    for what, pick in (
        ("one tensor", max(ours, key=lambda r: r.get("numel", 0)) if ours else None),
        ("a list", listed[0] if listed else None),
    ):
        goal = f"fused_adam_ >= {ROOF:.0%} of D2D copy, {what}"
        if pick is None:
            rows.append((goal, f"missing: no such {OURS_ADAM} record", "-"))
            continue
        share = pick["gb_per_s"] / copy
        rows.append(
            (
                goal,
                f"{share:.0%} ({pick['gb_per_s']:.0f} of {copy:.0f} GB/s; "
                f"{_human(pick.get('numel', 0))} {pick['impl']})",
                _verdict(share >= ROOF),
            )
        )
    stats = {
        (r["impl"].replace("gpu_kernels.grad_stats", ""), r.get("numel")): r
        for r in records
        if str(r.get("impl", "")).startswith("gpu_kernels.grad_stats") and r.get("median_ms")
    }
    for r in records:
        impl = str(r.get("impl", ""))
        if not impl.startswith("torch._foreach_norm") or not r.get("median_ms"):
            continue
        mine = stats.get((impl.replace("torch._foreach_norm", ""), r.get("numel")))
        if mine is None:
            continue
        ratio = r["median_ms"] / mine["median_ms"]
        rows.append(
            (
                f"grad_stats >= torch._foreach_norm, {_human(r.get('numel', 0))}"
                f"{impl[len('torch._foreach_norm') :]}",
                f"{ratio:.2f}x its speed",
                _verdict(ratio >= 1.0),
            )
        )
    return rows


def memory_goals(records: list) -> list:
    ours = next((r for r in records if r.get("impl") == "HybridAdamW" and r.get("offload") == 0.0), None)
    ref = next((r for r in records if r.get("impl") == TORCH_ADAM), None)
    if not ours or not ref or ours.get("peak_device_mb") is None or ref.get("peak_device_mb") is None:
        raise Missing(f"no offload 0 or torch record in {MEMORY_JSON}")
    ratio = ours["peak_device_mb"] / ref["peak_device_mb"]
    return [
        (
            "peak device memory at offload 0 <= torch fused AdamW's",
            f"{ratio:.3f}x ({ours['peak_device_mb']:.0f} vs {ref['peak_device_mb']:.0f} MB)",
            _verdict(ratio <= 1.0),
        )
    ]


def speculation_goals(records: list) -> list:
    spec = next((r for r in records if "speculative=True" in str(r.get("impl", ""))), None)
    seq = next((r for r in records if "speculative=False" in str(r.get("impl", ""))), None)
    if not spec or not seq or not spec.get("median_ms") or not seq.get("median_ms"):
        raise Missing(f"no speculative=True/False pair in {STEP_JSON}")
    ratio = spec["median_ms"] / seq["median_ms"]
    rows = [
        (
            "speculation never slower than without (iteration)",
            f"{ratio:.3f}x ({spec['median_ms']:.1f} vs {seq['median_ms']:.1f} ms)",
            _verdict(ratio <= 1.0),
        )
    ]
    # backward as it is without speculation (speculation's hooks lengthen the speculative row's)
    fwd, worker, hidden = seq.get("fwd_bwd_ms"), spec.get("worker_ms"), spec.get("hidden_pct")
    if fwd is not None and worker is not None and hidden is not None:
        if fwd > worker:
            rows.append(
                (
                    "speculation hides >= 80% of the host step (backward longer than it)",
                    f"{hidden:.0f}%",
                    _verdict(hidden >= 80),
                )
            )
        else:
            rows.append(
                (
                    "speculation hides >= 80% of the host step (backward longer than it)",
                    f"not applicable here: backward {fwd:.1f} ms < host step {worker:.1f} ms "
                    f"({hidden:.0f}% hidden)",
                    "-",
                )
            )
    return rows


def peer_goals(records: list) -> list:
    """At offload 0: iteration <= 1.02x torch fused AdamW's; at offload 1.0: <= 0.8x torchao's
    time, at no more peak device memory and host bytes per param."""
    by = {str(r.get("impl", "")): r for r in records}
    rows = []
    torch_row = by.get(TORCH_ROW)
    off0 = by.get("HybridAdamW offload 0")

    def iteration(goal, ours, peer, limit):
        ratio = ours["median_ms"] / peer["median_ms"]
        rows.append(
            (
                goal,
                f"{ratio:.2f}x ({ours['median_ms']:.1f} vs {peer['median_ms']:.1f} ms)",
                _verdict(ratio <= limit),
            )
        )

    if torch_row and off0:
        iteration("iteration at offload 0 <= 1.02x torch fused AdamW's", off0, torch_row, 1.02)
    torchao = next((r for k, r in by.items() if k.startswith(TORCHAO_ROW)), None)
    off1 = by.get("HybridAdamW offload 1")
    if torchao and off1:
        iteration("iteration at offload 1.0 <= 0.8x torchao CPUOffloadOptimizer's", off1, torchao, 0.8)
        for key, what in (("peak_device_mb", "peak device MB"), ("host_bytes_per_param", "host B/param")):
            a, b = off1.get(key), torchao.get(key)
            if a is not None and b is not None:
                rows.append((f"{what} at offload 1.0 <= torchao's", f"{a:.1f} vs {b:.1f}", _verdict(a <= b)))
    elif off1:
        rows.append(
            (
                "iteration at offload 1.0 <= 0.8x torchao CPUOffloadOptimizer's",
                "missing: no torchao row (carry its wheel in .wheels/)",
                "-",
            )
        )
    if not rows:
        raise Missing(f"no torch / offload rows in {PEERS_JSON}")
    return rows


def worker_rate_goals(records: list) -> list:
    """The worker's step that step() waits for, split (a GPU host's default), against the
    in-process kernel on every core (torchao's CPUOffloadOptimizer steps in process)."""
    by = {str(r.get("impl", "")): r for r in records}
    split, base = by.get("split"), by.get("in_process")
    if not split or not base or not split.get("gelems_per_s") or not base.get("gelems_per_s"):
        raise Missing(f"no split / in_process rows in {WORKER_RATE_JSON}")
    ratio = split.get("vs_in_process") or split["gelems_per_s"] / base["gelems_per_s"]
    return [
        (
            f"worker's waited host step >= {WORKER_RATE_SHARE:.0%} of the in-process kernel's rate",
            f"{ratio:.2f}x ({split['gelems_per_s']:.2f} vs {base['gelems_per_s']:.2f} G elem/s, "
            f"grads on {split.get('grads_on', '?')})",
            _verdict(ratio >= WORKER_RATE_SHARE),
        )
    ]


def goals(out_dir: str) -> str:
    """Issue #35's goals as a markdown table: measured value, pass / FAIL, or "-" with why not."""
    rows = []
    for name, make, what in (
        (KERNELS_JSON, kernel_goals, "kernels at the roof"),
        (MEMORY_JSON, memory_goals, "peak device memory at offload 0"),
        (STEP_JSON, speculation_goals, "speculation"),
        (PEERS_JSON, peer_goals, "iteration vs torch and torchao (PEERS=1)"),
        (WORKER_RATE_JSON, worker_rate_goals, "the worker's waited step vs the in-process kernel (PEERS=1)"),
    ):
        try:
            rows += make(load(out_dir, name))
        except Missing as e:
            rows.append((what, f"missing: {e}", "-"))
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def assemble(out_dir: str) -> str:
    """One markdown table of every figure, "missing: why" where a JSON could not give one."""
    rows = []
    for name, make, what in (
        (KERNELS_JSON, kernel_rows, "fused_adam_ GB/s vs torch and D2D copy"),
        (STEP_JSON, hidden_rows, "host step hidden under backward"),
        (MEMORY_JSON, memory_rows, "peak device memory per placement"),
    ):
        try:
            rows += make(load(out_dir, name))
        except Missing as e:
            rows.append((what, f"missing: {e}", name))
    lines = ["| measure | value | from |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# the memory run (CUDA)
# ------------------------------------------------------------------------------------------
def _peak_of_run(make_opt, steps: int, layers: int, width: int, batch: int) -> dict:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    params_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / MB
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    opt = make_opt(model.parameters())
    try:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(batch, width, device="cuda")).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / MB
    finally:
        getattr(opt, "close", lambda: None)()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return dict(peak_device_mb=peak, params_mb=params_mb, steps=steps, device=torch.cuda.get_device_name())


def memory(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_table memory: no CUDA device here; peak device memory is measured on GPUs only.")
        return 0
    from hybrid_opt import HybridAdamW

    records = []
    shape = dict(steps=args.steps, layers=args.layers, width=args.width, batch=args.batch)
    for off in PLACEMENTS:
        r = _peak_of_run(
            lambda p, off=off: HybridAdamW(p, offload_fraction=off, subgroup_numel=1 << 21), **shape
        )
        records.append(dict(impl="HybridAdamW", offload=off, **r))
        print(
            f"HybridAdamW offload {off:g}: peak {r['peak_device_mb']:.0f} MB (params {r['params_mb']:.0f} MB)",
            flush=True,
        )
    r = _peak_of_run(lambda p: torch.optim.AdamW(p, fused=True), **shape)
    records.append(dict(impl=TORCH_ADAM, offload=None, **r))
    print(f"{TORCH_ADAM}: peak {r['peak_device_mb']:.0f} MB")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("memory", help="peak device memory per placement (CUDA)")
    m.add_argument("--json", default=None)
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--width", type=int, default=2048)
    m.add_argument("--batch", type=int, default=16)
    t = sub.add_parser("table", help="the summary table from the check's JSONs")
    t.add_argument("out_dir")
    args = ap.parse_args(argv)
    if args.cmd == "memory":
        return memory(args)
    print(assemble(args.out_dir))
    print()
    print(f"Goals (issue #35; {ROOF:.0%} roof = of the D2D copy measured in the same run):")
    print()
    print(goals(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
