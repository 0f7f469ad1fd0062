"""The q8 Adam step (issue 38) against our fp32 kernel and torch's fused AdamW, same tensors, same
process, interleaved rounds, at each SIMD level this CPU runs.

    python benchmarks/bench_q8.py [--sizes 16Mi] [--reps 15] [--trials 3] [--levels avx512 avx2]
                                  [--threads 2] [--json out.json] [--one-process] [--timeout 900]

Each level runs as on a host that has no higher one: in a process of its own, with torch's kernels
(and so torch fused AdamW's, bitsandbytes' torch ops and the code torchao's torch.compile generates)
at the same level (ATEN_CPU_CAPABILITY=avx2 for avx2; `torch_level` in the records says which ran).
bitsandbytes' own C library picks AVX-512 by its own CPU check wherever the CPU has it.
--one-process times every level in this process against torch at the host's own level.

Rows (fp32 grads, fp32 master, in place): q8_q8 (both moments q8), fp32 (cpu_kernels.adam_step_),
torch_fused (torch.optim.AdamW fused=True, on torch's own threads, stepping the fp32 row's param and
moments); at avx512, q8_q8_pipeline or q8_q8_apart: the q8 step with the fused pass's other
arrangement of its codes than the CPU's vendor chose (cpu_kernels/csrc/kernels.h,
hybrid_get_q8_pipeline). bytes_per_elem is what a row
must move (reads + writes, no read-for-ownership): q8_q8 16 (p 4+4, g 4, m 1+1, v 1+1; the fp32
absmax per 256 rounds to 0.03), fp32 and torch 28. GB/s is those bytes over the median time; the
ratio column is fp32's median over the row's (issue 38's target for q8: >= 1.3). With --trials N the
interleaved timing runs N times: a row's median is the median of the trial medians and its spread
the lowest and highest trial median. bitsandbytes' and torchao's 8-bit AdamW run when importable
(issue 38 measured them 30-41x slower than torch fused); then "bnb / this" and "torchao / this"
say how many times faster than each a row steps (issue 38's target for q8: >= 25).

"% roof" is a row's GB/s over the roofline row's: `cpu_kernels.bandwidth_probe_`, Adam's 28 B an
element in place (four fp32 streams, one read, three updated) on tensors of its own, timed in the
same rounds (the probe moves no 1-byte stream, so a q8 row's roof is the fp32 pattern's bandwidth).
"state B/param (PSS)" is what the operating system counts the row's optimizer state to take: the
process's proportional set size (psutil) before and after the state is made, over the elements —
the moments (q8: codes and absmaxes) of ours; torch's state is the fp32 row's moments; bitsandbytes'
and torchao's, their first step on a second optimizer of the same size, after a first optimizer's
step has paid for torch.compile (torchao) and the libraries' own set-up, so that only the state counts.
The param (the fp32 master here, the model's own) is no row's state.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import host_description, markdown_table, parse_size, time_ms_interleaved, write_json  # noqa: E402

import cpu_kernels  # noqa: E402
from cpu_kernels import q8_reference as q8  # noqa: E402

# the torch kernels (ATEN_CPU_CAPABILITY) of a host whose best level is ours
TORCH_LEVEL = {"avx512": "avx512", "avx2": "avx2", "portable": "default"}
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
BYTES = {"q8_q8": 16.0 + 8.0 / 256, "q8_q8_pipeline": 16.0 + 8.0 / 256, "q8_q8_apart": 16.0 + 8.0 / 256}
BYTES.update(fp32=28.0, torch_fused=28.0, roofline=28.0)


def _pss() -> int:
    return psutil.Process().memory_full_info().pss


def _fixed_mmap_threshold() -> None:
    """glibc serves large allocations by mmap, and returns them to the OS when freed, only up to a
    threshold it raises after each such free: later ones then come from freed heap memory, which PSS
    already counts (a state made after a temporary was freed read 0 B/param). A fixed threshold keeps
    every large allocation mmap'd, so PSS grows by what a state holds. Not glibc: PSS as it comes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 16 << 10)  # M_MMAP_THRESHOLD: an absmax of 4 Mi elements is 64 KiB
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: the heap's free top goes back to the OS at once
        libc.mallopt(-2, 0)  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


