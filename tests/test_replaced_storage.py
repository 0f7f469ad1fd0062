"""A param whose memory is replaced after the optimizer was built keeps training as torch's
does (storage.py): `p.data = t`, and a module's load_state_dict(assign=True) with torch's
swap_module_params_on_conversion, at every placement; a param moved or cast after
construction (`.half()`, `.double()`, `.cuda()`) is refused with a message that says which
param changed, from what to what, and what to do.

Each case runs beside torch.optim.AdamW(foreach=False) given the same replacement.
"""

import tracemalloc
from contextlib import contextmanager

import pytest
import torch
from helpers import needs_named_params
from tolerances import assert_close
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view

SUBGROUP = 64
PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "mixed": dict(offload_fraction=0.5),
    "host": dict(offload_fraction=1.0),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=0.25),
}


def _placement(name, tmp_path):
    kw = dict(PLACEMENTS[name])
    if "nvme_fraction" in kw:
        kw["nvme_path"] = str(tmp_path)
    return kw


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 3)).to(dtype)


def _iteration(model, opt, i, clip=None):
    opt.zero_grad()
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
    ((model(x.to(model[0].weight.dtype)).float() - y) ** 2).mean().backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


@contextmanager
def _swap_module_params():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _replace_data(model, new_sd):
    with torch.no_grad():
        model[0].weight.data = new_sd["0.weight"].clone()
        model[2].bias.data = new_sd["2.bias"].clone()


def _load_assign(model, new_sd):
    with _swap_module_params():
        model.load_state_dict({k: v.clone() for k, v in new_sd.items()}, assign=True)


@pytest.mark.parametrize("replace", [_replace_data, _load_assign], ids=["p.data", "load_state_dict_assign"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_replaced_param_trains_like_torch(placement, replace, tmp_path):
    model, ref_model = _net(), _net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(7)
    new_sd = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        subgroup_numel=SUBGROUP,
        **_placement(placement, tmp_path),
    ) as opt:
        for i in range(8):
            if i == 3:  # mid-training, moments non-zero: torch keeps them, so must we
                replace(model, new_sd)
                replace(ref_model, new_sd)
            _iteration(ref_model, ref, i, clip=0.5)
            _iteration(model, opt, i)
            for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
                assert_close(a, b, msg=f"step {i}: {name}")
        sd, ref_sd = opt.state_dict(), ref.state_dict()
        for k, ref_st in ref_sd["state"].items():
            assert float(sd["state"][k]["step"]) == float(ref_st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(sd["state"][k][key], ref_st[key], msg=f"state[{k}][{key}]")


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_replaced_bf16_param_restarts_its_master_from_the_new_values(placement, tmp_path):
    """A bf16 model keeps an fp32 master: after `p.data = t` it restarts from t (an lr-0 step
    writes the master's rounding back into the param: t itself, bitwise)."""
    model = _net(torch.bfloat16)
    with HybridAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=SUBGROUP, **_placement(placement, tmp_path)
    ) as opt:
        for i in range(2):
            _iteration(model, opt, i)
        new = torch.randn(24, 8).to(torch.bfloat16)
        model[0].weight.data = new.clone()
        for g in opt.param_groups:
            g["lr"] = 0.0
        _iteration(model, opt, 2)
        assert torch.equal(model[0].weight.detach(), new)
        assert torch.equal(opt.state_dict()["state"][0]["master_param"], new.float())
        for g in opt.param_groups:
            g["lr"] = 1e-2
        _iteration(model, opt, 3)
        assert not torch.equal(model[0].weight.detach(), new), "the replaced param stopped training"


def test_load_state_dict_assign_without_swap_gives_new_params_no_optimizer_holds():
    """torch's default assign=True puts new Parameter objects in the module: neither torch's
    optimizer nor ours holds them, so neither trains them (we match torch, nothing raises)."""
    model, ref_model = _net(), _net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    new_sd = {k: v + 1 for k, v in model.state_dict().items()}
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0) as opt:
        _iteration(model, opt, 0)
        _iteration(ref_model, ref, 0)
        model.load_state_dict({k: v.clone() for k, v in new_sd.items()}, assign=True)
        ref_model.load_state_dict({k: v.clone() for k, v in new_sd.items()}, assign=True)
        _iteration(model, opt, 1)
        _iteration(ref_model, ref, 1)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)


