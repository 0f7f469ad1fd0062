"""hybrid_opt/mapped.py: tensors over file pieces mapped side by side, and HeldViews.

Real memfds and files, real mappings: the values read are the files' bytes in order; pieces
that do not meet on page boundaries are refused (the caller copies); a snapshot keeps every
tensor and slice over a span at its values while the file changes; a private span never writes
its file; a span goes with its last tensor.
"""

import gc
import io
import os

import torch
from helpers import backing

from hybrid_opt.mapped import PAGE, HeldViews, Piece, map_pieces, map_tensor, side_by_side
from hybrid_opt.shm import SharedArena
from hybrid_opt.state.checkpoint import _own_storage

F32 = torch.float32
PER_PAGE = PAGE // 4  # fp32 elements in a page


def arena_of(pages: int):
    arena = SharedArena(pages * PAGE, "test-mapped")
    full = arena.tensor(0, pages * PER_PAGE, F32)
    full.copy_(torch.arange(full.numel(), dtype=F32))
    return arena, full


def test_pieces_read_as_one_tensor_in_order():
    arena, full = arena_of(8)
    try:
        # the tail of page-run 1, the whole of page 4, the head of page 6: two page-aligned seams
        pieces = [
            Piece(arena.fd, 4 * 100, 4 * (2 * PER_PAGE - 100)),
            Piece(arena.fd, 4 * 4 * PER_PAGE, PAGE),
            Piece(arena.fd, 4 * 6 * PER_PAGE, 4 * 10),
        ]
        assert side_by_side(pieces)
        t = map_tensor(pieces, F32, (2 * PER_PAGE - 100 + PER_PAGE + 10,))
        want = torch.cat(
            [
                full[100 : 2 * PER_PAGE],
                full[4 * PER_PAGE : 5 * PER_PAGE],
                full[6 * PER_PAGE : 6 * PER_PAGE + 10],
            ]
        )
        assert torch.equal(t, want)
        assert t.untyped_storage().nbytes() == t.numel() * 4  # torch.save writes exactly these
        assert "test-mapped" in backing(t)
        full[100] = -1.0  # shared: the tensor reads the memory itself
        assert t[0].item() == -1.0
        buf = io.BytesIO()
        torch.save({"t": t}, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=True)["t"], t)
    finally:
        arena.close()


def test_pieces_that_do_not_meet_on_page_boundaries_are_refused():
    arena, _ = arena_of(4)
    try:
        ends_mid_page = [Piece(arena.fd, 0, 100), Piece(arena.fd, PAGE, 8)]
        starts_mid_page = [Piece(arena.fd, 0, PAGE), Piece(arena.fd, PAGE + 4, 8)]
        for pieces in (ends_mid_page, starts_mid_page):
            assert not side_by_side(pieces)
            assert map_pieces(pieces) is None
        assert map_pieces([]) is None
    finally:
        arena.close()


def test_a_released_span_keeps_its_values_in_every_tensor_over_it():
    arena, full = arena_of(4)
    held = HeldViews()
    try:
        pieces = [
            Piece(arena.fd, 0, PAGE, held=held, key=("bank", 0)),
            Piece(arena.fd, 2 * PAGE, PAGE, held=held, key=("bank", 2)),
        ]
        t = map_tensor(pieces, F32, (2 * PER_PAGE,))
        tail = t[-5:]  # a slice held on its own shares the span
        before = t.clone()
        assert len(held) == 1 and held.by_key
        held.release([("bank", 2)])  # the owner is about to write bank 2 (and only that)
        assert not held.by_key.get(("bank", 2))
        full.fill_(7.0)
        assert torch.equal(t, before) and torch.equal(tail, before[-5:])
        assert backing(t) == ""  # anonymous memory of its own now
        held.release([("bank", 0)])  # released once: a no-op the second time
        assert len(held) == 0
    finally:
        arena.close()
    assert torch.equal(t, before)  # the arena closed: the copy stays


def test_a_private_span_never_writes_its_file(tmp_path):
    path = tmp_path / "slot"
    data = torch.arange(2 * PER_PAGE, dtype=F32)
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        t = map_tensor([Piece(fd, 0, 2 * PAGE, private=True)], F32, (2 * PER_PAGE,))
        assert torch.equal(t, data) and backing(t) == str(path)
        t.mul_(-1)  # copy-on-write: the tensor's pages only
        assert torch.equal(t, -data)
        assert path.read_bytes() == data.numpy().tobytes()
    finally:
        os.close(fd)


def test_a_span_goes_with_its_last_tensor():
    arena, _ = arena_of(2)
    held = HeldViews()
    try:
        t = map_tensor([Piece(arena.fd, 0, PAGE, held=held, key=0)], F32, (PER_PAGE,))
        part = t[:4]
        del t
        gc.collect()
        assert len(held) == 1  # the slice still holds it
        del part
        gc.collect()
        assert len(held) == 0  # the span was deallocated: Python's mmap unmaps it then
    finally:
        arena.close()


def test_own_storage_aliases_just_a_slice():
    """What state_dict() hands out for a device-tier tensor outside an arena (CUDA): a view
    whose storage is exactly its bytes, keeping the tier's tensor alive."""
    base = torch.arange(100, dtype=F32)
    v = _own_storage(base[10:30])
    assert torch.equal(v, base[10:30]) and v.untyped_storage().nbytes() == 80
    base[10] = -3
    assert v[0].item() == -3
    del base
    gc.collect()
    assert v[1].item() == 11
    buf = io.BytesIO()
    torch.save(v, buf)
    assert buf.tell() < 2000  # the slice's 80 bytes, not the 400 of the whole tensor, plus the zip
