"""gpu_kernels: fused multi-tensor Adam/AdamW and gradient statistics, checked against torch
(`torch.optim.AdamW(foreach=False)` / `Adam`, `clip_grad_norm_`, `isfinite`) and against the
fp64 references beside the kernels.

The same tests run on CUDA tensors when a GPU is present, else on CPU tensors through
Triton's interpreter (conftest sets TRITON_INTERPRET=1). The interpreter costs ~0.7 ms per
program, so sizes stay small; `gpu` tests need sizes or properties only a GPU has.
"""

import contextlib
import importlib
import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers import needs_kernels, run_compile_check
from tolerances import assert_close

import gpu_kernels
from gpu_kernels import clip_coef, fused_adam_, fused_adam_reference_, grad_stats, grad_stats_reference

adam_module = importlib.import_module("gpu_kernels.adam")
stats_module = importlib.import_module("gpu_kernels.grad_stats")
runtime = importlib.import_module("gpu_kernels._runtime")

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
# the interpreter computes in numpy, which warns where fp32 -> fp16 casts or squares overflow;
# those overflows are the point of the tests that make them
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
ODD_SIZES = [1, 15, 17, 4099]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def make_state(sizes, device, grad_dtype=torch.float32, *, seed=0, amsgrad=False, copy_dtype=None):
    gen = torch.Generator().manual_seed(seed)

    def rand(n, scale=1.0):
        return (torch.randn(n, generator=gen) * scale).to(device)

    state = dict(
        params=[rand(n) for n in sizes],
        grads=[rand(n).to(grad_dtype) for n in sizes],
        exp_avgs=[rand(n, 0.1) for n in sizes],
        exp_avg_sqs=[rand(n, 0.01).abs() for n in sizes],
    )
    if amsgrad:
        state["max_exp_avg_sqs"] = [v * 1.5 for v in state["exp_avg_sqs"]]
    if copy_dtype is not None:
        state["param_copies"] = [torch.zeros(n, dtype=copy_dtype, device=device) for n in sizes]
    return state


def clone_state(state):
    return {k: [t.clone() for t in v] for k, v in state.items()}


def run(fn, state, **kwargs):
    fn(
        state["params"],
        state["grads"],
        state["exp_avgs"],
        state["exp_avg_sqs"],
        **{k: v for k, v in state.items() if k not in ("params", "grads", "exp_avgs", "exp_avg_sqs")},
        **kwargs,
    )


def assert_state_close(actual, expected):
    for key in actual:
        for i, (a, e) in enumerate(zip(actual[key], expected[key])):
            if key == "grads":
                assert torch.equal(a, e), f"{key}[{i}] was modified"
            else:
                assert_close(a, e, msg=f"{key}[{i}]")


