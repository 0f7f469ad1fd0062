"""Helpers shared by several test modules (the tests directory is on sys.path)."""

import contextlib
import copy
import inspect
import io
import os
import signal
import threading
import time

import psutil
import torch

import cpu_kernels as ck
from hybrid_opt.distributed.local_shards import has_public_dtensor
from hybrid_opt.tiers.host import AdamInputs

# where gpu_kernels run in this process: CUDA where a GPU is present, else CPU tensors through
# Triton's interpreter (conftest sets TRITON_INTERPRET=1 only without CUDA). Tests of the device
# tier's CUDA logic make their tensors here, so they run on either host.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ======================================================== what the installed torch and triton offer
# The suite runs on every torch the GPU CI matrix installs (2.4 on; .github/workflows/gpu-ci.yml). A
# test of a feature that torch added later, or that compares with torch's own later behaviour, is
# skipped on an older torch, saying which.
def _torch_takes_named_params() -> bool:
    try:
        torch.optim.SGD([("w", torch.zeros(1, requires_grad=True))], lr=0.1)
    except TypeError:  # torch < 2.6: "optimizer can only optimize Tensors"
        return False
    return True


def skip_unless(ok: bool, reason: str):
    import pytest

    return pytest.mark.skipif(not ok, reason=reason)


TORCH = torch.__version__
TORCH_VERSION = tuple(int(x) for x in TORCH.split("+")[0].split(".")[:2])
# the distributed tests run FSDP2 on a CPU mesh over gloo, which torch does from 2.9 and as they
# expect from 2.10 (measured 2026-12-07: 2.6 has no event on a CPU stream, 2.7 refuses ReduceOp.AVG on
# gloo, 2.8 hands the optimizer grads whose norm at 2 ranks is twice the single-process one, 2.9 gives
# rank 1's shards new memory at the first step, which the master-restart counts do not expect);
# FSDP2 itself is 2.6's
FSDP2_ON_GLOO = (2, 10)
FSDP2_ON_GLOO_REASON = f"FSDP2 on a CPU mesh over gloo (the distributed tests' launches) is tested from torch 2.10, this is {TORCH}"
needs_named_params = skip_unless(
    _torch_takes_named_params(), f"torch {TORCH}'s optimizers take no named parameters (torch >= 2.6)"
)
needs_torch_adam_decoupled = skip_unless(
    "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters,
    f"torch {TORCH}'s Adam has no decoupled_weight_decay to compare with",
)
# the library's own rule (read by the version: importing torch.distributed.tensor costs a second)
needs_public_dtensor = skip_unless(
    has_public_dtensor(), f"torch {TORCH} has no public torch.distributed.tensor.DTensor (torch >= 2.5)"
)


