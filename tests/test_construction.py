"""What constructing and closing an optimizer costs and gives back (issue #14).

- close() gives the trainer its cores and thread counts back: torch's and cpu_kernels' counts
  (one OpenMP runtime: setting either sets both) and every thread's affinity, whatever the
  order several optimizers close in, and after a construction that failed half way.
- the spare-bank pool exists only where speculation can use it.
- the arena's memory is reserved at construction (missing memory is a MemoryError there), and
  its pages are populated with every core, the spare banks in the background; a step that
  needs a bank not populated yet waits for it.
"""

import contextlib
import os
import threading
import time

import psutil
import pytest
import torch
from helpers import thread_masks
from torch import nn

import cpu_kernels
from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers import host as host_mod

SUBGROUP = 1 << 12
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 8)).to(dtype)


def _snapshot():
    return torch.get_num_threads(), cpu_kernels.get_num_threads(), thread_masks()


def _assert_restored(before):
    threads, kernel_threads, masks = before
    assert torch.get_num_threads() == threads
    assert cpu_kernels.get_num_threads() == kernel_threads
    main = masks[os.getpid()]
    _, _, now = _snapshot()
    # a thread that existed before has its own mask back; one started since, the process's
    wrong = {tid: m for tid, m in now.items() if m != masks.get(tid, main)}
    assert not wrong, f"threads left with another affinity: {wrong} (was {main})"


@pytest.fixture(autouse=True)
def _all_cores_threads():
    """Each test starts from one thread per core, so a split (and a restore that misses)
    is visible whatever an earlier test left behind."""
    saved = torch.get_num_threads(), cpu_kernels.get_num_threads()
    n = len(os.sched_getaffinity(0))
    cpu_kernels.set_num_threads(n)
    torch.set_num_threads(n)
    yield
    cpu_kernels.set_num_threads(saved[1])
    torch.set_num_threads(saved[0])


def _opt(model, **kw):
    return HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=1.0, subgroup_numel=SUBGROUP, **kw)


# ----------------------------------------------------------------- 1. close() gives back
@TWO_CORES
def test_close_restores_torch_threads_and_every_affinity():
    """One optimizer: close() gives torch back its thread count, not the trainer's share (1
    here), although torch and cpu_kernels share one libgomp's count."""
    before = _snapshot()
    opt = _opt(_model(), worker_share=0.5)  # a GPU host's split (a CPU-only host shares every core)
    assert torch.get_num_threads() == len(debug_view(opt).host.cores.trainer) < before[0]
    assert os.sched_getaffinity(0) == set(debug_view(opt).host.cores.trainer)
    opt.close()
    _assert_restored(before)
    opt.close()  # idempotent: nothing changes the second time
    _assert_restored(before)


@TWO_CORES
@pytest.mark.parametrize("order", ["opening_order", "reverse_order"])
def test_two_optimizers_closed_in_either_order_restore_threads_and_affinity(order):
    before = _snapshot()
    a, b = _opt(_model(0), worker_share=0.5), _opt(_model(1), worker_share=0.5)
    first, second = (a, b) if order == "opening_order" else (b, a)
    first.close()
    assert torch.get_num_threads() == len(debug_view(second).host.cores.trainer)  # the other still runs split
    assert os.sched_getaffinity(0) == set(debug_view(second).host.cores.trainer)
    second.close()
    _assert_restored(before)


def _threads_in_finish(io, step, monkeypatch, fail=False):
    """Runs step(); returns torch's and cpu_kernels' thread counts as the host tier's finish()
    waited for the worker (HostIO `io`'s finishing entered). The real finishing() runs (fail: it
    raises _Injected after it, and step() must raise it)."""
    seen, real = [], io.finishing

    @contextlib.contextmanager
    def finishing(pieces):
        seen.append((torch.get_num_threads(), cpu_kernels.get_num_threads()))
        with real(pieces):
            yield
        if fail:
            raise _Injected("after finishing")

    monkeypatch.setattr(io, "finishing", finishing)
    if fail:
        with pytest.raises(Exception, match="after finishing"):
            step()
    else:
        step()
    assert len(seen) == 1
    return seen[0]


def _opt_step(opt):
    """step() of `opt` on random grads (for _threads_in_finish)."""

    def step():
        for p in (q for g in opt.param_groups for q in g["params"]):
            p.grad = torch.randn_like(p)
        opt.step()

    return step


