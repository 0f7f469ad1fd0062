"""state_dict() copies nothing (issue #36): every tensor it hands out is a view of the memory
that holds the state, with a storage of its own — the device tier's buffers, the host tier's
committed bank, an nvme subgroup's committed slot — even for a param spread over several
subgroups (their pieces mapped side by side: hybrid_opt/mapped.py).

- Where each tensor's memory is, read from /proc/self/maps: a shared-memory or nvme file, not
  anonymous memory (a copy would be).
- Held across steps, a host or nvme tensor keeps the values it had when taken (its memory is
  copied before a step writes it again), a device tensor follows the state (the tier's own, as
  torch's are); never another step's bank or another subgroup's. close() keeps them.
- A checkpoint saved from the views resumes bitwise.
- What a save and a load cost in RAM, measured by the OS in a fresh process: trainer and worker
  anonymous memory plus the system's shared memory, sampled every 2 ms by another process.

Sizes here cut subgroups on page boundaries (subgroup_numel >= layout.PAGE_CUT_FROM).
"""

import pytest
import torch
from helpers import backing, cases_in_one_process, needs_public_dtensor
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.testing import debug_view

BF16 = torch.bfloat16
SUBGROUP = 1 << 15
HYPER = dict(lr=1e-2, weight_decay=0.1)
PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "host": dict(offload_fraction=1.0),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0),
    "mixed": dict(offload_fraction=0.5, nvme_fraction=0.25),
}
COMPRESSED = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, store_param_remainders=True)
FORMATS = {
    "fp32": (torch.float32, {}),
    "bf16-remainders": (BF16, COMPRESSED),
    "bf16-master": (BF16, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
}


def make_model(dtype, seed=0):
    torch.manual_seed(seed)
    # 4 x (65536 + 300) elements: every weight spans subgroups of 32768, the biases shift them
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(dtype)


def make_opt(model, placement, fmt, tmp_path, **kw):
    kw = {**HYPER, "subgroup_numel": SUBGROUP, **PLACEMENTS[placement], **FORMATS[fmt][1], **kw}
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = str(tmp_path)
    return HybridAdamW(model.parameters(), **kw)


def train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 256, generator=gen).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def spans(opt, idx) -> int:
    return sum(sl.param_index == idx for sg in debug_view(opt).subgroups for sl in sg.slices)


def clone_state(sd):
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_every_state_tensor_is_a_view_of_the_state(placement, fmt, tmp_path):
    """Each tensor (moments, master_param or master_remainder) lies in a shared-memory or nvme
    file, has a storage of exactly its bytes, and equals what a copy of the state reads."""
    model = make_model(FORMATS[fmt][0])
    with make_opt(model, placement, fmt, tmp_path) as opt:
        train(model, opt, 3)
        sd = opt.state_dict()
        assert any(spans(opt, i) > 1 for i in sd["state"])  # pieces of several subgroups
        assert {opt.plan.tiers[s.index] for s in debug_view(opt).subgroups} == {
            DEVICE if placement == "device" else placement
        }
        for idx, st in sd["state"].items():
            keys = {"step", "exp_avg", "exp_avg_sq"}
            if fmt != "fp32":
                keys.add("master_remainder" if fmt == "bf16-remainders" else "master_param")
            assert set(st) == keys, (idx, set(st))
            for k, t in st.items():
                if k == "step":
                    continue
                where = backing(t)
                assert "hybrid_opt-" in where or where.startswith(str(tmp_path)), (idx, k, where)
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (idx, k)
        # the same values a fresh call reads (the mapping of pieces side by side is exact)
        again = opt.state_dict()
        for idx, st in sd["state"].items():
            for k, t in st.items():
                assert torch.equal(t, again["state"][idx][k]), (idx, k)


