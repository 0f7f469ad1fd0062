"""hybrid_opt/torch_methods.py and local_shards.is_dtensor: a fresh process builds, steps,
checkpoints and closes a HybridAdamW without loading torch._dynamo or torch.distributed.tensor
(seconds of imports torch.optim.AdamW's construction pays), and where torch._dynamo is loaded, or
a method is not torch's own, the call goes through as it comes."""

import importlib
import subprocess
import sys
import textwrap

import torch

from hybrid_opt import HybridAdamW, torch_methods

FRESH = textwrap.dedent(
    """
    import io, sys, time
    import torch
    from hybrid_opt import HybridAdamW

    HEAVY = ("torch._dynamo", "torch.distributed.tensor", "sympy")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    t0 = time.perf_counter()
    opt = HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=0.5, subgroup_numel=1024)
    built = time.perf_counter() - t0
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    opt.save_state_dict(io.BytesIO())
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(16))]})
    opt.close()
    print([m for m in HEAVY if m in sys.modules], round(built, 3))
    """
)


def test_a_fresh_process_uses_hybrid_adamw_without_loading_dynamo_or_dtensor():
    res = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded, built = res.stdout.strip().rsplit(" ", 1)
    assert loaded == "[]", loaded
    assert float(built) < 1.5, built  # the worker's start; torch._dynamo alone takes 1.7-2.9 s here


class _Probe(torch.optim.Optimizer):
    def __init__(self):
        super().__init__([torch.nn.Parameter(torch.zeros(2))], {})


def test_torchs_own_method_is_its_unwrapped_function_until_dynamo_is_loaded(monkeypatch):
    probe = _Probe()
    bound = probe.zero_grad
    dynamo = importlib.import_module("torch._dynamo")  # what torch.compile loads first
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as in a process that never loaded it
    plain = torch_methods.base(bound)
    assert plain.func is torch.optim.Optimizer.zero_grad.__wrapped__ and plain.args == (probe,)
    monkeypatch.setitem(sys.modules, "torch._dynamo", dynamo)
    assert torch_methods.base(bound) is bound


def test_a_method_that_is_not_torchs_own_is_called_as_it_comes(monkeypatch):
    # torch's zero_grad wrapper made once with torch._dynamo loaded (it caches what it made), so the
    # mixin's call of it below imports nothing: torch._dynamo is not run a second time in this process
    _Probe().zero_grad()
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as in a process that never loaded it
    calls = []

    class Mixin(torch.optim.Optimizer):
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    class Mine(HybridAdamW, Mixin):
        pass

    p = torch.nn.Parameter(torch.ones(8))
    with Mine([p], lr=0.1) as opt:
        bound = super(HybridAdamW.__mro__[1], opt).zero_grad
        assert torch_methods.base(bound) is bound  # Mixin's, next in the MRO
        p.grad = torch.ones(8)
        opt.zero_grad()
    assert calls == [True] and p.grad is None