def _made(make):
    """(make(), the bytes the process's PSS grew by while it ran)."""
    before = _pss()
    out = make()
    return out, _pss() - before


def _steppers(n: int) -> tuple[dict, dict]:
    """({row: step}, {row: bytes of optimizer state the OS counts}) over n elements."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g)
    m0, v0 = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    q_param, f_param = (torch.randn(n, generator=torch.Generator().manual_seed(1)) for _ in range(2))
    quantize = lambda k: (q8.quantize_blocks(m0[:k], True), q8.quantize_blocks(v0[:k], False))  # noqa: E731
    quantize(4096)  # its code's first pages (PSS counts a library's pages too), then the state alone
    (mq, vq), q8_state = _made(lambda: quantize(n))
    (fm, fv), fp32_state = _made(lambda: (m0.clone(), v0.clone()))
    probe = [torch.randn(n, generator=g) for _ in range(4)]

    def ours_q8():
        cpu_kernels.q8_adam_step_(q_param, grad, mq, vq, step=3, **HP)

    def ours_fp32():
        cpu_kernels.adam_step_(f_param, grad, fm, fv, step=3, **HP)

    # torch steps the fp32 row's tensors, its state the fp32 row's moments: where a tensor's pages lie
    # moved a step by up to a third on a Zen 3 (bench_cpu_adam.py), so the two compare kernels
    t_param = torch.nn.Parameter(f_param)  # shares storage
    t_param.grad = grad
    opt = torch.optim.AdamW(
        [t_param],
        lr=HP["lr"],
        betas=(HP["beta1"], HP["beta2"]),
        eps=HP["eps"],
        weight_decay=HP["weight_decay"],
        fused=True,
    )
    opt.state[t_param] = {"step": torch.tensor(0.0), "exp_avg": fm, "exp_avg_sq": fv}
    steppers = {"q8_q8": ours_q8, "fp32": ours_fp32, "torch_fused": opt.step}
    state = {"q8_q8": q8_state, "fp32": fp32_state, "torch_fused": fp32_state}
    if cpu_kernels.simd_level() == "avx512":
        # the fused pass's other arrangement of its codes than the CPU's vendor chose (kernels.h,
        # hybrid_get_q8_pipeline): q8_q8_pipeline where it writes them after each block, else _apart
        other = not cpu_kernels._lib._q8_pipeline()

        def ours_q8_other():
            cpu_kernels._lib._set_q8_pipeline(other)
            try:
                ours_q8()
            finally:
                cpu_kernels._lib._set_q8_pipeline(not other)

        steppers["q8_q8_pipeline" if other else "q8_q8_apart"] = ours_q8_other
        state["q8_q8_pipeline" if other else "q8_q8_apart"] = q8_state
    for name, factory in _eight_bit_baselines():
        steppers[name], state[name] = factory(n, grad)
    steppers["roofline"] = lambda: cpu_kernels.bandwidth_probe_(*probe)
    return steppers, state


def _first_steps(make_opt, n, grad):
    """A peer's step and its state's bytes: a first optimizer steps once (torch.compile, the library's
    set-up), then a second one of the same size makes its state in its first step, measured."""
    params = []
    for _ in range(2):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = grad.clone()
        params.append(p)
    make_opt(params[0]).step()
    opt = make_opt(params[1])
    _, made = _made(opt.step)
    return opt.step, made


def _eight_bit_baselines():
    """(name, factory(n, grad) -> step) for bitsandbytes' / torchao's AdamW8bit where importable."""
    out = []
    try:
        import bitsandbytes as bnb  # noqa: F401

        def bnb_factory(n, grad):
            return _first_steps(
                lambda p: bnb.optim.AdamW8bit([p], lr=HP["lr"], weight_decay=HP["weight_decay"]), n, grad
            )

        out.append(("bnb_adamw8bit", bnb_factory))
        BYTES["bnb_adamw8bit"] = 16.0
    except ImportError:
        pass
    try:
        from torchao.optim import AdamW8bit

        def ao_factory(n, grad):
            return _first_steps(
                lambda p: AdamW8bit([p], lr=HP["lr"], weight_decay=HP["weight_decay"]), n, grad
            )

        out.append(("torchao_adamw8bit", ao_factory))
        BYTES["torchao_adamw8bit"] = 16.0
    except ImportError:
        pass
    return out


def _level_in_own_process(level: str, args) -> list:
    """One level's records, timed by this script in a process whose torch runs at that level."""
    env = dict(os.environ, HYBRID_OPT_SIMD=level)
    if level in TORCH_LEVEL:
        env["ATEN_CPU_CAPABILITY"] = TORCH_LEVEL[level]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--one-process",
            "--levels",
            level,
            "--sizes",
            *args.sizes,
        ]
        cmd += ["--reps", str(args.reps), "--trials", str(args.trials), "--threads", str(args.threads)]
        try:
            run = subprocess.run(
                [*cmd, "--json", out], env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"bench_q8: level {level} gave no result within {args.timeout:g} s (killed)"
            ) from None
        if run.returncode != 0:
            raise SystemExit(f"bench_q8: level {level} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
        with open(out) as f:
            return json.load(f)


def _time_levels(levels: list, sizes: list, reps: int, trials: int, threads: int) -> list:
    """Every level's records, timed in this process."""
    records = []
    for size in sizes:
        n = parse_size(size)
        for level in levels:
            cpu_kernels.set_simd_level(level)
            steppers, state = _steppers(n)
            runs = [time_ms_interleaved(steppers, reps=reps) for _ in range(trials)]
            base = statistics.median(t["fp32"]["median_ms"] for t in runs)
            roof_gbps = (
                BYTES["roofline"] * n / statistics.median(t["roofline"]["median_ms"] for t in runs) / 1e6
            )
            anchors = {
                key: statistics.median(t[name]["median_ms"] for t in runs)
                for key, name in (("vs_bnb", "bnb_adamw8bit"), ("vs_torchao", "torchao_adamw8bit"))
                if name in steppers
            }
            for name in steppers:
                medians = [t[name]["median_ms"] for t in runs]
                ms = statistics.median(medians)
                records.append(
                    dict(
                        impl=name,
                        n=n,
                        size=size,
                        level=level,
                        q8_level=cpu_kernels.q8_simd_level(),
                        torch_level=torch.backends.cpu.get_cpu_capability(),
                        threads=threads,
                        median_ms=ms,
                        lo_ms=min(medians),
                        hi_ms=max(medians),
                        bytes_per_elem=BYTES[name],
                        gbps=BYTES[name] * n / ms / 1e6,
                        pct_roof=100 * BYTES[name] * n / ms / 1e6 / roof_gbps,
                        state_bytes_per_param=state[name] / n if name in state else None,
                        vs_fp32=base / ms,
                        **{key: anchor / ms for key, anchor in anchors.items()},
                    )
                )
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["16Mi"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--levels", nargs="+", default=None, help="default: every level this CPU runs")
    ap.add_argument("--threads", type=int, default=cpu_kernels.get_num_threads())
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-process", action="store_true", help="every level here, torch at the host's level")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each level's process may take")
    args = ap.parse_args()
    levels = (
        args.levels
        or [
            lv
            for lv in ("avx512", "avx2", "neon", "sve", "portable")
            if lv in cpu_kernels.available_simd_levels()
        ][:2]
    )
    _fixed_mmap_threshold()
    cpu_kernels.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    print(f"host: {host_description()}; threads {args.threads}; torch {torch.__version__}")
    if args.one_process:
        records = _time_levels(levels, args.sizes, args.reps, args.trials, args.threads)
    else:
        records = [r for level in levels for r in _level_in_own_process(level, args)]
    print(
        markdown_table(
            records,
            [
                ("impl", "impl", "s"),
                ("size", "size", "s"),
                ("level", "level", "s"),
                ("torch_level", "torch level", "s"),
                ("threads", "threads", "d"),
                ("median_ms", "median ms", ".2f"),
                ("lo_ms", "lo", ".2f"),
                ("hi_ms", "hi", ".2f"),
                ("bytes_per_elem", "B/elem", ".2f"),
                ("gbps", "GB/s", ".1f"),
                ("pct_roof", "% roof", ".0f"),
                ("state_bytes_per_param", "state B/param (PSS)", ".2f"),
                ("vs_fp32", "fp32 / this", ".2f"),
                ("vs_bnb", "bnb / this", ".1f"),
                ("vs_torchao", "torchao / this", ".1f"),
            ],
        )
    )
    write_json(args.json, records)


if __name__ == "__main__":
    main()