def transformers_or_skip():
    """transformers, or the test (or module) skipped where it is not installed or does not run with
    this torch (transformers 5 takes no torch below 2.6: its models are then missing)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from transformers.utils import is_torch_available

    if not is_torch_available():
        pytest.skip(
            f"transformers {transformers.__version__} does not run with torch {TORCH}",
            allow_module_level=True,
        )
    return transformers


def __getattr__(name):
    # needs_kernels: the gpu_kernels run on KERNEL_DEVICE (CUDA, or Triton's interpreter, triton >=
    # 3.2, without one). Made on first use: asking imports triton, which the scripts that import this
    # module in a fresh interpreter do not need
    if name == "needs_kernels":
        import gpu_kernels

        why = gpu_kernels.unavailable_reason(KERNEL_DEVICE)
        globals()[name] = skip_unless(why is None, str(why))
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def thread_masks() -> dict:
    """Every thread's CPU affinity in this process (affinity is per thread on Linux)."""
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            masks[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return masks


def child_pids() -> set:
    """The pids of this process's children and theirs (workers, launchers), but for the
    background jobs' (background_jobs.py), whose processes (ptxas) come and go meanwhile."""
    import background_jobs

    jobs, out = background_jobs.groups(), set()
    for c in psutil.Process().children(recursive=True):
        try:
            if os.getpgid(c.pid) not in jobs:
                out.add(c.pid)
        except ProcessLookupError:
            pass  # ended meanwhile
    return out


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding path (longest mount-point prefix)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            mnt, typ = line.split()[1], line.split()[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind


def make_states(numels, *, amsgrad=False, moment_dtype=torch.float32, seed=0):
    """Mid-training states: non-zero moments, and max_exp_avg_sq above v for about half the
    elements (so both branches of amsgrad's max are taken)."""
    gen = torch.Generator().manual_seed(seed)
    states = []
    for n in numels:
        s = dict(
            p=torch.randn(n, generator=gen),
            m=(torch.randn(n, generator=gen) * 0.1).to(moment_dtype),
            v=(torch.rand(n, generator=gen) * 1e-2).to(moment_dtype),
        )
        if amsgrad:
            s["vmax"] = (s["v"].float() * 2 * torch.rand(n, generator=gen)).to(moment_dtype)
        states.append(s)
    return states


def make_grads(numels, dtype=torch.float32, *, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for n in numels]


def wait_gone(pid, timeout_s):
    """True once `pid` no longer runs: gone, or a zombie its parent can reap. A killed process's
    leader shows as a zombie while its other threads still exit (a worker's I/O threads, under
    load); until they have, its pipes stay open and waitpid() does not see it dead."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (
                psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                and len(os.listdir(f"/proc/{pid}/task")) <= 1
            ):
                return True
        except (psutil.NoSuchProcess, FileNotFoundError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _id(v):
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else None


def inputs(step=1, **over):
    kw = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    kw.update(over)
    return AdamInputs(**kw)


def load(tier, states):
    for sg, s in enumerate(states):
        tier.load_state(sg, s["p"], s["m"], s["v"], s.get("vmax"))


def ref_step(state, grad, inp: AdamInputs, copy_dtype=None):
    """The direct step of each run (the whole subgroup without runs), in place on `state`;
    returns the param copy of the stepped elements (others zero) when asked for one."""
    n = state["p"].numel()
    copy = torch.zeros(n, dtype=copy_dtype) if copy_dtype else None
    for off, k, step in inp.ranges(n):
        part = {key: t[off : off + k].clone() for key, t in state.items()}
        c = torch.empty(k, dtype=copy_dtype) if copy_dtype else None
        ck.adam_step_(
            part["p"],
            grad[off : off + k],
            part["m"],
            part["v"],
            max_exp_avg_sq=part["vmax"] if inp.amsgrad else None,
            param_copy=c,
            step=step,
            lr=inp.lr,
            beta1=inp.beta1,
            beta2=inp.beta2,
            eps=inp.eps,
            weight_decay=inp.weight_decay,
            decoupled=inp.decoupled,
            grad_scale=inp.grad_scale,
        )
        for key, t in part.items():
            state[key][off : off + k] = t
        if copy is not None:
            copy[off : off + k] = c
    return copy


def assert_bitwise_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    if not torch.equal(a.view(ints), b.view(ints)):
        bad = (a.view(ints) != b.view(ints)).nonzero().flatten()
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} elements differ, first at "
            f"{bad[0].item()}: {a[bad[0]].item()!r} vs {b[bad[0]].item()!r}"
        )


def run_compile_check(script: str) -> None:
    """Runs `script` (it compiles Triton kernels for sm_90, no GPU needed, and prints OK or
    SKIP <why>) in a fresh interpreter without TRITON_INTERPRET: the interpreter patches
    triton.language in this process."""
    import subprocess
    import sys

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert "OK" in out.stdout


def backing(t: torch.Tensor) -> str:
    """What the memory at t's first element is, from /proc/self/maps: the mapped file's path
    ("/memfd:hybrid_opt-host (deleted)", an nvme swap file), or "" for anonymous memory (a
    copy of its own: malloc, torch's CPU allocator)."""
    at = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= at < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"address {at:#x} is not mapped")


def with_fp32_masters(state: dict, params) -> dict:
    """`state` (a state_dict()["state"]) with every bf16 param's fp32 master under
    `master_param`: a remainder entry's `master_remainder` (int16, the tier's own) decoded with
    its param (hybrid_opt.fp32_master) and dropped, an fp32-master entry's `master_param` as it
    is; fp32 params have neither. Entries are new dicts over the same tensors. For comparing a
    whole state across formats (remainders or an fp32 master) where the master is what counts.

    Decode while the param still has the bits the state was taken with: a remainder is half of
    the master, the param the other half. `params`: the optimizer's params in index order."""
    from hybrid_opt import fp32_master

    params = list(params)
    out = {}
    for i, entry in state.items():
        st = {k: v for k, v in entry.items() if k != "master_remainder"}
        master = fp32_master(entry, params[i])
        if master is not None:
            st["master_param"] = master
        out[i] = st
    return out


def arena_rss(pid="self", inode=None) -> int:
    """Rss bytes of process `pid`'s mappings of host arenas (smaps: the pages it has in memory);
    of one arena's only, given its memfd's `inode` (an earlier test's arena, kept mapped by a view
    in a reference cycle until the garbage collector runs, is not this test's)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = "memfd:hybrid_opt-host" in line and (inode is None or int(head[4]) == inode)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@contextlib.contextmanager
def stopped(pid):
    """Process `pid` (a worker) stopped by SIGSTOP inside the block, so it is busy for certain;
    the block gets `resume_in(seconds)`, which continues it from a timer (a call that waits for it
    can start first). It is continued at the end whatever happens."""
    timers = []

    def resume_in(seconds: float) -> None:
        timers.append(threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)))
        timers[-1].start()

    os.kill(pid, signal.SIGSTOP)
    try:
        yield resume_in
    finally:
        for t in timers:
            t.cancel()
        os.kill(pid, signal.SIGCONT)


# The start of a script that cases_in_one_process() runs: released(), for the script's windows too.
_CASES_PRELUDE = r"""
import ctypes as _ctypes, gc as _gc
def released():
    _gc.collect()
    _ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: a reuse shows
"""
# Its end: `measure(*fields, path, nvme)`, which the script defines, for each case "a:b:..." in
# turn, with a file path and an nvme directory of its own.
_CASES_DRIVER = r"""
import json as _json, os as _os, sys as _sys
_root, _got = _sys.argv[1], {}
for _case in _sys.argv[2:]:  # one optimizer after another, each closed and its memory freed first
    _nvme = _os.path.join(_root, _case.replace(":", "-"))
    _os.mkdir(_nvme)
    _got[_case] = measure(*_case.split(":"), _os.path.join(_root, "ck.pt"), _nvme)
    released()
print(_json.dumps(_got))
"""


def cases_in_one_process(script: str, cases: list, root: str) -> dict:
    """{case: what `measure` returned} from one fresh interpreter running `script` (which
    defines measure(*fields, path, nvme) and may call released(): gc, then malloc_trim) over
    every case, one after another, under `root`.

    Memory tests measure rises within windows, so cases can follow one another once each has
    closed its optimizer and handed its memory back: a fresh interpreter per case would cost a
    torch import each (4-5 s on a CI runner) for nothing the windows can see. glibc returns
    every block of 256 KiB or more to the OS when it is freed (a fixed threshold, not its
    adaptive one), so RssAnon follows what is allocated and no case reuses what one before it
    freed."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(
        [sys.executable, "-c", _CASES_PRELUDE + script + _CASES_DRIVER, root, *cases],
        cwd=repo,
        env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 18)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def draw_grads(rng, params: list, none: float, zero: float) -> list:
    """A random history's grads for one pass (random_histories, zero_histories): per param, drawn
    from `rng` (a random.Random), None with probability `none`, "zero" with `zero`, else a
    tensor of the param's shape from its own seed."""
    grads = []
    for p in params:
        pick = rng.random()
        seed = rng.randrange(10**6)
        if pick < none:
            grads.append(None)
        elif pick < none + zero:
            grads.append("zero")
        else:
            grads.append(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return grads


def grads_loss(params: list, grads: list):
    """sum(p * g) over the params given a grad (None: the param takes no part), whose backward
    makes each grad `g` bit for bit; None where no param takes part (random histories)."""
    terms = [(p * g).sum().float() for p, g in zip(params, grads) if g is not None]
    return torch.stack(terms).sum() if terms else None


def backward_with(params: list, grads: list) -> None:
    """A backward pass whose grads are `grads`, accumulated into p.grad as a training loop's are."""
    loss = grads_loss(params, grads)
    if loss is not None:
        loss.backward()


def grads_pattern(grads: list) -> str:
    """A random history's pass in a failure message: "g" a grad, "0" zeros, "-" none."""
    return "".join("-" if g is None else "0" if isinstance(g, str) else "g" for g in grads)


def reloaded_state(opt, via: str) -> dict:
    """The optimizer's state dict as a new one loads it: "memory" a deep copy of `state_dict()`;
    "file" `save_state_dict` written to a file and read back as a checkpoint is (weights_only);
    "fp32" the same with fp32=True (what torch.optim.AdamW loads)."""
    if via == "memory":
        return copy.deepcopy(opt.state_dict())
    buffer = io.BytesIO()
    opt.save_state_dict(buffer, fp32=via == "fp32")
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
