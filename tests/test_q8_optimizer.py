"""q8 moments (issue 38) through HybridAdamW / HybridAdam: the options and their errors, the
layout (quantized and small params apart, no block split), the device tier (the in-process C
kernel on a CPU-only host; the CUDA launch path through TRITON_INTERPRET) bitwise against a
pure-torch loop of `q8_adam_step_reference`, the trajectory against torch.optim.AdamW, and
checkpoints (codes and absmaxes under documented keys, a torch checkpoint quantized).

Grads come from a fixed stream (set on .grad), so every run steps the same inputs and state is
compared with torch.equal.
"""

import pytest
import torch
from helpers import needs_kernels
from tolerances import Q8_TRAJECTORY_SHARE, assert_close
from torch import nn

import cpu_kernels
from cpu_kernels.q8_reference import Q8Blocks, dequantize_blocks, q8_adam_step_reference, quantize_blocks
from cpu_kernels.reference import FUSED_MULTIPLY_ADD_LEVELS, adam_step_bitwise_reference
from hybrid_opt import HybridAdam, HybridAdamW
from hybrid_opt.state.state_format import Q8, Q8_MIN_NUMEL, StateFormat
from hybrid_opt.testing import debug_view

# each test's optimizers closed at its end (conftest): they are built without `with` here
pytestmark = pytest.mark.usefixtures("close_optimizers")

BF16, FP32 = torch.bfloat16, torch.float32
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
# quantized: 6144 (24 blocks), 5000 (a partial last block), 5120; small: 185, 19, 36
SHAPES = ((64, 96), (5000,), (37, 5), (80, 64), (19,), (3, 3, 4))
MOMENTS = {
    "both q8": (Q8, Q8),
    "exp_avg q8": (Q8, FP32),
    "exp_avg_sq q8": (FP32, Q8),
    "bf16 + q8": (BF16, Q8),
    "q8 + bf16": (Q8, BF16),
}


def _params(dtype, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _set_grads(params, step):
    for p, g in zip(params, _grads(params, step)):
        p.grad = g


def _hybrid(params, fmt: StateFormat, cls=HybridAdamW, amsgrad=False, **kw):
    kw.setdefault("offload_fraction", 0.0)
    kw.setdefault("subgroup_numel", 2048)
    return cls(
        params,
        amsgrad=amsgrad,
        exp_avg_dtype=fmt.exp_avg_dtype,
        exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
        store_param_remainders=fmt.store_param_remainders,
        **HYPER,
        **kw,
    )


def _run(opt, params, steps, first=0):
    for k in range(first, first + steps):
        _set_grads(params, k)
        opt.step()
    return opt


def _zero(n, dtype, signed):
    return quantize_blocks(torch.zeros(n), signed) if dtype == Q8 else torch.zeros(n, dtype=dtype)


def reference_run(params, steps, fmt: StateFormat, amsgrad=False, decoupled=True):
    """A pure-torch loop over the same grad stream: q8_adam_step_reference for each param of at
    least Q8_MIN_NUMEL elements, adam_step_bitwise_reference (the kernel's fma) for the smaller
    ones, which keep fp32 moments for a q8 format. The state each param has after `steps`."""
    fma = cpu_kernels.simd_level() in FUSED_MULTIPLY_ADD_LEVELS
    state = []
    for p in params:
        n = p.numel()
        f = fmt.for_subgroup(n >= Q8_MIN_NUMEL)
        rem = f.remainders_for(p.dtype)
        master = p.detach().reshape(-1).clone() if rem else p.detach().reshape(-1).float().clone()
        state.append(
            dict(
                fmt=f,
                param=master,
                exp_avg=_zero(n, f.exp_avg_dtype, True),
                exp_avg_sq=_zero(n, f.exp_avg_sq_dtype, False),
                max_exp_avg_sq=_zero(n, f.exp_avg_sq_dtype, False) if amsgrad else None,
                remainder=torch.zeros(n, dtype=torch.int16) if rem else None,
            )
        )
    for k in range(steps):
        for st, g in zip(state, _grads(params, k)):
            hp = dict(
                step=k + 1,
                lr=HYPER["lr"],
                beta1=HYPER["betas"][0],
                beta2=HYPER["betas"][1],
                eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"],
                decoupled=decoupled,
                max_exp_avg_sq=st["max_exp_avg_sq"],
                remainder=st["remainder"],
            )
            args = (st["param"], g.reshape(-1), st["exp_avg"], st["exp_avg_sq"])
            if st["fmt"].quantized_moments:
                out = q8_adam_step_reference(*args, **hp)
            else:
                out = adam_step_bitwise_reference(*args, **hp, fma=fma)
            for key, v in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "remainder"), out):
                st[key] = v
    return state


