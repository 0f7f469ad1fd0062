"""The device path's host traffic: what step() must read from the device (one combined read,
at most one sync per step), the device tier's per-step constants (no per-step tensors), and
the clocks "auto" times backward and the device step with (GPU time on CUDA, read lazily).

CPU tests check every piece of this that runs without CUDA (the combined read, the float
grad scale and its bits, the clock chosen by device, the lazy reading of marks through an
injected clock); `gpu` tests count the syncs with torch.cuda.set_sync_debug_mode and check
that "auto" measures GPU time.
"""

import importlib
import warnings

import pytest
import torch
from helpers import KERNEL_DEVICE, needs_kernels
from tolerances import assert_close
from torch import nn

import gpu_kernels
import hybrid_opt.stepping as stepping_module
from hybrid_opt import HybridAdamW
from hybrid_opt.clocks import CudaClock, HostClock, clock_for
from hybrid_opt.state import layout as L
from hybrid_opt.step_stats import MAX_UNREAD_SAMPLES
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.device import DeviceTier, read_scalars
from hybrid_opt.tiers.inputs import AdamInputs

# the scheduler's synthetic rates (as tests/test_scheduler.py): "auto" keeps everything on
# the device tier and never measures the machine
SLOW_HOST = dict(
    host_adam_gelems_per_s=0.001,
    device_adam_gbps=40.0,
    device_adam_gbps_with_worker=20.0,
    h2d_gbps=5.0,
    d2h_gbps=5.0,
    trainer_slowdown_with_worker=1.6,
    backward_slowdown_with_host_adam=1.1,
)


def _net(device="cpu", width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2)).to(device)


def _backward(model, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, model[0].in_features, generator=g).to(device)
    model(x).square().mean().backward()


# ============================================================================= the combined read
def test_read_scalars_reads_every_kind_exactly_in_one_copy_per_device(monkeypatch):
    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacks.append(len(ts)) or real_stack(ts, *a, **k))
    norm_sq = torch.tensor(1234.5678901234567, dtype=torch.float64)  # fp64 kept to the last bit
    found = torch.ones(1)
    scale = torch.tensor([65536.0], dtype=torch.bfloat16)
    out = read_scalars((found, None, scale, 2.5, norm_sq))
    assert out == [1.0, None, 65536.0, 2.5, 1234.5678901234567]
    assert all(isinstance(v, float) for v in out if v is not None)
    assert stacks == [3], "the tensors of one device must be read in one copy"
    assert read_scalars((None, None)) == [None, None] and stacks == [3]  # nothing to read: no copy
    with pytest.raises(ValueError, match="value 0 has 2 elements"):
        read_scalars((torch.zeros(2),))


@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("scaler", [False, True], ids=["noscaler", "scaler"])
def test_step_reads_the_device_once_per_step(monkeypatch, clip, scaler):
    """found_inf, the loss scale and clipping's norm² go through one read_scalars call per step
    (the one sync on a GPU), and the step still follows torch."""
    calls = []
    real = stepping_module.read_scalars
    monkeypatch.setattr(stepping_module, "read_scalars", lambda vs: calls.append(vs) or real(vs))
    model, ref_model = _net(), _net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    gs_ref = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0, max_grad_norm=clip) as opt:
        for i in range(3):
            for m, o, s in ((model, opt, gs), (ref_model, ref, gs_ref)):
                o.zero_grad()
                g = torch.Generator().manual_seed(i)
                loss = m(torch.randn(4, 8, generator=g)).square().mean()
                (s.scale(loss) if s else loss).backward()
            if clip:
                if gs_ref:
                    gs_ref.unscale_(ref)
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
            for o, s in ((ref, gs_ref), (opt, gs)):
                if s:
                    s.step(o)
                    s.update()
                else:
                    o.step()
        assert len(calls) == 3
        if scaler:
            assert all(isinstance(c[0], torch.Tensor) and isinstance(c[1], torch.Tensor) for c in calls)
        assert (opt.last_grad_norm is not None) == bool(clip)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert_close(a, b)


# ============================================================================= the device tier
def _device_tier(numels=(300, 77)):
    params = [torch.randn(n, device=KERNEL_DEVICE) for n in numels]
    sgs = L.layout_group(params, 0, 0, 1 << 20, 0)
    for p in params:
        p.grad = torch.randn_like(p)
    return DeviceTier(sgs, amsgrad=False), sgs, params


