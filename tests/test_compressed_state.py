"""Compressed optimizer state (#16) through HybridAdamW / HybridAdam: the options and their
errors, the device tier's bf16 moments and 16-bit master remainders bitwise against the
pure-torch reference of the same rounding, remainders ≡ an fp32 master, checkpoints in
torch's format both ways, and convergence with bf16 moments.

Grads come from a fixed stream (set on .grad), not from a forward, so every run steps the
very same inputs and state can be compared with torch.equal.
"""

import warnings

import pytest
import torch
from helpers import needs_kernels, transformers_or_skip, with_fp32_masters
from torch import nn

import cpu_kernels
from cpu_kernels.reference import (
    FUSED_MULTIPLY_ADD_LEVELS,
    adam_step_bitwise_reference,
    encode_remainder_reference,
)
from hybrid_opt import HybridAdam, HybridAdamW, fp32_master
from hybrid_opt.state.state_format import StateFormat
from hybrid_opt.testing import debug_view

# each test's optimizers closed at its end (conftest): they are built without `with` here
pytestmark = pytest.mark.usefixtures("close_optimizers")

BF16, FP32 = torch.bfloat16, torch.float32
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
MOMENTS = {
    "fp32": (FP32, FP32),
    "exp_avg bf16": (BF16, FP32),
    "exp_avg_sq bf16": (FP32, BF16),
    "both bf16": (BF16, BF16),
}


