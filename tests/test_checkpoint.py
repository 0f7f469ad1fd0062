"""Checkpoints: where state_dict() puts each tier's state, what load_state_dict() accepts, and
torch.distributed.checkpoint (DCP) on a hybrid optimizer.

- Every param gets views of the memory holding its state, each with a storage of its own: the
  device tier's buffers (references, as torch returns its own state tensors), the host tier's
  committed bank, an nvme subgroup's committed slot (verified once per call). Only a param
  over subgroups cut off a page boundary (the tiny ones here) or over two tiers gets a copy;
  what the views cost and keep across steps: test_state_dict_views.py.
- load_state_dict() takes any float dtype and any strides (and any device: the CUDA half of
  that is in test_gpu_checkpoint.py).
- `self.state` holds torch's per-param step counts, so DCP's get/set_optimizer_state_dict see
  a trained optimizer as trained (no lr-0 "initialisation" step over real state), and on a
  fresh one its dummy step leaves what torch.optim.AdamW's leaves, with no host work.

Exact state is compared with torch.equal; numerics against torch.optim with the shared
tolerances.
"""

import collections
import copy
import io
from contextlib import ExitStack

import pytest
import torch
from helpers import backing
from test_optimizer import (
    BF16,
    FP32,
    assert_state_close,
    lockstep,
    loss_fn,
    make_batches,
    make_net,
    save_load,
    train,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from hybrid_opt import HybridAdam, HybridAdamW
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.testing import debug_view

SUBGROUP = 64  # Net (724 elements): 12 subgroups; fc1.weight spans 8, fc1.bias shares one
HYPER = dict(lr=1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvme"))


PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "mixed": dict(offload_fraction=0.5),
    "host": dict(offload_fraction=1.0),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=0.5),
}


def hybrid(params, placement, nvme_dir, cls=HybridAdamW, **kw):
    kw = {**HYPER, "subgroup_numel": SUBGROUP, **PLACEMENTS[placement], **kw}
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = nvme_dir
    return cls(params, **kw)


def parts_of(opt, idx):
    return [(sg, sl) for sg in debug_view(opt).subgroups for sl in sg.slices if sl.param_index == idx]


def within(t, buf) -> bool:
    """t's elements lie inside buf's memory."""
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def arena_range(opt):
    arena = debug_view(opt).host.arena
    base = arena.tensor(0, 1, torch.uint8).data_ptr()
    return base, base + arena.nbytes


# ============================================================================= 1. where state lands
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
def test_device_tier_state_is_views_of_its_buffers(dtype, nvme_dir):
    """offload 0: a param in one subgroup gets views of the tier's buffers (exp_avg,
    exp_avg_sq, and the fp32 master of a bf16 param), each with a storage of its own, equal to
    torch's state and following the live state like torch's references; a param spanning
    subgroups cut off a page boundary (these tiny ones) gets a copy of its own (page-aligned
    cuts map side by side: test_state_dict_views.py)."""
    model = make_net(dtype)
    ref_model = make_net(FP32)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    with hybrid(model.parameters(), "device", nvme_dir) as opt:
        lockstep(model, opt, ref_model, ref, make_batches(5), share_grads=dtype != FP32)
        sd = opt.state_dict()
        assert_state_close(sd, ref.state_dict())
        views, copies = [], []
        shapes = [p.shape for p in model.parameters()]
        for idx, st in sd["state"].items():
            parts = parts_of(opt, idx)
            assert {opt.plan.tiers[sg.index] for sg, _ in parts} == {DEVICE}
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"} | (
                {"master_param"} if dtype != FP32 else set()
            )
            bufs = list(debug_view(opt).device.master.values())  # an fp32 subgroup's master is its params
            bufs += [t for s in debug_view(opt).device.state.values() for t in s.values()]
            for k, t in st.items():
                if k == "step":
                    continue
                assert t.shape == shapes[idx]
                if len(parts) == 1:
                    sg, sl = parts[0]
                    buf = (
                        debug_view(opt).device.master
                        if k == "master_param"
                        else {i: s[k] for i, s in debug_view(opt).device.state.items()}
                    )[sg.index]
                    # the buffer's memory (on a CPU-only host mapped again: its own storage)
                    assert backing(t) == backing(buf) and t.untyped_storage().nbytes() == t.nbytes, (idx, k)
                    views.append((idx, k))
                else:
                    assert not any(within(t, b) for b in bufs), (idx, k)
                    copies.append((idx, k))
        assert views and copies  # both cases are exercised
        before = {(i, k): sd["state"][i][k].clone() for i, k in views + copies}
        train(model, opt, make_batches(1, seed=7))
        now = opt.state_dict()["state"]
        for i, k in views:  # references: they show the live state
            assert torch.equal(sd["state"][i][k], now[i][k]), (i, k)
        for i, k in copies:  # copies: the state when state_dict() was called
            assert torch.equal(sd["state"][i][k], before[(i, k)]), (i, k)
            if k != "master_param" or dtype != FP32:
                assert not torch.equal(now[i][k], before[(i, k)]), (i, k)