@needs_kernels
def test_device_tier_passes_the_grad_scale_as_a_float(monkeypatch):
    """No per-step tensor for the combined grad scale: the launcher gets a Python float (a
    Triton fp32 argument), the sign of maximize folded in; once the launch table is cached a
    step builds no tensor from Python values at all."""
    seen = []
    real = gpu_kernels.FusedAdam.step  # fused_adam_ and the tier's prepared launches step through it
    monkeypatch.setattr(
        gpu_kernels.FusedAdam, "step", lambda self, **k: seen.append(k["grad_scale"]) or real(self, **k)
    )
    tier, sgs, params = _device_tier()
    hp = AdamInputs(0, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, -1.0)
    work = [(sgs[0].index, sl, hp, 1) for sl in sgs[0].slices]
    tier._step_cuda(work, 0.25, None)  # the first launch builds (and caches) its table
    before = [p.clone() for p in params]

    def no_tensor(*a, **k):
        raise AssertionError("torch.tensor called during a device step")

    monkeypatch.setattr(torch, "tensor", no_tensor)
    tier._step_cuda([(i, sl, hp, 2) for i, sl, _, _ in work], 0.25, None)
    assert seen == [-0.25, -0.25] and all(type(s) is float for s in seen)
    assert all(not torch.equal(a, b) for a, b in zip(params, before))


def _two_tiers_stepped(steps, edit):
    """The same device tier twice: one through its prepared launches, one with them off (each
    step checks the tensors and launches afresh over contiguous copies of the grads); `edit(params, k)` changes the grads before
    step k. Returns both tiers' params and moments."""
    out = []
    for prepared in (True, False):
        torch.manual_seed(11)
        tier, sgs, params = _device_tier((300, 77, 4099))
        if not prepared:  # no key: every step checks the tensors and launches over grad copies
            tier._launch_key = lambda *a, **k: None
        hp = AdamInputs(0, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, 1.0)
        for k in range(1, steps + 1):
            edit(params, k)
            tier._step_cuda([(sg.index, sl, hp, k) for sg in sgs for sl in sg.slices], 0.5, None)
        out.append(
            [p.detach().clone() for p in params]
            + [t.clone() for st in tier.state.values() for t in st.values()]
        )
    return out


@needs_kernels
def test_prepared_device_launches_step_the_bits_of_fresh_ones():
    """Grads rewritten in place (the prepared launch is found again) and grads made anew at
    other addresses (a new one is prepared): the bits of checking and launching afresh."""

    def edit(params, k):
        gen = torch.Generator().manual_seed(k)
        for p in params:
            new = torch.randn(p.shape, generator=gen).to(p.device)
            if k % 2:
                p.grad.copy_(new)
            else:
                p.grad = new.clone()  # new memory

    prepared, fresh = _two_tiers_stepped(4, edit)
    for a, b in zip(prepared, fresh):
        assert torch.equal(a, b)


@needs_kernels
def test_a_prepared_device_launch_makes_no_tensor_per_slice_and_holds_no_grad(monkeypatch):
    """The steady state: the second step finds its launch (no grad view, no tier view, one
    launch); the launch keeps no reference to a grad (zero_grad frees its memory); a dropped
    subgroup empties the cache."""
    import gc
    import weakref

    tier, sgs, params = _device_tier((300, 77))
    hp = AdamInputs(0, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, 1.0)
    work = [(sg.index, sl, hp, 1) for sg in sgs for sl in sg.slices]
    tier._step_cuda(work, 0.25, None)
    adam = importlib.import_module("gpu_kernels.adam")
    before = adam._fused_adam_kernel.launches

    def refuse(*a, **k):
        raise AssertionError("a per-slice tensor in the steady state")

    with monkeypatch.context() as m:
        m.setattr(L.ParamSlice, "grad_view", refuse)
        m.setattr(DeviceTier, "_views", refuse)
        tier._step_cuda([(i, sl, hp, 2) for i, sl, _, _ in work], 0.25, None)
    assert adam._fused_adam_kernel.launches == before + 1
    grads = [weakref.ref(p.grad) for p in params]
    for p in params:
        p.grad = None
    gc.collect()
    assert all(g() is None for g in grads), "a prepared launch holds a grad"
    assert tier._launches
    tier.drop(sgs[0].index, keep_subgroup=True)
    assert not tier._launches