def _params(dtype, seed=0, shapes=((37, 5), (19,), (3, 3, 4))):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, scale=1.0):
    """The fixed grad stream: step k's grads, in the params' dtypes."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _set_grads(params, step):
    for p, g in zip(params, _grads(params, step)):
        p.grad = g


def _mixed_moments_supported():
    p, g = torch.zeros(2), torch.zeros(2)
    try:
        cpu_kernels.adam_step_(
            p,
            g,
            torch.zeros(2, dtype=BF16),
            torch.zeros(2),
            step=1,
            lr=0.1,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.0,
        )
        return True
    except TypeError:
        return False


def _skip_unsupported(exp_avg_dtype, exp_avg_sq_dtype):
    if exp_avg_dtype != exp_avg_sq_dtype and not _mixed_moments_supported():
        pytest.skip("this cpu_kernels build steps exp_avg and exp_avg_sq of one dtype only")


# ---------------------------------------------------------------------------- options
def test_default_state_format_is_torch_s_plain_one():
    opt = HybridAdamW(_params(FP32), offload_fraction=0.0)
    assert opt.state_format == StateFormat() and opt.state_format.plain


@pytest.mark.parametrize("cls", [HybridAdamW, HybridAdam])
def test_options_are_stored_as_one_state_format(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bf16 params: remainders apply, no warning
        opt = cls(
            _params(BF16),
            offload_fraction=0.0,
            exp_avg_dtype=BF16,
            exp_avg_sq_dtype=FP32,
            store_param_remainders=True,
        )
    assert opt.state_format == StateFormat(BF16, FP32, True)


ERRORS = [
    (dict(exp_avg_dtype=torch.float16), TypeError, r"exp_avg_dtype must be torch.float32 or torch.bfloat16"),
    (
        dict(exp_avg_sq_dtype=torch.float64),
        TypeError,
        r"exp_avg_sq_dtype must be torch.float32 or torch.bfloat16",
    ),
    (dict(exp_avg_dtype="bf16"), TypeError, r"exp_avg_dtype must be"),
    (dict(store_param_remainders=1), TypeError, r"store_param_remainders must be a bool, got int"),
    (dict(exp_avg_dtype=BF16, rollback="inverse"), ValueError, r"rounding to bf16 is not invertible"),
    (dict(exp_avg_sq_dtype=BF16, rollback="inverse"), ValueError, r"rollback='inverse' cannot undo"),
    (
        dict(store_param_remainders=True, rollback="inverse"),
        ValueError,
        r"rollback='inverse' cannot be combined with store_param_remainders",
    ),
]


@pytest.mark.parametrize("kwargs,error,match", ERRORS, ids=[str(e[0]) for e in ERRORS])
def test_bad_state_format_is_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        HybridAdamW(_params(BF16), offload_fraction=0.0, **kwargs)


def test_remainders_without_a_bf16_param_warn_and_change_nothing():
    with pytest.warns(
        UserWarning, match="store_param_remainders=True has no effect here: no parameter is bf16"
    ):
        opt = HybridAdamW(_params(FP32), offload_fraction=0.0, store_param_remainders=True)
    assert not debug_view(opt).device.remainder
    plain = HybridAdamW(_params(FP32), offload_fraction=0.0)
    assert debug_view(opt).device.nbytes() == debug_view(plain).device.nbytes()


# ---------------------------------------------------------------------------- device tier
def _reference_run(params, steps, fmt: StateFormat, amsgrad=False, decoupled=True):
    """adam_step_bitwise_reference over the same grad stream: the state every step leaves."""
    fma = cpu_kernels.simd_level() in FUSED_MULTIPLY_ADD_LEVELS
    state = []
    for p in params:
        rem = fmt.remainders_for(p.dtype)
        master = p.detach().clone() if rem else p.detach().float().clone()
        z = lambda dt: torch.zeros(p.shape, dtype=dt)  # noqa: E731
        state.append(
            dict(
                param=master,
                exp_avg=z(fmt.exp_avg_dtype),
                exp_avg_sq=z(fmt.exp_avg_sq_dtype),
                max_exp_avg_sq=z(fmt.exp_avg_sq_dtype) if amsgrad else None,
                remainder=z(torch.int16) if rem else None,
            )
        )
    for k in range(steps):
        for st, g in zip(state, _grads(params, k)):
            out = adam_step_bitwise_reference(
                st["param"],
                g,
                st["exp_avg"],
                st["exp_avg_sq"],
                step=k + 1,
                lr=HYPER["lr"],
                beta1=HYPER["betas"][0],
                beta2=HYPER["betas"][1],
                eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"],
                decoupled=decoupled,
                max_exp_avg_sq=st["max_exp_avg_sq"],
                remainder=st["remainder"],
                fma=fma,
            )
            for key, v in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder"), out):
                st[key] = v
    return state


def _hybrid_run(params, steps, fmt: StateFormat, cls=HybridAdamW, amsgrad=False, **kw):
    kw.setdefault("offload_fraction", 0.0)
    kw.setdefault("subgroup_numel", 64)
    opt = cls(
        params,
        amsgrad=amsgrad,
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        store_param_remainders=fmt.store_param_remainders,
        **HYPER,
        **kw,
    )
    for k in range(steps):
        _set_grads(params, k)
        opt.step()
    return opt


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("moments", list(MOMENTS), ids=list(MOMENTS))
@pytest.mark.parametrize("model", ["fp32", "bf16 master", "bf16 remainders"])
def test_device_tier_steps_the_reference_bitwise(model, moments, amsgrad):
    m, v = MOMENTS[moments]
    _skip_unsupported(m, v)
    fmt = StateFormat(m, v, model == "bf16 remainders")
    params = _params(FP32 if model == "fp32" else BF16)
    ref = _reference_run(params, 6, fmt, amsgrad=amsgrad)
    opt = _hybrid_run(params, 6, fmt, amsgrad=amsgrad)
    sd = opt.state_dict()["state"]
    for i, (p, st) in enumerate(zip(params, ref)):
        assert sd[i]["exp_avg"].dtype == m and sd[i]["exp_avg_sq"].dtype == v
        assert torch.equal(sd[i]["exp_avg"], st["exp_avg"]), i
        assert torch.equal(sd[i]["exp_avg_sq"], st["exp_avg_sq"]), i
        if amsgrad:
            assert torch.equal(sd[i]["max_exp_avg_sq"], st["max_exp_avg_sq"]), i
        if model == "fp32":
            assert torch.equal(p.detach(), st["param"]), i
        elif model == "bf16 master":
            assert torch.equal(sd[i]["master_param"], st["param"]), i
            assert torch.equal(p.detach(), st["param"].to(BF16)), i
        else:
            assert torch.equal(p.detach(), st["param"]), i  # the high half
            assert "master_param" not in sd[i] and sd[i]["master_remainder"].dtype == torch.int16, i
            assert torch.equal(sd[i]["master_remainder"], st["remainder"]), i  # the low half
            assert torch.equal(
                fp32_master(sd[i], p), cpu_kernels.decode_remainder_reference(st["param"], st["remainder"])
            ), i


def test_device_tier_bytes_are_what_the_format_says():
    params = _params(BF16)
    n = sum(p.numel() for p in params)
    for fmt in (
        StateFormat(),
        StateFormat(BF16, BF16),
        StateFormat(BF16, BF16, True),
        StateFormat(FP32, BF16, True),
    ):
        _skip_unsupported(fmt.exp_avg_dtype, fmt.exp_avg_sq_dtype)
        opt = _hybrid_run(params, 0, fmt)
        assert debug_view(opt).device.nbytes() == n * fmt.state_bytes(BF16), fmt
        assert debug_view(opt).placement.device_bytes(debug_view(opt).subgroups) == n * fmt.state_bytes(
            BF16
        ), fmt
    assert StateFormat(BF16, BF16, True).state_bytes(BF16) == 6  # 2 + 2 + 2 instead of 12


@pytest.mark.parametrize("fmt", [StateFormat(), StateFormat(BF16, BF16), StateFormat(BF16, BF16, True)])
def test_budgets_count_at_least_what_a_mixed_fp32_bf16_host_tier_allocates(fmt):
    """fp32 norms beside bf16 weights: the host tier keeps a 4-byte master region for both
    (tiers/compressed.py), so the budgets may not count the bf16 subgroups' 2-byte remainder
    (they counted the first subgroup's dtype: 25 % short with remainders)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 256)).to(BF16)
    model[1].float()
    opt = HybridAdamW(
        model.parameters(),
        offload_fraction=1.0,
        subgroup_numel=1 << 16,
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        store_param_remainders=fmt.store_param_remainders,
        **HYPER,
    )
    try:
        assert {s.dtype for s in debug_view(opt).subgroups} == {BF16, FP32}
        counted, dtype = debug_view(opt).placement.budget_format(debug_view(opt).subgroups)
        host = debug_view(opt).host
        allocated = host.bank_bytes / (len(host.numels) * host.capacity)  # bytes per element of a bank
        page_slack = 2 * 4096 / host.capacity  # a bank's state block and the bank end on a page
        assert counted.bank_bytes(dtype) + page_slack >= allocated, (counted, dtype, allocated)
        assert counted.bank_bytes(dtype) > allocated - 0.5  # and not more
    finally:
        opt.close()


# ---------------------------------------------------------------------------- remainders ≡ master
def _ties(master):
    """Elements where the remainder's param (ties away) differs from master.to(bf16) (ties to
    even): low half exactly 0x8000 with an even high half."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)


@pytest.mark.parametrize("moments", ["fp32", "both bf16"])
def test_remainders_step_the_same_master_as_an_fp32_master_bitwise(moments):
    """Many steps at offload 0 from one grad stream: the decoded master is the fp32-master
    run's bit for bit at every step; the params differ exactly on the ties."""
    m, v = MOMENTS[moments]
    shapes = ((160, 100), (19,))  # 16019 elements: ties (1 in 2^17 per element-step) do occur
    a_params, b_params = _params(BF16, seed=3, shapes=shapes), _params(BF16, seed=3, shapes=shapes)
    a = _hybrid_run(a_params, 0, StateFormat(m, v, False), subgroup_numel=4096)
    b = _hybrid_run(b_params, 0, StateFormat(m, v, True), subgroup_numel=4096)
    ties = 0
    for k in range(60):
        for params, opt in ((a_params, a), (b_params, b)):
            _set_grads(params, k)
            opt.step()
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        for i, (pa, pb) in enumerate(zip(a_params, b_params)):
            master = fp32_master(sb[i], pb)  # b keeps remainders: decoded with its param
            assert torch.equal(sa[i]["master_param"], master), (k, i)
            assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]), (k, i)
            tie = _ties(sa[i]["master_param"])
            differ = pa.detach().view(torch.int16) != pb.detach().view(torch.int16)
            assert torch.equal(differ, tie), (k, i)
            # the fp32 master's encoding is b's param and b's remainder
            high, low = encode_remainder_reference(sa[i]["master_param"])
            assert torch.equal(pb.detach(), high) and torch.equal(sb[i]["master_remainder"], low), (k, i)
            ties += int(tie.sum())
    print(f"remainders vs fp32 master: {ties} tied element-steps over 60 steps x 16019 elements")
    assert ties > 0  # the tie case was met (fixed seeds: the same count every run)


