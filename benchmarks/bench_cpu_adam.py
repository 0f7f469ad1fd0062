"""CPU Adam: ours vs torch's fused AdamW, the torch composite doing the fused job, and
DeepSpeedCPUAdam when importable, against Adam's own memory roofline measured in the same run.

    python benchmarks/bench_cpu_adam.py [--sizes 16Mi 64Mi] [--reps 15] [--trials 3] [--json out.json]
        [--impls ours ours_remainders ...]

Each row steps the same tensors in the same process; the impls and the roofline probe are
timed in interleaved rounds, and each row's % of roofline is against the probe of its own
size and thread count. With --trials N the whole interleaved timing runs N times: a row's
median is the median of the N trial medians, its spread the lowest and highest of them. bytes_per_elem is what an impl must
move per element (reads + writes, no read-for-ownership): ours 28 for every fp32-state path
(fp32: p 4+4, g 4, m 4+4, v 4+4; fused: bf16 g 2 and bf16 model copy 2 instead of g 4); the
composite 48 (grad widen 2+4, unscale 4+4, fused AdamW 28, model copy 4+2). Compressed state
(bf16 grads): ours_bf16_moments 20 (fp32 master 4+4, g 2, m 2+2, v 2+2, bf16 model copy 2);
ours_remainders 18 (bf16 param 2+2 — the model's own, no copy —, int16 remainder 2+2, g 2,
m 2+2, v 2+2), the same 18 in bank mode (reads 10, non-temporal writes 8 elsewhere);
ours_remainders_fp32_moments 26 (remainders alone: param 2+2, remainder 2+2, g 2, m 4+4,
v 4+4); ours_remainders_bf16_sq 22 (fp32 exp_avg 4+4, bf16 exp_avg_sq 2+2: the moment dtypes
chosen independently).

Each row is measured against the roof of its own access pattern (column "% own roof"): a
probe that moves exactly the streams its kernel moves, with trivial arithmetic, split over
threads as the kernels split their work. A pattern is written as one token a stream, the
kind then the element's bytes: r read only, u read and written back in place, n written
only with non-temporal stores (bank mode's outputs, the param copy), w written only with plain
stores (AVX2's register loop in bank mode off Intel CPUs: level_patterns); ours_remainders is
"r2 u2 u2 u2 u2" (grad; param, remainder, exp_avg, exp_avg_sq). One core streams a mix that
reads a smaller share of its bytes faster (its reads in flight are the limit), so a single
28 B probe was no roof for the 16-bit rows: they beat it at one thread. Each pattern runs in
cpu_kernels.bandwidth_probe_pattern_, timed prefetching 1024 elements ahead (the kernels'
distance) and 2048; the in-place 28 B pattern (ours, torch's fused AdamW, DeepSpeed) also in
cpu_kernels.bandwidth_probe_, split over threads both as our kernels split and as torch does,
and bank mode's in bandwidth_probe_bank_. A pattern's roof is the fastest of its probes. The
28 B in-place probe stays as a reference column ("% 28 B roof"), the one roof of the
composite (several passes: no pattern of its own). The summary names the rows under 90 %
of their own roof and any above it.

Runs as it is on any host cpu_kernels builds on (x86-64, AArch64); every record names the
SIMD level it measured and the machine. On the Arm vector levels (neon, sve) bank mode is
timed twice, plain and with streaming stores (rows `_stnt`, STNP / STNT1, off by default in
the library because it is unmeasured: docs/kernels.md, "AArch64").
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, parse_size, time_ms_interleaved, write_json  # noqa: E402

import cpu_kernels  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
SCALE = 1.0 / 1024.0  # a loss scale's inverse times a clip coefficient: exact in fp32


class Job:
    """Fresh state for one size, shared by every impl (same tensors, same placement)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.n = n
        self.param = torch.randn(n, generator=g)
        self.grad = torch.randn(n, generator=g)
        self.grad_bf16 = self.grad.bfloat16()
        # Moments start as normal numbers, not zeros: each row's roofline probe runs on the row's
        # own tensors (see main) and adds one to every element's bits, which keeps a normal
        # number normal but would make a zero a subnormal.
        self.exp_avg = 0.1 * self.grad
        self.exp_avg_sq = 1e-3 * self.grad * self.grad
        self.param_bf16 = torch.empty(n, dtype=torch.bfloat16)
        # compressed state: bf16 moments beside an fp32 master; a bf16 param + remainder
        self.master_c = self.param.clone()
        self.exp_avg_c, self.exp_avg_sq_c = self.exp_avg.bfloat16(), self.exp_avg_sq.bfloat16()
        self.param_r, self.remainder = cpu_kernels.encode_remainder(self.param)
        self.exp_avg_r, self.exp_avg_sq_r = self.exp_avg.bfloat16(), self.exp_avg_sq.bfloat16()
        # remainders alone: fp32 moments
        self.exp_avg_r32, self.exp_avg_sq_r32 = self.exp_avg.clone(), self.exp_avg_sq.clone()
        self.exp_avg_sq_r16 = self.exp_avg_sq.bfloat16()  # beside the fp32 exp_avg_r32
        self.step = 0

    def bump(self) -> int:
        self.step += 1
        return self.step


