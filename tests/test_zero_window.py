"""process_group's comm memory in one process (a world of 1, gloo): `opt.allocated_bytes["comm"]`
is the storages the optimizer holds for its collectives — the comm window's slots
(hybrid_opt/distributed/zero_pool.py) and each bucket's averaged chunks — and for a model of many buckets
the window is a few buckets, not the model (it was ~3 fp32 copies of it); release_grads'
argument errors (hybrid_opt/arguments.py)."""

import pytest
import torch
from helpers import needs_public_dtensor

from hybrid_opt import HybridAdamW
from hybrid_opt.distributed import zero, zero_pool
from hybrid_opt.testing import debug_view

LAYERS, WIDTH = 12, 64


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


@needs_public_dtensor  # process_group= (torch >= 2.5)
@pytest.mark.parametrize("overlap", [False, True])
def test_comm_bytes_are_the_storages_held_and_a_window_not_the_model(world_of_one, monkeypatch, overlap):
    monkeypatch.setattr(zero, "BUCKET_NUMEL", WIDTH * WIDTH + WIDTH)  # a bucket per layer
    monkeypatch.setattr(zero_pool, "WINDOW_FLOOR_BYTES", 0)  # the window is WINDOW buckets
    model = _model()
    fp32 = sum(p.numel() for p in model.parameters()) * 4
    with HybridAdamW(
        model.parameters(),
        offload_fraction=0.5,
        process_group=world_of_one.group.WORLD,
        overlap_param_gather=overlap,
    ) as opt:
        z = debug_view(opt).sharding
        assert len(z.buckets) == LAYERS
        for _ in range(2):
            model(torch.randn(4, WIDTH)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            got = opt.allocated_bytes["comm"]
            held = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in z.comm_tensors()
                if t is not None
            }
            assert got == sum(held.values())
            chunks = sum(b.buf.untyped_storage().nbytes() for b in z.buckets)  # a world of 1: all of it
            window = got - chunks - sum(t.untyped_storage().nbytes() for t in z.counts.tensors())
            # a world of 1 sends nothing (its own segment never leaves: zero_reduce.py), so a
            # slot is a bucket's gather staging (a layer's two params)
            largest = max(z.window.slot_numel(b) for b in z.buckets) * 4
            assert largest == (WIDTH * WIDTH + WIDTH) * 4
            assert window == zero_pool.WINDOW * largest
            assert window < fp32 / 2, (window, fp32)
            # no bucket keeps a slot once its reduction is done; overlapped gathers keep at
            # most the window's, landing the oldest to free one
            assert not z.reduction.in_flight() and not z.window.holders("reduce")
            staged = len(z.window.holders("gather"))
            assert staged <= zero_pool.WINDOW and (staged > 0) == overlap


def test_release_grads_needs_process_group():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="release_grads=True needs process_group="):
        HybridAdamW([p], release_grads=True)
    with pytest.raises(TypeError, match="release_grads must be True or False"):
        HybridAdamW([p], release_grads="yes")
