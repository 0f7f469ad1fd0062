"""Memory the optimizer takes while it builds and moves its tiers: flattening in pieces, the
device budget (torch's caching allocator, the activations of "auto"), calibration sized by
the budget, and moves that check room first and lose nothing when they fail."""
import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hybrid_opt import HybridAdamW
from hybrid_opt import layout as L
from test_optimizer import assert_state_close, make_batches, make_net, train


# ============================================================================= flattening
def _big_params(n_params=24, numel=1 << 16, seed=0):
    """Parameters that own their storage (nothing else refers to it)."""
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(n_params)]


def test_flat_pieces_are_whole_subgroups_cut_at_parameter_boundaries():
    assert L.flat_pieces([30, 30, 30, 30], 16, 64) == [[0, 1], [2, 3]]   # cap 64: 2 params each
    assert L.flat_pieces([30, 30, 30, 30], 16, 70) == [[0, 1], [2, 3]]   # cap rounds down to 64
    assert L.flat_pieces([10, 200, 10], 16, 64) == [[0], [1], [2]]        # a large param alone
    assert L.flat_pieces([5, 5, 5], 16, 1) == [[0, 1, 2]]                  # at least one subgroup
    assert L.flat_pieces([], 16, 64) == []


def test_flattening_releases_each_old_storage_before_the_next_piece():
    """A 6 MiB model flattened in 1 MiB pieces: when each piece is allocated, the live memory
    (old storages not yet copied + pieces made so far + this piece) never exceeds the model
    plus one piece, and every parameter's old storage is gone once its piece is filled. One
    flat buffer for the whole model (the old layout) would hold the model twice."""
    params = _big_params()
    values = [p.detach().clone() for p in params]
    numel = params[0].numel()
    model_bytes = sum(p.numel() * 4 for p in params)
    old = [StorageWeakRef(p.untyped_storage()) for p in params]
    piece_bytes = 1 << 20
    live, made, real = [], [], L._flatten_piece

    def watched(members, device, dtype):
        alive = sum(numel * 4 for w in old if not w.expired())
        piece = sum(p.numel() * 4 for _, p in members)
        live.append(alive + sum(made) + piece)
        flat, placed = real(members, device, dtype)
        made.append(piece)
        for idx, _ in members:
            assert old[idx].expired(), f"param {idx}'s old storage is still held after its copy"
        return flat, placed

    L._flatten_piece = watched
    try:
        sgs, flats = L.flatten_group(params, 0, 0, subgroup_numel=1 << 14, first_subgroup=0,
                                     piece_bytes=piece_bytes)
    finally:
        L._flatten_piece = real
    assert len(flats) == model_bytes // piece_bytes and max(made) == piece_bytes
    assert max(live) <= model_bytes + piece_bytes, (max(live), model_bytes)
    assert all(w.expired() for w in old)
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
        assert any(p.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flats)
    # subgroups tile each piece: no subgroup spans two flat buffers, every element is covered
    assert sum(s.numel for s in sgs) == sum(p.numel() for p in params)
    for s in sgs:
        assert any(s.flat.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flats)


def test_an_optimizer_over_many_pieces_matches_one_flat_buffer_bitwise(monkeypatch):
    """Pieces change where subgroups end (one partial subgroup per piece), never the numbers."""
    batches = make_batches(6)
    one, many = make_net(), make_net()
    with HybridAdamW(one.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.5,
                     subgroup_numel=64) as a:
        monkeypatch.setattr(L, "FLATTEN_PIECE_BYTES", 64 * 4)  # one subgroup per piece
        with HybridAdamW(many.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.5,
                         subgroup_numel=64) as b:
            assert [s.numel for s in b._subgroups] != [s.numel for s in a._subgroups]
            train(one, a, batches)
            train(many, b, batches)
            for x, y in zip(one.parameters(), many.parameters()):
                assert torch.equal(x, y)
            assert_state_close(b.state_dict(), a.state_dict(), exact=True)
