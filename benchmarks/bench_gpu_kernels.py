"""Benchmark of gpu_kernels (fused Adam, grad statistics) against torch on one CUDA device.

The Adam job, the same for every implementation: an AdamW step of fp32 master params with
fp32 moments, from bf16 grads that carry a loss scale (unscaled inside the step), with a
found_inf flag, writing the updated params into a bf16 model copy. The bytes the job must
move per element: read p, m, v (12) + a bf16 grad (2), write p, m, v (12) + a bf16 copy (2)
= 28 B. Every implementation's GB/s is those 28 B × numel / time, so GB/s ratios are speed
ratios, and "% BW" compares with the device-to-device copy bandwidth measured in the same run.

  gpu_kernels.fused_adam_      one launch: unscale, AdamW, bf16 copy (each call checks every tensor)
  gpu_kernels.FusedAdam.step   the same launch over tensors checked and tabled once
  torch.AdamW(fused=True)      bf16 grads copied into fp32 .grad buffers (_foreach_copy_),
                               the fused step unscaling through its grad_scale/found_inf (as
                               GradScaler drives it), params copied into the bf16 copy
  torch.AdamW(foreach=True)    the same with the unscale as _foreach_mul_ on the fp32 grads

The same job with compressed state (gpu_kernels.fused_adam_ only; "vs torch" is still torch's
fp32-state fused AdamW), each row's GB/s at its own bytes per element:

  ... bf16 m,v                 bf16 moments: p 4+4, grad 2, m 2+2, v 2+2, bf16 copy 2 = 20 B
  ... remainders               the master as the bf16 param + int16 remainder (the param is the
                               bf16 copy): p 2+2, remainder 2+2, grad 2, m 4+4, v 4+4 = 26 B
  ... bf16 m,v + remainders    both: 18 B

The grad-statistics job: the global sum of squares and a non-finite flag over bf16 grads
(2 B/element read):

  gpu_kernels.grad_stats             two-stage, deterministic
  torch._foreach_norm                per-tensor norms, total norm, isfinite — clip_grad_norm_'s work
  torch amp check+_foreach_norm      GradScaler's _amp_foreach_non_finite_check_and_unscale_, then the norms
                                     (fp16/fp32 grads: torch has no bf16 CUDA kernel for it, no row here)

Sizes are single tensors of 16M..1G elements plus one list of `--tensors` tensors of random
sizes. Timing is triton.testing.do_bench (median, p20, p80 of per-call CUDA-event times, L2
flushed between calls; host launch overhead counts where it exceeds the device time, for
every implementation alike). Prints a markdown table; `--json PATH` writes one record per
measurement: {"impl", "numel", "threads", "grad_dtype", "median_ms", "p20_ms", "p80_ms",
"gelem_per_s", "gb_per_s", "bytes_per_elem", "device"} plus {"impl": "copy_bandwidth",
"gb_per_s", "device"}. `--sweep` also times other launch configurations of both kernels.

Without CUDA it says so and exits 0 (`--dry-run` instead runs every code path on CPU
through Triton's interpreter at toy sizes, timed with a wall clock — a check, not a figure).
"""

import argparse
import gc
import importlib
import itertools
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import time_ms  # noqa: E402

ADAM_BYTES = 28
STATS_BYTES = 2
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LOSS_SCALE = 65536.0
STEP = 10