@pytest.mark.parametrize("fmt", ["fp32", "bf16-remainders"])
@pytest.mark.parametrize("placement", ["device", "host", "nvme", "mixed"])
def test_a_state_dict_held_across_steps_keeps_its_values_or_follows_the_state(placement, fmt, tmp_path):
    """Taken, then held over three steps (banks rotate, nvme slots alternate, speculation runs):
    each tensor, and a slice of it held on its own, equals either its values when taken (host
    and nvme: copied before their memory was written again) or the state now (device: the
    tier's own tensors, stepped in place, as torch's are) — never a later bank's contents."""
    model = make_model(FORMATS[fmt][0])
    with make_opt(model, placement, fmt, tmp_path) as opt:
        train(model, opt, 2)
        sd = opt.state_dict()
        taken = clone_state(sd)
        slices = {
            (i, k): t.view(-1)[-5:] for i, st in sd["state"].items() for k, t in st.items() if k != "step"
        }
        train(model, opt, 3, seed=2)
        now = clone_state(opt.state_dict())
        kinds, wants = set(), {}
        for idx, st in sd["state"].items():
            on_device = {
                opt.plan.tiers[sg.index]
                for sg in debug_view(opt).subgroups
                for sl in sg.slices
                if sl.param_index == idx
            } == {DEVICE}
            for k, t in st.items():
                if k == "step":
                    continue
                want = wants[(idx, k)] = now[idx][k] if on_device else taken[idx][k]
                assert not torch.equal(taken[idx][k], now[idx][k]), (idx, k)  # the state moved
                assert torch.equal(t, want), (idx, k, on_device)
                assert torch.equal(slices[(idx, k)], want.view(-1)[-5:]), (idx, k)
                kinds.add(on_device)
        assert kinds == (
            {True} if placement == "device" else {False} if placement != "mixed" else {True, False}
        )
    for (idx, k), want in wants.items():  # close() left them their values
        assert torch.equal(sd["state"][idx][k], want), (idx, k)


@pytest.mark.parametrize("fmt", ["fp32", "bf16-remainders"])
@pytest.mark.parametrize("placement", ["device", "host", "nvme", "mixed"])
def test_a_saved_checkpoint_resumes_bitwise(placement, fmt, tmp_path):
    """torch.save(opt.state_dict()) mid-training, loaded into a fresh optimizer (and model):
    the next steps give the same params and state bitwise as training on."""
    dtype = FORMATS[fmt][0]
    model = make_model(dtype)
    path = tmp_path / "opt.pt"
    with make_opt(model, placement, fmt, tmp_path) as opt:
        train(model, opt, 3)
        torch.save(opt.state_dict(), path)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, 3, seed=5)
        want_params = [p.detach().clone() for p in model.parameters()]
        want_state = clone_state(opt.state_dict())
    model2 = make_model(dtype, seed=9)
    model2.load_state_dict(weights)
    nvme2 = tmp_path / "b"
    nvme2.mkdir()
    with make_opt(model2, placement, fmt, nvme2) as opt2:
        opt2.load_state_dict(torch.load(path, weights_only=True))
        train(model2, opt2, 3, seed=5)
        for p, q in zip(model2.parameters(), want_params):
            assert torch.equal(p, q)
        got = opt2.state_dict()["state"]
        for idx, st in want_state.items():
            for k, t in st.items():
                assert torch.equal(got[idx][k], t), (idx, k)