def _backward_grads(params, step):
    """The same grad stream through autograd ((p * g).sum() leaves p.grad == g): the grad
    hooks fire, so host subgroups are speculated during backward as in training."""
    for p in params:
        p.grad = None
    sum((p * g).sum() for p, g in zip(params, _grads(params, step))).backward()


PLACED = {
    "host": dict(offload_fraction=1.0),
    "mixed": dict(offload_fraction=0.5),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=0.5),
}


@pytest.mark.parametrize("placement", list(PLACED))
def test_compressed_state_is_bitwise_the_same_at_every_placement(placement, tmp_path):
    """bf16 moments + remainders on the host / nvme tiers (speculated in backward) step the
    device tier's bits, and the master stays the fp32-master run's bit for bit."""
    kw = (
        dict(PLACED[placement], nvme_path=str(tmp_path))
        if "nvme_fraction" in PLACED[placement]
        else dict(PLACED[placement])
    )
    fmt = StateFormat(BF16, BF16, True)
    runs = {name: _params(BF16, seed=4) for name in ("device", "placed", "fp32 master")}
    opts = {
        "device": _hybrid_run(runs["device"], 0, fmt),
        "placed": _hybrid_run(runs["placed"], 0, fmt, **kw),
        "fp32 master": _hybrid_run(runs["fp32 master"], 0, StateFormat(BF16, BF16, False)),
    }
    try:
        assert debug_view(opts["placed"]).host is not None
        for k in range(12):
            for name, params in runs.items():
                _backward_grads(params, k)
                opts[name].step()
        sds = {name: o.state_dict()["state"] for name, o in opts.items()}
        for i in range(len(runs["device"])):
            for key in ("master_remainder", "exp_avg", "exp_avg_sq"):
                assert sds["placed"][i][key].dtype == sds["device"][i][key].dtype
                assert torch.equal(sds["placed"][i][key], sds["device"][i][key]), (i, key)
            for name in ("device", "placed"):  # decoded with their params: the fp32 master's bits
                assert torch.equal(
                    fp32_master(sds[name][i], runs[name][i]), sds["fp32 master"][i]["master_param"]
                ), (name, i)
            assert torch.equal(runs["placed"][i].detach(), runs["device"][i].detach()), i
        assert opts["placed"].stats["speculation"] is not None
    finally:
        for o in opts.values():
            o.close()


