"""CPU Adam over a model's list of params: ours in one call against ours a call per tensor and
torch's AdamW, fused and as it runs by default on a CPU, the same tensors in the same process.

    python benchmarks/bench_cpu_many.py [--lists demo gpt 1000x16Ki] [--threads 1 2] [--reps 25]
        [--trials 3] [--json out.json]

A model's params are many tensors, most of them small: the demo's TinyGPT has 53, 26 of them 128
elements; the bench GPT 51. Rows (fp32 param, grad and moments, AdamW, in place; 28 bytes an
element):
- `ours_many`: a cpu_kernels.adam_call per tensor (check=False, as the CPU device tier makes them)
  and one cpu_kernels.adam_steps_: one parallel region whose threads split the list's elements
  end to end;
- `ours_each`: cpu_kernels.adam_step_ per tensor (its checks, a parallel region from 64Ki
  elements on);
- `torch_fused`: torch._fused_adamw_ over the lists, what torch.optim.AdamW(fused=True) runs;
- `torch_default`: torch.optim.AdamW(params).step(), a loop over the tensors on a CPU (foreach
  and fused are off there unless asked for).
Each list also runs cpu_kernels.bandwidth_probe_ over one tensor of its total size (Adam's 28
bytes an element, no arithmetic): "% roof" is against it. ms are medians of interleaved rounds;
with --trials N the median of N trial medians and their lowest and highest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_description, markdown_table, write_json  # noqa: E402
from bench_cpu_adam import _trials  # noqa: E402

import cpu_kernels  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
BYTES = 28  # p 4+4, g 4, m 4+4, v 4+4


def list_sizes(name: str) -> list[int]:
    """The param sizes of list `name`: demo (TinyGPT), gpt (benchmarks/peers_model.py's bench
    GPT), or COUNTxSIZE (COUNT tensors of SIZE elements, SIZE with Ki/Mi)."""
    if name == "demo":
        from hybrid_opt.demo import TinyGPT

        return [p.numel() for p in TinyGPT().parameters()]
    if name == "gpt":
        from peers_model import GPT, ModelConfig

        return [p.numel() for p in GPT(ModelConfig()).parameters()]
    count, _, size = name.partition("x")
    units = {"Ki": 2**10, "Mi": 2**20}
    mult = next((v for u, v in units.items() if size.endswith(u)), 1)
    return [int(size.rstrip("KiM")) * mult] * int(count)


class Lists:
    """The tensors of one list: params (with grads, for torch.optim), moments, and torch's step
    counts; every row steps these same tensors."""

    def __init__(self, sizes: list[int]):
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.randn(n, generator=gen) for n in sizes]
        for p in self.params:
            p.grad = torch.randn(p.numel(), generator=gen) * 1e-2
        self.m = [0.1 * p.grad for p in self.params]
        self.v = [1e-3 * p.grad * p.grad for p in self.params]
        self.steps = [torch.tensor(1.0) for _ in self.params]
        self.step = 1
        self.torch_opt = torch.optim.AdamW(
            self.params,
            lr=HP["lr"],
            betas=(HP["beta1"], HP["beta2"]),
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
        )
        self.probe = torch.randn(sum(sizes), generator=gen)
        self.probe_g = torch.randn(sum(sizes), generator=gen)
        self.probe_m = torch.randn(sum(sizes), generator=gen)
        self.probe_v = torch.rand(sum(sizes), generator=gen)

    def ours_many(self):
        self.step += 1
        calls = [
            cpu_kernels.adam_call(p, p.grad, m, v, step=self.step, check=False, **HP)
            for p, m, v in zip(self.params, self.m, self.v)
        ]
        cpu_kernels.adam_steps_(calls)

    def ours_each(self):
        self.step += 1
        for p, m, v in zip(self.params, self.m, self.v):
            cpu_kernels.adam_step_(p, p.grad, m, v, step=self.step, **HP)

    def torch_fused(self):
        grads = [p.grad for p in self.params]
        torch._foreach_add_(self.steps, 1)
        torch._fused_adamw_(
            self.params,
            grads,
            self.m,
            self.v,
            [],
            self.steps,
            amsgrad=False,
            maximize=False,
            **HP,
        )

    def torch_default(self):
        self.torch_opt.step()

    def roofline(self):
        cpu_kernels.bandwidth_probe_(self.probe, self.probe_g, self.probe_m, self.probe_v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lists", nargs="+", default=["demo", "gpt", "1000x16Ki"])
    ap.add_argument("--threads", nargs="+", type=int, default=None, help="default: 1 and every core")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or sorted({1, cores})
    print(f"host: {host_description()}; SIMD {cpu_kernels.simd_level()}; torch {torch.__version__}")
    rows = []
    for name in args.lists:
        sizes = list_sizes(name)
        job = Lists(sizes)
        for th in threads:
            torch.set_num_threads(th)
            cpu_kernels.set_num_threads(th)
            fns = {
                "ours_many": job.ours_many,
                "ours_each": job.ours_each,
                "torch_fused": job.torch_fused,
                "torch_default": job.torch_default,
                "roofline": job.roofline,
            }
            by = _trials(fns, args.reps, args.trials)
            total = sum(sizes)
            roof_ms = by["roofline"]["median_ms"]
            for impl, r in by.items():
                if impl == "roofline":
                    continue
                rows.append(
                    dict(
                        list=name,
                        tensors=len(sizes),
                        elements=total,
                        impl=impl,
                        threads=th,
                        simd=cpu_kernels.simd_level(),
                        median_ms=r["median_ms"],
                        lo_ms=r["trial_min_ms"],
                        hi_ms=r["trial_max_ms"],
                        vs_torch_fused=by["torch_fused"]["median_ms"] / r["median_ms"],
                        gbs=BYTES * total / r["median_ms"] / 1e6,
                        pct_roof=100 * roof_ms / r["median_ms"],
                        roof_ms=roof_ms,
                    )
                )
    cols = [
        ("list", "list", ""),
        ("tensors", "tensors", "d"),
        ("elements", "elements", ","),
        ("impl", "impl", ""),
        ("threads", "threads", "d"),
        ("median_ms", "median ms", ".3f"),
        ("lo_ms", "lo", ".3f"),
        ("hi_ms", "hi", ".3f"),
        ("vs_torch_fused", "torch fused / this", ".2f"),
        ("gbs", "GB/s", ".1f"),
        ("pct_roof", "% roof", ".0f"),
    ]
    print(markdown_table(rows, cols))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