_MEASURE = r"""
import os, sys, torch
from hybrid_opt import HybridAdamW
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from ram_sampler import RamSampler, wait_until_steady
def measure(placement, fmt, path, nvme):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(12)])
    kw = {"device": dict(offload_fraction=0.0), "host": dict(offload_fraction=1.0),
          "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme)}[placement]
    if fmt == "bf16-remainders":
        model = model.to(torch.bfloat16)
        kw.update(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True)
    opt = HybridAdamW(model.parameters(), lr=1e-3, **kw)
    for _ in range(2):
        model(torch.randn(4, 1024, dtype=next(model.parameters()).dtype)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    pids = [os.getpid(), opt.worker_pid]
    released()
    wait_until_steady(pids)
    out = {}
    with RamSampler(pids) as w:
        sd = opt.state_dict()
        torch.save(sd, path)
        del sd
    out["save"] = w.result["anon_shmem_peak"]
    out["state"] = sum(t.numel() * t.element_size() for st in torch.load(path, weights_only=True)["state"].values()
                       for t in st.values())
    released()
    with RamSampler(pids) as w:
        opt.load_state_dict(torch.load(path, weights_only=True))
    out["load"] = w.result["anon_shmem_peak"]
    released()
    with RamSampler(pids) as w:
        opt.load_state_dict(torch.load(path, weights_only=True, mmap=True))
    out["load_mmap"] = w.result["anon_shmem_peak"]
    opt.close()
    os.unlink(path)
    return out
"""
PEAK_FORMATS = ["fp32", "bf16-remainders"]
PEAK_PLACEMENTS = ["device", "host", "nvme"]


@pytest.fixture(scope="module")
def checkpoint_peaks(tmp_path_factory):
    """_MEASURE over every (placement, format), one optimizer after another in one fresh process
    (helpers.cases_in_one_process)."""
    cases = [f"{p}:{f}" for p in PEAK_PLACEMENTS for f in PEAK_FORMATS]
    return cases_in_one_process(_MEASURE, cases, str(tmp_path_factory.mktemp("checkpoint_peaks")))


@pytest.mark.parametrize("fmt", PEAK_FORMATS)
@pytest.mark.parametrize("placement", PEAK_PLACEMENTS)
def test_a_checkpoint_costs_no_ram(placement, fmt, checkpoint_peaks):
    """12 x Linear(1024, 1024), default subgroups, in a fresh process: torch.save(state_dict())
    takes at most 5 % of the state's bytes more RAM (the OS's anonymous memory of trainer and
    worker plus the system's shared memory); load_state_dict(torch.load(f)) at most the loaded
    dict plus 5 %; a load from torch.load(f, mmap=True) at most 5 %."""
    got = checkpoint_peaks[f"{placement}:{fmt}"]
    budget = 0.05 * got["state"]
    assert got["save"] <= budget, got
    assert got["load"] <= got["state"] + budget, got
    assert got["load_mmap"] <= budget, got


@needs_public_dtensor
def test_a_sharded_params_state_stays_on_the_cpu_under_a_cuda_mesh(tmp_path):
    """FSDP2 and process_group on a GPU: the state of a host or nvme subgroup is CPU memory,
    the param's mesh is CUDA's. DTensor.from_local moved such a local tensor onto the mesh's
    device, so state_dict() copied the offloaded state back onto the GPU (and without CUDA,
    raised). Each state DTensor is built over the local tensor as it lies, the absmaxes of a
    q8 moment too (dtensor_state.dtensor_over). A CUDA-typed mesh needs no GPU to build."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from hybrid_opt.distributed.dtensor_state import dtensor_like
    from hybrid_opt.distributed.q8_shards import absmax_dtensor, absmax_local_shape

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        # a param as FSDP2's CPU offload lays it out: a CPU shard under a CUDA mesh
        meta = TensorMeta(torch.Size((1024, 8)), (8, 1), torch.float32)
        p = DTensor(
            torch.randn(1024, 8), DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False
        )
        state = torch.zeros(1024, 8)
        entry = dtensor_like(state, p)
        assert entry.device_mesh.device_type == "cuda" and entry.placements == p.placements
        assert entry.to_local().data_ptr() == state.data_ptr()  # the state itself: no copy
        assert entry.shape == p.shape and entry.stride() == p.stride()
        absmax = torch.ones(math.prod(absmax_local_shape(p)))
        blocks = absmax_dtensor(absmax, p)
        assert blocks.to_local().data_ptr() == absmax.data_ptr()
    finally:
        dist.destroy_process_group()