def assert_state_equal(sd_state, ref, params, fmt, amsgrad=False):
    """Each param's state_dict() entry is the reference's bitwise: q8 moments as codes and
    absmaxes under `<moment>_q8` / `<moment>_absmax`, the others under torch's keys."""
    for i, (p, st) in enumerate(zip(params, ref)):
        entry = sd_state[i]
        for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            want = st[name]
            if isinstance(want, Q8Blocks):
                assert name not in entry, (i, name)
                assert entry[name + "_q8"].dtype == torch.uint8 and entry[name + "_q8"].shape == p.shape, (
                    i,
                    name,
                )
                assert torch.equal(entry[name + "_q8"].reshape(-1), want.codes), (i, name)
                assert torch.equal(entry[name + "_absmax"], want.absmax), (i, name)
            else:
                assert name + "_q8" not in entry, (i, name)
                assert torch.equal(entry[name].reshape(-1), want), (i, name)
        if st["remainder"] is not None:
            assert torch.equal(p.detach().reshape(-1), st["param"]), i
            assert torch.equal(entry["master_remainder"].reshape(-1), st["remainder"]), i
        elif p.dtype == FP32:
            assert torch.equal(p.detach().reshape(-1), st["param"]), i
        else:
            assert torch.equal(entry["master_param"].reshape(-1), st["param"]), i
            assert torch.equal(p.detach().reshape(-1), st["param"].to(p.dtype)), i


# ---------------------------------------------------------------------------- options
def test_q8_is_a_moment_format_of_its_own_bytes():
    fmt = StateFormat(Q8, Q8, True)
    assert fmt.quantized_moments and fmt.compressed_moments and not fmt.plain
    assert fmt.moment_bytes() == 2 * (1 + 4 / 256)
    assert fmt.moment_bytes(amsgrad=True) == 3 * (1 + 4 / 256)
    assert fmt.state_bytes(BF16) == 2 + 2 * (1 + 4 / 256)  # about 4.03 B per param (issue 38)
    assert StateFormat(Q8, FP32).state_bytes(FP32) == 4 + 1 + 4 / 256 + 4
    assert fmt.unquantized() == StateFormat(FP32, FP32, True)
    assert StateFormat(BF16, Q8).unquantized() == StateFormat(BF16, FP32)
    assert StateFormat(Q8, Q8).stored_moments(True) == {
        "exp_avg": torch.uint8,
        "exp_avg_absmax": FP32,
        "exp_avg_sq": torch.uint8,
        "exp_avg_sq_absmax": FP32,
        "max_exp_avg_sq": torch.uint8,
        "max_exp_avg_sq_absmax": FP32,
    }


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(exp_avg_dtype="q4"),
            TypeError,
            r"exp_avg_dtype must be torch.float32 or torch.bfloat16 \(or \"q8\"",
        ),
        (dict(exp_avg_sq_dtype=Q8, rollback="inverse"), ValueError, "q8 moments"),
        (dict(exp_avg_dtype=Q8, offload_fraction=0.0, subgroup_numel=128), ValueError, "one q8 block"),
    ],
)
def test_bad_q8_options_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        HybridAdamW(_params(FP32), **kwargs)


# ---------------------------------------------------------------------------- layout
@pytest.mark.parametrize("subgroup_numel", [2048, 1000, 1 << 16])
def test_layout_keeps_small_params_apart_and_never_splits_a_block(subgroup_numel):
    params = _params(FP32)
    opt = _hybrid(params, StateFormat(Q8, Q8), subgroup_numel=subgroup_numel)
    sgs = debug_view(opt).subgroups
    assert {sg.quantized for sg in sgs} == {True, False}
    for sg in sgs:
        assert {params[sl.param_index].numel() >= Q8_MIN_NUMEL for sl in sg.slices} == {sg.quantized}
        if not sg.quantized:
            continue
        assert sg.numel <= subgroup_numel
        for k, sl in enumerate(sg.slices):
            assert sl.sub_offset % 256 == 0 and sl.param_offset % 256 == 0, (sg.index, k)
            ends_param = sl.param_offset + sl.numel == params[sl.param_index].numel()
            if sl.numel % 256:  # a partial block: the param's last, and the subgroup's
                assert ends_param and k == len(sg.slices) - 1, (sg.index, k)
    # without q8 the small and large params share subgroups, as before
    plain = debug_view(_hybrid(_params(FP32), StateFormat(), subgroup_numel=1 << 16)).subgroups
    assert len(plain) == 1 and not plain[0].quantized


# ---------------------------------------------------------------------------- device tier
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("moments", list(MOMENTS), ids=list(MOMENTS))
@pytest.mark.parametrize("model", ["fp32", "bf16 master", "bf16 remainders"])
def test_device_tier_steps_the_q8_reference_bitwise(model, moments, amsgrad):
    m, v = MOMENTS[moments]
    fmt = StateFormat(m, v, model == "bf16 remainders")
    params = _params(FP32 if model == "fp32" else BF16)
    ref = reference_run(params, 5, fmt, amsgrad=amsgrad)
    opt = _run(_hybrid(params, fmt, amsgrad=amsgrad), params, 5)
    assert any(debug_view(opt).device.quantized(sg.index) for sg in debug_view(opt).subgroups)
    assert_state_equal(opt.state_dict()["state"], ref, params, fmt, amsgrad)


def test_adam_l2_decay_steps_the_q8_reference_bitwise():
    params = _params(FP32, seed=2)
    fmt = StateFormat(Q8, Q8)
    ref = reference_run(params, 4, fmt, decoupled=False)
    opt = _run(_hybrid(params, fmt, cls=HybridAdam), params, 4)
    assert_state_equal(opt.state_dict()["state"], ref, params, fmt)


