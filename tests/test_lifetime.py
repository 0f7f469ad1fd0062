"""Who holds the optimizer and who acts on it (hybrid_opt/lifetime.py): an optimizer dropped
without close() is collected and frees everything the OS shows (its worker reaped, no
`memfd:hybrid_opt` mapping or descriptor, no nvme file), with a warning the default filters
show; a wrapper that forwards attribute reads (Lightning's LightningOptimizer shape) acts on
the optimizer it wraps and never closes it by being collected."""

import gc
import io
import os
import warnings
import weakref

import psutil
import pytest
import torch
from helpers import needs_public_dtensor

from hybrid_opt import HybridAdamW, UnclosedOptimizerWarning
from hybrid_opt.testing import debug_view


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _train(model, opt, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()


ARENAS = ("memfd:hybrid_opt-host", "memfd:hybrid_opt-device")  # the state's shared memory


def _arena_maps(pid="self", names=("memfd:hybrid_opt",)) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(any(name in line for name in names) for line in f)


def _arena_fds(pid="self", names=("memfd:hybrid_opt",)) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        n += any(name in link for name in names)
    return n


def _files(path) -> list:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def _drop_and_collect(opt_holder: list):
    ref = weakref.ref(opt_holder[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own default filters: a ResourceWarning would not show
        opt_holder.clear()
        gc.collect()
    return ref, [w for w in caught if issubclass(w.category, UnclosedOptimizerWarning)]


@pytest.mark.parametrize(
    "placement", [dict(offload_fraction=1.0), dict(offload_fraction=0.5, nvme_fraction=0.5)]
)
def test_an_optimizer_dropped_without_close_is_freed(tmp_path, placement):
    gc.collect()  # what earlier tests left in reference cycles (their tiers are closed)
    assert _arena_maps() == 0 and _arena_fds() == 0
    model = _model()
    if placement.get("nvme_fraction"):
        placement = dict(placement, nvme_path=str(tmp_path))
    held = [HybridAdamW(model.parameters(), lr=1e-2, subgroup_numel=256, **placement)]
    _train(model, held[0])
    pid = held[0].worker_pid
    assert pid is not None and _arena_maps() > 0
    if placement.get("nvme_path"):
        assert _files(tmp_path)
    ref, warned = _drop_and_collect(held)
    assert ref() is None, f"still held by: {gc.get_referrers(ref())}"
    assert len(warned) == 1 and "close()" in str(warned[0].message)
    assert not psutil.pid_exists(pid), "the worker was not reaped (a zombie, or still running)"
    assert _arena_maps() == 0 and _arena_fds() == 0
    assert _files(tmp_path) == []
    model(torch.randn(4, 32)).sum().backward()  # the model trains on: no hook of the dead optimizer left


@needs_public_dtensor  # process_group= (torch >= 2.5)
def test_a_process_group_optimizer_dropped_without_close_is_freed(tmp_path):
    """process_group's reduce hooks and the global forward pre-hook of its param gathers hold
    the optimizer weakly too (a gloo world of one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = _model()
        held = [
            HybridAdamW(
                model.parameters(),
                lr=1e-2,
                subgroup_numel=256,
                offload_fraction=1.0,
                process_group=dist.group.WORLD,
                overlap_param_gather=True,
            )
        ]
        _train(model, held[0])
        pid = held[0].worker_pid
        ref, warned = _drop_and_collect(held)
        assert ref() is None and len(warned) == 1
        assert not psutil.pid_exists(pid) and _arena_maps() == 0 and _arena_fds() == 0
        model(torch.randn(4, 32)).sum().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "placement", [dict(offload_fraction=0.5), dict(offload_fraction=0.5, nvme_fraction=0.25)]
)
def test_a_process_forked_from_the_trainer_holds_none_of_the_state(tmp_path, placement):
    """A DataLoader worker (forked from the trainer) used to keep every page of the optimizer's
    shared memory mapped and its nvme files open: after close() that memory and disk stayed
    allocated until the child exited, and its copy of the worker's request pipe kept the worker
    from seeing the trainer's exit. Forked, it holds none of them (no mapping, no descriptor)
    and runs the model; the optimizer's methods refuse there, naming the cause, and its close()
    lets go of nothing but its copy; the trainer trains on, bitwise a run with no fork."""
    import select
    import signal

    if placement.get("nvme_fraction"):
        placement = dict(placement, nvme_path=str(tmp_path))
    finals = []
    for fork in (True, False):
        model = _model()
        with HybridAdamW(model.parameters(), lr=1e-2, subgroup_numel=256, **placement) as opt:
            _train(model, opt)
            assert _arena_maps(names=ARENAS) >= 2  # the host tier's and the CPU device tier's
            if fork:
                # what else backs the optimizer: its nvme files and their lock (under tmp_path),
                # the worker's stderr file and its request pipe (EOF there tells it the trainer died)
                client = debug_view(opt).host.client
                backing = ARENAS + (str(tmp_path), "memfd:hybrid_opt-worker-stderr")
                backing += (os.readlink(f"/proc/self/fd/{client._req}"),)
                assert _arena_fds(names=backing) >= 3 + bool(placement.get("nvme_path"))
                report_r, report_w = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: runs the model; the optimizer is the parent's
                    code = 1
                    try:
                        os.close(report_r)
                        torch.set_num_threads(1)  # as a DataLoader worker: OpenMP's pool is not forked
                        ok = bool(torch.isfinite(model(torch.randn(4, 32))).all())
                        try:  # refused, naming the cause
                            _train(model, opt, 1)
                            refused = False
                        except RuntimeError as e:
                            refused = "a forked child holds none of its worker" in str(e)
                        opt.close()  # lets this copy go, touching nothing of the parent's
                        maps, fds = _arena_maps(names=ARENAS), _arena_fds(names=backing)
                        os.write(report_w, f"{maps} {fds} {ok:d} {refused:d}".encode())
                        signal.pause()  # alive until the parent is done
                    finally:
                        os._exit(code)
                os.close(report_w)
                try:
                    ready, _, _ = select.select([report_r], [], [], 60)
                    assert ready, "the forked child did not report within 60 s"
                    assert os.read(report_r, 64).decode().split() == ["0", "0", "1", "1"]
                    _train(model, opt)
                    opt.close()
                    # the child lives on and holds none of it: the memory goes with the trainer's
                    # last view of it, the files with close()
                    assert _arena_maps(pid, ARENAS) == _arena_fds(pid, backing) == 0
                    assert _arena_fds(names=ARENAS) == 0
                finally:
                    os.close(report_r)
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            else:
                _train(model, opt)
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_a_closed_optimizer_dropped_says_nothing():
    model = _model()
    held = [HybridAdamW(model.parameters(), lr=1e-2, subgroup_numel=256)]
    _train(model, held[0], 1)
    held[0].close()
    ref, warned = _drop_and_collect(held)
    assert ref() is None and warned == []


class _Forwarding:
    """LightningOptimizer's shape: an instance of a class made from this one and the wrapped
    optimizer's class, reading every missing attribute from the wrapped optimizer."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Forwarding" + type(optimizer).__name__, (type(self), type(optimizer)), {})

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def test_a_forwarding_wrapper_acts_on_the_optimizer_it_wraps():
    model = _model()
    opt = HybridAdamW(model.parameters(), lr=1e-2, subgroup_numel=256)
    twin_model = _model()
    twin = HybridAdamW(twin_model.parameters(), lr=1e-2, subgroup_numel=256)
    try:
        wrapper = _Forwarding(opt)
        assert isinstance(wrapper, HybridAdamW)
        own = dict(wrapper.__dict__)
        for m, o in ((model, wrapper), (twin_model, twin)):
            for _ in range(3):
                o.zero_grad()
                m(torch.randn(4, 32, generator=torch.Generator().manual_seed(1))).square().mean().backward()
                o.step()
        sd = wrapper.state_dict()
        buf = io.BytesIO()
        wrapper.save_state_dict(buf)
        buf.seek(0)
        assert torch.equal(
            torch.load(buf, weights_only=True)["state"][0]["exp_avg"], sd["state"][0]["exp_avg"]
        )
        wrapper.load_state_dict(sd)
        assert wrapper.__dict__ == own, set(wrapper.__dict__) - set(own)  # no write landed on it
        for a, b in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(a, b)
        # an old wrapper collected (Lightning rebuilds them) does not close the optimizer
        del wrapper
        gc.collect()
        assert not opt.closed and opt.worker_pid is not None
        _train(model, opt, 1)
        # an explicit close() through a wrapper closes the optimizer itself
        _Forwarding(opt).close()
        assert opt.closed and opt.worker_pid is None
        with pytest.raises(RuntimeError, match="was closed .* cannot step again: build a new one"):
            opt.step()
    finally:
        opt.close()
        twin.close()


_FORK_SCRIPT = r"""
import os, sys, time, torch
from hybrid_opt import HybridAdamW
nvme = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Linear(64, 64)
opt = HybridAdamW(m.parameters(), offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme, subgroup_numel=1024)
def train():
    opt.zero_grad(); m(torch.randn(4, 64)).square().mean().backward(); opt.step()
train()
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(nvme) for f in fs)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # an ordinary interpreter exit: atexit and the finalizers run in the child
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
    time.sleep(0.05)
else:
    if time.monotonic() >= deadline:
        os.kill(pid, 9); print("CHILD HUNG"); sys.exit(1)
assert sorted(os.path.join(d, f) for d, _, fs in os.walk(nvme) for f in fs) == files, "the child removed files"
train()
sd = opt.state_dict()  # reads the nvme files back
opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3000))]})
opt.param_groups[-1]["params"][0].grad = torch.randn(3000)
opt.step()
assert set(opt.plan.tiers) == {"nvme"}, opt.plan
opt.close()
print("OK")
"""


def test_a_forked_child_exiting_leaves_the_parents_nvme_tier_alone(tmp_path):
    """os.fork() copies the optimizer's exit hooks into the child: the child's interpreter exit
    must neither remove the parent's nvme directory (the swap directory's atexit) nor wait on
    I/O threads that stayed in the parent (the aio engine's finalizer). The child exits at once
    and the parent's files, checkpoints and new groups are intact."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
