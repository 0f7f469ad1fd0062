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
the table is printed at the end of the check whatever failed before it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

KERNELS_JSON, STEP_JSON, MEMORY_JSON = "bench_gpu_kernels.json", "bench_step.json", "gpu_memory.json"
OURS_ADAM, TORCH_ADAM, COPY = "gpu_kernels.fused_adam_", "torch.AdamW(fused=True)", "copy_bandwidth"
PLACEMENTS = (0.0, 0.5, 1.0)
MB = 2 ** 20


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
    for unit, size in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def kernel_rows(records: list) -> list:
    """fused_adam_ against torch's fused AdamW and the copy bandwidth, per size of the run
    (single tensors, and the list case "[N tensors]"); the launch sweep's rows are left out."""
    copy = next((r.get("gb_per_s") for r in records if r.get("impl") == COPY), None)
    torch_by_job = {(r["impl"].replace(TORCH_ADAM, ""), r.get("numel")): r for r in records
                    if str(r.get("impl", "")).startswith(TORCH_ADAM)}
    rows = []
    for r in records:
        impl = str(r.get("impl", ""))
        suffix = impl[len(OURS_ADAM):]
        if not impl.startswith(OURS_ADAM) or (suffix and not suffix.startswith(" [")):
            continue
        base = torch_by_job.get((suffix, r.get("numel")))
        ours = r.get("gb_per_s")
        what = f"fused_adam_ GB/s, {_human(r.get('numel', 0))} elements{suffix}"
        if ours is None:
            rows.append((what, "missing: the record has no gb_per_s", KERNELS_JSON))
            continue
        parts = [f"{ours:.0f} GB/s"]
        parts.append(f"{ours / base['gb_per_s']:.2f}x torch AdamW(fused=True) ({base['gb_per_s']:.0f} GB/s)"
                     if base and base.get("gb_per_s") else "torch AdamW(fused=True): missing")
        parts.append(f"{100 * ours / copy:.0f}% of D2D copy ({copy:.0f} GB/s)" if copy else "D2D copy: missing")
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
        value = ("missing: no hidden_pct in the record" if pct is None else
                 f"{pct:.0f}% of a {worker:.1f} ms host step" if worker is not None else f"{pct:.0f}%")
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
            rows.append((what, f"{r['peak_device_mb']:.0f} MB (params {r.get('params_mb', 0):.0f} MB)",
                         MEMORY_JSON))
    ref = next((r for r in records if r.get("impl") == TORCH_ADAM), None)
    if ref is not None and ref.get("peak_device_mb") is not None:
        rows.append((f"peak device memory, {TORCH_ADAM}", f"{ref['peak_device_mb']:.0f} MB", MEMORY_JSON))
    return rows


def assemble(out_dir: str) -> str:
    """One markdown table of every figure, "missing: why" where a JSON could not give one."""
    rows = []
    for name, make, what in ((KERNELS_JSON, kernel_rows, "fused_adam_ GB/s vs torch and D2D copy"),
                             (STEP_JSON, hidden_rows, "host step hidden under backward"),
                             (MEMORY_JSON, memory_rows, "peak device memory per placement")):
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
    return dict(peak_device_mb=peak, params_mb=params_mb, steps=steps,
                device=torch.cuda.get_device_name())


def memory(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("gpu_table memory: no CUDA device here; peak device memory is measured on GPUs only.")
        return 0
    from hybrid_opt import HybridAdamW
    records = []
    shape = dict(steps=args.steps, layers=args.layers, width=args.width, batch=args.batch)
    for off in PLACEMENTS:
        r = _peak_of_run(lambda p, off=off: HybridAdamW(p, offload_fraction=off, subgroup_numel=1 << 21),
                         **shape)
        records.append(dict(impl="HybridAdamW", offload=off, **r))
        print(f"HybridAdamW offload {off:g}: peak {r['peak_device_mb']:.0f} MB (params {r['params_mb']:.0f} MB)",
              flush=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
