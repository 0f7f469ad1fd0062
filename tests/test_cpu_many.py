"""Many tensors in one call: `adam_steps_` (hybrid_adam_step_many) and `grad_stats_many`
(hybrid_grad_stats_many) give each tensor the bits of its own `adam_step_` / `grad_stats` call,
at every SIMD level and thread count, whichever thread's run a tensor falls in (the split cuts
inside the large ones and hands the small ones whole to one thread)."""

from __future__ import annotations

import pytest
import torch

import cpu_kernels as ck

pytestmark = pytest.mark.usefixtures("restore_kernel_threads")

CHUNK = 16384  # ADAM_CHUNK and GRAD_STATS_CHUNK (dispatch.c, kernels.h)
# empty, tails, one element past a chunk, and large ones the threads' cuts fall inside
SIZES = (0, 1, 17, 4099, CHUNK, CHUNK + 1, 4 * CHUNK + 77, 300_001, 5, 3 * CHUNK)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), f"{what}: not bitwise equal"


def _state(n, k):
    """Call k's tensors and arguments: each call its own format (grad dtype, moment dtypes,
    amsgrad, remainders, param copy, bank mode, Adam or AdamW) and its own hyperparameters."""
    gen = torch.Generator().manual_seed(100 + k)
    master = torch.randn(n, generator=gen)
    moment = (torch.float32, torch.bfloat16)[k % 2]
    sq = (torch.float32, torch.bfloat16)[(k // 2) % 2]
    s = dict(
        grad=(torch.randn(n, generator=gen) * 64).to(GRAD_DTYPES[k % 3]),
        exp_avg=(torch.randn(n, generator=gen) * 0.1).to(moment),
        exp_avg_sq=(torch.rand(n, generator=gen) * 1e-2).to(sq),
        max_exp_avg_sq=(torch.rand(n, generator=gen) * 2e-2).to(sq) if k % 4 == 1 else None,
    )
    remainders = k % 5 == 2
    if remainders:
        s["param"], s["remainder"] = ck.encode_remainder(master)
    else:
        s["param"] = master
        if k % 5 == 3:
            s["param_copy"] = torch.full((n,), float("nan"), dtype=(torch.bfloat16, torch.float16)[k % 2])
    if k % 3 == 1:  # bank mode: the new state written elsewhere, the inputs left as they were
        outs = [s["param"], s["exp_avg"], s["exp_avg_sq"]] + ([s["max_exp_avg_sq"]] if k % 4 == 1 else [])
        s["out"] = tuple(torch.full_like(t, float("nan")) for t in outs)
        if remainders:
            s["remainder_out"] = torch.zeros_like(s["remainder"])
    hyper = dict(
        step=3 + k,
        lr=1e-3 * (1 + k % 3),
        beta1=0.9,
        beta2=0.999 - 0.001 * (k % 2),
        eps=1e-8,
        weight_decay=0.01 * (k % 4),
        decoupled=k % 6 != 5,
        grad_scale=(0.5, 1.0, -0.25)[k % 3],
    )
    return s, hyper


def _clone(s):
    return {
        key: (tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone() if v is not None else None)
        for key, v in s.items()
    }


def _written(s):
    """Every tensor a call may have written or must have left alone, flattened and named."""
    out = []
    for key, v in sorted(s.items()):
        for j, t in enumerate(v if isinstance(v, tuple) else (v,)):
            if t is not None:
                out.append((f"{key}[{j}]", t))
    return out


def _step(s, hyper):
    """The call's tensors as adam_step_ / adam_call take them."""
    tensors = {key: v for key, v in s.items() if key not in ("param", "grad", "exp_avg", "exp_avg_sq")}
    return (s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"]), dict(hyper, **tensors)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_adam_steps_gives_each_call_the_bits_of_its_own_adam_step(simd, threads):
    ck.set_num_threads(threads)
    states = [_state(n, k) for k, n in enumerate(SIZES)]
    alone, together = [], []
    for s, hyper in states:
        one, many = _clone(s), _clone(s)
        args, kw = _step(one, hyper)
        ck.adam_step_(*args, **kw)
        alone.append(one)
        args, kw = _step(many, hyper)
        together.append((many, ck.adam_call(*args, **kw)))
    ck.adam_steps_(call for _, call in together)
    for k, (one, (many, _)) in enumerate(zip(alone, together)):
        for (name, a), (_, b) in zip(_written(one), _written(many)):
            _assert_bitwise(b, a, f"call {k} ({SIZES[k]} elements), {name}, {threads} threads")


def test_adam_steps_over_more_calls_than_its_stack_holds(simd):
    """200 calls: the per-call constants and starts on the heap (64 on the stack)."""
    ck.set_num_threads(2)
    sizes = [(k * 37) % 700 for k in range(200)]
    states = [_state(n, k) for k, n in enumerate(sizes)]
    alone = [_clone(s) for s, _ in states]
    for one, (_, hyper) in zip(alone, states):
        args, kw = _step(one, hyper)
        ck.adam_step_(*args, **kw)
    calls = []
    for s, hyper in states:
        args, kw = _step(s, hyper)
        calls.append(ck.adam_call(*args, **kw))
    ck.adam_steps_(calls)
    for k, (one, (s, _)) in enumerate(zip(alone, states)):
        for (name, a), (_, b) in zip(_written(one), _written(s)):
            _assert_bitwise(b, a, f"call {k}, {name}")


def test_adam_steps_of_no_calls_changes_nothing():
    ck.adam_steps_([])


def test_adam_call_checks_its_arguments_as_adam_step_does_unless_told_not_to():
    p, g, m, v = torch.zeros(8), torch.zeros(8, dtype=torch.int32), torch.zeros(8), torch.zeros(8)
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for fn in (ck.adam_step_, ck.adam_call):
        with pytest.raises(TypeError, match="grad must have dtype"):
            fn(p, g, m, v, **hyper)
        with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
            fn(p, g.float(), m, v, **dict(hyper, beta1=1.5))
    # check=False: the caller vouches for its tensors (the device tier); nothing runs until adam_steps_
    gf = g.float()
    call = ck.adam_call(p, gf, m, v, check=False, **hyper)
    assert call.n == 8 and call.param == p.data_ptr() and call.grad == gf.data_ptr()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_grad_stats_many_is_each_grads_grad_stats_bit_for_bit(simd, threads):
    ck.set_num_threads(threads)
    gen = torch.Generator().manual_seed(5)
    grads = [(torch.randn(n, generator=gen) * 3).to(GRAD_DTYPES[k % 3]) for k, n in enumerate(SIZES)]
    grads[4][100] = float("inf")  # one non-finite grad among finite ones
    grads[7][-1] = float("nan")
    got = ck.grad_stats_many(grads)
    assert len(got) == len(grads)
    for k, (g, (s, finite)) in enumerate(zip(grads, got)):
        want, want_finite = ck.grad_stats(g)
        assert (s == want or (s != s and want != want)) and finite == want_finite, f"grad {k}"
    assert [f for _, f in got] == [k not in (4, 7) for k in range(len(grads))]


def test_grad_stats_many_over_more_grads_and_chunks_than_its_stack_holds(simd):
    """300 grads (the bases on the heap past 64) and 300+ chunks (the partials past 256)."""
    ck.set_num_threads(2)
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(CHUNK + k, generator=gen) for k in range(300)]
    assert ck.grad_stats_many(grads) == [ck.grad_stats(g) for g in grads]
    assert ck.grad_stats_many([]) == []


def test_grad_stats_many_names_the_grad_it_refuses():
    with pytest.raises(TypeError, match=r"grads\[1\] must have dtype"):
        ck.grad_stats_many([torch.zeros(3), torch.zeros(3, dtype=torch.int64)])