@TWO_CORES
@pytest.mark.parametrize("fail", [False, True], ids=["ok", "failed"])
def test_a_waited_step_the_worker_runs_on_shared_cores_leaves_the_trainers_torch_one_thread(
    monkeypatch, fail
):
    """Sharing every core with the worker while the worker steps what step() waits for
    (HostTier(inline=False): by default the trainer steps it itself, tests/test_inline_steps.py),
    the trainer's torch runs on one thread meanwhile (cpu_kernels' too: one OpenMP runtime), and
    both get their counts back after, failed or not."""
    before = _snapshot()
    tier = host_mod.HostTier([SUBGROUP, SUBGROUP], inline=False)
    try:
        assert tier.cores.shared and tier.inline is None
        counts = (torch.get_num_threads(), cpu_kernels.get_num_threads())
        assert counts[0] > 1
        inputs = host_mod.AdamInputs(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
        steps = {sg: (torch.randn(SUBGROUP), inputs) for sg in (0, 1)}
        seen = _threads_in_finish(tier.io, lambda: tier.stepping.finish(steps), monkeypatch, fail)
        assert seen == (1, 1)
        assert (torch.get_num_threads(), cpu_kernels.get_num_threads()) == counts
    finally:
        tier.close()
    _assert_restored(before)


@TWO_CORES
def test_a_waited_step_on_split_cores_keeps_the_trainers_thread_count(monkeypatch):
    before = _snapshot()
    opt = _opt(_model(), worker_share=0.5)
    try:
        trainer = len(debug_view(opt).host.cores.trainer)
        assert _threads_in_finish(debug_view(opt).host.io, _opt_step(opt), monkeypatch) == (
            trainer,
            cpu_kernels.get_num_threads(),
        )
        assert torch.get_num_threads() == trainer
    finally:
        opt.close()
    _assert_restored(before)


class _Injected(RuntimeError):
    pass


@TWO_CORES
@pytest.mark.parametrize("where", ["host_tier", "loading_state"])
@pytest.mark.parametrize("order", ["opening_order", "reverse_order"])
def test_a_failed_construction_in_between_leaves_nothing_applied(monkeypatch, where, order):
    """A construction that fails after its CoreSplit was applied (inside the host tier, or
    while the optimizer loads the params into it) restores it before raising: the others
    still close back to the original threads and masks, and its worker is gone."""
    before = _snapshot()
    a = _opt(_model(0))
    children = {p.pid for p in psutil.Process().children()}

    def boom(*args, **kw):
        raise _Injected("injected")

    with monkeypatch.context() as m:
        if where == "host_tier":
            m.setattr(host_mod.HostIO, "probe_remote_gather", boom)
        else:
            m.setattr(host_mod.HostTier, "load_state", boom)
        with pytest.raises(_Injected):
            _opt(_model(2))
    assert {p.pid for p in psutil.Process().children()} <= children
    assert os.sched_getaffinity(0) == set(debug_view(a).host.cores.trainer)
    b = _opt(_model(1))
    first, second = (a, b) if order == "opening_order" else (b, a)
    first.close()
    second.close()
    _assert_restored(before)


# ----------------------------------------------------------------- 2. spare pool
def _train(opt, model, steps=4, seed=7):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _bigger_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 64))  # ~7 subgroups


def test_no_spare_pool_per_subgroup_without_speculation_and_the_same_bits():
    """speculative=False needs no bank per subgroup (no step waits for validation): its pool
    is two banks, so the arena is smaller per parameter; the results are the same bits as
    speculative=True's and match torch within fp32 rounding."""
    from tolerances import assert_close

    models = [_bigger_model() for _ in range(3)]
    ref = torch.optim.AdamW(models[2].parameters(), lr=1e-2, foreach=False)
    n = sum(p.numel() for p in models[0].parameters())
    with _opt(models[0], speculative=True) as spec, _opt(models[1], speculative=False) as plain:
        resident = len(debug_view(spec).host.numels)
        assert resident >= 5
        assert spec.plan.spare_banks == resident
        assert plain.plan.spare_banks == 2
        stride = debug_view(plain).host.banks.bank_stride
        assert debug_view(plain).host.spare_bytes == 2 * stride
        assert (
            debug_view(spec).host.arena.nbytes - debug_view(plain).host.arena.nbytes
            == (resident - 2) * stride
        )
        assert debug_view(plain).host.arena.nbytes / n < debug_view(spec).host.arena.nbytes / n
        _train(spec, models[0])
        _train(plain, models[1])
        _train(ref, models[2])
        assert debug_view(spec).host_stats["committed"] > 0  # speculation did run on one side
        for a, b, c in zip(models[0].parameters(), models[1].parameters(), models[2].parameters()):
            assert torch.equal(a, b)
            assert_close(a, c, dtype=torch.float32)
        sa, sb = spec.state_dict()["state"], plain.state_dict()["state"]
        for i in sa:
            for k in sa[i]:
                assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)