def test_device_tier_bytes_are_codes_and_absmaxes():
    params = _params(BF16)
    fmt = StateFormat(Q8, Q8, True)
    opt = _hybrid(params, fmt)
    big = sum(p.numel() for p in params if p.numel() >= Q8_MIN_NUMEL)
    small = sum(p.numel() for p in params if p.numel() < Q8_MIN_NUMEL)
    blocks = sum(-(-sg.numel // 256) for sg in debug_view(opt).subgroups if sg.quantized)
    assert debug_view(opt).device.nbytes() == big * (2 + 2) + blocks * 2 * 4 + small * (2 + 8)
    # what the budgets count (footprint.py) is what the tier allocated
    assert (
        debug_view(opt).placement.device_bytes(debug_view(opt).subgroups) == debug_view(opt).device.nbytes()
    )


def test_q8_trajectory_follows_torch_adamw_loosely():
    """q8 moments are lossy: the params follow torch.optim.AdamW(foreach=False) on the same
    grads within a loose bound (each step moves a param by about lr), far closer than a
    zero-moment run would."""
    params, ref_params = _params(FP32, seed=5), _params(FP32, seed=5)
    opt = _hybrid(params, StateFormat(Q8, Q8))
    ref = torch.optim.AdamW(ref_params, foreach=False, **HYPER)
    start = [p.detach().clone() for p in params]
    for k in range(20):
        _set_grads(params, k)
        _set_grads(ref_params, k)
        opt.step()
        ref.step()
    for p, r, s in zip(params, ref_params, start):
        moved = (r.detach() - s).abs().max()
        drift = (p.detach() - r.detach()).abs().max()
        assert drift <= Q8_TRAJECTORY_SHARE * moved, (float(drift), float(moved))
    # and not by luck: fp32 moments follow torch within fp32 rounding, q8 ones do not
    assert not torch.equal(params[0].detach(), ref_params[0].detach())


def _triton_on_cpu(opt, monkeypatch):
    """The device tier's CUDA launch path (_step_cuda: gpu_kernels.q8_adam_ for q8 subgroups,
    the prepared fused_adam_ for the others) run on CPU tensors through TRITON_INTERPRET."""
    tier = debug_view(opt).device
    monkeypatch.setattr(
        tier,
        "step",
        lambda work, scale, found_inf=None: tier._step_cuda(work, float(scale), found_inf) if work else None,
    )


@needs_kernels
@pytest.mark.parametrize("model", ["fp32", "bf16 remainders"])
def test_cuda_launch_path_steps_the_q8_reference_bitwise_in_the_interpreter(model, monkeypatch):
    """Without a GPU: the q8 subgroups' launch (gpu_kernels.q8_adam_) gives the reference's
    codes, absmaxes and params bitwise; the small params' fused_adam_ follows it within fp32."""
    fmt = StateFormat(Q8, Q8, model == "bf16 remainders")
    params = _params(FP32 if model == "fp32" else BF16, seed=7, shapes=((64, 96), (5000,), (37, 5)))
    ref = reference_run(params, 3, fmt)
    opt = _hybrid(params, fmt)
    _triton_on_cpu(opt, monkeypatch)
    _run(opt, params, 3)
    sd = opt.state_dict()["state"]
    assert_state_equal({i: sd[i] for i in (0, 1)}, ref[:2], params[:2], fmt)
    assert_close(params[2].detach().reshape(-1).float(), ref[2]["param"].float(), FP32, msg="small param")


# ---------------------------------------------------------------------------- checkpoints
def test_q8_checkpoint_round_trip_is_bitwise():
    """state_dict() of a q8 optimizer loaded into a fresh one: the run continues bit for bit as
    the uninterrupted one, and the checkpoint loads with torch.load(weights_only=True)."""
    import io

    fmt = StateFormat(Q8, Q8, True)
    a_params, b_params = _params(BF16, seed=9), _params(BF16, seed=9)
    a = _run(_hybrid(a_params, fmt), a_params, 3)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    with torch.no_grad():
        for pa, pb in zip(a_params, b_params):
            pb.copy_(pa)
    b = _hybrid(b_params, fmt)
    b.load_state_dict(sd)
    _run(a, a_params, 3, first=3)
    _run(b, b_params, 3, first=3)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    for i in sa:
        assert set(sa[i]) == set(sb[i]), i
        for key in sa[i]:
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)
    for pa, pb in zip(a_params, b_params):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_torch_adamw_checkpoint_loads_quantized(placement, tmp_path):
    """A torch.optim.AdamW checkpoint (fp32 moments) loads into a q8 optimizer on any tier:
    each large param's moments quantized blockwise (quantize_blocks), the small ones' kept fp32."""
    params = _params(FP32, seed=4)
    ref = torch.optim.AdamW(params, foreach=False, **HYPER)
    _set_grads(params, 0)
    ref.step()
    sd = ref.state_dict()
    kw = {
        "device": dict(offload_fraction=0.0),
        "host": dict(offload_fraction=1.0),
        "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=str(tmp_path)),
    }[placement]
    opt = _hybrid(params, StateFormat(Q8, Q8), **kw)
    opt.load_state_dict(sd)
    mine = opt.state_dict()["state"]
    for i, p in enumerate(params):
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if p.numel() >= Q8_MIN_NUMEL:
                want = quantize_blocks(sd["state"][i][name].reshape(-1), signed)
                assert torch.equal(mine[i][name + "_q8"].reshape(-1), want.codes), (i, name)
                assert torch.equal(mine[i][name + "_absmax"], want.absmax), (i, name)
            else:
                assert torch.equal(mine[i][name], sd["state"][i][name]), (i, name)
        assert float(mine[i]["step"]) == 1.0
    opt.close()


def test_q8_checkpoint_loads_dequantized_into_fp32_moments():
    params = _params(FP32, seed=6)
    q = _run(_hybrid(params, StateFormat(Q8, Q8)), params, 2)
    sd = q.state_dict()
    f = _hybrid(params, StateFormat())
    f.load_state_dict(sd)
    st = f.state_dict()["state"]
    for i, p in enumerate(params):
        if p.numel() >= Q8_MIN_NUMEL:
            want = dequantize_blocks(
                Q8Blocks(sd["state"][i]["exp_avg_q8"].reshape(-1), sd["state"][i]["exp_avg_absmax"]), True
            )
            assert torch.equal(st[i]["exp_avg"].reshape(-1), want), i


def test_a_q8_entry_of_the_wrong_size_is_refused_naming_the_key():
    params = _params(FP32, seed=6)
    opt = _run(_hybrid(params, StateFormat(Q8, Q8)), params, 1)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_absmax"] = sd["state"][0]["exp_avg_absmax"][:-1].clone()
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        _hybrid(params, StateFormat(Q8, Q8)).load_state_dict(sd)


# ---------------------------------------------------------------------------- host tier
FAULT_ENV = "HYBRID_OPT_WORKER_FAULT"


PLACED = {  # speculative=True: on this CPU-only host "auto" would step them in step() alone
    "host": dict(offload_fraction=1.0, speculative=True),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=0.6, speculative=True),
    "mixed": dict(offload_fraction=0.5, nvme_fraction=0.25, speculative=True),
}


