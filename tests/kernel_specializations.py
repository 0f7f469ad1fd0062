"""Every kernel specialization gpu_kernels' launchers can produce, compiled for one GPU
architecture through the launch path itself (`gpu_kernels.offline.compile_for`), without a GPU.

Run as a script (tests/test_gpu_compile.py does, in a fresh interpreter: Triton's interpreter
patches triton.language in a process that has interpreted):

    python tests/kernel_specializations.py --arch 90

fused_adam_'s specializations are the product of two families of choices:
- what decides the kernel's pointer types: grad dtype (3) x what is written beside the fp32
  master (no copy, an fp32 / bf16 / fp16 copy, or a bf16 param with remainders: 5) x exp_avg
  dtype (2) x exp_avg_sq dtype (2) x amsgrad (2) = 120;
- the scalars and facts: lr float or device tensor (2) x grad_scale none / float / device
  tensor (3) x found_inf none / tensor (2) x 16-byte aligned or not (2) x decoupled (2) x
  weight decay zero or not (2) = 96.
Case i takes pointer combination i and scalar combination i mod 96 (mixed radix), so every
combination of each family is compiled, 120 programs in all. grad_stats: grad dtype (3) x
alignment (2) for stage 1, sum dtype (2) for stage 2. q8_adam_ (gpu_kernels/q8.py): moment formats
(q8/q8, q8/fp32, q8/bf16, fp32/q8, bf16/q8) x amsgrad (10), grad dtype x what is written beside
the master (15), grad_scale none / float / tensor x found_inf x aligned x decoupled x weight decay
(48): case i takes combination i of each family modulo its size, 48 programs in all.

Each compiled program must reach a cubin with no fp32 multiply-add in its PTX (compiled
without contraction: every specialization rounds alike), and every kernel's `tl.constexpr`
parameters must still be constexpr in the function Triton compiled (a rebuilt kernel without its annotations
compiles them as runtime values: the first H200 run, 2026-12-04). Prints one line per kernel
family and OK.
"""

import argparse
import inspect
import itertools
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gpu_kernels  # noqa: E402
from gpu_kernels import _runtime, offline, q8  # noqa: E402

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BESIDE = (None, torch.float32, torch.bfloat16, torch.float16, "remainders")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
NUMELS = (1000, 70001)  # two tensors: whole chunks and a tail


def pointer_cases():
    return list(itertools.product(GRAD_DTYPES, BESIDE, MOMENT_DTYPES, MOMENT_DTYPES, (False, True)))


def scalar_cases():
    return list(
        itertools.product(
            ("float", "tensor"),
            (None, "float", "tensor"),
            (False, True),
            (True, False),
            (True, False),
            (0.0, 0.01),
        )
    )


def _tensor(numel, dtype, aligned):
    """A CPU tensor standing in for device memory; unaligned: 2 bytes past a 16-byte boundary
    (4 for the fp32 ones), so the launcher groups it as such."""
    if aligned:
        return torch.zeros(numel, dtype=dtype)
    return torch.zeros(numel + 1, dtype=dtype)[1:]


def adam_call(case, scalars):
    grad_dtype, beside, exp_avg_dtype, exp_avg_sq_dtype, amsgrad = case
    lr_kind, scale_kind, found_inf, aligned, decoupled, weight_decay = scalars
    remainders = beside == "remainders"
    lists = dict(
        params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], max_exp_avg_sqs=[], param_copies=[], remainders=[]
    )
    for n in NUMELS:
        lists["params"].append(_tensor(n, torch.bfloat16 if remainders else torch.float32, aligned))
        lists["grads"].append(_tensor(n, grad_dtype, aligned))
        lists["exp_avgs"].append(_tensor(n, exp_avg_dtype, aligned))
        lists["exp_avg_sqs"].append(_tensor(n, exp_avg_sq_dtype, aligned))
        lists["max_exp_avg_sqs"].append(_tensor(n, exp_avg_sq_dtype, aligned))
        if beside is not None and not remainders:
            lists["param_copies"].append(_tensor(n, beside, aligned))
        lists["remainders"].append(_tensor(n, torch.int16, aligned))
    args = dict(
        params=lists["params"],
        grads=lists["grads"],
        exp_avgs=lists["exp_avgs"],
        exp_avg_sqs=lists["exp_avg_sqs"],
        max_exp_avg_sqs=lists["max_exp_avg_sqs"] if amsgrad else None,
        param_copies=lists["param_copies"] or None,
        remainders=lists["remainders"] if remainders else None,
        step=3,
        lr=torch.tensor([1e-3]) if lr_kind == "tensor" else 1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale={None: None, "float": 0.5, "tensor": torch.tensor([0.5])}[scale_kind],
        found_inf=torch.zeros(1) if found_inf else None,
    )
    gpu_kernels.fused_adam_(
        args.pop("params"), args.pop("grads"), args.pop("exp_avgs"), args.pop("exp_avg_sqs"), **args
    )