# ---------------------------------------------------------------------------- checkpoints
def test_compressed_checkpoint_is_torch_s_format_with_bf16_moments_and_an_fp32_master():
    """torch's keys with bf16 moments, and the master as the tier stores it: an int16
    `master_remainder` (no fp32 `master_param`) that with the bf16 param decodes to it."""
    params = _params(BF16)
    opt = _hybrid_run(params, 4, StateFormat(BF16, BF16, True))
    sd = opt.state_dict()
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_remainder"}
        assert st["exp_avg"].dtype == BF16 and st["exp_avg_sq"].dtype == BF16
        assert st["master_remainder"].dtype == torch.int16 and st["master_remainder"].shape == p.shape
        master = fp32_master(st, p)
        assert master.dtype == FP32 and master.shape == p.shape
        # the param is the master's high half (ties away), so it is a rounding of it; the
        # remainder is its low half
        high, low = encode_remainder_reference(master)
        assert torch.equal(high, p.detach()) and torch.equal(low, st["master_remainder"]), i


def test_torch_checkpoint_loads_into_a_compressed_optimizer_rounded_to_nearest_even():
    params = _params(FP32)
    ref = torch.optim.AdamW([nn.Parameter(p.detach().clone()) for p in params], foreach=False, **HYPER)
    for k in range(3):
        for p, g in zip(ref.param_groups[0]["params"], _grads(params, k)):
            p.grad = g
        ref.step()
    with torch.no_grad():
        for p, q in zip(params, ref.param_groups[0]["params"]):
            p.copy_(q)
    opt = _hybrid_run(params, 0, StateFormat(BF16, BF16))
    opt.load_state_dict(ref.state_dict())
    sd = opt.state_dict()["state"]
    for i, q in enumerate(ref.param_groups[0]["params"]):
        st = ref.state[q]
        assert torch.equal(sd[i]["exp_avg"], st["exp_avg"].to(BF16))  # torch's cast: nearest even
        assert torch.equal(sd[i]["exp_avg_sq"], st["exp_avg_sq"].to(BF16))
        assert int(sd[i]["step"]) == 3


