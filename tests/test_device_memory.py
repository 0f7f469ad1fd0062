"""Device memory at offload 0 against torch.optim.AdamW(fused=True) (issue #35: peak device memory
at most torch's): every tensor allocated on the params' device while the optimizer is built and
steps, seen by a TorchDispatchMode, and the same allocations as torch's CUDA caching allocator
counts them (max_memory_allocated), replayed through a model of its rounding.

On CUDA (the `gpu` cases) the device tier's state is CUDA memory the tracker sees. On a CPU-only
host it is shared memory (a memfd arena the CPU device tier keeps, tiers/device_memory.py), which
no op allocates: the comparison adds its bytes as the OS counts them (opt.allocated_bytes, held
against os.fstat by test_allocated_bytes.py), and the caching allocator is CUDA's alone."""

import weakref
from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_opt import HybridAdamW

MiB = 1 << 20


class AllocationTracker(TorchDispatchMode):
    """Every new storage an op makes on `device` (views and in-place results are not new),
    with the moment it is freed: `events` is [("alloc", key, bytes, op) | ("free", key)] in
    order."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.events: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            a.untyped_storage().data_ptr()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor) and a.device == self.device
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device != self.device or t._is_view():
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in inputs:
                continue
            key = object()
            self.events.append(("alloc", key, storage.nbytes(), str(func)))
            weakref.finalize(storage, self.events.append, ("free", key))
        return out

    def live_peak(self) -> int:
        """The most bytes of tracked storages alive at once."""
        live, peak, size = 0, 0, {}
        for e in self.events:
            if e[0] == "alloc":
                size[e[1]] = e[2]
                live += e[2]
                peak = max(peak, live)
            else:
                live -= size.pop(e[1])
        return peak


class CachingAllocatorModel:
    """torch's CUDA caching allocator as max_memory_allocated sees it (c10/cuda/
    CUDACachingAllocator.cpp, one stream, default settings): a request rounded up to 512 B;
    one of at most 1 MiB costs that (the small pool splits 2 MiB blocks to 512 B); a larger one
    takes the smallest free cached block that holds it, else a new block of 20 MiB (under 10
    MiB) or rounded up to 2 MiB, and the rest of that block is split off only when it is more
    than 1 MiB — a smaller rest is handed out with it and counted. Freed blocks stay cached and
    merge with free neighbours of the same segment."""

    def __init__(self):
        self.segments: list = []  # each a list of [size, free] blocks in address order
        self.blocks: dict = {}
        self.allocated = self.peak = 0

    def alloc(self, key, nbytes: int) -> None:
        size = max(512, -(-nbytes // 512) * 512)
        if size <= MiB:
            self.blocks[key] = (None, [size, False])
            return self._count(size)
        fits = [
            (b[0], k, seg, b) for k, seg in enumerate(self.segments) for b in seg if b[1] and b[0] >= size
        ]
        if fits:
            _, _, seg, block = min(fits, key=lambda f: f[:2])
        else:
            new = 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            seg = [[new, True]]
            self.segments.append(seg)
            block = seg[0]
        if block[0] - size > MiB:
            seg.insert(self._index(seg, block) + 1, [block[0] - size, True])
            block[0] = size
        block[1] = False
        self.blocks[key] = (seg, block)
        self._count(block[0])

    def free(self, key) -> None:
        seg, block = self.blocks.pop(key)
        self.allocated -= block[0]
        if seg is None:
            return
        block[1] = True
        i = self._index(seg, block)
        if i + 1 < len(seg) and seg[i + 1][1]:
            block[0] += seg.pop(i + 1)[0]
        if i > 0 and seg[i - 1][1]:
            seg[i - 1][0] += seg.pop(i)[0]

    def replay(self, events: list) -> int:
        """The peak allocated bytes of `events` (AllocationTracker's)."""
        for e in events:
            if e[0] == "alloc":
                self.alloc(e[1], e[2])
            else:
                self.free(e[1])
        return self.peak

    @staticmethod
    def _index(seg: list, block: list) -> int:
        return next(k for k, b in enumerate(seg) if b is block)

    def _count(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)


def test_the_allocator_model_rounds_as_measured_on_an_h200():
    """Its rounding against figures read on an H200 (torch 2.11): 12 x Linear(4096) fp32 params,
    then moments and grads. torch's per-param moments cost their size; 98 moments of the 49
    subgroups HybridAdamW cuts them into (subgroup_numel 4Mi) cost 31.6 MiB more, as measured
    (peak 3,170 MiB against torch's 3,139), and none more when split off one freed block."""

    def peak(moments, one_block=False):
        m, keys = CachingAllocatorModel(), iter(range(10**6))
        params = [4096 * 4096 * 4, 4096 * 4] * 12
        for n in params:
            m.alloc(next(keys), n)
        if one_block:
            k = next(keys)
            m.alloc(k, sum(moments))
            m.free(k)
        for n in moments + params:  # the moments, then the grads
            m.alloc(next(keys), n)
        return m.peak / MiB

    torch_moments = [4096 * 4096 * 4, 4096 * 4] * 24
    subgroups = [4109760 * 4] * 96 + [4107264 * 4] * 2
    assert sum(torch_moments) == sum(subgroups)
    assert peak(torch_moments) == pytest.approx(3072.75, abs=0.01)
    assert peak(subgroups) - peak(torch_moments) == pytest.approx(31.6, abs=0.1)
    assert peak(subgroups, one_block=True) - peak(torch_moments) < 0.1


WIDTH = 2048


def _model():  # 12.6M fp32 params: torch's moments 16 MiB per weight, HybridAdamW's 9.6 MiB per subgroup
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])