@pytest.mark.parametrize("placement", ["mixed", "host", "nvme"])
def test_offloaded_state_is_views_of_the_committed_state(placement, nvme_dir):
    """A param with any element off the device: CPU tensors with storages of their own over the
    memory that holds its committed state — the shared arena's bank, the nvme file's committed
    slot (copy-on-write) — not copies, equal to torch's, keeping their values after close().
    A param over several subgroups cut off a page boundary (these tiny ones), or over the
    device and host tiers, is the one copy."""
    model = make_net()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, amsgrad=True, **HYPER)
    opt = hybrid(model.parameters(), placement, nvme_dir, amsgrad=True)
    try:
        lockstep(model, opt, ref_model, ref, make_batches(5))
        sd = opt.state_dict()
        assert_state_close(sd, ref.state_dict())
        views = 0
        for idx, st in sd["state"].items():
            parts = parts_of(opt, idx)
            if {opt.plan.tiers[sg.index] for sg, _ in parts} == {DEVICE}:
                continue
            for k, t in st.items():
                assert t.device.type == "cpu", (idx, k)
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (idx, k)
                if k != "step" and len(parts) == 1:
                    where = backing(t)
                    assert "hybrid_opt-host" in where or where.startswith(nvme_dir), (idx, k, where)
                    views += 1
        assert views > 0
        kept = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    finally:
        opt.close()
    for i, st in kept.items():
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)


def test_nvme_slots_are_verified_once_and_mapped(nvme_dir, monkeypatch):
    """Every nvme subgroup's committed slot is checksum-verified once per state_dict() (not once
    per param), and its params' state is that slot's pages, mapped: no copy is read."""
    from hybrid_opt.tiers.host_views import HostViews

    model = make_net()
    with hybrid(model.parameters(), "nvme", nvme_dir, nvme_fraction=1.0) as opt:
        train(model, opt, make_batches(3))
        view = debug_view(opt)
        view.settle_writes()  # the writes behind the last step land: the slots hold the state
        want = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
        verified = collections.Counter()
        real = HostViews._verify

        def counting(self, sg, slot):
            verified[(sg, slot)] += 1
            return real(self, sg, slot)

        monkeypatch.setattr(HostViews, "_verify", counting)
        got = opt.state_dict()
        on_host = view.host_subgroups()
        assert all(view.on_nvme(sg) for sg in on_host)
        # HostViews counts by the host tier's own numbers
        assert sorted(sg for sg, _ in verified) == sorted(on_host)
        assert set(verified.values()) == {1}, verified
        assert got["state"].keys() == want.keys()
        for i, st in got["state"].items():
            for k, v in st.items():
                assert torch.equal(v, want[i][k]), (i, k)
                if k != "step" and len(parts_of(opt, i)) == 1:
                    assert backing(v).startswith(nvme_dir), (i, k)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("placement", ["device", "mixed", "nvme"])
