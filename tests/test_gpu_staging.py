"""CUDA grad staging and arena pinning (skipped without a CUDA device; benchmarks/gpu_check.sh
runs them):

- with a CUDA model at offload 1.0, speculation stages grads on a side stream (not the
  default one) and gives the same bits as speculative=False, each speculation committed;
- backward with speculation never synchronizes: torch.cuda.set_sync_debug_mode("error")
  makes any synchronizing CUDA call in a grad hook raise (the hook's error then fails
  step()); a blocking D2H copy in the hook would be such a call;
- an attached GradScaler's scale is read once per backward, and its speculations commit;
- a CPU model never pins its arena, even with CUDA present; a CUDA model's arena is pinned;
- a failed cudaHostRegister (forced for real: the range is already registered) warns, leaves
  no error in the CUDA runtime (the next kernel launch check would report it), and training
  stays bitwise equal to the pinned run.
"""

import ctypes

import pytest
import torch
from torch import nn

import hybrid_opt.shm as shm
from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers import staging

pytestmark = pytest.mark.gpu

WIDTH, DEPTH = 256, 6  # 394,752 elements: 7 subgroups of 64Ki
HYPER = dict(lr=1e-2, weight_decay=0.1, subgroup_numel=1 << 16, spare_banks=16)


def make_model(device="cuda"):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(device)


def train(speculative, steps=5, *, no_sync=False, scaler=None, watch_streams=None):
    """Trains a CUDA model at offload 1.0; returns params, state, per-step speculation stats
    and whether the arena was pinned."""
    net = make_model()
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {"spec": [], "scale_reads": []}
    with HybridAdamW(net.parameters(), offload_fraction=1.0, speculative=speculative, **HYPER) as opt:
        if scaler is not None:
            opt.attach_grad_scaler(scaler)
            reads, get_scale = [], scaler.get_scale
            scaler.get_scale = lambda: reads.append(1) or get_scale()
        for k in range(steps):
            x = torch.randn(64, WIDTH, device="cuda", generator=g)
            y = torch.randn(64, WIDTH, device="cuda", generator=g)
            opt.zero_grad()
            loss = ((net(x) - y) ** 2).mean()
            if scaler is not None:
                reads.clear()
                loss = scaler.scale(loss)
            # a scaler's first backward reads its scale once (it has no scale tensor before)
            if no_sync and (scaler is None or k > 0):
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert debug_view(opt).speculation_error is None, debug_view(opt).speculation_error
            if scaler is not None:
                out["scale_reads"].append(len(reads))
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            out["spec"].append(dict(opt.stats["speculation"]))
        torch.cuda.synchronize()
        out["pinned"] = debug_view(opt).host.arena.pinned
        out["n_host"] = sum(1 for t in opt.plan.tiers if t != "device")
        out["stagers"] = debug_view(opt).host.io.stagers
        out["state"] = opt.state_dict()
    out["params"] = [p.detach().cpu() for p in net.parameters()]
    return out


def assert_bitwise(a, b):
    for i, (p, q) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(p, q), f"param {i} differs"
    for i, st in a["state"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"]["state"][i][k]), f"state[{i}][{k}] differs"


def assert_all_committed(run):
    for i, s in enumerate(run["spec"]):
        assert s["committed"] == run["n_host"] and s["redone"] == s["stepped"] == 0, (i, s)


def test_speculation_stages_on_a_side_stream_and_matches_plain_bitwise(monkeypatch):
    streams = []
    copy = staging.CudaStager.copy

    def watched(self, fill):
        def fill_and_note():
            streams.append((torch.cuda.current_stream(self.device), self.stream))
            fill()

        return copy(self, fill_and_note)

    monkeypatch.setattr(staging.CudaStager, "copy", watched)
    spec = train(True)
    monkeypatch.setattr(staging.CudaStager, "copy", copy)
    plain = train(False)
    assert_bitwise(spec, plain)
    assert_all_committed(spec)
    assert spec["pinned"] and plain["pinned"]
    assert streams, "no grad was staged through the CUDA stager"
    default = torch.cuda.default_stream()
    for current, side in streams:
        assert current == side and side != default, "a staging copy ran on the default stream"
    assert list(spec["stagers"]) == [torch.device("cuda", torch.cuda.current_device())]


def test_backward_with_speculation_never_synchronizes():
    spec = train(True, no_sync=True)
    assert_all_committed(spec)  # the hooks did speculate (under the debug mode)
    assert_bitwise(spec, train(False))


def test_an_attached_grad_scaler_is_read_by_zero_grad_not_by_the_hooks():
    """zero_grad() after update() copies the scale ahead (non-blocking, before the forward): no
    hook syncs for it but the first backward's, before the scaler has a scale tensor."""
    spec = train(True, scaler=torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1))
    plain = train(False, scaler=torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1))
    assert spec["scale_reads"] == [1] + [0] * (len(spec["spec"]) - 1), spec["scale_reads"]
    assert_all_committed(spec)
    assert_bitwise(spec, plain)


def test_backward_with_speculation_and_a_grad_scaler_never_synchronizes():
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1)
    spec = train(True, no_sync=True, scaler=scaler)
    assert_all_committed(spec)
    assert_bitwise(
        spec, train(False, scaler=torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1))
    )


def test_a_cpu_model_never_pins_even_with_cuda_present():
    net = make_model("cpu")
    with HybridAdamW(net.parameters(), offload_fraction=1.0, **HYPER) as opt:
        assert debug_view(opt).host is not None and not debug_view(opt).host.arena.pinned


def _peek(runtime):
    fn = runtime.lib.cudaPeekAtLastError
    fn.argtypes, fn.restype = [], ctypes.c_int
    return fn()


def test_a_failed_pin_clears_its_error_warns_and_training_stays_exact(monkeypatch):
    runtime = shm.cuda_runtime()
    assert runtime is not None, "the CUDA runtime library torch uses was not found in this process"
    decoy = shm.SharedArena(1 << 20)
    try:
        assert decoy.pin()
        ptr = decoy.tensor(0, 1, torch.uint8).data_ptr()
        # the scenario is real: registering a range again fails and leaves its error set
        assert runtime.lib.cudaHostRegister(ptr, decoy.nbytes, shm.CUDA_HOST_REGISTER_PORTABLE) != 0
        assert _peek(runtime) != 0
        assert runtime.clear_error() != 0 and _peek(runtime) == 0

        def failing_register(self, _ptr, _nbytes):  # the real call, on the registered range
            return self.lib.cudaHostRegister(ptr, decoy.nbytes, shm.CUDA_HOST_REGISTER_PORTABLE)

        monkeypatch.setattr(shm.CudaRuntime, "register", failing_register)
        monkeypatch.setattr(shm, "_pin_warned", False)
        with pytest.warns(RuntimeWarning, match="could not be pinned"):
            unpinned = train(True, steps=4)
        assert _peek(runtime) == 0, "a failed pin left its error in the CUDA runtime"
        # a kernel launch checks cudaGetLastError: a stale error would fail it here
        assert torch.ones(1024, device="cuda").mul_(2).sum().item() == 2048.0
        monkeypatch.undo()
    finally:
        decoy.close()
    pinned = train(True, steps=4)
    assert not unpinned["pinned"] and pinned["pinned"]
    assert_all_committed(unpinned)
    assert_bitwise(unpinned, pinned)