# Each row's access pattern (see the docstring): the x86 kernels stream the param copy wherever
# it is line-aligned, in place or not, and bank mode's outputs likewise.
INPLACE_28 = "r4 u4 u4 u4"
BANK_28 = "r4 r4 r4 r4 n4 n4 n4"
PATTERNS = {
    "ours": INPLACE_28,
    "ours_bank": BANK_28,
    "ours_bank_stnt": BANK_28,
    "ours_fused": "r2 u4 u4 u4 n2",
    "ours_bf16_moments": "r2 u4 u2 u2 n2",
    "ours_remainders": "r2 u2 u2 u2 u2",
    "ours_remainders_bank": "r2 r2 r2 r2 r2 n2 n2 n2 n2",
    "ours_remainders_bank_stnt": "r2 r2 r2 r2 r2 n2 n2 n2 n2",
    "ours_remainders_fp32_moments": "r2 u2 u2 u4 u4",
    "ours_remainders_bf16_sq": "r2 u2 u2 u4 u2",
    "torch_fused": INPLACE_28,
    "deepspeed_cpu_adam": INPLACE_28,
}
# where a level's kernel moves a row's streams otherwise: AVX2's register loop writes bank mode's
# 16-bit outputs with plain stores off Intel CPUs (kernels_avx2.c, adam_c16_modes; level_patterns)
PLAIN_BANK_PATTERNS = {"avx2": {"ours_remainders_bank": "r2 r2 r2 r2 r2 w2 w2 w2 w2"}}
_KINDS = {"r": "read", "u": "update", "n": "write_nt", "w": "write"}
# elements the pattern probes prefetch ahead, each timed; the faster is the roof (1-2 % apart at one
# thread on a 2-core Zen 5 VM, either way round by pattern: further for in-place, nearer with
# non-temporal writes)
PATTERN_PREFETCH = (1024, 2048)


def level_patterns(level: str) -> dict:
    """The rows whose pattern differs at `level`: AVX2's bank mode stores plainly unless the library
    chose non-temporal stores for this CPU (an Intel one: cpu_kernels._lib._avx2_bank_nt)."""
    if level == "avx2" and cpu_kernels._lib._avx2_bank_nt():
        return {}
    return PLAIN_BANK_PATTERNS.get(level, {})


def pattern_bytes(pattern: str) -> int:
    """Bytes an element moves in `pattern`: an updated stream twice (read and written)."""
    return sum(int(t[1:]) * (2 if t[0] == "u" else 1) for t in pattern.split())