class Run(NamedTuple):
    tracker: AllocationTracker
    last_iteration: int  # where the last iteration's events start in tracker.events
    state_bytes: object  # HybridAdamW's opt.allocated_bytes["device"]; None for torch's
    param_bytes: int


def _tracked_run(make_opt, device: str, steps=4) -> Run:
    """A model built on `device`, given an optimizer and trained `steps` iterations under the
    tracker."""
    x = torch.randn(8, WIDTH, device=device)
    with AllocationTracker(device) as tracker:
        model = _model().to(device)
        opt = make_opt(model.parameters())
        for _ in range(steps):
            last = len(tracker.events)
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    state = opt.allocated_bytes["device"] if isinstance(opt, HybridAdamW) else None
    getattr(opt, "close", lambda: None)()
    return Run(tracker, last, state, sum(p.numel() * 4 for p in model.parameters()))


def _allocated_bytes(events: list) -> int:
    return sum(e[2] for e in events if e[0] == "alloc")


def _torch_fused(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def _hybrid(params):
    return HybridAdamW(params, lr=1e-3, offload_fraction=0.0, subgroup_numel=3_000_000)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def runs(request) -> dict:
    device = request.param
    return {
        "device": device,
        "ours": _tracked_run(_hybrid, device),
        "torch": _tracked_run(_torch_fused, device),
    }


def test_offload_0_allocates_on_the_device_no_more_than_torch_fused_adamw(runs):
    """What the optimizer holds on the params' device is torch's state (two fp32 moments per
    element: no copy of the params or grads, no calibration buffer, no staging, no spare bank);
    with what it allocates for a moment (building, the first step) the most alive at once is
    at most torch's; and an iteration in the steady state allocates no more than torch's (the
    forward's and backward's tensors: a step allocates nothing that size)."""
    ours, theirs = runs["ours"], runs["torch"]
    assert ours.state_bytes == 2 * ours.param_bytes
    # the CPU device tier's state is shared memory, outside the tracker: counted as the OS does
    unseen = ours.state_bytes if runs["device"] == "cpu" else 0
    assert ours.tracker.live_peak() + unseen <= theirs.tracker.live_peak()
    assert _allocated_bytes(ours.tracker.events[ours.last_iteration :]) <= _allocated_bytes(
        theirs.tracker.events[theirs.last_iteration :]
    )


def test_offload_0_peak_device_memory_as_cudas_caching_allocator_counts_it_is_at_most_torchs(runs):
    """The same allocations replayed through the caching allocator's rounding: the moments of
    the 5 subgroups (9.6 MiB each: two to a 20 MiB block, the second handed out with the 0.8 MiB
    left, 4 MiB over torch's in all) cost their own size, as torch's per-parameter moments do."""
    if runs["device"] != "cuda":
        pytest.skip("the CPU device tier's state is shared memory: no caching allocator to replay it through")
    ours, theirs = runs["ours"], runs["torch"]
    assert CachingAllocatorModel().replay(ours.tracker.events) <= CachingAllocatorModel().replay(
        theirs.tracker.events
    )
