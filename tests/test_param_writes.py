"""A param written outside step() — `with torch.no_grad(): p.copy_(...)`, a module's
load_state_dict, an EMA swap — is seen by its version counter and its master restarts from
what was written (storage.py), at every placement, with an fp32 master or remainders; the
check costs nothing while no param is written.

Each run is compared with torch.optim.AdamW(foreach=False) over fp32 params that hold the
masters, given the same grads and the same writes. Grads come from a fixed stream through
autograd ((p * g).sum().backward() leaves p.grad == g), so the grad hooks and speculation run
as in training.
"""

import pytest
import torch
from tolerances import assert_bf16_within_ulps, assert_close
from torch import nn

from hybrid_opt import HybridAdamW, fp32_master
from hybrid_opt.state.storage import ParamGuard
from hybrid_opt.testing import debug_view

BF16, FP32 = torch.bfloat16, torch.float32
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
SHAPES = ((24, 10), (33,), (5, 7))
PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "host": dict(offload_fraction=1.0),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0),
}


def _kw(placement, tmp_path):
    kw = dict(PLACEMENTS[placement])
    if "nvme_fraction" in kw:
        kw["nvme_path"] = str(tmp_path)
    return kw


def _pair(dtype, placement, tmp_path, remainders=False, device="cpu"):
    """(hybrid params, hybrid optimizer, torch params holding the masters, torch's AdamW)."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in SHAPES]
    params = [nn.Parameter(t.clone()) for t in init]
    masters = [nn.Parameter(t.float()) for t in init]
    opt = HybridAdamW(
        params, subgroup_numel=128, store_param_remainders=remainders, **HYPER, **_kw(placement, tmp_path)
    )
    ref = torch.optim.AdamW(masters, foreach=False, **HYPER)
    return params, opt, masters, ref


def _backward(params, masters, k):
    g = torch.Generator().manual_seed(100 + k)
    grads = [torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype) for p in params]
    for opt_params in (params,):
        for p in opt_params:
            p.grad = None
    sum((p * gr).sum() for p, gr in zip(params, grads)).backward()
    for m, gr in zip(masters, grads):
        m.grad = gr.float()


def _step(params, opt, masters, ref, k, write=None):
    _backward(params, masters, k)
    if write is not None:  # between backward and step(): speculation already read the old master
        write()
    opt.step()
    ref.step()


def _check(params, opt, masters, what):
    sd = opt.state_dict()["state"]
    for i, (p, m) in enumerate(zip(params, masters)):
        master = fp32_master(sd[i], p)  # an fp32 master, or decoded from a remainder and p
        master = p.detach() if master is None else master  # an fp32 param is its own
        assert_close(master.cpu(), m.detach().cpu(), FP32, msg=f"{what}: master of param {i}")
        if p.dtype == BF16:
            assert_bf16_within_ulps(p.detach().cpu(), m.detach().cpu().to(BF16), msg=f"{what}: param {i}")


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("model", ["bf16", "bf16 remainders", "fp32"])
def test_a_param_written_outside_step_restarts_its_master_from_it(model, placement, tmp_path):
    dtype = FP32 if model == "fp32" else BF16
    params, opt, masters, ref = _pair(dtype, placement, tmp_path, remainders="remainders" in model)
    _write_and_train(params, opt, masters, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("model", ["bf16", "bf16 remainders"])
def test_cuda_a_param_written_outside_step_restarts_its_master_from_it(model, placement, tmp_path):
    """On CUDA: the device tier's Triton launch (remainders= / param_copies=) and the pinned
    host tier see the write too."""
    params, opt, masters, ref = _pair(
        BF16, placement, tmp_path, remainders="remainders" in model, device="cuda"
    )
    _write_and_train(params, opt, masters, ref, BF16)


def _write_and_train(params, opt, masters, ref, dtype):
    g = torch.Generator().manual_seed(7)
    device = params[0].device
    new0 = torch.randn(SHAPES[0], generator=g).to(device=device, dtype=dtype)
    new2 = torch.randn(SHAPES[2], generator=g).to(device=device, dtype=dtype)
    with opt:
        for k in range(3):
            _step(params, opt, masters, ref, k)
        _check(params, opt, masters, "before any write")
        with torch.no_grad():  # between steps (an EMA swap, a re-init)
            params[0].copy_(new0)
            masters[0].copy_(new0.float())
        for k in range(3, 5):
            _step(params, opt, masters, ref, k)
        _check(params, opt, masters, "after a write between steps")

        def write():
            with torch.no_grad():
                params[2].copy_(new2)
                masters[2].copy_(new2.float())

        _step(params, opt, masters, ref, 5, write=write)  # between backward and step()
        _step(params, opt, masters, ref, 6)
        _check(params, opt, masters, "after a write between backward and step()")


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_module_load_state_dict_is_seen(placement, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(6, 4).to(BF16)
    other = nn.Linear(6, 4).to(BF16)
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = HybridAdamW(model.parameters(), subgroup_numel=16, **HYPER, **_kw(placement, tmp_path))
    ref = torch.optim.AdamW(masters, foreach=False, **HYPER)
    params = list(model.parameters())
    with opt:
        _step(params, opt, masters, ref, 0)
        model.load_state_dict(other.state_dict())  # copies in place: the params' versions move
        with torch.no_grad():
            for m, p in zip(masters, other.parameters()):
                m.copy_(p.float())
        _step(params, opt, masters, ref, 1)
        _check(params, opt, masters, "after model.load_state_dict")


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_a_param_rewritten_with_its_own_values_keeps_its_master(placement, tmp_path):
    params, opt, masters, ref = _pair(BF16, placement, tmp_path)
    with opt:
        for k in range(3):
            _step(params, opt, masters, ref, k)
        before = opt.state_dict()["state"][1]["master_param"].clone()
        assert not torch.equal(before, params[1].detach().float())  # the master holds more bits
        with torch.no_grad():
            params[1].copy_(params[1].clone())
        after = opt.state_dict()["state"][1]["master_param"]
        assert torch.equal(before, after)


def test_with_remainders_a_rewritten_param_restarts_from_its_values(tmp_path):
    """No second copy of the high half is kept (that is the point of remainders): a written
    bf16 param restarts its master from its values even when they are the ones it held."""
    params, opt, masters, ref = _pair(BF16, "device", tmp_path, remainders=True)
    for k in range(3):
        _step(params, opt, masters, ref, k)
    with torch.no_grad():
        params[1].copy_(params[1].clone())
    sd = opt.state_dict()["state"]
    assert not sd[1]["master_remainder"].any()  # the checkpoint's remainders are 0 too
    assert torch.equal(fp32_master(sd[1], params[1]), params[1].detach().float())
    for sg in debug_view(opt).subgroups:  # its remainders are 0: the master is the param's own value
        for sl in sg.slices:
            if sl.param_index == 1:
                assert (
                    not debug_view(opt)
                    .device.remainder[sg.index][sl.sub_offset : sl.sub_offset + sl.numel]
                    .any()
                )
    # the params not written keep their masters' low halves
    assert not torch.equal(fp32_master(sd[0], params[0]), params[0].detach().float())


@pytest.mark.parametrize("placement", ["device", "host"])
def test_the_check_costs_nothing_while_no_param_is_written(placement, tmp_path, monkeypatch):
    calls = []
    real = ParamGuard.check_written

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(ParamGuard, "check_written", counted)
    params, opt, masters, ref = _pair(BF16, placement, tmp_path)
    with opt:
        for k in range(4):  # the step's own writes into the params do not count
            _step(params, opt, masters, ref, k)
        assert not calls
        with torch.no_grad():
            params[0].mul_(2)
            masters[0].copy_(params[0].float())  # the bf16 param's values are what was written
        _step(params, opt, masters, ref, 4)
        assert len(calls) == 1
        _check(params, opt, masters, "after mul_")