@pytest.mark.parametrize("placement", list(PLACED))
@pytest.mark.parametrize("moments", ["both q8", "bf16 + q8"])
@pytest.mark.parametrize("model", ["fp32", "bf16 remainders"])
def test_host_and_nvme_tiers_step_the_q8_reference_bitwise(model, moments, placement, tmp_path):
    """offload 1.0 (and nvme): the worker steps codes and absmaxes in its banks (a spare bank
    each step, exact rollback; an nvme subgroup's swapped in and out with them, its slots'
    CRCs over them), speculated during backward — the reference's bits, the small params'
    fp32 moments beside them in the same tier."""
    m, v = MOMENTS[moments]
    fmt = StateFormat(m, v, model == "bf16 remainders")
    params = _params(FP32 if model == "fp32" else BF16, seed=3)
    ref = reference_run(params, 4, fmt, amsgrad=True)
    kw = (
        dict(PLACED[placement], nvme_path=str(tmp_path))
        if "nvme_fraction" in PLACED[placement]
        else PLACED[placement]
    )
    with _hybrid(params, fmt, amsgrad=True, **kw) as opt:
        view = debug_view(opt)
        host = view.host
        assert host is not None and any(view.host_quantized(sg) for sg in view.host_subgroups())
        if placement == "host":
            assert not all(view.host_quantized(sg) for sg in view.host_subgroups())  # a mixed tier
        if placement != "host":
            assert any(view.host_quantized(sg) and view.on_nvme(sg) for sg in view.host_subgroups())
        for k in range(4):
            for p in params:
                p.grad = None
            sum((p * g).sum() for p, g in zip(params, _grads(params, k))).backward()
            opt.step()
        assert host.stats["committed"] > 0  # speculated in backward and committed
        assert_state_equal(opt.state_dict()["state"], ref, params, fmt, amsgrad=True)


def _stream(params, step):
    g = torch.Generator().manual_seed(500 + step)
    return [
        (torch.randn(p.shape, generator=g) * (8.0 if step % 3 == 1 else 0.01)).to(p.dtype) for p in params
    ]