@needs_named_params
@pytest.mark.parametrize("cast", ["half", "double"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_cast_after_construction_raises_and_says_what_to_do(placement, cast, tmp_path):
    model = _net()
    opt = HybridAdamW(
        model.named_parameters(), lr=1e-2, subgroup_numel=SUBGROUP, **_placement(placement, tmp_path)
    )
    with opt:
        _iteration(model, opt, 0)
        getattr(model, cast)()
        to = {"half": "torch.float16", "double": "torch.float64"}[cast]
        with pytest.raises(
            RuntimeError,
            match=rf"parameter 0 \(0\.weight\) was moved or cast after "
            rf"HybridAdamW was built: its memory changed from torch.float32 \(24, 8\) "
            rf"on cpu to {to} \(24, 8\) on cpu\..*Build the optimizer after moving or "
            rf"casting the model.*load it into a new HybridAdamW",
        ):
            _iteration(model, opt, 1)
        assert opt.state_dict()["state"][0]["step"] == 1  # the state is still there to carry over


def test_moved_model_continues_in_a_new_optimizer_from_the_state_dict():
    """What the error says to do: a new optimizer built on the cast model, loaded from the old
    one's state_dict, continues with the moments and step counts."""
    model = _net()
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0) as opt:
        for i in range(2):
            _iteration(model, opt, i)
        model.half()
        with pytest.raises(RuntimeError, match="moved or cast"):
            _iteration(model, opt, 2)
        sd = opt.state_dict()
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0) as new:
        new.load_state_dict(sd)
        assert torch.equal(new.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
        _iteration(model, new, 2)
        assert float(new.state_dict()["state"][0]["step"]) == 3


def test_storage_check_costs_no_allocation():
    """Once per step over every param: int comparisons only, nothing allocated per param
    (a list of 2,000 data_ptrs alone would be tens of KB)."""
    params = [nn.Parameter(torch.randn(3)) for _ in range(2000)]
    with HybridAdamW(params, lr=1e-2, offload_fraction=0.0) as opt:
        debug_view(opt).guard.check()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for _ in range(20):
                debug_view(opt).guard.check()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert peak < 4096, f"the per-step storage check allocated {peak} bytes"


@pytest.mark.parametrize("change", ["none", "written", "replaced"])
def test_the_plain_params_shortcut_answers_as_the_general_check(change, monkeypatch):
    """Where no tensor can be a DTensor and none is a process_group chunk, the per-step check reads
    each param's data_ptr and version directly (local_shards._all_plain): the same answers as the
    general path through local_of and write_count, for params untouched, written and replaced."""
    from hybrid_opt.distributed import local_shards

    params = [nn.Parameter(torch.randn(5)) for _ in range(4)]
    ptrs, counts = [p.data_ptr() for p in params], local_shards.write_counts(params)
    with torch.no_grad():
        if change == "written":
            params[2].add_(1.0)
        elif change == "replaced":
            params[1].data = torch.randn(5)
    # as in a process that never loaded torch.distributed.tensor nor sharded a param by
    # process_group (an earlier test may have done both)
    monkeypatch.setattr(local_shards, "_dtensor_class", lambda: None)
    monkeypatch.setattr(local_shards, "_ZERO_PARAMS", [])
    assert local_shards._all_plain()
    fast = local_shards.moved_or_written(params, ptrs, counts), local_shards.write_counts(params)
    monkeypatch.setattr(local_shards, "_all_plain", lambda: False)
    general = local_shards.moved_or_written(params, ptrs, counts), local_shards.write_counts(params)
    assert fast == general
    assert fast[0] == {"none": (False, False), "written": (False, True), "replaced": (True, False)}[change]


@pytest.mark.gpu
def test_model_cuda_after_construction_raises():
    model = _net()
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0) as opt:
        _iteration(model, opt, 0)
        model.cuda()
        with pytest.raises(
            RuntimeError,
            match=r"from torch.float32 \(24, 8\) on cpu to torch.float32 "
            r"\(24, 8\) on cuda:0.*Build the optimizer after moving",
        ):
            opt.step()


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_checkpoint_loaded_after_params_were_replaced_keeps_its_masters(placement, tmp_path):
    """Resuming: params given new memory (`p.data = t`, a swap-style load of the model), then
    the optimizer's checkpoint loaded, then step(): the checkpoint's fp32 masters stand (the
    params are their rounding), as with params never replaced; re-adopting the new memory
    only at step() restarted the masters from the bf16 params, discarding the loaded ones."""

    def run(replace):
        model = _net(torch.bfloat16)
        with HybridAdamW(
            model.parameters(), lr=1e-2, subgroup_numel=SUBGROUP, **_placement(placement, tmp_path)
        ) as opt:
            for i in range(3):
                _iteration(model, opt, i)
            sd = {k: v for k, v in opt.state_dict().items()}
            sd["state"] = {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()}
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            for i in range(3, 5):  # training goes on, then resumes from the checkpoint
                _iteration(model, opt, i)
            if replace:
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.data = weights[name].clone()
            else:
                model.load_state_dict(weights)
            opt.load_state_dict(sd)
            _iteration(model, opt, 3)
            return [p.detach().clone() for p in model.parameters()], opt.state_dict()

    (want, want_sd), (got, got_sd) = run(False), run(True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for k, st in want_sd["state"].items():
        assert torch.equal(got_sd["state"][k]["master_param"], st["master_param"]), k