# --------------------------------------------------------------------------------------------
# fused_adam_
# --------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
def test_fused_adam_matches_reference_on_odd_sizes(device, grad_dtype, decoupled, amsgrad):
    state = make_state(
        ODD_SIZES + [8192, 70001], device, grad_dtype, amsgrad=amsgrad, copy_dtype=torch.bfloat16
    )
    expected = clone_state(state)
    scale = torch.tensor([0.5], device=device)
    run(fused_adam_, state, step=3, decoupled=decoupled, grad_scale=scale, **HYPER)
    run(fused_adam_reference_, expected, step=3, decoupled=decoupled, grad_scale=scale, **HYPER)
    copies = state.pop("param_copies")
    expected.pop("param_copies")
    assert_state_close(state, expected)
    for c, p in zip(copies, state["params"]):
        assert torch.equal(c, p.to(c.dtype))


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("optimizer", ["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
def test_fused_adam_matches_torch_optim_over_steps(device, grad_dtype, optimizer, amsgrad, maximize):
    sizes = [15, 300, 4099]
    state = make_state(sizes, device, grad_dtype, amsgrad=amsgrad)
    for key in ("exp_avgs", "exp_avg_sqs") + (("max_exp_avg_sqs",) if amsgrad else ()):
        for t in state[key]:
            t.zero_()  # torch's fresh state
    torch_params = [p.clone().requires_grad_(True) for p in state["params"]]
    cls = getattr(torch.optim, optimizer)
    opt = cls(
        torch_params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=False,
    )
    # maximize is a negative grad scale; Adam's weight decay is L2 (decoupled=False)
    scale = torch.tensor([-1.0 if maximize else 1.0], device=device)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grads = [(torch.randn(n, generator=gen) * 3).to(device).to(grad_dtype) for n in sizes]
        state["grads"] = grads
        run(fused_adam_, state, step=step, decoupled=optimizer == "AdamW", grad_scale=scale, **HYPER)
        for p, g in zip(torch_params, grads):
            p.grad = g.float()
        opt.step()
        for i, p in enumerate(torch_params):
            torch_state = opt.state[p]
            assert_close(state["params"][i], p.detach(), msg=f"step {step} params[{i}]")
            assert_close(state["exp_avgs"][i], torch_state["exp_avg"], msg=f"step {step} exp_avgs[{i}]")
            assert_close(
                state["exp_avg_sqs"][i], torch_state["exp_avg_sq"], msg=f"step {step} exp_avg_sqs[{i}]"
            )
            if amsgrad:
                assert_close(
                    state["max_exp_avg_sqs"][i],
                    torch_state["max_exp_avg_sq"],
                    msg=f"step {step} max_exp_avg_sqs[{i}]",
                )


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_lr_tensor_and_float_scale_match_reference(device):
    state = make_state([17, 4099], device, torch.bfloat16)
    expected = clone_state(state)
    lr = torch.tensor([3e-3], device=device)
    run(fused_adam_, state, step=5, grad_scale=0.25, **{**HYPER, "lr": lr})
    run(fused_adam_reference_, expected, step=5, grad_scale=0.25, **{**HYPER, "lr": lr})
    assert_state_close(state, expected)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_without_weight_decay_or_scale(device):
    state = make_state([17, 4099], device)
    expected = clone_state(state)
    kwargs = {**HYPER, "weight_decay": 0.0}
    run(fused_adam_, state, step=1, **kwargs)
    run(fused_adam_reference_, expected, step=1, **kwargs)
    assert_state_close(state, expected)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_param_copies_bitwise_equal_torch_cast(device, copy_dtype):
    state = make_state(ODD_SIZES, device, torch.bfloat16, copy_dtype=copy_dtype)
    # random values already round differently under truncation (the interpreter's own cast)
    # and round-to-nearest-even about half the time; add extremes: near FLT_MAX, subnormal
    state["params"][3][:4] = torch.tensor([1.00390625, 1.01171875, -3.0e38, 1e-39])
    state["grads"][3][:4] = 0
    run(fused_adam_, state, step=2, **HYPER)
    for i, (c, p) in enumerate(zip(state["param_copies"], state["params"])):
        assert torch.equal(c, p.to(copy_dtype)), f"param_copies[{i}]"


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_none_copies_and_unaligned_views(device):
    """Rows are grouped by (grad dtype, copy dtype, alignment); results do not depend on it."""
    sizes = [15, 17, 4099, 33, 8]
    state = make_state(sizes, device)
    state["grads"] = [
        g.to(dt)
        for g, dt in zip(
            state["grads"], [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
        )
    ]
    state["param_copies"] = [
        torch.zeros(15, dtype=torch.bfloat16, device=device),
        None,
        torch.zeros(4099, dtype=torch.float16, device=device),
        None,
        torch.zeros(8, dtype=torch.bfloat16, device=device),
    ]
    # tensors 3 and 4 are views at odd element offsets of one flat buffer (not 16-byte aligned)
    flat = torch.randn(1 + 33 + 8 + 1, device=device)
    state["params"][3], state["params"][4] = flat[1:34], flat[34:42]
    expected = clone_state({k: v for k, v in state.items() if k != "param_copies"})
    before = adam_module._fused_adam_kernel.launches
    run(fused_adam_, state, step=4, **HYPER)
    run(fused_adam_reference_, expected, step=4, **HYPER)
    copies = state.pop("param_copies")
    assert_state_close(state, expected)
    for c, p in zip(copies, state["params"]):
        if c is not None:
            assert torch.equal(c, p.to(c.dtype))
    launches = adam_module._fused_adam_kernel.launches - before
    assert 1 < launches <= len(sizes)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_views_leave_neighbours_untouched(device):
    flat = torch.randn(64, device=device)
    before = flat.clone()
    params = [flat[3:20]]
    grads = [torch.randn(17, device=device)]
    fused_adam_(
        params, grads, [torch.zeros(17, device=device)], [torch.zeros(17, device=device)], step=1, **HYPER
    )
    assert torch.equal(flat[:3], before[:3]) and torch.equal(flat[20:], before[20:])
    assert not torch.equal(flat[3:20], before[3:20])


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_200_tensors_of_random_sizes_in_one_launch(device):
    rng = random.Random(0)
    sizes = [rng.randint(1, 300) for _ in range(200)]
    state = make_state(sizes, device, torch.bfloat16, copy_dtype=torch.bfloat16)
    expected = clone_state(state)
    kernel = adam_module._fused_adam_kernel
    before = kernel.launches
    run(fused_adam_, state, step=2, **HYPER)
    assert kernel.launches - before == 1
    run(fused_adam_reference_, expected, step=2, **HYPER)
    assert_state_close(state, expected)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [1.0, float("inf"), float("nan")])
def test_found_inf_leaves_every_tensor_bitwise_unchanged(device, flag):
    state = make_state(ODD_SIZES, device, torch.bfloat16, amsgrad=True, copy_dtype=torch.bfloat16)
    before = clone_state(state)
    found_inf = torch.tensor([flag], device=device)
    run(
        fused_adam_,
        state,
        step=7,
        found_inf=found_inf,
        grad_scale=torch.tensor([2.0], device=device),
        **{**HYPER, "lr": torch.tensor(1e-2, device=device)},
    )
    for key in state:
        for i, (a, b) in enumerate(zip(state[key], before[key])):
            assert torch.equal(a, b), f"{key}[{i}] changed although found_inf = {flag}"
    # and a zero flag steps normally
    run(fused_adam_, state, step=7, found_inf=torch.zeros(1, device=device), **HYPER)
    assert not torch.equal(state["params"][3], before["params"][3])


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists_and_empty_tensors(device):
    fused_adam_([], [], [], [], step=1, **HYPER)
    state = make_state([0, 5], device)
    expected = clone_state(state)
    run(fused_adam_, state, step=1, **HYPER)
    run(fused_adam_reference_, expected, step=1, **HYPER)
    assert_state_close(state, expected)


def _bad_adam_inputs(device):
    """(description, mutate(state, kwargs), exception, message regex) — torch's OptimizerInfo style."""

    def t(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    def set_list(key, i, value):
        def mutate(state, kwargs):
            state[key][i] = value

        return mutate

    def set_kw(**updates):
        def mutate(state, kwargs):
            kwargs.update(updates)

        return mutate

    def drop(key):
        def mutate(state, kwargs):
            state[key] = state[key][:-1]

        return mutate

    return [
        ("short grads", drop("grads"), ValueError, r"grads has 1 tensors but params has 2"),
        ("short exp_avg_sqs", drop("exp_avg_sqs"), ValueError, r"exp_avg_sqs has 1 tensors but params has 2"),
        (
            "numel mismatch",
            set_list("exp_avgs", 1, t(3)),
            ValueError,
            r"exp_avgs\[1\] has 3 elements but params\[1\] has 4",
        ),
        (
            "non-contiguous",
            set_list("params", 0, t(4, 2)[:, 0]),
            ValueError,
            r"params\[0\] is not contiguous",
        ),
        (
            "fp16 param",
            set_list("params", 0, t(4, dtype=torch.float16)),
            TypeError,
            r"params\[0\] has dtype torch.float16",
        ),
        (
            "int grad",
            set_list("grads", 1, t(4, dtype=torch.int32)),
            TypeError,
            r"grads\[1\] has dtype torch.int32",
        ),
        (
            "fp16 moment",
            set_list("exp_avg_sqs", 0, t(4, dtype=torch.float16)),
            TypeError,
            r"exp_avg_sqs\[0\] has dtype torch.float16; expected one of: float32, bfloat16",
        ),
        ("not a tensor", set_list("grads", 0, [0.0] * 4), TypeError, r"grads\[0\] must be a tensor"),
        (
            "other device",
            set_list("grads", 0, torch.zeros(4, device="meta")),
            ValueError,
            r"grads\[0\] is on meta",
        ),
        (
            "params across devices",
            set_list("params", 1, torch.zeros(4, device="meta")),
            ValueError,
            r"params\[1\] is on meta but params\[0\] is on \w+(:\d+)?; one launch needs every tensor "
            r"on the same device",
        ),
        (
            "lr elsewhere",
            set_kw(lr=torch.tensor(1e-3, device="meta")),
            ValueError,
            r"lr is on meta but the tensors are on",
        ),
        (
            "grad_scale elsewhere",
            set_kw(grad_scale=torch.ones(1, device="meta")),
            ValueError,
            r"grad_scale is on meta but the tensors are on",
        ),
        (
            "copy dtype",
            set_kw(param_copies=[t(4, dtype=torch.int8), None]),
            TypeError,
            r"param_copies\[0\] has dtype",
        ),
        (
            "short copies",
            set_kw(param_copies=[t(4, dtype=torch.bfloat16)]),
            ValueError,
            r"param_copies has 1 tensors",
        ),
        (
            "short max_exp_avg_sqs",
            set_kw(max_exp_avg_sqs=[t(4)]),
            ValueError,
            r"max_exp_avg_sqs has 1 tensors",
        ),
        (
            "2-element grad_scale",
            set_kw(grad_scale=t(2)),
            ValueError,
            r"grad_scale must have exactly one element",
        ),
        (
            "int grad_scale",
            set_kw(grad_scale=t(1, dtype=torch.int32)),
            TypeError,
            r"grad_scale must be one of",
        ),
        ("float found_inf", set_kw(found_inf=0.0), TypeError, r"found_inf must be a 1-element tensor"),
        (
            "found_inf elsewhere",
            set_kw(found_inf=torch.zeros(1, device="meta")),
            ValueError,
            r"found_inf is on meta",
        ),
        ("step 0", set_kw(step=0), ValueError, r"step must be >= 1"),
        ("float step", set_kw(step=1.5), TypeError, r"step must be an int"),
        ("negative lr", set_kw(lr=-1.0), ValueError, r"Invalid learning rate"),
        ("beta1 = 1", set_kw(beta1=1.0), ValueError, r"Invalid beta parameter at index 0"),
        ("beta2 < 0", set_kw(beta2=-0.1), ValueError, r"Invalid beta parameter at index 1"),
        ("negative eps", set_kw(eps=-1e-8), ValueError, r"Invalid epsilon value"),
        ("negative weight_decay", set_kw(weight_decay=-1.0), ValueError, r"Invalid weight_decay value"),
        (
            "params is a tensor",
            lambda s, k: s.update(params=s["params"][0]),
            TypeError,
            r"params must be a list or tuple of tensors",
        ),
    ]


@needs_kernels  # some cases reach the launch before the check
@pytest.mark.parametrize(
    "case",
    range(len(_bad_adam_inputs("cpu"))),
    ids=[case[0].replace(" ", "_") for case in _bad_adam_inputs("cpu")],
)
def test_fused_adam_rejects_bad_inputs(case):
    device = DEVICES[0]
    description, mutate, error, message = _bad_adam_inputs(device)[case]
    state = make_state([4, 4], device)
    kwargs = dict(step=1, **HYPER)
    mutate(state, kwargs)
    with pytest.raises(error, match=message):
        run(fused_adam_, state, **kwargs)


@needs_kernels
def test_cpu_tensors_without_interpreter_raise_runtime_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    state = make_state([4], "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        run(fused_adam_, state, step=1, **HYPER)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        grad_stats(state["grads"])
    assert "TRITON_INTERPRET" in gpu_kernels.unavailable_reason("cpu")


def test_import_never_needs_triton_and_calls_say_why():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, gpu_kernels\n"
        "assert 'needs triton' in gpu_kernels.unavailable_reason('cpu')\n"
        "for call in (lambda: gpu_kernels.grad_stats([torch.ones(3)]),\n"
        "             lambda: gpu_kernels.fused_adam_([torch.ones(3)], [torch.ones(3)], [torch.ones(3)],\n"
        "                 [torch.ones(3)], step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0)):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        assert 'needs triton' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no RuntimeError')\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# --------------------------------------------------------------------------------------------
# grad_stats and clip_coef
# --------------------------------------------------------------------------------------------


def _grads(sizes, dtypes, device, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dt).to(device) for n, dt in zip(sizes, dtypes)]


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtypes",
    [[torch.float32], [torch.bfloat16], [torch.float16], [torch.float16, torch.float32, torch.bfloat16]],
    ids=["fp32", "bf16", "fp16", "mixed"],
)
def test_grad_stats_matches_reference(device, dtypes):
    sizes = ODD_SIZES + [70001, 3, 8192]
    grads = _grads(sizes, [dtypes[i % len(dtypes)] for i in range(len(sizes))], device)
    sum_sq, found_inf = grad_stats(grads)
    ref_sq, ref_inf = grad_stats_reference(grads)
    assert sum_sq.shape == () and sum_sq.dtype == torch.float32 and sum_sq.device == grads[0].device
    assert found_inf.shape == () and found_inf.dtype == torch.float32
    assert_close(sum_sq, ref_sq)
    assert found_inf.item() == 0.0 == ref_inf.item()
    sum64, _ = grad_stats(grads, sum_dtype=torch.float64)
    assert sum64.dtype == torch.float64
    # squares are rounded to fp32 (exact for bf16/fp16), sums are fp64
    exact = sum(g.double().pow(2).sum().cpu() for g in grads)
    torch.testing.assert_close(sum64.cpu(), exact, rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("position", [0, 4098], ids=["first", "last"])
def test_grad_stats_found_inf_matches_torch_nonfinite_check(device, dtype, bad, position):
    grads = _grads([17, 4099], [torch.float32, dtype], device)
    grads[1][position] = bad
    _, found_inf = grad_stats(grads)
    torch_found = not all(torch.isfinite(g).all() for g in grads)
    assert torch_found and found_inf.item() == 1.0


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_grad_stats_large_finite_values_are_not_flagged(device):
    grads = [
        torch.full((5,), 65504.0, dtype=torch.float16, device=device),
        torch.full((3,), 3.0e38, dtype=torch.float32, device=device),
    ]
    sum_sq, found_inf = grad_stats(grads)
    assert found_inf.item() == 0.0
    assert sum_sq.isinf()  # the squares overflow fp32, as torch's norm does; the values are finite


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_grad_stats_is_bitwise_reproducible(device):
    rng = random.Random(0)
    n = 60 if device == "cpu" else 1000
    sizes = [rng.randint(1, 20000 if device == "cpu" else 200000) for _ in range(n)]
    grads = _grads(sizes, [GRAD_DTYPES[i % 3] for i in range(n)], device, scale=1e3)
    first = grad_stats(grads)
    for _ in range(2):
        again = grad_stats(grads)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert_close(first[0], grad_stats_reference(grads)[0])


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_grad_stats_empty(device):
    sum_sq, found_inf = grad_stats([])
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0
    sum_sq, found_inf = grad_stats([torch.zeros(0, device=device)])
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_matches_torch_clip_grad_norm(device, grad_dtype, max_norm):
    grads = _grads([15, 4099, 300], [grad_dtype] * 3, device, seed=3)
    # torch in fp32 on the widened grads: for bf16 grads torch's own norm is rounded to bf16
    # twice, while ours is exact up to fp32
    params = [torch.zeros(g.shape, device=device, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.float().clone()  # clip_grad_norm_ scales in place
    total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    sum_sq, _ = grad_stats(grads)
    coef = clip_coef(sum_sq, max_norm)
    assert coef.shape == () and coef.dtype == torch.float32 and coef.device == grads[0].device
    assert_close(sum_sq.sqrt(), total_norm)
    for i, (p, g) in enumerate(zip(params, grads)):
        assert_close(g.float() * coef, p.grad, msg=f"grads[{i}]")
    assert (coef.item() == 1.0) == (max_norm == 1e6)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda d: grad_stats(torch.ones(3, device=d)), TypeError, r"grads must be a list or tuple"),
        (
            lambda d: grad_stats([torch.ones(3, dtype=torch.int32, device=d)]),
            TypeError,
            r"grads\[0\] has dtype torch.int32",
        ),
        (lambda d: grad_stats([torch.ones(3, 2, device=d).t()]), ValueError, r"grads\[0\] is not contiguous"),
        (
            lambda d: grad_stats([torch.ones(3, device=d), torch.ones(3, device="meta")]),
            ValueError,
            r"grads\[1\] is on meta",
        ),
        (lambda d: grad_stats([torch.ones(3, device=d)], sum_dtype=torch.float16), TypeError, r"sum_dtype"),
        (lambda d: clip_coef(torch.ones((), device=d), -1.0), ValueError, r"max_norm must be >= 0"),
        (lambda d: clip_coef(1.0, 1.0), TypeError, r"sum_sq must be a tensor"),
    ],
)
def test_grad_stats_rejects_bad_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call(DEVICES[0])


# --------------------------------------------------------------------------------------------
# the tensors' device, not the current one (Triton launches on the current CUDA device and its
# current stream)
# --------------------------------------------------------------------------------------------


def test_device_guard_selects_a_cuda_device_and_is_a_noop_on_cpu():
    guard = runtime.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert runtime.device_guard("cuda:1").idx == 1
    for device in ("cpu", torch.device("cpu")):
        guard = runtime.device_guard(device)
        assert isinstance(guard, contextlib.nullcontext)
        with guard:
            pass


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_every_table_build_and_launch_runs_under_the_tensors_device(device, monkeypatch):
    """Records the guard open at each table build and each kernel launch (through the real
    launch path): on CUDA that guard makes the tensors' device current."""
    real_guard = runtime.device_guard
    open_guards = []
    events = []

    @contextlib.contextmanager
    def recording_guard(d):
        open_guards.append(torch.device(d))
        try:
            with real_guard(d):
                yield
        finally:
            open_guards.pop()

    def watch_launches(lazy):
        real_for_device = lazy.for_device

        def for_device(d):
            kernel = real_for_device(d)

            class Grid:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        events.append((lazy.__name__, list(open_guards)))
                        return kernel[grid](*args, **kwargs)

                    return launch

            return Grid()

        monkeypatch.setattr(lazy, "for_device", for_device)

    def watch_builds(module):
        real_build = module._build_table

        def build(*args):
            events.append((module.__name__ + "._build_table", list(open_guards)))
            return real_build(*args)

        monkeypatch.setattr(module, "_build_table", build)

    monkeypatch.setattr(runtime, "device_guard", recording_guard)
    for lazy in (
        adam_module._fused_adam_kernel,
        stats_module._grad_stats_partials_kernel,
        stats_module._grad_stats_combine_kernel,
    ):
        watch_launches(lazy)
    for module in (adam_module, stats_module):
        watch_builds(module)
        module._tables.clear()  # so the tables are built, not found
    state = make_state([15, 4099], device, torch.bfloat16)
    run(fused_adam_, state, step=1, **HYPER)
    grad_stats(state["grads"])
    expected = state["params"][0].device
    names = [name for name, _ in events]
    assert names == [
        "gpu_kernels.adam._build_table",
        "_fused_adam_kernel",
        "gpu_kernels.grad_stats._build_table",
        "_grad_stats_partials_kernel",
        "_grad_stats_combine_kernel",
    ]
    for name, guards in events:
        assert guards and guards[-1] == expected, f"{name} ran under {guards}, not {expected}"


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_tables_and_outputs_land_on_the_inputs_device(device):
    adam_module._tables.clear()
    stats_module._tables.clear()
    state = make_state([15, 4099], device, torch.float16)
    expected = state["params"][0].device
    run(fused_adam_, state, step=1, found_inf=torch.zeros(1, device=device), **HYPER)
    sum_sq, found_inf = grad_stats(state["grads"], sum_dtype=torch.float64)
    assert sum_sq.device == expected and found_inf.device == expected
    assert clip_coef(sum_sq, 1.0).device == expected
    for module in (adam_module, stats_module):
        tables = [entry.table for entry in module._tables._entries.values()]
        assert tables and all(t.device == expected for t in tables), module.__name__


# --------------------------------------------------------------------------------------------
# compiled code (checked without a GPU: Triton compiles for a named target on the CPU)
# --------------------------------------------------------------------------------------------

_COMPILE_CHECK = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
adam = importlib.import_module("gpu_kernels.adam")
stats = importlib.import_module("gpu_kernels.grad_stats")  # the package's `grad_stats` is the function
from gpu_kernels import _runtime


def ptx_for_sm90(lazy, signature, constexprs, aligned_args, num_warps):
    fn = _runtime._namespace(lazy.fn.__globals__, "compile")[lazy.__name__]
    names = fn.arg_names
    try:
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 2):
            src = ASTSource(fn, {n: "constexpr" if n in constexprs else signature[n] for n in names},
                            constexprs=dict(constexprs),
                            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned_args})
        else:
            from triton.compiler.compiler import AttrsDescriptor
            src = ASTSource(fn, {names.index(n): signature[n] for n in names if n not in constexprs},
                            {names.index(n): v for n, v in constexprs.items()},
                            AttrsDescriptor(divisible_by_16=tuple(names.index(n) for n in aligned_args)))
    except (TypeError, ImportError, AttributeError) as exc:
        print(f"SKIP triton {triton.__version__}: ahead-of-time compile API changed ({exc})")
        sys.exit(0)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm["ptx"]