def test_speculative_plain_and_nvme_steps_are_bitwise_through_clipping_overflow_and_a_killed_worker(
    monkeypatch, tmp_path
):
    """q8 moments + remainders at offload 0 (device tier), 1 speculated and 1 plain (the worker on
    cores of its own), 1 stepped by the trainer (every core shared: tiers/inline_steps.py) and nvme 1:
    one grad stream through autograd, a clip that bites every third step (speculated steps
    redone), a GradScaler overflow (rolled back: the state equals the one before, bitwise) and a
    worker killed with SIGKILL mid-step on the worker's runs — params, codes, absmaxes and
    remainders stay torch.equal across the five."""
    monkeypatch.setenv(FAULT_ENV, "mid_step:4")
    placements = {
        "device": dict(offload_fraction=0.0),
        "speculative": dict(offload_fraction=1.0, speculative=True, worker_share=0.5),
        "plain": dict(offload_fraction=1.0, speculative=False, worker_share=0.5),
        "trainer": dict(offload_fraction=1.0, speculative=False),
        "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=str(tmp_path), speculative=True),
    }
    fmt = StateFormat(Q8, Q8, True)
    runs, opts, scalers = {}, {}, {}
    try:
        for name, kw in placements.items():
            runs[name] = _params(BF16, seed=8)
            opts[name] = _hybrid(runs[name], fmt, max_grad_norm=1.0, **kw)
            scalers[name] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
            opts[name].attach_grad_scaler(scalers[name])
        for step in range(9):
            for name, params in runs.items():
                opt, scaler = opts[name], scalers[name]
                opt.zero_grad()
                handle = None
                if step == 5:  # one inf in one grad: the whole step is skipped
                    handle = params[0].register_hook(
                        lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                    )
                before = (
                    {i: {k: t.clone() for k, t in st.items()} for i, st in opt.state_dict()["state"].items()}
                    if step == 5
                    else None
                )
                loss = sum((p.float() * g.float()).sum() for p, g in zip(params, _stream(params, step)))
                scaler.scale(loss).backward()
                if handle is not None:
                    handle.remove()
                scaler.step(opt)
                scaler.update()
                assert opt.step_was_skipped == (step == 5), (name, step)
                if before is not None:
                    after = opt.state_dict()["state"]
                    for i in before:
                        for key, t in before[i].items():
                            assert torch.equal(after[i][key], t), (name, i, key)
            sds = {name: o.state_dict()["state"] for name, o in opts.items()}
            for i in range(len(SHAPES)):
                assert set(sds["speculative"][i]) == set(sds["device"][i]), i
                for name in ("speculative", "plain", "trainer", "nvme"):
                    assert torch.equal(runs[name][i], runs["device"][i]), (step, name, i)
                    for key, t in sds["device"][i].items():
                        assert torch.equal(sds[name][i][key], t), (step, name, i, key)
        assert "exp_avg_q8" in sds["device"][0] and "exp_avg" in sds["device"][2]
        nvme = debug_view(opts["nvme"])
        assert all(nvme.on_nvme(sg) for sg in nvme.host_subgroups())
        for name in ("speculative", "plain", "nvme"):
            assert debug_view(opts[name]).host_stats["worker_restarts"] >= 1, name
        if debug_view(opts["trainer"]).host.cores.shared:  # more than one core
            assert debug_view(opts["trainer"]).host.inline.count > 0
        assert debug_view(opts["speculative"]).host_stats["redone"] > 0
    finally:
        for o in opts.values():
            o.close()


@pytest.mark.parametrize("region", ["m", "v_absmax"])
def test_nvme_slot_checksums_cover_codes_and_absmaxes(region, tmp_path):
    """A byte flipped in a quantized nvme subgroup's committed slot — in its codes or in its
    absmaxes — fails that slot's CRC32C: state_dict() refuses it, naming the checksum."""
    params = _params(FP32, seed=12)
    with _hybrid(
        params, StateFormat(Q8, Q8), offload_fraction=1.0, nvme_fraction=1.0, nvme_path=str(tmp_path)
    ) as opt:
        _run(opt, params, 2)
        view = debug_view(opt)
        host = view.host
        sg = next(k for k in view.host_subgroups() if view.host_quantized(k) and view.on_nvme(k))
        assert host.banks.region_offset(region) < host.io_bytes  # inside the block a swap moves
        opt.state_dict()  # reads back whole before the flip
        path, slot = view.nvme_file(sg), view.file_slot(sg)
        with open(path, "r+b") as f:
            f.seek(slot * host.io_bytes + host.banks.region_offset(region) + 1)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(OSError, match="checksum mismatch"):
            opt.state_dict()