@pytest.mark.parametrize("into", ["torch", "plain hybrid"])
def test_compressed_checkpoint_loads_into_fp32_state_moments_upcast(into):
    params = _params(FP32)
    opt = _hybrid_run(params, 3, StateFormat(BF16, BF16))
    sd = opt.state_dict()
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    if into == "torch":
        other = torch.optim.AdamW(fresh, foreach=False, **HYPER)
        other.load_state_dict(sd)
        got = [other.state[p] for p in fresh]
    else:
        other = _hybrid_run(fresh, 0, StateFormat())
        other.load_state_dict(sd)
        got = [other.state_dict()["state"][i] for i in range(len(fresh))]
    for i, st in enumerate(got):
        assert st["exp_avg"].dtype == FP32
        assert torch.equal(st["exp_avg"], sd["state"][i]["exp_avg"].float())
        assert torch.equal(st["exp_avg_sq"], sd["state"][i]["exp_avg_sq"].float())
    # and it keeps training from there: one more step on both sides lands on the same params
    for p, q in zip(params, fresh):
        p.grad = q.grad = torch.full_like(p, 0.5)
    opt.step()
    other.step()
    # opt's bf16 moments round the new m and v, the upcast run keeps them fp32: the params agree
    # within fp32 rounding of the update (the fp32 value before rounding feeds both updates)
    for p, q in zip(params, fresh):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("into", ["remainders", "fp32 master"])
def test_remainder_checkpoint_round_trip_keeps_the_master_bitwise(into):
    params = _params(BF16, seed=5)
    opt = _hybrid_run(params, 5, StateFormat(BF16, FP32, True))
    sd = opt.state_dict()
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    other = _hybrid_run(fresh, 0, StateFormat(BF16, FP32, into == "remainders"))
    other.load_state_dict(sd)
    back = other.state_dict()["state"]
    for i in range(len(params)):
        assert torch.equal(fp32_master(back[i], fresh[i]), fp32_master(sd["state"][i], params[i])), i
        assert torch.equal(back[i]["exp_avg"], sd["state"][i]["exp_avg"]), i
        assert torch.equal(fresh[i].detach(), params[i].detach()), i  # a load wrote no new bits
    # both continue identically: same master after two more steps
    for k in range(5, 7):
        for ps, o in ((params, opt), (fresh, other)):
            _set_grads(ps, k)
            o.step()
    a, b = opt.state_dict()["state"], other.state_dict()["state"]
    for i in range(len(params)):
        assert torch.equal(fp32_master(a[i], params[i]), fp32_master(b[i], fresh[i])), i


# ---------------------------------------------------------------------------- convergence
def _demo_loss(exp_avg_dtype, exp_avg_sq_dtype, steps=40):
    import torch.nn.functional as F

    from hybrid_opt.demo import TinyGPT, bigram_batches

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=16)
    batches = bigram_batches(steps, 8, 16, 64, "cpu")
    opt = HybridAdamW(
        model.parameters(),
        lr=3e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        offload_fraction=0.0,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
    )
    losses = []
    for seq in batches:
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5, losses[0]


def test_bf16_moments_converge_within_half_a_percent_of_fp32_on_the_demo_model():
    fp32, first = _demo_loss(FP32, FP32)
    bf16, _ = _demo_loss(BF16, BF16)
    print(
        f"demo model, final loss (mean of last 5 of 40 steps): fp32 moments {fp32:.5f}, "
        f"bf16 moments {bf16:.5f} ({100 * (bf16 - fp32) / fp32:+.3f} %), from {first:.4f}"
    )
    assert fp32 < 0.9 * first  # it trained
    assert abs(bf16 - fp32) <= 0.005 * fp32