def vectors(kind, ptx):
    return len(re.findall(kind + r"\.global[.\w]*\.v4", ptx))


cfg = adam.LAUNCH_CONFIG["cuda"]
floats = ["step_size", "decay", "bias_correction1", "grad_scale", "one_minus_beta1", "beta2",
          "one_minus_beta2", "eps", "weight_decay", "bias_correction2_sqrt"]
signature = dict(meta_ptr="*i64", chunk_ptr="*i64", lr_ptr="*fp32", grad_scale_ptr="*fp32",
                 found_inf_ptr="*fp32", **{n: "fp32" for n in floats})
for grad_code, copy_code, amsgrad, found_inf in [(2, 2, False, True), (1, 3, True, False)]:
    constexprs = dict(META=adam._META, GRAD_CODE=grad_code, COPY_CODE=copy_code, LR_ON_DEVICE=True,
                      SCALE_MODE=2, HAS_FOUND_INF=found_inf, WEIGHT_DECAY=True, DECOUPLED=True,
                      AMSGRAD=amsgrad, EXP_AVG_CODE=1, EXP_AVG_SQ_CODE=1, REMAINDER=False, ALIGNED=True,
                      BLOCK=cfg["BLOCK"], ITERS=cfg["ITERS"])
    ptx = ptx_for_sm90(adam._fused_adam_kernel, signature, constexprs, ["meta_ptr", "chunk_ptr"],
                       cfg["num_warps"])
    print("adam", grad_code, copy_code, "ld.v4", vectors("ld", ptx), "st.v4", vectors("st", ptx))
    # per unmasked iteration: p, m, v (2 x 16 B per thread each) and a bf16 grad (1 x 16 B)
    assert vectors("ld", ptx) >= 7 * cfg["ITERS"] and vectors("st", ptx) >= 7 * cfg["ITERS"]