# ---------------------------------------------------------------------------- moves, memory
def test_replan_moves_codes_and_absmaxes_between_tiers_bitwise(tmp_path):
    """replan() device -> host + nvme -> device between steps: the moved codes, absmaxes and
    remainders step on as the reference's (nothing dequantized on the way)."""
    fmt = StateFormat(Q8, Q8, True)
    params = _params(BF16, seed=13)
    ref = reference_run(params, 6, fmt)
    with _hybrid(params, fmt, nvme_path=str(tmp_path)) as opt:
        _run(opt, params, 2)
        opt.replan(1.0, 0.5)
        view = debug_view(opt)
        assert view.host is not None and any(view.on_nvme(sg) for sg in view.host_subgroups())
        _run(opt, params, 2, first=2)
        opt.replan(0.0)
        assert debug_view(opt).host is None
        _run(opt, params, 2, first=4)
        assert_state_equal(opt.state_dict()["state"], ref, params, fmt)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_checkpoint_moves_between_placements_bitwise(placement, tmp_path):
    """A device-tier q8 checkpoint loads into a host / nvme placement (and back into the
    device tier from there): the run goes on as the reference's."""
    fmt = StateFormat(Q8, Q8)
    params = _params(FP32, seed=14)
    ref = reference_run(params, 5, fmt)
    first = _run(_hybrid(params, fmt), params, 2)
    sd = first.state_dict()
    sd = {
        "state": {i: {k: t.clone() for k, t in st.items()} for i, st in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    first.close()
    kw = (
        dict(PLACED[placement], nvme_path=str(tmp_path))
        if "nvme_fraction" in PLACED[placement]
        else PLACED[placement]
    )
    with _hybrid(params, fmt, **kw) as second:
        second.load_state_dict(sd)
        _run(second, params, 2, first=2)
        sd = second.state_dict()
        sd = {
            "state": {i: {k: t.clone() for k, t in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"],
        }
    with _hybrid(params, fmt) as third:
        third.load_state_dict(sd)
        _run(third, params, 1, first=4)
        assert_state_equal(third.state_dict()["state"], ref, params, fmt)


def _linear_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False)).to(BF16)


@pytest.mark.parametrize(
    "fmt, bound",
    [(StateFormat(Q8, Q8, True), 0.40), (StateFormat(Q8, Q8), 0.55)],
    ids=["q8 + remainders", "q8 + fp32 master"],
)
def test_nvme_files_and_host_banks_hold_the_q8_bytes(fmt, bound, tmp_path):
    """Bytes measured by the OS for a bf16 model of large params: the nvme files
    (opt.allocated_bytes["nvme"]: their sizes) within issue 38's bounds of the fp32 format's,
    and each host bank what StateFormat.bank_bytes counts (codes, absmaxes, master or
    remainder, the bf16 copy) — what the budgets and the cost model use."""
    files = {}
    for name, f in (("q8", fmt), ("fp32", StateFormat())):
        model = _linear_model(0)
        with _hybrid(
            list(model.parameters()),
            f,
            subgroup_numel=1 << 16,
            offload_fraction=1.0,
            nvme_fraction=1.0,
            nvme_path=str(tmp_path),
        ) as opt:
            files[name] = opt.allocated_bytes["nvme"]
    assert files["q8"] <= bound * files["fp32"], files
    model = _linear_model(0)
    # one spare bank per subgroup, as speculation sizes the pool
    with _hybrid(
        list(model.parameters()), fmt, subgroup_numel=1 << 16, offload_fraction=1.0, speculative=True
    ) as opt:
        view = debug_view(opt)
        host = view.host
        assert all(view.host_quantized(sg) for sg in view.host_subgroups())
        per_element = host.bank_bytes / (len(host.numels) * host.capacity)
        page_slack = 2 * 4096 / host.capacity  # a bank's state block and the bank end on a page
        # the bf16 copy (with remainders the high half) is in copy slots, one per spare bank: a
        # committed bank holds the state alone, a spare bank and its slot what bank_bytes counts
        want = fmt.state_bytes(BF16)
        assert want <= per_element <= want + page_slack, per_element
        spare = host.spare_bytes / (len(host.numels) * host.capacity)  # one spare per subgroup
        assert fmt.bank_bytes(BF16) <= spare <= fmt.bank_bytes(BF16) + page_slack, spare
        print(
            f"{fmt}: host arena {opt.allocated_bytes['host'] / sum(p.numel() for p in model.parameters()):.2f} "
            f"B/param, bank {per_element:.3f} B/element; nvme {files['q8']} B against fp32's {files['fp32']}"
        )


def _arena_bytes_per_param(model, fmt, **kw):
    """The host arena's bytes per param as the OS reports them: os.fstat on its memfd (and
    opt.allocated_bytes["host"], which reads the same)."""
    import os

    with _hybrid(list(model.parameters()), fmt, offload_fraction=1.0, **kw) as opt:
        arena = os.fstat(debug_view(opt).host.arena.fd).st_size
        assert opt.allocated_bytes["host"] == arena
    return arena / sum(p.numel() for p in model.parameters())


def _wide_model(bias: bool):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512, bias=bias) for _ in range(8)]).to(BF16)


@pytest.mark.parametrize(
    "fmt", [StateFormat(Q8, Q8, True), StateFormat(Q8, Q8)], ids=["q8 + rem", "q8 + master"]
)
def test_small_params_do_not_widen_the_q8_banks(fmt):
    """A bf16 model whose weights are quantized and whose biases (512 elements: small) keep fp32
    moments: the biases' subgroup is cut at a quarter of the size, its fp32 moments fit the
    banks' 1-byte code regions, and the host arena (os.fstat) costs at most 5 % more per param
    than the same model without biases (before: every bank's moment regions were 4 bytes wide,
    2.0x for q8 + remainders, 1.8x with an fp32 master)."""
    kw = dict(subgroup_numel=1 << 16)
    with_bias = _arena_bytes_per_param(_wide_model(True), fmt, **kw)
    without = _arena_bytes_per_param(_wide_model(False), fmt, **kw)
    assert with_bias <= 1.05 * without, (with_bias, without)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_a_small_subgroup_larger_than_a_quarter_bank_widens_its_regions(placement, tmp_path):
    """A host tier whose small params' subgroup (2,000 elements of fp32 moments: 8,000 bytes a
    moment) outgrows the codes of its largest quantized one (4,096: 4,096 bytes): each q8 moment
    region holds the larger, and both step the reference's bits (a region too small would let the
    small subgroup's exp_avg run into its exp_avg_sq)."""
    fmt = StateFormat(Q8, Q8)
    params = _params(FP32, seed=18, shapes=((4096,), (1000,), (1000,)))
    ref = reference_run(params, 3, fmt)
    kw = dict(PLACED[placement], subgroup_numel=8192)
    if placement == "nvme":
        kw["nvme_path"] = str(tmp_path)
    with _hybrid(params, fmt, **kw) as opt:
        view = debug_view(opt)
        assert sorted(sg.numel for sg in view.subgroups) == [2000, 4096]
        _run(opt, params, 3)
        assert_state_equal(opt.state_dict()["state"], ref, params, fmt)