def test_bf16_moments_and_remainders_converge_on_a_tiny_gpt2():
    transformers = transformers_or_skip()
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    from hybrid_opt.demo import bigram_batches

    batches = bigram_batches(30, 8, 16, 64, "cpu")
    final = {}
    for name, kw in (
        ("fp32", {}),
        ("compressed", dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, store_param_remainders=True)),
    ):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).to(BF16)
        opt = HybridAdamW(model.parameters(), lr=3e-3, offload_fraction=0.0, **kw)
        losses = []
        for seq in batches:
            out = model(seq[:, :-1], labels=seq[:, :-1])
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(out.loss.item())
        final[name] = (sum(losses[-5:]) / 5, losses[0])
    print(f"tiny GPT-2 (bf16), final loss: {final}")
    assert final["fp32"][0] < 0.9 * final["fp32"][1]
    assert abs(final["compressed"][0] - final["fp32"][0]) <= 0.01 * final["fp32"][0]


# ---------------------------------------------------------------------------- CUDA (Triton)
def _cuda_run(fmt, steps, params):
    opt = HybridAdamW(
        params,
        offload_fraction=0.0,
        subgroup_numel=1 << 12,
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        store_param_remainders=fmt.store_param_remainders,
        **HYPER,
    )
    for k in range(steps):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g.cuda()
        opt.step()
    return opt


@pytest.mark.gpu
@pytest.mark.parametrize("moments", ["fp32", "both bf16", "exp_avg bf16"])
def test_cuda_remainders_step_the_same_master_as_an_fp32_master_bitwise(moments):
    """The Triton launch with remainders= decodes, steps and encodes the very master the
    param_copies launch steps: decoded masters torch.equal over 30 steps, params differ only
    on ties."""
    m, v = MOMENTS[moments]
    shapes = ((300, 100), (77,))
    a = [nn.Parameter(p.detach().cuda()) for p in _params(BF16, seed=8, shapes=shapes)]
    b = [nn.Parameter(p.detach().cuda()) for p in _params(BF16, seed=8, shapes=shapes)]
    oa, ob = _cuda_run(StateFormat(m, v, False), 30, a), _cuda_run(StateFormat(m, v, True), 30, b)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert debug_view(ob).device.remainder and not debug_view(oa).device.remainder
    for i in range(len(a)):
        assert torch.equal(sa[i]["master_param"], fp32_master(sb[i], b[i])), i  # b: remainders
        assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]), i
        differ = a[i].detach().view(torch.int16) != b[i].detach().view(torch.int16)
        assert torch.equal(differ, _ties(sa[i]["master_param"])), i


@pytest.mark.gpu
def test_cuda_compressed_device_tier_follows_the_cpu_reference_within_bf16_rounding():
    """Triton's fp32 arithmetic rounds differently from the CPU kernel's: the state after a few
    steps agrees with the bitwise CPU reference within the bf16 tolerance (moments) and the
    fp32 one (master)."""
    from tolerances import assert_close

    fmt = StateFormat(BF16, BF16, True)
    cpu = _params(BF16, seed=9)
    ref = _reference_run(cpu, 4, fmt)
    gpu = [nn.Parameter(p.detach().cuda()) for p in _params(BF16, seed=9)]
    sd = _cuda_run(fmt, 4, gpu).state_dict()["state"]
    for i, st in enumerate(ref):
        master = cpu_kernels.decode_remainder_reference(st["param"], st["remainder"])
        assert_close(fp32_master(sd[i], gpu[i]).cpu(), master, FP32, msg=f"master {i}")
        assert_close(sd[i]["exp_avg"].cpu().float(), st["exp_avg"].float(), BF16, msg=f"exp_avg {i}")
        assert_close(sd[i]["exp_avg_sq"].cpu().float(), st["exp_avg_sq"].float(), BF16, msg=f"exp_avg_sq {i}")
        assert sd[i]["exp_avg"].dtype == BF16 and sd[i]["exp_avg_sq"].dtype == BF16