@needs_kernels
def test_float_grad_scale_gives_the_bits_of_a_tensor_scale():
    """The float argument is rounded to fp32 in the kernel exactly as the 1-element fp32
    tensor it replaces was: the same bits."""
    torch.manual_seed(3)
    n = 1000
    state = tuple(t.to(KERNEL_DEVICE) for t in (torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 1e-2))
    g = torch.randn(n).to(KERNEL_DEVICE)
    results = []
    for scale in (0.1 * -1, torch.tensor([0.1 * -1], dtype=torch.float32, device=KERNEL_DEVICE)):
        p, m, v = (t.clone() for t in state)
        gpu_kernels.fused_adam_(
            [p],
            [g],
            [m],
            [v],
            step=3,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            grad_scale=scale,
        )
        results.append((p, m, v))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ============================================================================= clocks
def test_committed_host_params_reach_the_model_in_one_batched_copy():
    """A committed host subgroup's new params are copied into the model's params (each its own
    memory) in one batched call, whatever the gaps of params without grads: on CUDA a blocking
    copy is a host sync, so one per subgroup, not one per param. Counted on the CPU with a
    dispatch mode on the params' storages."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopiesInto(TorchDispatchMode):
        def __init__(self, ptrs):
            super().__init__()
            self.ptrs, self.count = ptrs, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dst = args[0][0] if func is torch.ops.aten._foreach_copy_.default else args[0]
            if (
                func in (torch.ops.aten.copy_.default, torch.ops.aten._foreach_copy_.default)
                and dst.untyped_storage().data_ptr() in self.ptrs
            ):
                self.count += 1
            return func(*args, **(kwargs or {}))

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))  # 6 params
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=1.0, speculative=False) as opt:
        assert len(debug_view(opt).subgroups) == 1 and len(debug_view(opt).subgroups[0].slices) == 6
        ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for frozen in (None, model[1].bias):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            if frozen is not None:
                frozen.grad = None  # a gap in the subgroup's params with grads
            before = frozen.detach().clone() if frozen is not None else None
            with CopiesInto(ptrs) as mode:
                opt.step()
            assert mode.count == 1, (frozen is not None, mode.count)
            if frozen is not None:
                assert torch.equal(frozen.detach(), before)  # no grad: not written


def test_clock_is_chosen_by_device():
    assert isinstance(clock_for("cpu"), HostClock)
    cuda = clock_for("cuda:1")  # building one touches no GPU
    assert isinstance(cuda, CudaClock) and cuda.device == torch.device("cuda:1")
    h = HostClock()
    a = h.mark()
    assert h.seconds(a, h.mark()) >= 0


class FakeClock:
    """Marks are counters; a mark completes only once `done` reaches it, as a CUDA event the
    GPU has not reached yet. seconds() never waits: None until both marks completed."""

    def __init__(self):
        self.n = self.done = 0

    def mark(self):
        self.n += 1
        return self.n

    def seconds(self, start, end):
        return None if end > self.done else (end - start) * 1e-3


def test_auto_on_cpu_times_with_the_host_clock():
    model = _net()
    with HybridAdamW(
        model.parameters(), lr=1e-2, offload_fraction="auto", subgroup_numel=64, calibration=SLOW_HOST
    ) as opt:
        view = debug_view(opt)
        for i in range(3):
            opt.zero_grad()
            _backward(model, seed=i)
            opt.step()
        assert isinstance(view.clock, HostClock)
        measured = opt.stats["measured"]
        assert measured["step"] == 3  # read at once on a CPU host
        assert measured["device_s"] > 0 and measured["backward_s"] > 0
        assert opt.stats["device_s"] > 0 and opt.stats["tiers"]["device"]["trainer_s"] > 0
        assert len(view.planner.samples) == 3


def test_auto_reads_marks_only_once_complete_and_a_step_late():
    """An injected clock whose marks complete late (a GPU behind the trainer): nothing is
    observed until they complete, then that step's sample is, exactly; the queue of unread
    steps stays bounded."""
    model = _net()
    with HybridAdamW(
        model.parameters(),
        lr=1e-2,
        offload_fraction="auto",
        subgroup_numel=64,
        calibration=SLOW_HOST,
        refit_every=0,
    ) as opt:
        view = debug_view(opt)
        clock = view.step_stats.clock = FakeClock()
        opt.zero_grad()
        _backward(model)  # marks 1, 2: the hooks on the first and last params
        opt.step()  # marks 3, 4 around the device step
        assert clock.n == 4
        assert view.planner.samples == [] and "measured" not in opt.stats
        clock.done = 4
        opt.zero_grad()
        _backward(model, seed=1)
        opt.step()  # reads step 1 now; step 2's marks (5..8) are not complete
        (sample,) = view.planner.samples
        assert sample.device_s == pytest.approx(1e-3) and sample.backward_s == pytest.approx(1e-3)
        assert opt.stats["measured"]["step"] == 1
        assert opt.stats["measured"]["device_s"] == pytest.approx(1e-3)
        for i in range(MAX_UNREAD_SAMPLES + 3):
            opt.zero_grad()
            _backward(model, seed=2 + i)
            opt.step()
        assert len(view.unread_samples) == MAX_UNREAD_SAMPLES
        clock.done = clock.n  # the GPU caught up with every step so far, not the next one
        opt.zero_grad()
        _backward(model, seed=99)
        opt.step()
        assert [entry[0] for entry in view.unread_samples] == [view.steps_taken]
        assert opt.stats["measured"]["step"] == view.steps_taken - 1


# ============================================================================= on a GPU
def _cuda_model(width=256):
    return _net("cuda", width)


def _syncs_during(fn):
    """How many synchronizing CUDA calls fn makes (torch's sync debug mode, warning each time)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
def test_device_step_without_clipping_or_scaler_never_syncs():
    model = _cuda_model()
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0) as opt:
        for i in range(2):  # compiles the kernel and fills the table cache
            opt.zero_grad()
            _backward(model, "cuda", seed=i)
            opt.step()
        opt.zero_grad()
        _backward(model, "cuda", seed=5)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "clip,scaler", [(1e-3, False), (None, True), (1e-3, True)], ids=["clip", "scaler", "clip+scaler"]
)
def test_device_step_syncs_once_with_clipping_or_a_scaler(clip, scaler):
    model, ref_model = _cuda_model(), _cuda_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    gs = torch.amp.GradScaler("cuda", init_scale=256.0) if scaler else None
    with HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.0, max_grad_norm=clip) as opt:
        counts = []
        for i in range(3):
            opt.zero_grad()
            ref.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).cuda()
            loss = model(x).square().mean()
            (gs.scale(loss) if gs else loss).backward()
            ref_model(x).square().mean().backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
            ref.step()
            torch.cuda.synchronize()
            counts.append(_syncs_during(lambda: gs.step(opt) if gs else opt.step()))
            if gs:
                gs.update()
        assert counts[1:] == [1, 1], counts
        if clip:
            assert isinstance(opt.last_grad_norm, float)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert_close(a, b)