Q8_MOMENTS = (
    ("q8", "q8"),
    ("q8", torch.float32),
    ("q8", torch.bfloat16),
    (torch.float32, "q8"),
    (torch.bfloat16, "q8"),
)


def q8_cases():
    moments = list(itertools.product(Q8_MOMENTS, (False, True)))
    sources = list(itertools.product(GRAD_DTYPES, BESIDE))
    scalars = list(
        itertools.product((None, "float", "tensor"), (False, True), (True, False), (True, False), (0.0, 0.01))
    )
    return [(moments[i % len(moments)], sources[i % len(sources)], scalars[i]) for i in range(len(scalars))]


def _q8_moment(fmt, numel, aligned):
    if fmt != "q8":
        return _tensor(numel, fmt, aligned)
    return q8.Q8Blocks(
        _tensor(numel, torch.uint8, aligned), _tensor(-(-numel // q8.BLOCK), torch.float32, aligned)
    )


def q8_call(case):
    ((exp_avg_fmt, exp_avg_sq_fmt), amsgrad), (grad_dtype, beside), scalars = case
    scale_kind, found_inf, aligned, decoupled, weight_decay = scalars
    remainders = beside == "remainders"
    lists = dict(
        params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], max_exp_avg_sqs=[], param_copies=[], remainders=[]
    )
    for n in NUMELS:
        lists["params"].append(_tensor(n, torch.bfloat16 if remainders else torch.float32, aligned))
        lists["grads"].append(_tensor(n, grad_dtype, aligned))
        lists["exp_avgs"].append(_q8_moment(exp_avg_fmt, n, aligned))
        lists["exp_avg_sqs"].append(_q8_moment(exp_avg_sq_fmt, n, aligned))
        lists["max_exp_avg_sqs"].append(_q8_moment(exp_avg_sq_fmt, n, aligned))
        if beside is not None and not remainders:
            lists["param_copies"].append(_tensor(n, beside, aligned))
        lists["remainders"].append(_tensor(n, torch.int16, aligned))
    q8.q8_adam_(
        lists["params"],
        lists["grads"],
        lists["exp_avgs"],
        lists["exp_avg_sqs"],
        max_exp_avg_sqs=lists["max_exp_avg_sqs"] if amsgrad else None,
        param_copies=lists["param_copies"] or None,
        remainders=lists["remainders"] if remainders else None,
        step=3,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale={None: None, "float": 0.5, "tensor": torch.tensor([0.5])}[scale_kind],
        found_inf=torch.zeros(1) if found_inf else None,
    )


def stats_call(grad_dtype, aligned, sum_dtype):
    gpu_kernels.grad_stats([_tensor(n, grad_dtype, aligned) for n in NUMELS], sum_dtype=sum_dtype)


def annotated_constexprs(fn):
    tl = _runtime.language()
    return [name for name, p in inspect.signature(fn).parameters.items() if p.annotation is tl.constexpr]


def check_constexprs(compiled_namespace_key, minimum=8):
    """The functions Triton compiled keep every parameter annotated `tl.constexpr` as one."""
    checked = 0
    for module_name, mode in list(_runtime._namespaces):
        if mode != compiled_namespace_key:
            continue
        namespace = _runtime._namespaces[(module_name, mode)]
        for name, obj in namespace.items():
            lazy = sys.modules[module_name].__dict__.get(name)
            if not isinstance(lazy, _runtime.LazyKernel):
                continue
            want = annotated_constexprs(lazy.fn)
            got = [p.name for p in obj.params if p.is_constexpr]
            assert got == want, f"{module_name}.{name}: constexpr parameters {got}, annotated {want}"
            checked += 1
    assert checked >= minimum, f"only {checked} kernels and helpers checked"
    return checked


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90", help="compute capability: 80, 90, sm_90...")
    parser.add_argument("--limit", type=int, default=None, help="compile only the first N adam cases")
    parser.add_argument(
        "--only",
        choices=("q8",),
        default=None,
        help="compile one family only (q8: q8_adam_'s cases, for work on that kernel)",
    )
    args = parser.parse_args(argv)
    if args.only == "q8":
        return main_q8(offline.parse_arch(args.arch))
    arch = offline.parse_arch(args.arch)
    pointers, scalars = pointer_cases(), scalar_cases()
    cases = [(p, scalars[i % len(scalars)]) for i, p in enumerate(pointers)]
    assert len(pointers) >= len(scalars)
    if args.limit is not None:
        cases = cases[: args.limit]

    t0 = time.perf_counter()
    with offline.compile_for(arch) as compiled:
        for case, sc in cases:
            before = len(compiled)
            try:
                adam_call(case, sc)
            except Exception as exc:
                raise SystemExit(f"fused_adam_ {case} {sc} failed to compile for sm_{arch}:\n{exc}") from exc
            # one launch per (dtype, alignment) group: here one
            assert len(compiled) == before + 1, (case, sc, len(compiled) - before)
        n_adam = len(compiled)
        for grad_dtype, aligned, sum_dtype in itertools.product(
            GRAD_DTYPES, (True, False), (torch.float32, torch.float64)
        ):
            try:
                stats_call(grad_dtype, aligned, sum_dtype)
            except Exception as exc:
                raise SystemExit(
                    f"grad_stats {grad_dtype} aligned={aligned} {sum_dtype} failed to "
                    f"compile for sm_{arch}:\n{exc}"
                ) from exc
        n_stats = len(compiled) - n_adam
        n_q8 = compile_q8(arch, compiled)
        key = _runtime._mode(torch.device("cpu"))
        kernels = compiled[:]
        checked = check_constexprs(key)
    check_ptx(kernels, arch)
    adam_programs = {k.hash for k in kernels[:n_adam]}
    q8_programs = {k.hash for k in kernels[n_adam + n_stats :]}
    print(
        f"sm_{arch} (triton {_triton_version()}): fused_adam_ {len(cases)} cases -> {len(adam_programs)} distinct programs; "
        f"grad_stats {n_stats} launches; q8_adam_ {n_q8} cases -> {len(q8_programs)} distinct programs; "
        f"{checked} functions keep their constexprs; {time.perf_counter() - t0:.1f} s"
    )
    assert len(adam_programs) == len(cases), "two cases compiled to the same program: a choice is lost"
    assert len(q8_programs) == n_q8, "two q8 cases compiled to the same program: a choice is lost"
    print("OK")
    return 0


def compile_q8(arch, compiled):
    """Compiles q8_adam_'s cases into `compiled`; returns how many programs they made."""
    before = len(compiled)
    for case in q8_cases():
        try:
            q8_call(case)
        except Exception as exc:
            raise SystemExit(f"q8_adam_ {case} failed to compile for sm_{arch}:\n{exc}") from exc
        assert len(compiled) == before + 1, (case, len(compiled) - before)
        before = len(compiled)
    return len(q8_cases())


def _triton_version():
    import triton

    return triton.__version__


def check_ptx(kernels, arch):
    for kernel in kernels:
        ptx = kernel.asm["ptx"]
        assert kernel.asm.get("cubin"), f"{kernel.name}: no cubin"
        assert f".target sm_{arch}" in ptx, f"{kernel.name}: PTX for another target"
        # no contraction: every multiply and add rounds once (.rn also keeps ptxas from fusing)
        assert not re.search(r"\bfma\.\w+\.f32", ptx), f"{kernel.name}: fp32 multiply-adds in the PTX"


def main_q8(arch):
    t0 = time.perf_counter()
    with offline.compile_for(arch) as compiled:
        n = compile_q8(arch, compiled)
        kernels = compiled[:]
        checked = check_constexprs(_runtime._mode(torch.device("cpu")), minimum=4)
    check_ptx(kernels, arch)
    programs = {k.hash for k in kernels}
    print(
        f"sm_{arch} (triton {_triton_version()}): q8_adam_ {n} cases -> {len(programs)} distinct programs; {checked} functions keep "
        f"their constexprs; {time.perf_counter() - t0:.1f} s"
    )
    assert len(programs) == n, "two q8 cases compiled to the same program: a choice is lost"
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