def parse_numel(text):
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(n):
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size and n % (size // 16) == 0:
            return f"{n / size:g}{unit}"
    return str(n)


class Timer:
    def __init__(self, dry_run, quick):
        self.dry_run = dry_run
        self.warmup, self.rep = (10, 40) if quick else (25, 100)

    def __call__(self, fn):
        """(median, p20, p80) in ms."""
        if self.dry_run:
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            return times[1], times[0], times[2]
        from triton.testing import do_bench

        median, p20, p80 = do_bench(fn, warmup=self.warmup, rep=self.rep, quantiles=[0.5, 0.2, 0.8])
        return median, p20, p80


def random_sizes(total, count, seed=0):
    rng = random.Random(seed)
    weights = [rng.uniform(0.05, 1.0) for _ in range(count)]
    scale = total / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[-1] = max(1, sizes[-1] + total - sum(sizes))
    return sizes


def free_memory():
    gc.collect()  # an optimizer and its closures can hold a size's tensors in a cycle
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# the Adam job
# ------------------------------------------------------------------------------------------


def adam_state(sizes, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(n, scale=1.0):
        return torch.randn(n, device=device, generator=gen).mul_(scale)

    params = [randn(n) for n in sizes]
    return dict(
        params=params,
        grads=[randn(n, LOSS_SCALE * 1e-2).to(torch.bfloat16) for n in sizes],
        exp_avgs=[randn(n, 1e-3) for n in sizes],
        exp_avg_sqs=[randn(n, 1e-3).square_() for n in sizes],
        copies=[p.to(torch.bfloat16) for p in params],
    )


def ours_adam(state, device):
    import gpu_kernels

    inv_scale = torch.full((1,), 1.0 / LOSS_SCALE, device=device)
    found_inf = torch.zeros(1, device=device)

    def step():
        gpu_kernels.fused_adam_(
            state["params"],
            state["grads"],
            state["exp_avgs"],
            state["exp_avg_sqs"],
            step=STEP,
            grad_scale=inv_scale,
            found_inf=found_inf,
            param_copies=state["copies"],
            **HYPER,
        )

    return step


def torch_adam(state, device, *, fused):
    params = state["params"]
    fp32_grads = [torch.empty_like(p) for p in params]
    for p, g in zip(params, fp32_grads):
        p.grad = g
    kind = dict(fused=True) if fused else dict(foreach=True)
    opt = torch.optim.AdamW(
        params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        **kind,
    )
    # torch's state starts from the same moments, at the same step count
    for p, m, v in zip(params, state["exp_avgs"], state["exp_avg_sqs"]):
        opt.state[p] = dict(
            step=torch.tensor(float(STEP - 1), device=device if fused else "cpu"), exp_avg=m, exp_avg_sq=v
        )
    # 0-dim, as GradScaler keeps them (the fused step broadcasts found_inf into the step counts)
    scale = torch.full((), LOSS_SCALE, device=device)
    inv_scale = torch.full((), 1.0 / LOSS_SCALE, device=device)
    found_inf = torch.zeros((), device=device)

    def step():
        torch._foreach_copy_(fp32_grads, state["grads"])
        if fused:
            opt.grad_scale, opt.found_inf = scale, found_inf  # what GradScaler.step sets
        else:
            torch._foreach_mul_(fp32_grads, inv_scale)
        opt.step()
        torch._foreach_copy_(state["copies"], params)

    return step


def ours_prepared(state, device):
    import gpu_kernels

    inv_scale = torch.full((1,), 1.0 / LOSS_SCALE, device=device)
    found_inf = torch.zeros(1, device=device)
    launch = gpu_kernels.FusedAdam(
        state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"], param_copies=state["copies"]
    )

    def step():
        launch.step(step=STEP, grad_scale=inv_scale, found_inf=found_inf, **HYPER)

    return step


ADAM_IMPLS = {
    "gpu_kernels.fused_adam_": ours_adam,
    "gpu_kernels.FusedAdam.step": ours_prepared,
    "torch.AdamW(fused=True)": lambda s, d: torch_adam(s, d, fused=True),
    "torch.AdamW(foreach=True)": lambda s, d: torch_adam(s, d, fused=False),
}


# name -> (compressed_state's arguments, bytes per element); see the module doc
COMPRESSED = {
    "bf16 m,v": (dict(bf16_moments=True, remainders=False), 20),
    "remainders": (dict(bf16_moments=False, remainders=True), 26),
    "bf16 m,v + remainders": (dict(bf16_moments=True, remainders=True), 18),
}


def compressed_state(sizes, device, *, bf16_moments, remainders):
    import gpu_kernels

    state = adam_state(sizes, device)
    if bf16_moments:
        for key in ("exp_avgs", "exp_avg_sqs"):
            state[key] = [t.to(torch.bfloat16) for t in state[key]]
    state["remainders"] = None
    if remainders:
        halves = [gpu_kernels.encode_remainder(p) for p in state["params"]]
        state["params"], state["remainders"] = [h for h, _ in halves], [r for _, r in halves]
        state["copies"] = None  # the bf16 param is the model's copy
    return state


def ours_compressed(state, device, reference=False):
    import gpu_kernels

    inv_scale = torch.full((1,), 1.0 / LOSS_SCALE, device=device)
    found_inf = torch.zeros(1, device=device)
    fn = gpu_kernels.fused_adam_reference_ if reference else gpu_kernels.fused_adam_

    def step():
        fn(
            state["params"],
            state["grads"],
            state["exp_avgs"],
            state["exp_avg_sqs"],
            step=STEP,
            grad_scale=inv_scale,
            found_inf=found_inf,
            param_copies=state["copies"],
            remainders=state["remainders"],
            **HYPER,
        )

    return step


def check_compressed(device, sizes):
    """One step of each compressed variant against the fp64 reference on the same state: the
    master within fp32 rounding, bf16 moments within bf16 rounding."""
    import gpu_kernels

    failures = []
    for name, (kwargs, _) in COMPRESSED.items():
        ours, ref = compressed_state(sizes, device, **kwargs), compressed_state(sizes, device, **kwargs)
        ours_compressed(ours, device)()
        ours_compressed(ref, device, reference=True)()

        def master(state):
            if state["remainders"] is None:
                return torch.cat(state["params"])
            return torch.cat(
                [gpu_kernels.decode_remainder(p, r) for p, r in zip(state["params"], state["remainders"])]
            )

        ok = torch.allclose(master(ours), master(ref), rtol=1e-5, atol=1e-6)
        for key in ("exp_avgs", "exp_avg_sqs"):
            a, b = torch.cat(ours[key]).double(), torch.cat(ref[key]).double()
            ok &= torch.allclose(a, b, rtol=2**-8, atol=1e-6)  # one bf16 ulp
        print(f"check gpu_kernels.fused_adam_ {name}: master and moments vs the fp64 reference: {ok}")
        if not ok:
            failures.append(f"gpu_kernels.fused_adam_ {name}")
    return failures


def check_adam(device, sizes):
    """One step of every implementation from the same state. Ours must be the bits of the
    reference's fp32 arithmetic (computed on the CPU: the kernel contracts no multiply-add) and
    every implementation within fp32 rounding of the fp64 reference — torch.optim.AdamW's
    formula, which torch's fused kernel computes in another order (measured on an H200: 2.5e-6
    from foreach and from ours, which agree)."""
    import gpu_kernels

    start = adam_state(sizes, device)
    inv_scale = 1.0 / LOSS_SCALE
    exact = {k: [t.to("cpu", copy=True) for t in v] for k, v in start.items()}
    rounded = {k: [t.to("cpu", copy=True) for t in v] for k, v in start.items()}
    for ref, arithmetic in ((exact, "fp32"), (rounded, "fp64")):
        gpu_kernels.fused_adam_reference_(
            ref["params"],
            ref["grads"],
            ref["exp_avgs"],
            ref["exp_avg_sqs"],
            step=STEP,
            grad_scale=inv_scale,
            arithmetic=arithmetic,
            **HYPER,
        )
    ref_exact, ref_p = torch.cat(exact["params"]), torch.cat(rounded["params"])
    failures = []
    for name, make in ADAM_IMPLS.items():
        state = {k: [t.clone() for t in v] for k, v in start.items()}
        make(state, device)()
        p, c = torch.cat(state["params"]).cpu(), torch.cat(state["copies"]).cpu()
        # ours: the tests' fp32 tolerance (tests/tolerances.py), |a - b| <= 1e-6 + 1e-5 |b|; a
        # peer ten times that (its order of operations is its own: this catches a wrong setup)
        ours = name.startswith("gpu_kernels.")
        close = torch.allclose(p, ref_p.float(), rtol=1e-5 if ours else 1e-4, atol=1e-6 if ours else 1e-5)
        diff = (p.double() - ref_p.double()).abs().max().item()
        copy_ok = torch.equal(c, p.to(torch.bfloat16))
        bitwise = torch.equal(p, ref_exact) if ours else True
        print(
            f"check {name}: params vs the fp64 reference max |diff| {diff:.2e} (close: {close})"
            + (f"; the fp32 reference's bits: {bitwise}" if ours else "")
            + f"; bf16 copy == cast: {copy_ok}"
        )
        if not close or not copy_ok or not bitwise:
            failures.append(name)
    return failures


# ------------------------------------------------------------------------------------------
# the grad-statistics job
# ------------------------------------------------------------------------------------------


def ours_stats(grads, device):
    import gpu_kernels

    return lambda: gpu_kernels.grad_stats(grads)


def torch_norm_stats(grads, device):
    def run():
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        return total.square(), (~torch.isfinite(total)).float()

    return run


def torch_amp_stats(grads, device):
    if device.type == "cuda" and any(g.dtype == torch.bfloat16 for g in grads):
        # torch has no bf16 CUDA kernel for it (GradScaler is for fp16 grads): no such row
        return None
    found_inf = torch.zeros(1, device=device)
    one = torch.ones(1, device=device)

    def run():
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        return total.square(), found_inf

    return run


STATS_IMPLS = {
    "gpu_kernels.grad_stats": ours_stats,
    "torch._foreach_norm": torch_norm_stats,
    "torch amp check+_foreach_norm": torch_amp_stats,
}


def check_stats(device, sizes):
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(n, device=device, generator=gen).to(torch.bfloat16) for n in sizes]
    import gpu_kernels

    ours = gpu_kernels.grad_stats(grads)
    again = gpu_kernels.grad_stats(grads)
    reference = sum(g.double().square().sum() for g in grads)
    rel = abs(ours[0].item() - reference.item()) / reference.item()
    same = torch.equal(ours[0], again[0]) and torch.equal(ours[1], again[1])
    grads[-1][-1] = float("inf")
    flagged = gpu_kernels.grad_stats(grads)[1].item() == 1.0
    print(
        f"check gpu_kernels.grad_stats: rel diff vs fp64 {rel:.2e}; bitwise repeatable: {same}; inf flagged: {flagged}"
    )
    return [] if rel < 1e-6 and same and flagged else ["gpu_kernels.grad_stats"]


# ------------------------------------------------------------------------------------------


def copy_bandwidth(device, timer, dry_run):
    numel = 2**16 if dry_run else min(2**29, torch.cuda.mem_get_info()[0] // 16)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    median, _, _ = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (median * 1e-3) / 1e9


def record(impl, numel, median, p20, p80, bytes_per_elem, device_name, grad_dtype="bfloat16"):
    return dict(
        impl=impl,
        numel=numel,
        threads=None,
        grad_dtype=grad_dtype,
        median_ms=median,
        p20_ms=p20,
        p80_ms=p80,
        gelem_per_s=numel / (median * 1e-3) / 1e9,
        gb_per_s=numel * bytes_per_elem / (median * 1e-3) / 1e9,
        bytes_per_elem=bytes_per_elem,
        device=device_name,
    )


def run_jobs(jobs, impls, make_inputs, bytes_per_elem, device, device_name, timer, label):
    records = []
    for numel, sizes in jobs:
        for name, make in impls.items():
            inputs = make_inputs(sizes, device)
            fn = make(inputs, device)
            suffix = f" [{len(sizes)} tensors]" if len(sizes) > 1 else ""
            if fn is None:
                print(f"  {label} {name}{suffix} {human(numel)}: no such job for these inputs, skipped")
                continue
            median, p20, p80 = timer(fn)
            records.append(record(name + suffix, numel, median, p20, p80, bytes_per_elem, device_name))
            print(f"  {label} {name}{suffix} {human(numel)}: {median:.3f} ms", flush=True)
            del inputs, fn
            free_memory()
    return records


def sweep(device, device_name, timer, numel):
    """Times other launch configurations of both kernels on this GPU, each set as its
    architecture's entry of the kernel's LAUNCH_CONFIG (as _runtime.launch_config picks it), and
    prints the fastest as the entry to put there."""
    adam = importlib.import_module("gpu_kernels.adam")
    stats = importlib.import_module("gpu_kernels.grad_stats")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    else:
        arch = "cpu"
    records = []
    for module, name, make, grid in (
        (
            adam,
            "gpu_kernels.fused_adam_",
            lambda: (adam_state([numel], device), ours_adam, ADAM_BYTES),
            # ITERS 8: a program's first loads wait for two dependent table reads (its chunk's
            # row, then its tensor's), which more elements per program amortize
            itertools.product((1024, 2048, 4096), (1, 2, 4, 8), (4, 8)),
        ),
        (
            stats,
            "gpu_kernels.grad_stats",
            lambda: ([torch.randn(numel, device=device).to(torch.bfloat16)], ours_stats, STATS_BYTES),
            itertools.product((2048, 4096), (4, 8, 16), (8,)),
        ),
    ):
        saved = module.LAUNCH_CONFIG.get(arch)
        base = dict(module.LAUNCH_CONFIG.get(arch, module.LAUNCH_CONFIG["cuda" if arch != "cpu" else "cpu"]))
        inputs, impl, nbytes = make()
        best = None
        try:
            for block, iters, warps in grid:
                config = dict(base, BLOCK=block, ITERS=iters, num_warps=warps)
                module.LAUNCH_CONFIG[arch] = config
                median, p20, p80 = timer(impl(inputs, device))
                records.append(
                    record(
                        f"{name} BLOCK={block} ITERS={iters} warps={warps}",
                        numel,
                        median,
                        p20,
                        p80,
                        nbytes,
                        device_name,
                    )
                )
                if best is None or median < best[0]:
                    best = (median, config)
        finally:
            if saved is None:
                module.LAUNCH_CONFIG.pop(arch, None)
            else:
                module.LAUNCH_CONFIG[arch] = saved
        print(
            f"sweep: fastest {name} on {arch}: {best[0]:.3f} ms with {best[1]} — "
            f"{module.__name__}.LAUNCH_CONFIG[{arch!r}] = {best[1]}",
            flush=True,
        )
        del inputs
        free_memory()
    return records


def launch_overhead(n_tensors, rounds=21):
    """Host time of one call over `n_tensors` tensors, fused_adam_ against FusedAdam.step: what
    a list pays per step before its kernel runs (on a GPU it decides the list's figure once it
    exceeds the kernel's time). On CUDA the calls launch; without a GPU every launch compiles
    for sm_90 instead (gpu_kernels.offline: the same launcher and Triton binder, no launch)."""
    import contextlib

    import gpu_kernels
    from gpu_kernels import offline

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = random_sizes(n_tensors * 1000, n_tensors)
    state = adam_state(sizes, device)
    scale, found_inf = torch.full((1,), 1.0 / LOSS_SCALE, device=device), torch.zeros(1, device=device)
    kwargs = dict(step=STEP, grad_scale=scale, found_inf=found_inf, **HYPER)
    lists = (state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"])
    records = []
    with contextlib.nullcontext() if cuda else offline.compile_for("sm_90"):
        launch = gpu_kernels.FusedAdam(*lists, param_copies=state["copies"])
        calls = {
            "gpu_kernels.fused_adam_": lambda: gpu_kernels.fused_adam_(
                *lists, param_copies=state["copies"], **kwargs
            ),
            "gpu_kernels.FusedAdam.step": lambda: launch.step(**kwargs),
        }
        for name, call in calls.items():
            t = time_ms(call, reps=rounds, warmup=1)  # the first call compiles
            median, p20, p80 = (t[k] * 1e3 for k in ("median_ms", "p20_ms", "p80_ms"))
            records.append(
                dict(
                    impl=f"host time per call: {name} [{n_tensors} tensors]",
                    n_tensors=n_tensors,
                    median_us=median,
                    p20_us=p20,
                    p80_us=p80,
                    mode="cuda launch" if cuda else "compile-only for sm_90 (no GPU)",
                )
            )
            print(
                f"host time per call, {name}, {n_tensors} tensors: {median:.1f} us (p20 {p20:.1f}, "
                f"p80 {p80:.1f}; {'CUDA' if cuda else 'no GPU: compile-only launches for sm_90'})",
                flush=True,
            )
        records.append(_device_tier_overhead(device, rounds))
        if cuda:
            torch.cuda.synchronize()
    return records


def _device_tier_overhead(device, rounds):
    """hybrid_opt's device tier stepping the layout of the peer study's model (12 x
    Linear(4096) cut into 49 subgroups: 72 slices), with 1/1024-size tensors: the host time of
    one step (its prepared launches found again)."""
    from hybrid_opt.state import layout as L
    from hybrid_opt.tiers.device import DeviceTier
    from hybrid_opt.tiers.inputs import AdamInputs

    params = []
    for _ in range(12):
        params += [
            torch.nn.Parameter(torch.randn(16384, device=device)),
            torch.nn.Parameter(torch.randn(4, device=device)),
        ]
    sgs = L.layout_group(params, 0, 0, sum(p.numel() for p in params) // 49 + 1, 0)
    for p in params:
        p.grad = torch.randn_like(p)
    tier = DeviceTier(sgs, amsgrad=False)
    hp = AdamInputs(0, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1.0)
    work = [(sg.index, sl, hp, 2) for sg in sgs for sl in sg.slices]
    t = time_ms(lambda: tier._step_cuda(work, 0.5, None), reps=rounds, warmup=1)
    median, p20, p80 = (t[k] * 1e3 for k in ("median_ms", "p20_ms", "p80_ms"))
    name = f"host time per call: DeviceTier step [{len(work)} slices, {len(sgs)} subgroups]"
    print(f"{name}: {median:.1f} us (p20 {p20:.1f}, p80 {p80:.1f})", flush=True)
    return dict(
        impl=name,
        n_tensors=len(work),
        median_us=median,
        p20_us=p20,
        p80_us=p80,
        mode="cuda launch" if device.type == "cuda" else "compile-only for sm_90 (no GPU)",
    )


def markdown(records, copy_gbs):
    """One table; "vs torch" is the torch baseline's time over this row's, same job and size."""

    def job(r):
        family = "stats" if r["bytes_per_elem"] == STATS_BYTES else "adam"
        return family, r["numel"], " tensors]" in r["impl"]

    baselines = {
        job(r): r
        for r in records
        if r["impl"].split(" [")[0] in ("torch.AdamW(fused=True)", "torch._foreach_norm")
    }
    lines = [
        "| impl | numel | median ms | p20–p80 ms | Gelem/s | GB/s | % copy BW | vs torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        base = baselines.get(job(r))
        speedup = f"{base['median_ms'] / r['median_ms']:.2f}×" if base else ""
        lines.append(
            f"| {r['impl']} | {human(r['numel'])} | {r['median_ms']:.3f} | {r['p20_ms']:.3f}–{r['p80_ms']:.3f} "
            f"| {r['gelem_per_s']:.1f} | {r['gb_per_s']:.0f} | {100 * r['gb_per_s'] / copy_gbs:.0f}% | {speedup} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help="single-tensor sizes, comma separated (16M,64M,256M,1G)")
    parser.add_argument(
        "--quick", action="store_true", help="reduced sizes and repetitions (16M,128M; a 64M list)"
    )
    parser.add_argument("--tensors", type=int, default=1000, help="tensors in the list case")
    parser.add_argument("--list-numel", help="total elements of the list case (256M; 64M with --quick)")
    parser.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    parser.add_argument("--json", metavar="PATH", help="write the records there")
    parser.add_argument(
        "--launch-overhead",
        action="store_true",
        help="only the host time per call over --tensors tensors (runs without a GPU too)",
    )
    parser.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.launch_overhead:
        records = launch_overhead(args.tensors)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
        return 0

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
        sizes = [parse_numel(s) for s in (args.sizes or "4K,12K").split(",")]
        list_numel, n_tensors = parse_numel(args.list_numel or "16K"), min(args.tensors, 20)
        device_name = "cpu (dry run, TRITON_INTERPRET=1)"
    else:
        if not torch.cuda.is_available():
            print("bench_gpu_kernels: no CUDA device here; this benchmark runs on GPUs only. Nothing to do.")
            return 0
        device = torch.device("cuda")
        default_sizes = "16M,128M" if args.quick else "16M,64M,256M,1G"
        sizes = [parse_numel(s) for s in (args.sizes or default_sizes).split(",")]
        list_numel = parse_numel(args.list_numel or ("64M" if args.quick else "256M"))
        n_tensors = args.tensors
        device_name = torch.cuda.get_device_name(device)
    import triton

    timer = Timer(args.dry_run, args.quick)
    print(f"# gpu_kernels benchmark on {device_name}: torch {torch.__version__}, triton {triton.__version__}")

    failures = check_adam(device, [1000, 4099, 2**14 if args.dry_run else 2**20])
    failures += check_compressed(device, [1000, 4099, 2**14 if args.dry_run else 2**20])
    failures += check_stats(device, [1000, 4099, 2**14 if args.dry_run else 2**20])

    copy_gbs = copy_bandwidth(device, timer, args.dry_run)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    records = [dict(impl="copy_bandwidth", gb_per_s=copy_gbs, device=device_name)]

    jobs = [(n, [n]) for n in sizes] + [(list_numel, random_sizes(list_numel, n_tensors))]
    records += run_jobs(
        jobs, ADAM_IMPLS, lambda s, d: adam_state(s, d), ADAM_BYTES, device, device_name, timer, "adam"
    )
    # --quick (gpu_check.sh's time limit): compressed state at the largest size only
    compressed_jobs = [max(jobs[:-1])] if args.quick else jobs
    for name, (kwargs, nbytes) in COMPRESSED.items():
        records += run_jobs(
            compressed_jobs,
            {f"gpu_kernels.fused_adam_ {name}": ours_compressed},
            lambda s, d, kwargs=kwargs: compressed_state(s, d, **kwargs),
            nbytes,
            device,
            device_name,
            timer,
            "adam",
        )

    def make_grads(s, d):
        gen = torch.Generator(device=d).manual_seed(2)
        return [torch.randn(n, device=d, generator=gen).to(torch.bfloat16) for n in s]

    records += run_jobs(jobs, STATS_IMPLS, make_grads, STATS_BYTES, device, device_name, timer, "grad_stats")
    if args.sweep:
        records += sweep(device, device_name, timer, sizes[-1] if args.dry_run else min(max(sizes), 2**27))

    print()
    print(markdown([r for r in records if r["impl"] != "copy_bandwidth"], copy_gbs))
    ours = [r for r in records if r["impl"] == "gpu_kernels.fused_adam_"]
    if ours:
        big = max(ours, key=lambda r: r["numel"])
        base = next(
            r for r in records if r["impl"] == "torch.AdamW(fused=True)" and r["numel"] == big["numel"]
        )
        print(
            f"\nfused_adam_ at {human(big['numel'])}: {100 * big['gb_per_s'] / copy_gbs:.0f}% of copy bandwidth "
            f"(target >= 85%), {base['median_ms'] / big['median_ms']:.2f}× torch.AdamW(fused=True) (target >= 1.1×)"
        )
    listed = [r for r in records if r["impl"].startswith("gpu_kernels.grad_stats [")]
    if listed:
        print(
            f"grad_stats over {n_tensors} tensors: {100 * listed[0]['gb_per_s'] / copy_gbs:.0f}% of copy "
            f"bandwidth (target >= 80%)"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    if failures:
        print(f"FAILED correctness checks: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