@pytest.mark.gpu
def test_auto_on_cuda_measures_gpu_time_not_launch_time():
    """64M fp32 elements on the device tier: one step moves ≥ 28 bytes each through HBM
    (~0.4 ms at 4.8 TB/s on an H200), while launching it takes tens of microseconds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8192, 8192, bias=False)).cuda()
    elements = sum(p.numel() for p in model.parameters())
    # an explicit device budget: without one, "auto" on CUDA keeps every state off the device
    # until a refit has measured the iterations' peak (refit_every=0: never)
    with HybridAdamW(
        model.parameters(),
        lr=1e-4,
        offload_fraction="auto",
        calibration=SLOW_HOST,
        refit_every=0,
        device_memory_budget=16 << 30,
    ) as opt:
        assert opt.plan.summary()["device"]["share"] == 1.0, opt.plan
        for i in range(4):
            opt.zero_grad()
            model(torch.randn(16, 8192, device="cuda")).square().mean().backward()
            opt.step()
            torch.cuda.synchronize()
        assert isinstance(debug_view(opt).clock, CudaClock)
        measured = opt.stats["measured"]
        assert measured["step"] in (3, 4)
        floor = elements * 28 / 5e12
        assert measured["device_s"] >= floor, (measured, floor, opt.stats["device_s"])
        assert measured["backward_s"] is None or measured["backward_s"] >= 0


# ============================================================================= a CPU host's device tier
CPU_FORMATS = {
    "fp32": (torch.float32, {}),
    "amsgrad": (torch.float32, dict(amsgrad=True)),
    "bf16_master": (torch.bfloat16, {}),
    "bf16_remainders": (
        torch.bfloat16,
        dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ),
}


def _cpu_run(fmt: str, steps: int, monkeypatch=None, grads=None):
    """HybridAdamW at offload 0 on the CPU (the device tier's CPU path) over a small net in `fmt`;
    `grads(net, k)` may replace the grads before step k. With `monkeypatch`, each step's packed
    structs are checked against adam_call's (DeviceTier._cpu_fields). Returns the params."""
    import cpu_kernels
    from cpu_kernels import _api
    from hybrid_opt.tiers import device as device_module

    dtype, extra = CPU_FORMATS[fmt]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8)).to(dtype)
    opt = HybridAdamW(net.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.0, **extra)
    seen = []
    if monkeypatch is not None:
        real_step, real_steps = DeviceTier._step_cpu, cpu_kernels.adam_steps_

        def step_cpu(self, work, grad_scale):
            seen.append((self, work, grad_scale))
            return real_step(self, work, grad_scale)

        def adam_steps(calls):
            tier, work, scale = seen[-1]
            want = []
            for index, sl, hp, step in work:
                p, m, v, vmax, copy, rem = tier._views(index, sl)
                args = device_module._kernel_args(hp, step, scale, vmax, copy, rem)
                want.append(bytes(_api.adam_call(p, sl.grad_view(), m, v, check=False, **args)))
            assert [bytes(c) for c in calls] == want
            return real_steps(calls)

        monkeypatch.setattr(DeviceTier, "_step_cpu", step_cpu)
        monkeypatch.setattr(cpu_kernels, "adam_steps_", adam_steps)
    with opt:
        for k in range(1, steps + 1):
            opt.zero_grad()  # grads freed: each step's are new memory
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(6, 24, generator=g).to(dtype), torch.randn(6, 8, generator=g)
            ((net(x).float() - y) ** 2).mean().backward()
            if grads is not None:
                grads(net, k)
            if k == 3:
                opt.param_groups[0]["lr"] = 3e-3  # a changed hyperparameter reaches the cached structs
            opt.step()
    assert monkeypatch is None or len(seen) == steps
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("fmt", list(CPU_FORMATS))
def test_a_cpu_device_tiers_packed_structs_are_adam_calls_own(fmt, monkeypatch):
    """On a CPU host the device tier packs each slice's struct from fields it keeps per slice
    (DeviceTier._cpu_fields), setting the grad's address and the step's values: byte for byte
    the struct adam_call makes from the slice's tensors and that step's grad, for every format,
    with new grads each step and the lr changed."""
    _cpu_run(fmt, 4, monkeypatch)


