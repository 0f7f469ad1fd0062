"""Checkpoints of a CUDA model (skipped without a CUDA device; benchmarks/gpu_check.sh runs them):

- state_dict() puts host/nvme state on the CPU and leaves device-only params' state on the
  GPU (views of the tier's buffers, each with a storage of its own — a slice of the buffer's
  — or a copy for a param spanning subgroups), so GPU memory grows by those copies and by
  nothing else, even for a moment (what it allocates is counted on the CPU in
  test_state_dict_allocations.py);
- a bf16 checkpoint loaded with map_location="cpu" resumes a CUDA model bitwise (the CPU
  master_param is compared with the CUDA param on the param's device).
"""

import io

import pytest
import torch
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.testing import debug_view

pytestmark = pytest.mark.gpu

SUBGROUP = 1 << 16
HYPER = dict(lr=1e-2, weight_decay=0.1, subgroup_numel=SUBGROUP)


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvme"))


PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "host": dict(offload_fraction=1.0),
    "mixed_nvme": dict(offload_fraction=0.5, nvme_fraction=0.25),
}


def placement_kwargs(name, nvme_dir):
    kw = dict(PLACEMENTS[name])
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = nvme_dir
    return kw


def make_params(dtype, seed=0):
    """A small param, one spanning subgroups, six of about a subgroup each, a small one. The
    layout evens subgroups out (525,288 elements: nine of 58,366), so the SUBGROUP-sized params
    straddle two; the first small one lies inside subgroup 0, on the device when it is there."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1000, 2 * SUBGROUP] + [SUBGROUP] * 6 + [1000]
    return [nn.Parameter((torch.randn(n, generator=g) * 0.1).to(dtype).cuda()) for n in sizes]


def train(params, opt, steps, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(
            ((p.float() - torch.randn(p.shape, generator=g, device="cuda")) ** 2).mean() for p in params
        )
        loss.backward()  # post-accumulate hooks: host subgroups are speculated during it
        opt.step()
    torch.cuda.synchronize()


def parts_of(opt, idx):
    return [(sg, sl) for sg in debug_view(opt).subgroups for sl in sg.slices if sl.param_index == idx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("placement", ["host", "mixed_nvme"])
def test_state_dict_keeps_offloaded_state_off_the_gpu(placement, dtype, nvme_dir):
    params = make_params(dtype)
    with HybridAdamW(params, **HYPER, **placement_kwargs(placement, nvme_dir)) as opt:
        train(params, opt, 3, seed=1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        sd = opt.state_dict()
        torch.cuda.synchronize()
        grown = torch.cuda.max_memory_allocated() - before
        # the copies it returns: CUDA state in memory of its own, not within the tier's buffers
        # (each rounded up to the caching allocator's 512 B blocks, as max_memory_allocated
        # counts it). A view's storage is a slice of a buffer's: told apart by its address
        device = debug_view(opt).device
        tier = [
            (b.data_ptr(), b.data_ptr() + b.nbytes())
            for b in {
                t.untyped_storage().data_ptr(): t.untyped_storage()
                for t in [*device.master.values(), *(t for st in device.state.values() for t in st.values())]
            }.values()
        ]

        def in_tier(t):
            return any(lo <= t.data_ptr() < hi for lo, hi in tier)

        copies = {
            t.untyped_storage().data_ptr(): -(-t.untyped_storage().nbytes() // 512) * 512
            for st in sd["state"].values()
            for t in st.values()
            if t.is_cuda and not in_tier(t)
        }
        assert grown <= sum(copies.values()), (
            f"state_dict() took {grown} B of GPU memory, the copies it returns {sum(copies.values())} B"
        )
        kinds = set()
        for idx, st in sd["state"].items():
            tiers = {opt.plan.tiers[sg.index] for sg, _ in parts_of(opt, idx)}
            want = "cuda" if tiers == {DEVICE} else "cpu"
            kinds.add(want)
            for k, t in st.items():
                if k != "step":
                    assert t.device.type == want, (idx, k, tiers)
                    assert t.dtype == torch.float32 and t.shape == params[idx].shape
        assert "cpu" in kinds and (placement == "host" or "cuda" in kinds)
        if placement != "host":
            # a device-only param in one subgroup: views of the tier's buffers, each with a
            # storage of its own (exactly its bytes: what torch.save writes)
            views = [
                idx
                for idx in sd["state"]
                if len(parts_of(opt, idx)) == 1 and opt.plan.tiers[parts_of(opt, idx)[0][0].index] == DEVICE
            ]
            assert views
            for idx in views:
                sg, sl = parts_of(opt, idx)[0]
                buf = debug_view(opt).device.state[sg.index]["exp_avg"]
                t = sd["state"][idx]["exp_avg"]
                assert t.data_ptr() == buf[sl.sub_offset :].data_ptr()
                for k, v in sd["state"][idx].items():
                    if k != "step":
                        assert in_tier(v) and v.untyped_storage().nbytes() == v.numel() * v.element_size(), (
                            idx,
                            k,
                        )
            # a device-only param over several subgroups: a copy (no view spans CUDA subgroups)
            for idx in sd["state"]:
                parts = parts_of(opt, idx)
                if len(parts) > 1 and {opt.plan.tiers[sg.index] for sg, _ in parts} == {DEVICE}:
                    assert not any(in_tier(v) for k, v in sd["state"][idx].items() if k != "step"), idx


@pytest.mark.parametrize("placement", ["device", "host", "mixed_nvme"])
def test_bf16_checkpoint_loaded_to_cpu_resumes_bitwise(placement, nvme_dir):
    """Trained, saved, torch.load(map_location="cpu"), loaded into a fresh optimizer over the
    CUDA model: the continuation is bitwise the uninterrupted run's."""
    kw = dict(**HYPER, **placement_kwargs(placement, nvme_dir))
    params = make_params(torch.bfloat16)
    with HybridAdamW(params, **kw) as opt:
        train(params, opt, 3, seed=1)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        weights = [p.detach().clone() for p in params]
        train(params, opt, 3, seed=2)
        end_state = opt.state_dict()
        end = {i: {k: v.cpu() for k, v in st.items()} for i, st in end_state["state"].items()}
    buf.seek(0)
    sd = torch.load(buf, map_location="cpu", weights_only=True)
    assert all(t.device.type == "cpu" for st in sd["state"].values() for t in st.values())
    params2 = [nn.Parameter(w.clone()) for w in weights]
    with HybridAdamW(params2, **kw) as opt2:
        opt2.load_state_dict(sd)
        train(params2, opt2, 3, seed=2)
        for a, b in zip(params, params2):
            assert torch.equal(a, b)
        got = opt2.state_dict()["state"]
        assert got.keys() == end.keys()
        for i, st in end.items():
            for k, v in st.items():
                assert torch.equal(got[i][k].cpu(), v), (i, k)


@pytest.mark.parametrize("placement", ["device", "host", "mixed_nvme"])
def test_save_state_dict_of_a_cuda_model_loads_as_state_dict(placement, nvme_dir, tmp_path):
    """save_state_dict (state/saving.py) on a CUDA model: the device tier's state comes back on
    the GPU (its records copied to the host one param at a time), the rest on the CPU, every
    tensor bitwise state_dict()'s; and GPU memory does not grow by the device state while it runs."""
    params = make_params(torch.bfloat16)
    with HybridAdamW(params, **HYPER, **placement_kwargs(placement, nvme_dir)) as opt:
        train(params, opt, 3, seed=1)
        want = opt.state_dict()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        opt.save_state_dict(tmp_path / "opt.pt")
        grew = torch.cuda.max_memory_allocated() - before
        largest = max(p.numel() for p in params) * 4 * 3  # one param's fp32 moments and master
        assert grew <= largest + (1 << 20), (grew, largest)
        got = torch.load(tmp_path / "opt.pt", weights_only=True)
        assert list(got["state"]) == list(want["state"])
        for i, st in want["state"].items():
            for k, v in st.items():
                g = got["state"][i][k]
                assert g.device == v.device and g.dtype == v.dtype and torch.equal(g, v), (i, k)
