"""torch's own optimizer database (`torch.testing._internal.common_optimizers.optim_db`) run
against HybridAdam / HybridAdamW.

For Adam and AdamW, torch's table holds
- error inputs (`optim_error_inputs_func`): each must raise the same error type (or warning)
  with a message matching torch's regex, on device "cpu", exactly as torch's `test_errors`
  asks of torch's own classes;
- optimizer inputs (`optim_inputs_func`, expanded with the global "cliquey" flags foreach /
  fused / differentiable by torch's own helper, and taken for the "cpu", "cuda" and "mps"
  device types so that the Tensor-lr / Tensor-betas / capturable configs are included — they
  are built from CPU tensors, no accelerator is needed): each either trains like
  torch.optim.Adam / AdamW(foreach=False) with the same kwargs on a tiny model for a few steps
  (tests/tolerances.py), at offload 0 and 1, or is one of the configs we reject on purpose,
  listed in REJECTED with the reason, and raises our error naming the cause.

torch's test helpers import `expecttest` (the `test` extra installs it); without it this module
is skipped with that reason.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest: pip install -e '.[test]'")
from tolerances import assert_close  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)

from hybrid_opt import HybridAdam, HybridAdamW  # noqa: E402

OURS = {torch.optim.Adam: HybridAdam, torch.optim.AdamW: HybridAdamW}
INFOS = [info for info in optim_db if info.optim_cls in OURS]
STEPS = 4
SUBGROUP = 16  # the model's 35 elements span 3 subgroups

# kwargs we reject on purpose, with the reason and the message our error carries
REJECTED = {
    "capturable": (
        "CUDA graph capture cannot record the host tier's steps in another process",
        r"does not support capturable=True",
    ),
    "differentiable": (
        "no autograd graph runs through the tiers' in-place kernels",
        r"does not support differentiable=True",
    ),
}


def _error_cases():
    for info in INFOS:
        for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            yield pytest.param(
                info.optim_cls, e, id=f"{info.optim_cls.__name__}-{e.optimizer_error_input.desc}"
            )


def _optim_inputs(info):
    """torch's configs for every device type, the cliquey flags included, one per description."""
    seen = {}
    for device in ("cpu", "cuda", "mps"):
        for oi in _get_optim_inputs_including_global_cliquey_kwargs(device, torch.float32, info):
            seen.setdefault(oi.desc, oi)
    return list(seen.values())


def _input_cases():
    for info in INFOS:
        for oi in _optim_inputs(info):
            for offload in (0.0, 1.0):
                yield pytest.param(
                    info.optim_cls, oi, offload, id=f"{info.optim_cls.__name__}-{oi.desc}-offload{offload:g}"
                )


def _sample_param():
    return nn.Parameter(torch.randn(2, 3, generator=torch.Generator().manual_seed(0)))


def test_the_database_has_adam_and_adamw_with_inputs():
    """Guards the tests below against an empty table (a renamed helper would skip them all)."""
    assert {info.optim_cls for info in INFOS} == set(OURS)
    for info in INFOS:
        assert len(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)) >= 6  # 6 in torch 2.4
        descs = {oi.desc for oi in _optim_inputs(info)}
        assert {"default", "amsgrad", "maximize", "capturable"} <= descs
        assert any("differentiable" in d for d in descs) and any("fused" in d for d in descs)


@pytest.mark.parametrize("torch_cls,error_input", list(_error_cases()))
def test_error_inputs_raise_torchs_error(torch_cls, error_input):
    oi = error_input.optimizer_error_input
    # torch's table passes params=None where the kwargs alone fail; a real parameter makes the
    # error come from the argument checks, not from a missing parameter list
    params = oi.params if oi.params is not None else [_sample_param()]
    assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR  # all Adam's are
    for cls in (torch_cls, OURS[torch_cls]):  # torch first: the table still says what torch does
        if issubclass(error_input.error_type, Warning):
            with pytest.warns(error_input.error_type, match=error_input.error_regex):
                opt = cls(params, **oi.kwargs)
            getattr(opt, "close", lambda: None)()
        else:
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                cls(params, **oi.kwargs)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5))


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 5, generator=g)) for _ in range(n)]