def test_a_non_contiguous_grad_takes_adam_calls_own_path_with_the_same_bits():
    """A grad that is not contiguous (a transposed tensor set as .grad) is stepped through a
    contiguous copy, as before: the same bits as the same values in a contiguous grad."""

    def transposed(net, k):
        w = net[0].weight
        w.grad = w.grad.t().contiguous().t()  # the same values, column-major
        assert not w.grad.is_contiguous()

    assert all(torch.equal(a, b) for a, b in zip(_cpu_run("fp32", 3), _cpu_run("fp32", 3, grads=transposed)))


def test_a_cpu_device_tiers_steady_step_makes_no_tensor_per_slice(monkeypatch):
    """The second step finds every slice's fields (no grad view, no tier view); a dropped subgroup
    empties them, as it empties the prepared launches."""
    tier, sgs, params = _device_tier((300, 77))
    if params[0].device.type != "cpu":
        pytest.skip("the CPU path of the device tier")
    hp = AdamInputs(0, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, 1.0)
    work = [(sg.index, sl, hp, 1) for sg in sgs for sl in sg.slices]
    tier._step_cpu(work, 0.25)
    before = [p.clone() for p in params]

    def refuse(*a, **k):
        raise AssertionError("a per-slice tensor in the steady state")

    with monkeypatch.context() as m:
        m.setattr(L.ParamSlice, "grad_view", refuse)
        m.setattr(DeviceTier, "_views", refuse)
        tier._step_cpu([(i, sl, hp, 2) for i, sl, _, _ in work], 0.25)
    assert all(not torch.equal(a, b) for a, b in zip(params, before))
    assert tier._cpu_calls
    tier.drop(sgs[0].index)
    assert not tier._cpu_calls