def pattern_probe(pattern: str, streams: tuple, prefetch: int):
    """bandwidth_probe_pattern_ over `pattern`'s streams: `streams`, the row's own tensors, one a
    token in the pattern's order. Where a page of one tensor lies in physical memory against the
    same page of the others changes a step's time by up to a third on a 2-core Zen 3 (the same
    kernel, the same sizes, other tensors), so a roof is only a roof on the tensors it is
    compared with; and torch's rows step them too."""
    tokens = pattern.split()
    if len(tokens) != len(streams) or any(int(t[1:]) != s.element_size() for t, s in zip(tokens, streams)):
        raise AssertionError(f"pattern {pattern}: streams of {[s.element_size() for s in streams]} B")
    by_kind: dict[str, list] = {kind: [] for kind in _KINDS.values()}
    for token, tensor in zip(tokens, streams):
        by_kind[_KINDS[token[0]]].append(tensor)
    return lambda: cpu_kernels.bandwidth_probe_pattern_(**by_kind, prefetch=prefetch)


def impls(job: Job, bank: tuple):
    """(name, grad dtype, bytes/elem, callable, streams) for every implementation available:
    streams are the tensors the row moves, in the order of its pattern (PATTERNS; None where it
    has none)."""

    def ours_fp32():
        cpu_kernels.adam_step_(job.param, job.grad, job.exp_avg, job.exp_avg_sq, step=job.bump(), **HP)

    def ours_bank():  # speculative step: new state into a spare bank, inputs untouched
        cpu_kernels.adam_step_(
            job.param, job.grad, job.exp_avg, job.exp_avg_sq, step=job.bump(), out=bank, **HP
        )

    def ours_fused():
        cpu_kernels.adam_step_(
            job.param,
            job.grad_bf16,
            job.exp_avg,
            job.exp_avg_sq,
            step=job.bump(),
            grad_scale=SCALE,
            param_copy=job.param_bf16,
            **HP,
        )

    def ours_bf16_moments():  # fp32 master, bf16 moments, the bf16 model copy written
        cpu_kernels.adam_step_(
            job.master_c,
            job.grad_bf16,
            job.exp_avg_c,
            job.exp_avg_sq_c,
            step=job.bump(),
            grad_scale=SCALE,
            param_copy=job.param_bf16,
            **HP,
        )

    def ours_remainders():  # bf16 param + int16 remainder (lossless master), bf16 moments
        cpu_kernels.adam_step_(
            job.param_r,
            job.grad_bf16,
            job.exp_avg_r,
            job.exp_avg_sq_r,
            step=job.bump(),
            grad_scale=SCALE,
            remainder=job.remainder,
            **HP,
        )

    def ours_remainders_fp32_moments():  # remainders alone: fp32 moments
        cpu_kernels.adam_step_(
            job.param_r,
            job.grad_bf16,
            job.exp_avg_r32,
            job.exp_avg_sq_r32,
            step=job.bump(),
            grad_scale=SCALE,
            remainder=job.remainder,
            **HP,
        )

    def ours_remainders_bf16_sq():  # remainders, fp32 exp_avg, bf16 exp_avg_sq
        cpu_kernels.adam_step_(
            job.param_r,
            job.grad_bf16,
            job.exp_avg_r32,
            job.exp_avg_sq_r16,
            step=job.bump(),
            grad_scale=SCALE,
            remainder=job.remainder,
            **HP,
        )

    rbank = tuple(torch.empty(job.n, dtype=torch.bfloat16) for _ in range(3))
    rbank_rem = torch.empty(job.n, dtype=torch.int16)
    fp32_state = (job.grad, job.param, job.exp_avg, job.exp_avg_sq)
    rem_state = (job.grad_bf16, job.param_r, job.remainder)
    streams = {
        "ours": fp32_state,
        "ours_bank": (*fp32_state, *bank),
        "ours_fused": (job.grad_bf16, *fp32_state[1:], job.param_bf16),
        "ours_bf16_moments": (job.grad_bf16, job.master_c, job.exp_avg_c, job.exp_avg_sq_c, job.param_bf16),
        "ours_remainders": (*rem_state, job.exp_avg_r, job.exp_avg_sq_r),
        "ours_remainders_bank": (*rem_state, job.exp_avg_r, job.exp_avg_sq_r, *rbank, rbank_rem),
        "ours_remainders_fp32_moments": (*rem_state, job.exp_avg_r32, job.exp_avg_sq_r32),
        "ours_remainders_bf16_sq": (*rem_state, job.exp_avg_r32, job.exp_avg_sq_r16),
        "torch_fused": fp32_state,
        "deepspeed_cpu_adam": fp32_state,
    }
    streams["ours_bank_stnt"] = streams["ours_bank"]
    streams["ours_remainders_bank_stnt"] = streams["ours_remainders_bank"]

    def ours_remainders_bank():
        cpu_kernels.adam_step_(
            job.param_r,
            job.grad_bf16,
            job.exp_avg_r,
            job.exp_avg_sq_r,
            step=job.bump(),
            grad_scale=SCALE,
            remainder=job.remainder,
            out=rbank,
            remainder_out=rbank_rem,
            **HP,
        )

    def streaming(fn):  # the same call with the Arm levels' streaming stores turned on
        def run():
            was = cpu_kernels._lib._arm_streaming_stores()
            cpu_kernels._lib._set_arm_streaming_stores(True)
            try:
                fn()
            finally:
                cpu_kernels._lib._set_arm_streaming_stores(was)

        return run

    def row(name, grad_dtype, bpe, fn):
        return name, grad_dtype, bpe, fn, streams.get(name)

    arm_vector_level = cpu_kernels.simd_level() in ("neon", "sve")
    yield row("ours", "float32", 28, ours_fp32)
    yield row("ours_bank", "float32", 28, ours_bank)
    if arm_vector_level:
        yield row("ours_bank_stnt", "float32", 28, streaming(ours_bank))
    yield row("ours_fused", "bfloat16", 28, ours_fused)
    yield row("ours_bf16_moments", "bfloat16", 20, ours_bf16_moments)
    yield row("ours_remainders", "bfloat16", 18, ours_remainders)
    yield row("ours_remainders_bank", "bfloat16", 18, ours_remainders_bank)
    if arm_vector_level:
        yield row("ours_remainders_bank_stnt", "bfloat16", 18, streaming(ours_remainders_bank))
    yield row("ours_remainders_fp32_moments", "bfloat16", 26, ours_remainders_fp32_moments)
    yield row("ours_remainders_bf16_sq", "bfloat16", 22, ours_remainders_bf16_sq)

    tparam = torch.nn.Parameter(job.param)  # shares storage: no extra copy
    tparam.grad = job.grad
    opt = torch.optim.AdamW(
        [tparam],
        lr=HP["lr"],
        betas=(HP["beta1"], HP["beta2"]),
        eps=HP["eps"],
        weight_decay=HP["weight_decay"],
        fused=True,
    )
    # torch steps our tensors: its state is the Job's moments (page placement: pattern_probe)
    opt.state[tparam] = {"step": torch.tensor(0.0), "exp_avg": job.exp_avg, "exp_avg_sq": job.exp_avg_sq}
    yield row("torch_fused", "float32", 28, opt.step)

    gbuf = torch.empty(job.n)  # preallocated: a fresh fp32 grad per step measures page faults

    def torch_composite():
        gbuf.copy_(job.grad_bf16).mul_(SCALE)
        tparam.grad = gbuf
        opt.step()
        job.param_bf16.copy_(tparam.detach())

    yield row("torch_composite", "bfloat16", 48, torch_composite)

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception as e:  # not installed here: skip cleanly, say so
        print(f"(DeepSpeedCPUAdam not importable: {type(e).__name__}; skipped)")
    else:
        dparam = torch.nn.Parameter(job.param)
        dparam.grad = job.grad
        dopt = DeepSpeedCPUAdam(
            [dparam],
            lr=HP["lr"],
            betas=(HP["beta1"], HP["beta2"]),
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            adamw_mode=True,
        )
        dopt.state[dparam] = {"step": 0, "exp_avg": job.exp_avg, "exp_avg_sq": job.exp_avg_sq}
        yield row("deepspeed_cpu_adam", "float32", 28, dopt.step)