def test_state_dict_round_trip_at_every_placement(placement, dtype, nvme_dir):
    """Saved through a file, loaded into a fresh optimizer: the same state bitwise, and the
    same next steps."""
    model = make_net(dtype)
    batches = make_batches(8)
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(model.parameters(), placement, nvme_dir))
        train(model, opt, batches[:4])
        sd = save_load(opt.state_dict())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, batches[4:])
        model2 = make_net(dtype, seed=5)
        model2.load_state_dict(weights)
        opt2 = stack.enter_context(hybrid(model2.parameters(), placement, nvme_dir))
        opt2.load_state_dict(sd)
        _assert_state_equal(opt2.state_dict(), sd)
        train(model2, opt2, batches[4:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        _assert_state_equal(opt2.state_dict(), opt.state_dict())


@pytest.mark.parametrize("remainders", [False, True], ids=["masters", "remainders"])
@pytest.mark.parametrize("placement", ["device", "mixed", "nvme"])
def test_a_bf16_model_loaded_after_its_optimizer_keeps_the_saved_masters(placement, remainders, nvme_dir):
    """opt.load_state_dict before model.load_state_dict: at the optimizer's load the params are
    not yet the saved masters' rounding, so the masters start from the params; the model's load
    then writes that rounding, and the saved masters stand again (ParamGuard.hold_masters).
    Either order continues bitwise as the original, as it does in torch."""
    batches = make_batches(8)
    kw = dict(store_param_remainders=remainders)
    results = {}
    for order in ("model_first", "optimizer_first"):
        model = make_net(BF16)
        with ExitStack() as stack:
            opt = stack.enter_context(hybrid(model.parameters(), placement, nvme_dir, **kw))
            train(model, opt, batches[:4])
            sd = save_load(opt.state_dict())
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            train(model, opt, batches[4:])
            model2 = make_net(BF16, seed=5)
            opt2 = stack.enter_context(hybrid(model2.parameters(), placement, nvme_dir, **kw))
            loads = [lambda: model2.load_state_dict(weights), lambda: opt2.load_state_dict(sd)]
            for load in loads if order == "model_first" else loads[::-1]:
                load()
            train(model2, opt2, batches[4:])
            results[order] = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
            _assert_state_equal(opt2.state_dict(), opt.state_dict())
    assert results == {"model_first": True, "optimizer_first": True}


def _assert_state_equal(got, want):
    assert got["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert got["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


# ============================================================================= 2. what loads
def _strided_fp64(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, fp64, not contiguous (where the shape allows it)."""
    t = t.double()
    if t.dim() >= 2:
        return t.t().contiguous().t()
    if t.dim() == 1:
        return torch.stack([t, torch.zeros_like(t)], -1)[:, 0]
    return t


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("placement", ["device", "mixed", "nvme"])
def test_state_dict_of_another_dtype_and_strides_loads(placement, dtype, nvme_dir):
    """fp64, non-contiguous moments (and master_param) load as the fp32 state they round to
    exactly, and training continues bitwise like the original."""
    model = make_net(dtype)
    batches = make_batches(8)
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(model.parameters(), placement, nvme_dir, amsgrad=True))
        train(model, opt, batches[:4])
        sd = save_load(opt.state_dict())
        odd = copy.deepcopy(sd)
        strided = 0
        for st in odd["state"].values():
            for k in list(st):
                if k != "step":
                    st[k] = _strided_fp64(st[k])
                    strided += not st[k].is_contiguous()
        assert strided > 0
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, batches[4:])
        model2 = make_net(dtype, seed=5)
        model2.load_state_dict(weights)
        opt2 = stack.enter_context(hybrid(model2.parameters(), placement, nvme_dir, amsgrad=True))
        opt2.load_state_dict(odd)
        _assert_state_equal(opt2.state_dict(), sd)
        train(model2, opt2, batches[4:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)


# ============================================================================= 3. torch's self.state and DCP
@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_loaded_hyperparameters_are_the_loaders_own_as_in_torch(nvme_dir):
    """load_state_dict copies the checkpoint's param-group values, as torch's deep copy does: a
    Tensor lr (or betas) a scheduler then fills in place on the source optimizer, or on a second
    optimizer loaded from the same dict, is not shared."""

    def make(cls, model):
        kw = dict(lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.999)))
        return (
            cls(model.parameters(), **kw)
            if cls is torch.optim.AdamW
            else hybrid(model.parameters(), "mixed", nvme_dir, **kw)
        )

    lrs = {}
    for cls in (torch.optim.AdamW, HybridAdamW):
        src, dst, other = (make(cls, make_net()) for _ in range(3))
        sd = src.state_dict()
        dst.load_state_dict(sd)
        other.load_state_dict(sd)
        torch.optim.lr_scheduler.StepLR(src, step_size=1, gamma=0.1).step()  # fills src's lr tensor
        src.param_groups[0]["betas"][0].fill_(0.5)
        g, o = dst.param_groups[0], other.param_groups[0]
        assert g["lr"] is not o["lr"] and g["betas"][0] is not o["betas"][0]
        lrs[cls.__name__] = (float(src.param_groups[0]["lr"]), float(g["lr"]), float(g["betas"][0]))
        for opt in (src, dst, other):
            getattr(opt, "close", lambda: None)()
    assert lrs["HybridAdamW"] == lrs["AdamW"], lrs
    assert lrs["AdamW"][1:] == (pytest.approx(0.01), pytest.approx(0.9)), lrs


def test_self_state_holds_step_counts(nvme_dir):
    """`self.state[p]` is {"step": 0-dim float32 tensor} for each param that has stepped (as in
    torch), absent for one that never got a grad; it follows steps, load_state_dict and a
    param group added later."""
    model = make_net()
    frozen = model.tiny[0]
    params = list(model.parameters())
    with hybrid(params, "mixed", nvme_dir) as opt:
        for batch in make_batches(3):
            opt.zero_grad()
            loss_fn(model, batch).backward()
            frozen.grad = None
            opt.step()
        assert frozen not in opt.state
        assert set(opt.state) == set(params) - {frozen}
        for p, st in opt.state.items():
            assert set(st) == {"step"} and st["step"].dtype == torch.float32 and st["step"].dim() == 0
            assert float(st["step"]) == 3
        step_tensor = opt.state[params[0]]["step"]
        train(model, opt, make_batches(1))
        assert float(step_tensor) == 4  # updated in place, as torch's step tensor is
        assert float(opt.state[frozen]["step"]) == 1

        # a checkpoint in which two params have no state: their entries go
        ref = torch.optim.AdamW(copy.deepcopy(model).parameters(), foreach=False, **HYPER)
        ref_params = list(ref.param_groups[0]["params"])
        for p in ref_params:
            p.grad = None if p is ref_params[1] or p is ref_params[3] else torch.ones_like(p)
        ref.step()
        opt.load_state_dict(save_load(ref.state_dict()))
        assert set(opt.state) == set(params) - {params[1], params[3]}
        assert all(float(st["step"]) == 1 for st in opt.state.values())

        extra = nn.Parameter(torch.randn(10))
        opt.add_param_group(dict(params=[extra]))
        loss = loss_fn(model, make_batches(1)[0]) + extra.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert float(opt.state[extra]["step"]) == 1
        assert float(opt.state[params[0]]["step"]) == 2 and float(opt.state[params[1]]["step"]) == 1
        sd = opt.state_dict()
        for i, p in enumerate(params + [extra]):
            assert float(opt.state[p]["step"]) == float(sd["state"][i]["step"])


def _fqns(model):
    return [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_dcp_get_optimizer_state_dict_leaves_a_trained_optimizer_unchanged(placement, nvme_dir):
    """get_optimizer_state_dict after zero_grad() reads `optimizer.state` to decide whether to
    run its lr-0 initialisation step: with the step counts there it does not, so every state
    tensor and param stays bitwise, and its dict is state_dict()'s content under FQNs."""
    model = make_net()
    with hybrid(model.parameters(), placement, nvme_dir, amsgrad=True) as opt:
        train(model, opt, make_batches(4))
        opt.zero_grad()
        before = save_load(opt.state_dict())
        params = [p.detach().clone() for p in model.parameters()]
        osd = get_optimizer_state_dict(model, opt)
        _assert_state_equal(opt.state_dict(), before)
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        names = _fqns(model)
        assert set(osd["state"]) == {names[i] for i in before["state"]}
        for i, st in before["state"].items():
            assert osd["state"][names[i]].keys() == st.keys()
            for k, v in st.items():
                assert torch.equal(osd["state"][names[i]][k], v), (i, k)
        (group,), (saved,) = osd["param_groups"], before["param_groups"]
        assert group["params"] == [names[i] for i in saved["params"]]
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in saved.items() if k != "params"
        }


@pytest.mark.parametrize(
    "cls,reference,kw",
    [
        (HybridAdamW, torch.optim.AdamW, dict(amsgrad=True)),
        (HybridAdam, torch.optim.Adam, dict(weight_decay=0.1)),  # L2 decay: the dummy step moves the moments
    ],
    ids=["AdamW", "Adam_l2"],
)
@pytest.mark.parametrize("placement", ["device", "host"])
def test_dcp_on_a_fresh_optimizer_matches_torch(placement, cls, reference, kw, nvme_dir):
    """On a fresh optimizer DCP's dummy step (zero grads, lr 0) leaves what torch's leaves:
    step 1, zero moments (AdamW), params unchanged, no grads; AdamW's takes no host step."""
    model = make_net()
    ref_model = copy.deepcopy(model)
    kw = {**HYPER, **kw}
    ref = reference(ref_model.parameters(), foreach=False, **kw)
    want = get_optimizer_state_dict(ref_model, ref)
    with hybrid(model.parameters(), placement, nvme_dir, cls=cls, **kw) as opt:
        got = get_optimizer_state_dict(model, opt)
        assert got["state"].keys() == want["state"].keys() and got["state"]
        for name, st in want["state"].items():
            assert got["state"][name].keys() == st.keys()
            assert float(got["state"][name]["step"]) == 1.0
        assert_state_close(
            dict(state={i: got["state"][n] for i, n in enumerate(_fqns(model))}),
            dict(state={i: want["state"][n] for i, n in enumerate(_fqns(model))}),
        )
        if cls is HybridAdamW:
            assert all(not t.any() for st in got["state"].values() for k, t in st.items() if k != "step")
            if debug_view(opt).host is not None:
                assert debug_view(opt).host_stats["stepped"] == debug_view(opt).host_stats["committed"] == 0
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
        assert all(p.grad is None for p in model.parameters())
        assert opt.param_groups[0]["lr"] == HYPER["lr"]  # DCP restores it


@pytest.mark.parametrize("dst", ["device", "mixed", "nvme"])
def test_dcp_set_optimizer_state_dict_round_trip_trains_like_the_original(dst, nvme_dir):
    """get_optimizer_state_dict from a trained optimizer (host tier), through a file, then
    set_optimizer_state_dict into a fresh one (its dummy step first): same state bitwise, and
    the same next steps bitwise."""
    model = make_net()
    batches = make_batches(8)
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(model.parameters(), "host", nvme_dir))
        train(model, opt, batches[:4])
        opt.zero_grad()
        osd = save_load(get_optimizer_state_dict(model, opt))
        sd = save_load(opt.state_dict())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, batches[4:])
        model2 = make_net(seed=5)
        model2.load_state_dict(weights)
        opt2 = stack.enter_context(hybrid(model2.parameters(), dst, nvme_dir, lr=1e-3))
        set_optimizer_state_dict(model2, opt2, osd)
        assert opt2.param_groups[0]["lr"] == HYPER["lr"]
        _assert_state_equal(opt2.state_dict(), sd)
        train(model2, opt2, batches[4:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        _assert_state_equal(opt2.state_dict(), opt.state_dict())


COMPRESSED = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, store_param_remainders=True)


@pytest.mark.parametrize("dst", ["device", "mixed", "nvme"])
def test_dcp_round_trip_of_compressed_state_trains_like_the_original(dst, nvme_dir):
    """A bf16 model with bf16 moments and remainders (#16): get_optimizer_state_dict from a
    trained optimizer (host tier), through a file, set_optimizer_state_dict into a fresh one
    at another placement (its dummy step first): bf16 moments and decoded fp32 masters
    bitwise, and the next steps bitwise."""
    model = make_net(BF16)
    batches = make_batches(6)
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(model.parameters(), "host", nvme_dir, **COMPRESSED))
        train(model, opt, batches[:3])
        opt.zero_grad()
        osd = save_load(get_optimizer_state_dict(model, opt))
        sd = save_load(opt.state_dict())
        assert any(st["exp_avg"].dtype == BF16 for st in osd["state"].values())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, batches[3:])
        model2 = make_net(BF16, seed=5)
        model2.load_state_dict(weights)
        opt2 = stack.enter_context(hybrid(model2.parameters(), dst, nvme_dir, lr=1e-3, **COMPRESSED))
        set_optimizer_state_dict(model2, opt2, osd)
        _assert_state_equal(opt2.state_dict(), sd)
        train(model2, opt2, batches[3:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        _assert_state_equal(opt2.state_dict(), opt.state_dict())


def test_remainders_are_handed_out_as_they_are_stored(monkeypatch):
    """state_dict() of a subgroup keeping remainders decodes nothing: each bf16 param carries
    `master_remainder`, the int16 the tier stores (2 bytes an element, a storage of its own),
    in place of an fp32 master_param no tier holds; its checkpoint is that much smaller."""
    from hybrid_opt.tiers.device import DeviceTier

    decoded = []
    real = DeviceTier.master_of

    def counted(self, index):
        decoded.append(index)
        return real(self, index)

    monkeypatch.setattr(DeviceTier, "master_of", counted)
    sizes = {}
    for rem in (False, True):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(1000).to(BF16)) for _ in range(50)]
        with HybridAdamW(
            params,
            offload_fraction=0.0,
            subgroup_numel=1 << 16,
            exp_avg_dtype=BF16,
            exp_avg_sq_dtype=BF16,
            store_param_remainders=rem,
        ) as opt:
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
            decoded.clear()
            sd = opt.state_dict()
            assert decoded == []
            for st in sd["state"].values():
                m = st.pop("master_remainder" if rem else "master_param")
                assert m.dtype == (torch.int16 if rem else FP32) and set(st) == {
                    "step",
                    "exp_avg",
                    "exp_avg_sq",
                }
                assert m.untyped_storage().nbytes() == m.numel() * m.element_size()
            sd = opt.state_dict()
            buf = io.BytesIO()
            torch.save(sd, buf)
            sizes[rem] = buf.tell()
    assert sizes[True] <= 0.8 * sizes[False], sizes  # 6 bytes an element against 8