def _reference_kwargs(kwargs):
    """torch's class with the same hyperparameters on its plain for-loop path."""
    ref = {
        k: (
            v.clone()
            if isinstance(v, torch.Tensor)
            else tuple(b.clone() if isinstance(b, torch.Tensor) else b for b in v)
            if isinstance(v, tuple)
            else v
        )
        for k, v in kwargs.items()
        if k not in ("foreach", "fused", "differentiable")
    }
    return dict(ref, foreach=False)


@pytest.mark.parametrize("torch_cls,oi,offload", list(_input_cases()))
def test_optim_inputs_train_like_torch_or_are_rejected_clearly(torch_cls, oi, offload):
    cls = OURS[torch_cls]
    rejected = [k for k in REJECTED if oi.kwargs.get(k)]
    model = _model()
    if rejected:
        with pytest.raises(ValueError, match=REJECTED[rejected[0]][1]):
            cls(model.parameters(), offload_fraction=offload, subgroup_numel=SUBGROUP, **oi.kwargs)
        return
    ref_model = copy.deepcopy(model)
    ref = torch_cls(ref_model.parameters(), **_reference_kwargs(oi.kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config of torch's table warns with us
        opt = cls(model.parameters(), offload_fraction=offload, subgroup_numel=SUBGROUP, **oi.kwargs)
    with opt:
        assert opt.plan.summary()["device"]["share"] == 1.0 - offload
        for x, y in _batches():
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert_close(p.detach(), q.detach(), msg=f"{oi.desc}: {name}")
        # the run moved the params: a config that silently did nothing would pass the comparison
        assert not torch.equal(next(model.parameters()).detach(), next(_model().parameters()).detach())


@pytest.mark.parametrize("torch_cls", list(OURS))
@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(fused=True, differentiable=True), "`fused` does not support `differentiable`"),
        (dict(fused=True, foreach=True), "`fused` and `foreach` cannot be `True` together"),
    ],
    ids=["fused_differentiable", "fused_foreach"],
)
def test_fused_flag_errors_of_the_cuda_table_are_torchs(torch_cls, kwargs, error):
    """torch's table lists these two for CUDA devices only (its sample tensor is on the GPU),
    but torch raises them whatever the device: the same RuntimeError from ours, before our own
    rejection of differentiable."""
    for cls in (torch_cls, OURS[torch_cls]):
        with pytest.raises(RuntimeError, match=error):
            cls([_sample_param()], **kwargs)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(betas=(0.9, torch.tensor(0.99))), "betas must be either both floats or both Tensors"),
        (dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0"),
        (dict(lr=torch.tensor(0.01), foreach=True), "lr as a Tensor is not supported"),
        (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    ],
    ids=["mixed_betas", "beta2_of_1", "tensor_lr_foreach", "negative_lr"],
)
def test_add_param_group_checks_a_groups_own_values_like_the_constructor(kwargs, error):
    with HybridAdamW([_sample_param()], offload_fraction=0.0) as opt:
        with pytest.raises(ValueError, match=error):
            opt.add_param_group(dict(params=[_sample_param()], **kwargs))
        assert len(opt.param_groups) == 1


def test_tensor_betas_train_like_torch_and_are_kept_as_torch_keeps_them():
    """A 1-element Tensor beta of any shape is squeezed to 0-dim, as torch's constructor does."""
    betas = (torch.tensor([[0.9]]), torch.tensor([0.99]))
    model = _model()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, betas=betas, foreach=False)
    if [b.dim() for b in ref.param_groups[0]["betas"]] != [0, 0]:
        pytest.skip(
            f"torch {torch.__version__} keeps Tensor betas as given (later ones squeeze them, as ours)"
        )
    with HybridAdamW(
        model.parameters(), lr=0.01, betas=betas, offload_fraction=1.0, subgroup_numel=SUBGROUP
    ) as opt:
        assert [b.dim() for b in opt.param_groups[0]["betas"]] == [0, 0]
        assert [b.dim() for b in ref.param_groups[0]["betas"]] == [0, 0]
        for x, y in _batches():
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_close(p.detach(), q.detach())