def _trials(fns: dict, reps: int, trials: int) -> dict:
    """time_ms_interleaved `trials` times: per name the median of the trial medians (and of
    their p20 / p80), the trial medians themselves and their lowest and highest."""
    runs = [time_ms_interleaved(fns, reps=reps) for _ in range(trials)]
    out = {}
    for name in fns:
        meds = [r[name]["median_ms"] for r in runs]
        out[name] = {
            "median_ms": statistics.median(meds),
            "p20_ms": statistics.median(r[name]["p20_ms"] for r in runs),
            "p80_ms": statistics.median(r[name]["p80_ms"] for r in runs),
            "trial_medians_ms": meds,
            "trial_min_ms": min(meds),
            "trial_max_ms": max(meds),
        }
    return out


def _roof_check(by: dict, n: int, th: int) -> str:
    """Issue #37's bar, every row >= 90 % of a roof nothing beats: the rows of (n, th) under 90 %
    of their own pattern's roof (the composite, which has none, of the 28 B in-place one) and
    those above it."""
    rows = [(k[0], v) for k, v in by.items() if k[1:] == (n, th) and not k[0].startswith("roofline")]
    low, high = [], []
    for name, v in rows:
        roof = v.get("pattern_roofline_gb_per_s", v["roofline_gb_per_s"])
        pct = f"{name} {100 * v['gb_per_s'] / roof:.0f} %"
        if v["gb_per_s"] < 0.9 * roof:
            low.append(pct)
        elif v["gb_per_s"] > roof:
            high.append(pct)
    return f"under 90 % of its own roof: {', '.join(low) or 'none'}; above it: {', '.join(high) or 'none'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["16Mi", "64Mi"])
    ap.add_argument(
        "--threads", nargs="+", type=int, default=None, help="thread counts (default: 1 and all cores)"
    )
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--trials",
        type=int,
        default=1,
        help="repeat the interleaved timing; rows report the median of the trial medians",
    )
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument(
        "--impls",
        nargs="+",
        default=None,
        help="time only these rows (e.g. ours ours_remainders torch_fused); the roofline probes always run",
    )
    args = ap.parse_args(argv)

    all_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    thread_counts = args.threads or sorted({1, all_threads})
    level, machine = cpu_kernels.simd_level(), platform.machine()
    # torch's rows run at torch's own level: ATEN_CPU_CAPABILITY=avx2 gives an AVX2 host's torch
    torch_level = torch.backends.cpu.get_cpu_capability()
    print(
        f"cpu_kernels SIMD level: {level} ({machine}); torch {torch.__version__}, its kernels at {torch_level}; "
        f"thread counts {thread_counts}"
    )
    records, rows = [], []
    times_of = {}  # (numel, threads) -> the timings, for the summary
    for threads in thread_counts:
        torch.set_num_threads(threads)
        cpu_kernels.set_num_threads(threads)
        roof = 0.0
        for size in args.sizes:
            n = parse_size(size)
            # every row and every probe on the same tensors (pattern_probe says why); the probes
            # add one to each updated element's bits and fill the written ones
            job = Job(n)
            bank = (torch.empty(n), torch.empty(n), torch.empty(n))
            table = {
                name: (gdt, bpe, fn, streams)
                for name, gdt, bpe, fn, streams in impls(job, bank)
                if args.impls is None or name in args.impls
            }
            if args.impls is not None and len(table) < len(set(args.impls)):
                unknown = sorted(set(args.impls) - set(table))
                ap.error(f"--impls: no row named {', '.join(unknown)} at this level")
            fns = {name: fn for name, (_, _, fn, _) in table.items()}
            # the roofline: Adam's 28 bytes/element in place, no arithmetic, timed in the same
            # rounds as the impls so drift on this shared machine hits them alike; split over
            # threads as our kernels split (a run of whole 16Ki chunks a thread) and as torch
            # splits (one range a thread): the faster of the two is the roof
            for split in ("chunks", "contiguous"):
                fns[f"roofline_{split}"] = lambda j=job, s=split: cpu_kernels.bandwidth_probe_(
                    j.param, j.grad, j.exp_avg, j.exp_avg_sq, split=s
                )
            # bank mode's own access pattern (4 reads, 3 non-temporal writes elsewhere), for
            # telling the kernel's overhead from what the memory system gives that pattern
            fns["roofline_bank"] = lambda j=job, out=bank: cpu_kernels.bandwidth_probe_bank_(
                j.param, j.grad, j.exp_avg, j.exp_avg_sq, out
            )
            # every other row's own pattern, in the same rounds, prefetching as far ahead as the
            # kernels (1024 elements) and twice as far: the faster is the roof
            patterns = {**PATTERNS, **level_patterns(level)}
            own = {name: patterns[name] for name in table if name in patterns}
            own_streams = {}  # a pattern's tensors: the same for every row of that pattern
            for name, pattern in own.items():
                streams = table[name][3]
                first = own_streams.setdefault(pattern, streams)
                if [t.data_ptr() for t in first] != [t.data_ptr() for t in streams]:
                    raise AssertionError(f"{name}: pattern {pattern} on other tensors than another row's")
            for pattern in sorted(own_streams):
                for ahead in PATTERN_PREFETCH:
                    fns[f"roofline {pattern} @{ahead}"] = pattern_probe(pattern, own_streams[pattern], ahead)
            times = _trials(fns, args.reps, args.trials)
            probes = {s: times.pop(f"roofline_{s}") for s in ("chunks", "contiguous")}
            split = min(probes, key=lambda s: probes[s]["median_ms"])
            times["roofline"] = dict(probes[split], split=split)
            times_of[(n, threads)] = times
            size_roof = 28 * n / (times["roofline"]["median_ms"] * 1e6)
            bank_roof = 28 * n / (times["roofline_bank"]["median_ms"] * 1e6)
            roof = max(roof, size_roof)
            # the in-place and bank patterns' roofs: the fastest of their probes
            pattern_roofs = {INPLACE_28: size_roof, BANK_28: bank_roof}
            pattern_rows = []  # printed after the 28 B probes
            for pattern in sorted(set(own.values())):
                runs = {ahead: times.pop(f"roofline {pattern} @{ahead}") for ahead in PATTERN_PREFETCH}
                ahead = min(runs, key=lambda a: runs[a]["median_ms"])
                t = runs[ahead]
                gbs = pattern_bytes(pattern) * n / (t["median_ms"] * 1e6)
                pattern_roofs[pattern] = max(gbs, pattern_roofs.get(pattern, 0.0))
                pattern_rows.append(
                    {
                        "impl": f"roofline {pattern} (prefetch {ahead})",
                        "size": size,
                        "threads": threads,
                        "gb_per_s": gbs,
                        "bytes_per_elem": pattern_bytes(pattern),
                        "roof_pct": 100.0 * gbs / size_roof,
                        "own_pct": 100.0 * gbs / pattern_roofs[pattern],
                        **t,
                    }
                )
            for name, (gdt, bpe, _, _) in table.items():
                t = times[name]
                if name in own and pattern_bytes(own[name]) != bpe:
                    raise AssertionError(
                        f"{name}: pattern {own[name]} moves {pattern_bytes(own[name])} B, not {bpe}"
                    )
                rec = {
                    "impl": name,
                    "numel": n,
                    "threads": threads,
                    "grad_dtype": gdt,
                    "simd_level": level,
                    "torch_level": torch_level,
                    "machine": machine,
                    **t,
                    "gelem_per_s": n / (t["median_ms"] * 1e6),
                    "gb_per_s": bpe * n / (t["median_ms"] * 1e6),
                    "bytes_per_elem": bpe,
                    "roofline_gb_per_s": size_roof,
                }
                is_bank = name.endswith("_bank") or name.endswith("_bank_stnt")
                if is_bank:
                    rec["bank_roofline_gb_per_s"] = bank_roof
                if name in own:
                    rec["pattern"] = own[name]
                    rec["pattern_roofline_gb_per_s"] = pattern_roofs[own[name]]
                records.append(rec)
                rows.append(
                    dict(
                        rec,
                        size=size,
                        roof_pct=100.0 * rec["gb_per_s"] / size_roof,
                        own_pct=100.0 * rec["gb_per_s"] / pattern_roofs[own[name]] if name in own else None,
                    )
                )
            rows.append(
                {
                    "impl": f"roofline ({split})",
                    "size": size,
                    "threads": threads,
                    "gb_per_s": size_roof,
                    "bytes_per_elem": 28,
                    "roof_pct": 100.0,
                    "own_pct": 100.0,
                    **times["roofline"],
                }
            )
            rows.append(
                {
                    "impl": "roofline_bank",
                    "size": size,
                    "threads": threads,
                    "gb_per_s": bank_roof,
                    "bytes_per_elem": 28,
                    "roof_pct": 100.0 * bank_roof / size_roof,
                    "own_pct": 100.0,
                    **times["roofline_bank"],
                }
            )
            rows.extend(pattern_rows)
            records.append(
                {
                    "impl": "roofline_inplace",
                    "numel": n,
                    "threads": threads,
                    "gb_per_s": size_roof,
                    "split": split,
                    "simd_level": level,
                    "machine": machine,
                }
            )
            records.append(
                {
                    "impl": "roofline_bank",
                    "numel": n,
                    "threads": threads,
                    "gb_per_s": bank_roof,
                    "simd_level": level,
                    "machine": machine,
                }
            )
            del job, bank, table, fns
        records.append(
            {
                "impl": "roofline",
                "threads": threads,
                "gb_per_s": roof,
                "simd_level": level,
                "machine": machine,
            }
        )

    print(
        markdown_table(
            rows,
            [
                ("impl", "impl", "s"),
                ("size", "numel", "s"),
                ("threads", "threads", "d"),
                ("grad_dtype", "grad", "s"),
                ("bytes_per_elem", "B/elem", "d"),
                ("median_ms", "median ms", ".2f"),
                ("p20_ms", "p20 ms", ".2f"),
                ("p80_ms", "p80 ms", ".2f"),
                ("trial_min_ms", "trials min ms", ".2f"),
                ("trial_max_ms", "trials max ms", ".2f"),
                ("gelem_per_s", "G elem/s", ".3f"),
                ("gb_per_s", "GB/s", ".1f"),
                ("own_pct", "% own roof", ".0f"),
                ("roof_pct", "% 28 B roof", ".0f"),
            ],
        )
    )
    by = {(r["impl"], r["numel"], r["threads"]): r for r in records if r["impl"] != "roofline"}
    for n, th in sorted(times_of, key=lambda k: (k[1], k[0])):
        r, base = by.get(("ours", n, th)), by.get(("torch_fused", n, th))
        comp, fused = by.get(("torch_composite", n, th)), by.get(("ours_fused", n, th))
        rems = by.get(("ours_remainders", n, th))
        if None not in (r, base, comp, fused, rems):  # all there unless --impls left some out
            roof = base["pattern_roofline_gb_per_s"]  # the fastest probe of the 28 B in-place pattern
            print(
                f"numel {n} threads {th}: ours / torch fused = "
                f"{base['median_ms'] / r['median_ms']:.2f}x; ours_fused / torch composite = "
                f"{comp['median_ms'] / fused['median_ms']:.2f}x; ours_remainders (18 B) / "
                f"ours (28 B) = {r['median_ms'] / rems['median_ms']:.2f}x, / ours_fused = "
                f"{fused['median_ms'] / rems['median_ms']:.2f}x (ideal 1.56x); torch fused at "
                f"{100 * base['gb_per_s'] / roof:.0f} % of its roof (the 28 B in-place pattern)"
                + (" (above it: the probe is not a roof here)" if base["gb_per_s"] > roof else "")
            )
        print(f"numel {n} threads {th}: {_roof_check(by, n, th)}")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