cfg = stats.LAUNCH_CONFIG["cuda"]
ptx = ptx_for_sm90(
    stats._grad_stats_partials_kernel,
    dict(meta_ptr="*i64", chunk_ptr="*i64", partial_sq_ptr="*fp64", partial_flag_ptr="*i32", slot_offset="i32"),
    dict(META=stats._META, GRAD_CODE=2, ALIGNED=True, BLOCK=cfg["BLOCK"], ITERS=cfg["ITERS"]),
    ["meta_ptr", "chunk_ptr", "partial_sq_ptr", "partial_flag_ptr"], cfg["num_warps"])
print("grad_stats ld.v4", vectors("ld", ptx))
assert vectors("ld", ptx) >= cfg["ITERS"]
ptx_for_sm90(stats._grad_stats_combine_kernel,
             dict(partial_sq_ptr="*fp64", partial_flag_ptr="*i32", n_partials="i32", sum_sq_ptr="*fp32",
                  found_inf_ptr="*fp32"),
             dict(BLOCK=cfg["REDUCE_BLOCK"]), ["partial_sq_ptr", "partial_flag_ptr"], cfg["reduce_warps"])
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_compile_for_sm90_with_vector_accesses():
    """The interpreter runs Python, not the compiler: compile the real kernels for sm_90 (no
    GPU needed) and check that the alignment hints give 16-byte vector loads and stores. In a
    subprocess: the interpreter patches triton.language in this one."""
    run_compile_check(_COMPILE_CHECK)