@pytest.mark.parametrize(
    "fmt, bound",
    [
        (StateFormat(Q8, Q8, True), 0.40),
        (StateFormat(Q8, Q8), 0.55),
    ],
    ids=["q8 + remainders", "q8 + fp32 master"],
)
def test_the_host_arena_holds_issue_38s_share_of_the_fp32_formats(fmt, bound):
    """Issue 38 item 4: the host arena of a bf16 model of large params (8 x Linear(512), 2.1M
    params, subgroups of 64Ki: banks, spare banks, staging), as os.fstat reports it, within
    `bound` x the fp32 format's for the same model."""
    kw = dict(subgroup_numel=1 << 16)
    q8 = _arena_bytes_per_param(_wide_model(False), fmt, **kw)
    fp32 = _arena_bytes_per_param(_wide_model(False), StateFormat(), **kw)
    print(f"{fmt}: host arena {q8:.3f} B/param, fp32 format's {fp32:.3f}: {q8 / fp32:.3f}x (bound {bound})")
    assert q8 <= bound * fp32, (q8, fp32, q8 / fp32)


# ---------------------------------------------------------------------------- planner, demo
def test_plan_counts_the_q8_bytes(capsys):
    """`hybrid-opt plan --exp-avg-dtype q8 --exp-avg-sq-dtype q8 --store-param-remainders`:
    about 4.03 B of state per param on the device (issue 38's Llama-2-7B figure, 28 GB), and a
    7B model that needs the host tier with fp32 state fits on an 80 GB GPU."""
    import json

    from hybrid_opt.placement import plan_report

    got = {}
    for name, flags in (
        ("fp32", []),
        ("q8", ["--exp-avg-dtype", "q8", "--exp-avg-sq-dtype", "q8", "--store-param-remainders"]),
    ):
        assert plan_report.main(["--params", "7B", "--json", *flags]) == 0
        got[name] = json.loads(capsys.readouterr().out)
    assert got["fp32"]["plan"]["offload_fraction"] > 0
    assert got["q8"]["plan"]["offload_fraction"] == 0.0
    state = got["q8"]["memory_bytes"]["device"] - 7e9 * 2 * 2  # bf16 params and grads
    assert abs(state - 7e9 * (2 + 2 * (1 + 4 / 256))) < 1e6, state


def test_params_written_between_steps_restart_the_master_beside_q8_moments():
    """Params written outside step() (a q8 host tier's masters restart from them, its codes and
    absmaxes kept as they are): the host run stays the device run's, bit for bit."""
    runs = {"device": _params(FP32, seed=15), "host": _params(FP32, seed=15)}
    opts = {
        name: _hybrid(params, StateFormat(Q8, Q8), offload_fraction=0.0 if name == "device" else 1.0)
        for name, params in runs.items()
    }
    try:
        for k in range(4):
            for name, params in runs.items():
                if k == 2:
                    with torch.no_grad():
                        params[0].mul_(0.5)
                        params[1][:300] += 1.0
                _set_grads(params, k)
                opts[name].step()
        sds = {name: o.state_dict()["state"] for name, o in opts.items()}
        for i in range(len(SHAPES)):
            assert torch.equal(runs["host"][i], runs["device"][i]), i
            for key, t in sds["device"][i].items():
                assert torch.equal(sds["host"][i][key], t), (i, key)
    finally:
        for o in opts.values():
            o.close()


@pytest.mark.parametrize("offload", [0.0, 1.0])
def test_an_amsgrad_checkpoint_lays_out_a_q8_running_max(offload):
    """load_state_dict of an amsgrad checkpoint into a q8 optimizer built without amsgrad: the
    tiers are laid out again with a q8 running max (codes and absmaxes), loaded bitwise."""
    fmt = StateFormat(Q8, Q8)
    src_params, params = _params(FP32, seed=16), _params(FP32, seed=16)
    src = _run(_hybrid(src_params, fmt, amsgrad=True), src_params, 2)
    sd = src.state_dict()
    with torch.no_grad():
        for p, q in zip(params, src_params):
            p.copy_(q)
    with _hybrid(params, fmt, offload_fraction=offload) as opt:
        opt.load_state_dict(sd)
        _run(src, src_params, 1, first=2)
        _run(opt, params, 1, first=2)
        mine, theirs = opt.state_dict()["state"], src.state_dict()["state"]
        assert "max_exp_avg_sq_q8" in mine[0] and "max_exp_avg_sq_absmax" in mine[0]
        for i in theirs:
            for key, t in theirs[i].items():
                assert torch.equal(mine[i][key], t), (i, key)
    src.close()