def test_a_non_speculative_exact_step_writes_a_spare_bank_and_flips():
    """Without speculation an exact step still writes a spare bank and commits by flipping
    the subgroup's bank (a step failing mid-way must not tear committed state): the pool's
    two banks are what it needs."""
    model = _bigger_model()
    with _opt(model, speculative=False) as opt:
        view = debug_view(opt)
        banks = {sg: view.committed_bank(sg) for sg in view.host_subgroups()}
        _train(opt, model, steps=1)
        assert view.host_stats["stepped"] == len(banks) and view.host_stats["committed"] == 0
        for sg, bank in banks.items():
            assert view.committed_bank(sg) != bank, sg


@pytest.mark.parametrize("case", ["inverse", "nvme_only", "explicit"])
def test_spare_pool_only_where_it_can_be_used(case, tmp_path):
    """rollback="inverse" steps in place and an nvme step borrows the io banks: neither gets a
    spare pool; an explicit spare_banks is kept as asked, speculation or not."""
    model = _bigger_model()
    kw = {
        "inverse": dict(rollback="inverse"),
        "nvme_only": dict(nvme_fraction=1.0, nvme_path=str(tmp_path)),
        "explicit": dict(speculative=False, spare_banks=3),
    }[case]
    with _opt(model, **kw) as opt:
        view = debug_view(opt)
        want = 3 if case == "explicit" else 0
        assert opt.plan.spare_banks == want
        io = 2 * view.host.io_banks
        assert view.host.spare_bytes == (want + io) * view.host.banks.bank_stride
        _train(opt, model, steps=2)


# ----------------------------------------------------------------- 3. populating the arena
def _rss_of(addr_lo, nbytes, pid="self") -> int:
    """Rss bytes of the mapping starting at addr_lo in /proc/PID/smaps."""
    found = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = lo == addr_lo and hi - lo == nbytes
            elif found and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError(f"no mapping at {addr_lo:#x} of {nbytes} bytes")


def test_background_population_finishes_and_is_waited_for():
    """The `later` ranges are reserved at once and populated by a thread; wait_populated()
    returns only once the region asked for is in memory, and the whole arena ends populated."""
    from hybrid_opt import shm

    arena = shm.SharedArena(256 << 20, "hybrid_opt-test", later=[(64 << 20, 192 << 20)])
    try:
        if not arena.populated:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        base = shm.address(arena.mm)
        assert _rss_of(base, arena.nbytes) >= 64 << 20  # the part populated now
        arena.wait_populated(128 << 20, 64 << 20, timeout_s=30)
        assert _rss_of(base, arena.nbytes) >= 192 << 20  # in order: everything up to there
        arena.wait_populated(timeout_s=30)
        assert not arena.populating
        assert _rss_of(base, arena.nbytes) == arena.nbytes
    finally:
        arena.close()


def _gate_background(monkeypatch):
    """Holds every background population thread (not the ones populating now) at its first
    chunk until the returned event is set (bounded)."""
    from hybrid_opt import populate as pop

    gate, real = threading.Event(), pop.madvise

    def held(addr, nbytes, advice=pop.MADV_POPULATE_WRITE):
        if threading.current_thread().name == "hybrid_opt-populate":
            gate.wait(30)
        return real(addr, nbytes, advice)

    monkeypatch.setattr(pop, "madvise", held)
    return gate