# --------------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_no_host_sync_in_steady_state():
    state = make_state([4099, 100000, 17], "cuda", torch.bfloat16, copy_dtype=torch.bfloat16)
    scale = torch.tensor([0.5], device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    lr = torch.tensor(1e-3, device="cuda")

    def one_step():
        sum_sq, flag = grad_stats(state["grads"])
        coef = clip_coef(sum_sq, 1.0)
        run(fused_adam_, state, step=2, grad_scale=scale * coef, found_inf=flag, **{**HYPER, "lr": lr})
        return found_inf

    one_step()  # builds and caches the chunk tables (a pinned, non-blocking copy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        one_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.whole_gpu  # ~52 GiB: one at a time
def test_tensors_past_2_pow_31_elements():
    n = 2**31 + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < n * 24 + (8 << 30):
        pytest.skip(f"needs ~{n * 24 / 2**30:.0f} GiB of free device memory")
    g = torch.randn(2**20, device="cuda").to(torch.bfloat16).repeat(n // 2**20 + 1)[:n]
    p = torch.ones(n, device="cuda")
    m = torch.zeros(n, device="cuda")
    v = torch.zeros(n, device="cuda")
    tail = slice(n - 10000, n)
    expected = [t[tail].clone() for t in (p, g, m, v)]
    fused_adam_([p], [g], [m], [v], step=1, **HYPER)
    fused_adam_reference_(*[[t] for t in expected], step=1, **HYPER)
    assert_close(p[tail], expected[0])
    assert_close(m[tail], expected[2])
    del p, m, v
    sum_sq, found_inf = grad_stats([g])
    ref = sum(g[i : i + 2**28].double().pow(2).sum() for i in range(0, n, 2**28))
    assert_close(sum_sq, ref.float())
    g[-1] = float("nan")
    assert grad_stats([g])[1].item() == 1.0


@contextlib.contextmanager
def _on_cuda1_while_cuda0_is_current():
    """cuda:1 with a side stream as its current stream, cuda:0 as the current device: a
    launch that follows the current device lands on cuda:0 (an illegal address, or peer
    access), and one on cuda:1's default stream races with the work queued on the side one."""
    dev = torch.device("cuda", 1)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side), torch.cuda.device(0):
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(dev) == side
        yield dev
        assert torch.cuda.current_device() == 0, "a launcher left another device current"
    side.synchronize()


@pytest.mark.gpu
@needs_two_gpus
def test_fused_adam_steps_tensors_on_cuda1_while_cuda0_is_current():
    with _on_cuda1_while_cuda0_is_current() as dev:
        state = make_state(ODD_SIZES + [100000], dev, torch.bfloat16, amsgrad=True, copy_dtype=torch.bfloat16)
        expected = clone_state(state)
        scale = torch.tensor([0.5], device=dev)
        found_inf = torch.zeros(1, device=dev)
        lr = torch.tensor(HYPER["lr"], device=dev)
        for step in (1, 2, 3):
            # grads rewritten on the side stream just before each step (the second step
            # reuses the cached tables)
            for g in state["grads"]:
                g.neg_()
            run(fused_adam_, state, step=step, grad_scale=scale, found_inf=found_inf, **{**HYPER, "lr": lr})
    for step in (1, 2, 3):
        for g in expected["grads"]:
            g.neg_()
        run(fused_adam_reference_, expected, step=step, grad_scale=0.5, **HYPER)
    copies = state.pop("param_copies")
    expected.pop("param_copies")
    assert all(t.device == dev for ts in state.values() for t in ts)
    assert_state_close(state, expected)
    for c, p in zip(copies, state["params"]):
        assert torch.equal(c, p.to(c.dtype))
    mixed = make_state([4, 4], dev)
    mixed["params"][1] = mixed["params"][1].to("cuda:0")
    with pytest.raises(ValueError, match=r"params\[1\] is on cuda:0 but params\[0\] is on cuda:1"):
        run(fused_adam_, mixed, step=1, **HYPER)


@pytest.mark.gpu
@needs_two_gpus
def test_grad_stats_reads_grads_on_cuda1_while_cuda0_is_current():
    gen = torch.Generator().manual_seed(3)
    with _on_cuda1_while_cuda0_is_current() as dev:
        grads = [
            (torch.randn(n, generator=gen) * 3).to(dev, dtype)
            for n, dtype in zip(ODD_SIZES + [300000], [torch.float32, torch.bfloat16, torch.float16] * 2)
        ]
        results = []
        for _ in range(2):  # the second call reuses the cached tables
            for g in grads:
                g.mul_(2)  # queued on the side stream just before the kernels read it
            sum_sq, found_inf = grad_stats(grads)
            results.append((sum_sq.clone(), found_inf.clone(), [g.clone() for g in grads]))
        grads[-1][-1] = float("nan")
        nan_flag = grad_stats(grads)[1]
    for sum_sq, found_inf, snapshot in results:
        assert sum_sq.device == dev and found_inf.device == dev
        ref_sum, ref_flag = grad_stats_reference(snapshot)
        assert_close(sum_sq, ref_sum)
        assert found_inf.item() == ref_flag.item() == 0.0
    assert nan_flag.item() == 1.0
    with pytest.raises(ValueError, match=r"grads\[1\] is on cuda:0 but grads\[0\] is on cuda:1"):
        grad_stats([grads[0], grads[1].to("cuda:0")])


# --------------------------------------------------------------------------------------------
# FusedAdam: the same launch over tensors checked and tabled once
# --------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_prepared_launch_steps_the_bits_of_fused_adam_over_steps(device):
    """FusedAdam.step over three steps, grads rewritten in place between them, gives the bits
    fused_adam_ gives on the same tensors; an overflow step writes nothing."""
    state = make_state([15, 4099, 1 << 14], device, torch.bfloat16, copy_dtype=torch.bfloat16)
    expected = clone_state(state)
    launch = gpu_kernels.FusedAdam(
        state["params"],
        state["grads"],
        state["exp_avgs"],
        state["exp_avg_sqs"],
        param_copies=state["param_copies"],
    )
    gen = torch.Generator().manual_seed(5)
    for step in (1, 2, 3):
        for a, b in zip(state["grads"], expected["grads"]):
            new = torch.randn(a.shape, generator=gen).to(a.dtype)
            a.copy_(new)
            b.copy_(new)
        found_inf = torch.full((1,), float(step == 2), device=device)
        kwargs = dict(step=step, grad_scale=0.5, found_inf=found_inf, **HYPER)
        launch.step(**kwargs)
        run(fused_adam_, expected, **kwargs)
    for key in expected:
        for a, b in zip(state[key], expected[key]):
            assert torch.equal(a, b), key


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_prepared_launch_step_does_no_per_tensor_work(device, monkeypatch):
    """After construction a step checks, groups and tables nothing: one launch per group,
    whatever the number of tensors."""
    sizes = [7 + i for i in range(200)]
    state = make_state(sizes, device)
    launch = gpu_kernels.FusedAdam(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"])

    def refuse(*a, **k):
        raise AssertionError("per-tensor work during step()")

    for name in ("_checked_lists", "_check_tensor", "_groups", "_build_table"):
        monkeypatch.setattr(adam_module, name, refuse)
    before = adam_module._fused_adam_kernel.launches
    launch.step(step=1, **HYPER)
    assert adam_module._fused_adam_kernel.launches == before + 1


@needs_kernels
def test_prepared_launch_checks_its_tensors_once_with_fused_adam_s_messages():
    state = make_state([100, 200], DEVICES[0])
    with pytest.raises(ValueError, match=r"grads\[1\] has 100 elements but params\[1\] has 200"):
        gpu_kernels.FusedAdam(
            state["params"], [state["grads"][0], state["grads"][0]], state["exp_avgs"], state["exp_avg_sqs"]
        )
    launch = gpu_kernels.FusedAdam(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"])
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        launch.step(step=1, **{**HYPER, "beta1": 1.5})
    gpu_kernels.FusedAdam([], [], [], []).step(step=1, **HYPER)  # nothing to step