def test_add_param_group_lays_out_q8_and_small_params_apart():
    """A group added after construction is laid out as the first: its large params quantized,
    its small ones with fp32 moments, and both step the reference's bits."""
    fmt = StateFormat(Q8, Q8)
    params = _params(FP32, seed=17)
    ref = reference_run(params, 3, fmt)
    with _hybrid(params[:2], fmt) as opt:
        opt.add_param_group({"params": params[2:]})
        assert {sg.quantized for sg in debug_view(opt).subgroups if sg.group == 1} == {True, False}
        _run(opt, params, 3)
        assert_state_equal(opt.state_dict()["state"], ref, params, fmt)


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_state_dict_codes_are_views_of_the_state(placement, tmp_path):
    """state_dict() copies no codes: a weight spread over two subgroups (cut on pages: a page of
    codes) gets its `*_q8` tensors mapped from the memory that holds them — the device tier's
    memfd, a host bank, an nvme slot — not anonymous memory. (Its absmaxes, 1/256 of that, may
    be a copy where the pieces do not lie on pages.)"""
    from helpers import backing

    torch.manual_seed(0)
    # weights of 67584 elements (33 x 2048) and biases apart: subgroups of 32768, each a whole
    # number of pages of codes (a cut at 15 x 2048 would end a piece inside a page)
    model = nn.Sequential(nn.Linear(264, 256), nn.Linear(256, 264), nn.Linear(264, 256), nn.Linear(256, 264))
    kw = {
        "device": dict(offload_fraction=0.0),
        "host": dict(offload_fraction=1.0),
        "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=str(tmp_path)),
    }[placement]
    with HybridAdamW(
        model.parameters(), exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8, subgroup_numel=1 << 15, **kw
    ) as opt:
        for k in range(2):
            model(torch.randn(8, 264)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()["state"]
        spans = {
            i: sum(sl.param_index == i for sg in debug_view(opt).subgroups for sl in sg.slices) for i in sd
        }
        assert spans[0] == 3 and {sg.numel % 4096 for sg in debug_view(opt).subgroups if sg.quantized} == {0}
        for i in (0, 2):
            for key in ("exp_avg_q8", "exp_avg_sq_q8"):
                t = sd[i][key]
                assert backing(t) != "", (i, key)
                assert t.untyped_storage().nbytes() == t.numel(), (i, key)


def test_a_resident_q8_remainder_step_reads_the_committed_high_half_from_the_model():
    """A q8 + remainders host tier keeps no high half in its committed banks (copy slots: only the
    spare banks hold one): each resident step reads it from the model's param into its out bank's
    slot — on CUDA by an asynchronous copy, which the step's tasks wait behind (a stager stands in
    for the side stream here). Two steps that way give the bits of the same tier with synchronous
    copies: params, decoded masters, codes and absmaxes."""
    from test_host_tier_compressed import _Stager

    from hybrid_opt.tiers.host import AdamInputs, HostTier
    from hybrid_opt.worker import protocol as proto

    n = 3 * 4096
    gen = torch.Generator().manual_seed(31)
    master = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    params, tiers, stagers = {}, {}, {}
    for name in ("sync", "async"):
        params[name] = torch.zeros(n, dtype=BF16)
        tiers[name] = HostTier(
            [n],
            exp_avg_dtype=Q8,
            exp_avg_sq_dtype=Q8,
            remainders=True,
            params=[params[name]],
            copy_dtype=BF16,
            quantized=[True],
            slot_numel=4096,
            staging_slots=4,
            timeout_s=20.0,
        )
    try:
        for name, tier in tiers.items():
            tier.load_state(0, master)
            assert tier.pool.copy_of is not None and tier.pool.committed[0] not in tier.pool.copy_of
            tier.io.set_remote_gather(False)
        stagers["async"] = _Stager()
        tiers["async"].io.use_stager(stagers["async"])
        sent, send = [], tiers["async"].client.send

        def logged(task, gather=()):
            sent.append(task.op)
            return send(task, gather)

        tiers["async"].client.send = logged
        for step, grad in enumerate(grads, 1):
            inp = AdamInputs(step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
            for name, tier in tiers.items():
                assert tier.stepping.speculate(0, grad, inp)
                if name == "async":
                    stager = stagers[name]
                    assert len(stager.events) == 4  # the high half, then three pieces of grads
                    for ev in stager.events[1:]:
                        ev.complete()
                    tier.io.poll()
                    assert proto.OP_STEP not in sent and proto.OP_PING not in sent  # behind the high half
                    stager.events[0].complete()
                    stager.events.clear()
                    tier.io.poll()
                    assert sent.count(proto.OP_STEP) == 3 and sent.index(proto.OP_PING) < sent.index(
                        proto.OP_STEP
                    )
                    sent.clear()

                def on_commit(sg, views, p=params[name]):
                    p.copy_(views["param_copy"])

                assert tier.stepping.finish({0: (grad, inp)}, on_commit=on_commit) == {0: "committed"}
        assert torch.equal(params["sync"], params["async"])
        assert not torch.equal(params["sync"].float(), master.to(BF16).float())  # stepped
        a, b = (t.state(0) for t in tiers.values())
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    finally:
        for tier in tiers.values():
            tier.close()