@pytest.mark.usefixtures("shmem_without_huge_pages")
def test_a_step_that_needs_a_bank_not_yet_populated_waits_for_it(monkeypatch):
    """A bank handed out before the background population reached it is waited for: the
    step blocks until it is populated, and past the tier's timeout it raises, naming the
    cause, with the bank back in the pool."""
    from helpers import inputs

    gate = _gate_background(monkeypatch)
    tier = host_mod.HostTier([1 << 20] * 3, spare_banks=2, timeout_s=30.0)
    try:
        if not tier.arena.populated:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert tier.arena.populating
        grad = torch.ones(1 << 20)
        free = list(tier.pool.free)
        tier.client.timeout_s = 0.3
        with pytest.raises(TimeoutError, match=r"GB of shared memory .* still not populated, none of it for"):
            tier.stepping.step(0, grad, inputs(1))
        assert sorted(tier.pool.free) == sorted(free)
        tier.client.timeout_s = 30.0
        done = []
        t = threading.Thread(target=lambda: done.append(tier.stepping.step(0, grad, inputs(1))))
        t.start()
        t.join(0.5)
        assert not done and t.is_alive()  # waiting for its bank
        gate.set()
        t.join(30)
        assert done == ["stepped"]
        assert not tier.arena.populating
    finally:
        gate.set()
        tier.close()


def test_a_slow_population_that_makes_progress_is_waited_for_not_an_error(monkeypatch):
    """The bound on waiting for a bank is on the population's progress, not on its total time:
    a big arena populated by one thread takes minutes (8 B of moments per param at ~1 GB/s),
    and a step must not fail because the bank it needs comes late in the order."""
    from hybrid_opt import populate as pop
    from hybrid_opt import shm

    real = pop.madvise

    def slow(addr, nbytes, advice=pop.MADV_POPULATE_WRITE):
        if threading.current_thread().name == "hybrid_opt-populate":
            time.sleep(0.1)
        return real(addr, nbytes, advice)

    monkeypatch.setattr(pop, "madvise", slow)
    page = shm.PAGE
    arena = shm.SharedArena(17 * page, "hybrid_opt-test", later=[(k * page, page) for k in range(1, 17)])
    try:
        if not arena.populated:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        arena.wait_populated(16 * page, page, timeout_s=0.5)  # ~1.6 s in all, a chunk every 0.1 s
        assert not arena.populating
    finally:
        arena.close()


def test_the_population_has_ended_once_its_last_chunk_is_populated(monkeypatch):
    """`populating` turns False the moment a wait for the last chunk can return, not when the
    thread has exited: on Python 3.13 a thread stays alive until its OS thread has, and a waiter
    woken by the last chunk saw it running (the two tests above failed 1 run in 3 there). The
    thread is held here past its last chunk, on its way out."""
    import types as pytypes

    from hybrid_opt import populate as pop
    from hybrid_opt import shm

    leaving, release = threading.Event(), threading.Event()
    calls = []

    def perf_counter():  # the thread's second call is its last act, after the last chunk
        if threading.current_thread().name == "hybrid_opt-populate":
            calls.append(1)
            if len(calls) == 2:
                leaving.set()
                release.wait(30)
        return time.perf_counter()

    monkeypatch.setattr(
        pop, "time", pytypes.SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic)
    )
    page = shm.PAGE
    arena = shm.SharedArena(5 * page, "hybrid_opt-test", later=[(k * page, page) for k in range(1, 5)])
    try:
        if not arena.populated:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert leaving.wait(30), "the population thread never finished its chunks"
        arena.wait_populated(timeout_s=5)
        assert not arena.populating  # its thread is still alive, held above
    finally:
        release.set()
        arena.close()


