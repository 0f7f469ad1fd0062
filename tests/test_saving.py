"""save_state_dict(f): what torch.save(opt.state_dict(), f) writes, one param's state in memory
at a time (hybrid_opt/state/saving.py).

- torch.load of the file (weights_only, with and without mmap) gives state_dict()'s dict:
  every tensor bitwise, with its dtype, shape and device, and the param groups — at every
  placement and state format, with a tensor learning rate, and with torch's post hooks.
- Loaded into a fresh optimizer (from an mmap'ed file) it trains on bitwise as the original.
- The trainer's peak resident memory (the kernel's VmHWM, reset before each call) grows by
  about one param's state where state_dict() + torch.save grows by all of it
  (benchmarks/bench_checkpoint.py measures larger states).
"""

import gc
import inspect
import io
import os
import subprocess
import sys
import textwrap
from contextlib import ExitStack

import pytest
import torch
from test_checkpoint import PLACEMENTS, _assert_state_equal, hybrid
from test_optimizer import BF16, FP32, make_batches, make_net, train

from hybrid_opt import HybridAdamW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvme"))


def assert_same_dict(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    assert list(got["state"]) == list(want["state"])  # in state_dict()'s order too
    assert got["param_groups"] == want["param_groups"]
    _assert_state_equal(got, want)
    for i, st in want["state"].items():
        for k, v in st.items():
            g = got["state"][i][k]
            assert (g.dtype, g.shape, g.device) == (v.dtype, v.shape, v.device), (i, k)


def saved(opt, tmp_path, mmap: bool = False) -> dict:
    path = tmp_path / "opt.pt"
    opt.save_state_dict(path)
    return torch.load(path, weights_only=True, mmap=mmap)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_the_file_loads_as_state_dict(placement, dtype, nvme_dir, tmp_path):
    model = make_net(dtype)
    with hybrid(model.parameters(), placement, nvme_dir, amsgrad=dtype == FP32) as opt:
        train(model, opt, make_batches(3))
        want = opt.state_dict()
        for mmap in (False, True):
            assert_same_dict(saved(opt, tmp_path, mmap), want)
        buf = io.BytesIO()  # a file object too, as torch.save takes
        opt.save_state_dict(buf)
        buf.seek(0)
        assert_same_dict(torch.load(buf, weights_only=True), want)


@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_compressed_state_and_remainders_load_as_state_dict(placement, nvme_dir, tmp_path):
    model = make_net(BF16)
    with hybrid(
        model.parameters(),
        placement,
        nvme_dir,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        store_param_remainders=True,
    ) as opt:
        train(model, opt, make_batches(3))
        assert_same_dict(saved(opt, tmp_path), opt.state_dict())


def test_a_tensor_lr_and_post_hooks_are_kept(nvme_dir, tmp_path):
    """Tensors outside the state (a tensor lr) are written as torch writes them; torch's post
    hooks get the whole dict, and what they return is what is saved."""
    model = make_net()
    with hybrid(model.parameters(), "host", nvme_dir, lr=torch.tensor(1e-2)) as opt:
        train(model, opt, make_batches(2))
        got = saved(opt, tmp_path)
        assert isinstance(got["param_groups"][0]["lr"], torch.Tensor)
        assert_same_dict(got, opt.state_dict())

        def post(o, sd):
            sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"] + 1
            sd["extra"] = "kept"
            return sd

        opt.register_state_dict_post_hook(post)
        got, want = saved(opt, tmp_path), opt.state_dict()
        assert got["extra"] == "kept" and torch.equal(got["state"][0]["exp_avg"], want["state"][0]["exp_avg"])


def test_state_keeps_state_dicts_order_when_params_first_step_late(nvme_dir, tmp_path):
    """torch's own `state` is in the order params first stepped; state_dict()'s, by index."""
    model = make_net()
    with hybrid(model.parameters(), "host", nvme_dir) as opt:
        first = next(model.parameters())
        first.requires_grad_(False)
        train(model, opt, make_batches(1))
        first.requires_grad_(True)
        train(model, opt, make_batches(1))
        assert list(opt.state)[0] is not first  # the late param is last in torch's own order
        assert_same_dict(saved(opt, tmp_path), opt.state_dict())


def test_a_post_hooks_dict_is_written_as_it_returns_it(nvme_dir, tmp_path):
    model = make_net()
    with hybrid(model.parameters(), "host", nvme_dir) as opt:
        train(model, opt, make_batches(1))
        opt.register_state_dict_post_hook(lambda o, sd: {"optimizer": sd, "version": 3})
        got, want = saved(opt, tmp_path), opt.state_dict()
        assert list(got) == ["optimizer", "version"] == list(want) and got["version"] == 3
        assert_same_dict(got["optimizer"], want["optimizer"])


def test_a_one_element_device_param_is_written_as_its_own_element(tmp_path):
    """A scalar param (a logit scale, a gate) on the device tier is a view of its subgroup's
    buffer: the file holds its element, not the buffer once more."""
    scale = torch.nn.Parameter(torch.ones(()))
    linear = torch.nn.Linear(256, 256, bias=False)
    params = [scale, *linear.parameters()]
    with HybridAdamW(params, lr=1e-2, offload_fraction=0.0, subgroup_numel=1 << 20) as opt:
        (linear(torch.randn(4, 256)).sum() * scale).backward()
        opt.step()
        opt.save_state_dict(tmp_path / "opt.pt")
        got = torch.load(tmp_path / "opt.pt", weights_only=True)
        assert_same_dict(got, opt.state_dict())
        assert got["state"][0]["exp_avg"].untyped_storage().nbytes() == 4
        torch.save(opt.state_dict(), tmp_path / "torch.pt")
        # torch.save writes the subgroup's buffer (its views share it) once a key: about the same
        assert (tmp_path / "opt.pt").stat().st_size < 1.05 * (tmp_path / "torch.pt").stat().st_size


def test_a_symlinked_target_stays_a_link_and_a_file_keeps_its_mode(nvme_dir, tmp_path):
    model = make_net()
    with hybrid(model.parameters(), "host", nvme_dir) as opt:
        train(model, opt, make_batches(1))
        real, link = tmp_path / "ckpt-1.pt", tmp_path / "latest.pt"
        real.write_bytes(b"old")
        real.chmod(0o600)
        link.symlink_to(real.name)
        opt.save_state_dict(link)
        assert link.is_symlink() and (real.stat().st_mode & 0o777) == 0o600
        assert_same_dict(torch.load(real, weights_only=True), opt.state_dict())
        assert sorted(os.listdir(tmp_path)) == ["ckpt-1.pt", "latest.pt"]
        opt.save_state_dict(tmp_path / "new.pt")  # a new file: the mode torch.save gives one
        torch.save(opt.state_dict(), tmp_path / "torch.pt")
        assert (tmp_path / "new.pt").stat().st_mode == (tmp_path / "torch.pt").stat().st_mode
        with pytest.raises(IsADirectoryError, match="is a directory"):
            opt.save_state_dict(tmp_path)
        with pytest.raises(RuntimeError, match="Parent directory .*missing does not exist"):
            opt.save_state_dict(tmp_path / "missing" / "opt.pt")  # as torch.save says it


def test_it_imports_where_torch_writes_no_storage_alignment():
    """torch < 2.7 has no torch.serialization._get_storage_alignment (pyproject: torch >= 2.4)."""
    code = (
        "import io, zipfile, torch, torch.serialization as s\n"
        "kept = getattr(s, '_get_storage_alignment', None)  # None: an older torch itself\n"
        "if kept: del s._get_storage_alignment\n"
        "from hybrid_opt import HybridAdamW\n"
        "if kept: s._get_storage_alignment = kept  # torch's own zip writer reads it here (2.13)\n"
        "from hybrid_opt.state import saving; assert saving._get_storage_alignment is None\n"
        "p = torch.nn.Parameter(torch.randn(8)); opt = HybridAdamW([p], offload_fraction=0.0)\n"
        "p.grad = torch.randn(8); opt.step(); b = io.BytesIO(); opt.save_state_dict(b); b.seek(0)\n"
        "assert not [n for n in zipfile.ZipFile(b).namelist() if n.endswith('.storage_alignment')]; b.seek(0)\n"
        "assert torch.equal(torch.load(b, weights_only=True)['state'][0]['exp_avg'], opt.state_dict()['state'][0]['exp_avg'])\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("placement", ["mixed", "nvme"])
def test_loaded_from_the_mmaped_file_it_trains_on_bitwise(placement, nvme_dir, tmp_path):
    model = make_net(BF16)
    batches = make_batches(8)
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(model.parameters(), placement, nvme_dir))
        train(model, opt, batches[:4])
        opt.save_state_dict(tmp_path / "opt.pt")
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, batches[4:])
        model2 = make_net(BF16, seed=5)
        model2.load_state_dict(weights)
        opt2 = stack.enter_context(hybrid(model2.parameters(), placement, nvme_dir))
        opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True, mmap=True))
        train(model2, opt2, batches[4:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        _assert_state_equal(opt2.state_dict(), opt.state_dict())


def test_a_closed_optimizer_refuses_and_writes_nothing(nvme_dir, tmp_path):
    model = make_net()
    opt = hybrid(model.parameters(), "host", nvme_dir)
    train(model, opt, make_batches(1))
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.save_state_dict(tmp_path / "opt.pt")
    assert not (tmp_path / "opt.pt").exists()


_PEAK = textwrap.dedent("""
    import sys, torch
    from hybrid_opt import HybridAdamW

    def hwm_kib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))

    how, placement, path, nvme = sys.argv[1:5]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    kw = dict(offload_fraction=1.0) if placement == "host" else dict(offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme)
    with HybridAdamW(model.parameters(), lr=1e-3, subgroup_numel=1 << 20, **kw) as opt:
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from what is resident now
        base = hwm_kib()
        if how == "stream":
            opt.save_state_dict(path)
        else:
            torch.save(opt.state_dict(), path)
        print((hwm_kib() - base) / 1024)
""")


@pytest.mark.parametrize("malloc", ["default", "fixed"])
@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_the_peak_memory_of_a_save_is_about_one_params_state(placement, malloc, tmp_path):
    """8 x Linear(1024): 64 MiB of moments. state_dict() + torch.save raise the trainer's peak
    resident memory by about that; save_state_dict by one param's 8 MiB (with nvme, and the
    12 MiB of the subgroup read from its file) — with glibc's malloc as it comes (the save hands
    each param's blocks back: malloc_trim) and with a fixed mmap threshold (no freed blocks
    kept for reuse)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the kernel's peak RSS cannot be reset here (/proc/self/clear_refs)")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    peaks, sizes = {}, {}
    for how in ("full", "stream"):
        path = tmp_path / f"{how}.pt"
        nvme = tmp_path / f"nvme-{how}"
        nvme.mkdir()
        out = subprocess.run(
            [sys.executable, "-c", _PEAK, how, placement, str(path), str(nvme)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        peaks[how], sizes[how] = float(out.stdout.split()[-1]), path.stat().st_size
    assert peaks["full"] > 60, peaks  # the 64 MiB of moments copied (the measure works)
    assert peaks["stream"] < (12 if placement == "host" else 24), peaks  # 8 MiB (+ 12 read from nvme)
    assert abs(sizes["full"] - sizes["stream"]) < 64 << 10, sizes


def test_a_save_that_fails_part_way_leaves_the_file_that_was_there(nvme_dir, tmp_path, monkeypatch):
    """The file is written beside the path and renamed over it once complete; a failure part-way
    (a full disk, an interrupt) removes the partial file, and the optimizer is as it was."""
    from hybrid_opt.state import saving

    model = make_net()
    with hybrid(model.parameters(), "nvme", nvme_dir) as opt:
        train(model, opt, make_batches(2))
        path = tmp_path / "opt.pt"
        path.write_bytes(b"the previous checkpoint")
        want = opt.state_dict()
        write, calls = saving._Writer.write, []

        def failing(self, value):
            calls.append(1)
            if len(calls) == 5:
                raise OSError(28, "No space left on device")
            return write(self, value)

        monkeypatch.setattr(saving._Writer, "write", failing)
        with pytest.raises(OSError, match="No space left") as err:
            opt.save_state_dict(path)
        # the error kept holds no param's state: the state's generator was closed
        assert not [
            g
            for g in gc.get_objects()
            if inspect.isgenerator(g) and g.__name__ == "iter_state" and g.gi_frame is not None
        ], err
        assert path.read_bytes() == b"the previous checkpoint"
        assert sorted(os.listdir(tmp_path)) == ["opt.pt"]
        monkeypatch.setattr(saving._Writer, "write", write)
        assert_same_dict(saved(opt, tmp_path), want)
        train(model, opt, make_batches(1))