def _triton_on_cpu(opt, monkeypatch):
    """The device tier's CUDA launch path (_step_cuda: one fused_adam_ per launch key, with
    remainders= or param_copies=) run on CPU tensors through TRITON_INTERPRET."""
    tier = debug_view(opt).device
    monkeypatch.setattr(
        tier,
        "step",
        lambda work, scale, found_inf=None: tier._step_cuda(work, float(scale), found_inf) if work else None,
    )


@needs_kernels
def test_cuda_launch_path_with_remainders_steps_the_fp32_master_s_bits_in_the_interpreter(monkeypatch):
    """Without a GPU: the launch path's remainders= list gives the same decoded master as its
    param_copies= launch (bitwise), and both follow the CPU kernel within fp32 rounding."""
    from tolerances import assert_close

    fmt_r, fmt_m = StateFormat(BF16, BF16, True), StateFormat(BF16, BF16, False)
    runs = {}
    for name, fmt, triton in (("remainders", fmt_r, True), ("master", fmt_m, True), ("cpu", fmt_m, False)):
        params = _params(BF16, seed=11)
        opt = _hybrid_run(params, 0, fmt, subgroup_numel=1 << 12)
        if triton:
            _triton_on_cpu(opt, monkeypatch)
        for k in range(3):
            _set_grads(params, k)
            opt.step()
        runs[name] = (params, with_fp32_masters(opt.state_dict()["state"], params), opt)
    assert debug_view(runs["remainders"][2]).device.remainder
    for i in range(len(runs["cpu"][0])):
        r, m, c = (runs[n][1][i] for n in ("remainders", "master", "cpu"))  # masters decoded
        assert torch.equal(r["master_param"], m["master_param"]), i
        assert torch.equal(r["exp_avg_sq"], m["exp_avg_sq"]), i
        assert_close(r["master_param"], c["master_param"], FP32, msg=f"master {i}")
        differ = runs["remainders"][0][i].detach().view(torch.int16) != runs["master"][0][i].detach().view(
            torch.int16
        )
        assert torch.equal(differ, _ties(m["master_param"])), i


def test_moves_between_tiers_carry_compressed_state_bitwise(tmp_path):
    """replan() device -> host/nvme -> mixed -> device with bf16 moments + remainders: the
    decoded master, moments and params stay those of a run that never moved."""
    fmt = StateFormat(BF16, BF16, True)
    still, moved = _params(BF16, seed=12), _params(BF16, seed=12)
    a = _hybrid_run(still, 0, fmt)
    b = _hybrid_run(moved, 0, fmt, nvme_path=str(tmp_path))
    with a, b:
        for k, where in enumerate([None, (1.0, 0.5), None, (0.5, 0.0), None, (0.0, 0.0), None]):
            if where is not None:
                b.replan(*where)
            for params, opt in ((still, a), (moved, b)):
                _set_grads(params, k)
                opt.step()
            sa, sb = a.state_dict()["state"], b.state_dict()["state"]
            for i in range(len(still)):
                for key in ("master_remainder", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(sa[i][key], sb[i][key]), (k, i, key)
                assert torch.equal(still[i].detach(), moved[i].detach()), (k, i)
                assert torch.equal(fp32_master(sa[i], still[i]), fp32_master(sb[i], moved[i])), (k, i)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_compressed_checkpoint_loads_into_offloaded_tiers_bitwise(placement, tmp_path):
    fmt = StateFormat(BF16, BF16, True)
    params = _params(BF16, seed=13)
    src = _hybrid_run(params, 4, fmt)
    sd = src.state_dict()
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    kw = (
        dict(offload_fraction=1.0)
        if placement == "host"
        else dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=str(tmp_path))
    )
    with _hybrid_run(fresh, 0, fmt, **kw) as dst:
        dst.load_state_dict(sd)
        back = dst.state_dict()["state"]
        for i in range(len(params)):
            for key in ("master_remainder", "exp_avg", "exp_avg_sq"):
                assert back[i][key].dtype == sd["state"][i][key].dtype
                assert torch.equal(back[i][key], sd["state"][i][key]), (i, key)
            assert torch.equal(fresh[i].detach(), params[i].detach()), i  # so the masters decode alike
        for k in range(4, 6):
            for ps, o in ((params, src), (fresh, dst)):
                _set_grads(ps, k)
                o.step()
        for p, q in zip(params, fresh):
            assert torch.equal(p.detach(), q.detach())