def test_waiting_for_a_populated_region_does_not_scan_every_chunk():
    """step() waits for each host subgroup's banks: once the population is done that costs
    nothing per chunk (it was a scan of every chunk per bank, O(subgroups²) per step), and
    while it runs the chunk a region ends in is found by bisection, as the scan found it."""
    from hybrid_opt import populate as pop
    from hybrid_opt import shm

    page = shm.PAGE
    ranges = [(k * 3 * page + page, 2 * page) for k in range(40)]
    arena = shm.SharedArena(120 * page, "hybrid_opt-test", prefault=False)
    try:
        bp = pop.BackgroundPopulate(shm.address(arena.mm), ranges, name="hybrid_opt-populate-test")
        for off in range(0, 121 * page, page // 2):
            for n in (1, page, 3 * page, 7 * page):
                linear = max(
                    [k for k, (a, m) in enumerate(bp._chunks) if a < off + n and off < a + m], default=-1
                )
                assert bp._last_chunk(off, n) == linear, (off, n)
        bp.wait(timeout_s=30)

        def scan(*a):
            raise AssertionError("wait() looked for a chunk after the population had finished")

        bp._last_chunk = scan
        for k in range(40):
            bp.wait(k * 3 * page, 3 * page, timeout_s=1)
        bp.stop()
    finally:
        arena.close()


@pytest.mark.usefixtures("shmem_without_huge_pages")
def test_close_during_background_population_stops_it(monkeypatch):
    """close() while the population runs ends its thread (no thread is left running over
    unmapped memory, none keeps a trainer-only affinity). The population is slowed so that it
    is still running at close(): unslowed it ends before a small optimizer is built."""
    from hybrid_opt import populate as pop

    real = pop.madvise

    def slow(addr, nbytes, advice=pop.MADV_POPULATE_WRITE):
        if threading.current_thread().name == "hybrid_opt-populate":
            time.sleep(0.2)
        return real(addr, nbytes, advice)

    monkeypatch.setattr(pop, "madvise", slow)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 2.1M params, spare banks ~25 MB
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, subgroup_numel=1 << 18)
    if not debug_view(opt).host.arena.populated:
        opt.close()
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert debug_view(opt).host.arena.populating  # close() below runs mid-population
    t0 = time.perf_counter()
    opt.close()
    assert time.perf_counter() - t0 < 10.0
    assert not [t for t in threading.enumerate() if t.name.startswith("hybrid_opt-populate")]


@pytest.mark.usefixtures("shmem_without_huge_pages")
def test_missing_memory_is_a_memory_error_at_construction(monkeypatch):
    """Memory the arena cannot reserve is a MemoryError from the constructor (the background
    part included: it is reserved up front), naming the size and what to do."""
    import ctypes
    import errno

    from hybrid_opt import populate as pop

    class NoSpace:
        def __init__(self):
            self.real = pop._lib()

        def __getattr__(self, name):
            if name != "fallocate":
                return getattr(self.real, name)

            def fail(*a):
                ctypes.set_errno(errno.ENOSPC)
                return -1

            return fail

    monkeypatch.setattr(pop, "_libc", NoSpace())
    with pytest.raises(
        MemoryError, match=r"cannot allocate .* GB of shared memory \(hybrid_opt-host\) .*spare_banks"
    ):
        HybridAdamW(_bigger_model().parameters(), offload_fraction=1.0, subgroup_numel=SUBGROUP)


def test_populating_now_uses_one_thread_per_core_over_page_aligned_chunks(monkeypatch):
    """populate() splits the mapping into page-aligned chunks that every thread takes from
    (Python's mmap.madvise holds the GIL: the calls go through ctypes, which releases it)."""
    import mmap

    from hybrid_opt import populate as pop
    from hybrid_opt import shm

    seen, real = [], pop.madvise

    def recording(addr, nbytes, advice=pop.MADV_POPULATE_WRITE):
        seen.append((threading.current_thread().name, addr, nbytes))
        time.sleep(0.01)  # long enough that one thread cannot take every chunk alone
        return real(addr, nbytes, advice)

    monkeypatch.setattr(pop, "madvise", recording)
    arena = shm.SharedArena(pop.CHUNK * 4 + mmap.PAGESIZE, "hybrid_opt-test", prefault=False)
    try:
        base = shm.address(arena.mm)
        if not shm.populate(arena.mm, threads=2):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert len({name for name, _, _ in seen}) == 2
        assert all((a - base) % mmap.PAGESIZE == 0 and n % mmap.PAGESIZE == 0 for _, a, n in seen)
        assert sorted((a - base, n) for _, a, n in seen)[-1] == (pop.CHUNK * 4, mmap.PAGESIZE)
        assert sum(n for _, _, n in seen) == arena.nbytes
        assert _rss_of(base, arena.nbytes) == arena.nbytes
    finally:
        arena.close()


@pytest.mark.gpu
def test_a_pinned_arena_is_populated_whole_before_it_is_pinned():
    """cudaHostRegister locks every page: a pinned arena leaves nothing to the background
    (written against CUDA's documented semantics; runs only where CUDA is present)."""
    from hybrid_opt import shm

    tier = host_mod.HostTier([1 << 20] * 3, spare_banks=2, pin=True)
    try:
        assert tier.arena.pinned and not tier.arena.populating
        assert _rss_of(shm.address(tier.arena.mm), tier.arena.nbytes) == tier.arena.nbytes
        tier.arena.wait_populated(timeout_s=1.0)  # returns at once: nothing in the background
    finally:
        tier.close()
