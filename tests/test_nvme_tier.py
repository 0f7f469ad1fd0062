"""The nvme tier: subgroups whose state lives in two-slot swap files (HostTier(nvme=[...])).

What is exact is asserted bitwise (integer views, so -0.0 vs +0.0 would show): an nvme
subgroup is stepped by the same kernel from the same inputs as a resident one, only its
state travels through a file, so its trajectory must be the host tier's and the direct
`cpu_kernels.adam_step_` on clones, bit for bit, through speculation, commit, redo, rollback
and worker restarts. Faults are real: a byte flipped in a swap file, a file-size limit
(RLIMIT_FSIZE, in a child process: EFBIG, never a signal — Python ignores SIGXFSZ), bad
nvme_paths, a trainer killed with SIGKILL. Swap files go to a real disk (O_DIRECT), never tmpfs.
"""

import copy
import errno
import fcntl
import io
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    child_pids,
    fs_type,
    inputs,
    load,
    make_grads,
    make_states,
    ref_step,
    wait_gone,
)
from tolerances import assert_close
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import NVME
from hybrid_opt.swap import PREFIX
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.host import AdamInputs, HostTier
from hybrid_opt.tiers.host_io import TornState
from hybrid_opt.worker.client import WorkerError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOT = 4096
# one element, a few, exactly one slot, one slot + 1, and three pieces with a ragged tail;
# nvme and resident subgroups side by side in one tier
NUMELS = [1, 100, SLOT, SLOT + 1, 10_000 + 17]
NVME_FLAGS = [True, False, True, False, True]
BIG = 4  # the subgroup larger than a staging slot, stepped in runs
FAULT_ENV = "HYBRID_OPT_WORKER_FAULT"
TIMEOUT_S = 20.0  # a hung worker fails the test in seconds, not the default two minutes


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture
def nvme_dir(tmp_path):
    """An empty directory on a real disk filesystem (tmp_path unless /tmp is tmpfs)."""
    if fs_type(str(tmp_path)) not in ("tmpfs", "ramfs"):
        path = tmp_path / "nvme"
        path.mkdir()
        yield str(path)
        return
    root = os.path.join(REPO, "bench_out")  # git-ignored
    os.makedirs(root, exist_ok=True)
    path = tempfile.mkdtemp(prefix="test_nvme_", dir=root)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- helpers
def clone_states(states):
    return [{k: t.clone() for k, t in s.items()} for s in states]


_KEYS = {"param": "p", "exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "vmax"}


def read_state(tier, sg):
    """The committed state through the public reader: a file read for an nvme subgroup."""
    return {_KEYS[k]: t.clone() for k, t in tier.state(sg).items()}


def assert_state_equal(got, want, what):
    assert set(got) == set(want), f"{what}: state keys {set(got)} vs {set(want)}"
    for k in want:
        assert_bitwise_equal(got[k], want[k], f"{what} {k}")


def states_equal(got, want) -> bool:
    try:
        assert_state_equal(got, want, "")
        return True
    except AssertionError:
        return False


def assert_tier_equals(tier, states, what=""):
    for sg, want in enumerate(states):
        assert_state_equal(read_state(tier, sg), want, f"{what} subgroup {sg}")


def new_tier(numels, nvme, nvme_path, **kw):
    base = dict(slot_numel=SLOT, staging_slots=3, timeout_s=TIMEOUT_S)
    base.update(kw)
    return HostTier(list(numels), nvme=nvme, nvme_path=nvme_path, **base)


def slot_bytes(tier, sg, slot) -> bytes:
    with open(tier.swap.file(sg), "rb") as f:
        f.seek(slot * tier.io_bytes)
        return f.read(tier.io_bytes)


def flip_byte(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        (b,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def wait_until(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def child_env():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(FAULT_ENV, None)
    return env


# ------------------------------------------------------------------ 1. the host tier's trajectory
def _trajectory_plan():
    """(speculated subgroups, their inputs, stepped subgroups, final inputs, overflow) per
    iteration; inputs are per subgroup. Every outcome occurs, and the big nvme subgroup is
    stepped in runs (a run across a slot boundary, a one-element run, gaps, own step counts)
    through each of commit, redo and plain step."""
    all_sg = range(len(NUMELS))

    def each(inp, big=None):
        return {sg: (big if sg == BIG and big is not None else inp) for sg in all_sg}

    runs3 = ((0, 5000, 3), (6000, 1, 7), (7000, 3017, 3))
    runs4 = ((0, SLOT, 4), (8000, 2017, 2))
    runs5 = ((100, 9917, 5),)
    return [
        (all_sg, each(inputs(1)), all_sg, each(inputs(1)), False),  # committed
        (all_sg, each(inputs(2)), all_sg, each(inputs(2)), True),  # skipped
        (all_sg, each(inputs(2)), all_sg, each(inputs(2, grad_scale=0.5)), False),  # clipped: redone
        (
            [0, 2, 4],
            each(inputs(3), inputs(3, runs=runs3)),  # mixed: 0 dropped,
            [1, 2, 3, 4],
            each(inputs(3), inputs(3, runs=runs3)),
            False,
        ),  # 1, 3 stepped
        (
            [1, 3, 4],
            each(inputs(4, grad_version=(5,)), inputs(4, grad_version=(5,), runs=runs4)),
            all_sg,
            each(inputs(4, grad_version=(6,)), inputs(4, grad_version=(6,), runs=runs4)),
            False,
        ),
        ([], {}, all_sg, each(inputs(5, lr=3e-3), inputs(5, lr=3e-3, runs=runs5)), False),  # plain
    ]


TRAJECTORY_CONFIGS = [
    pytest.param(dict(), id="fp32"),
    pytest.param(dict(amsgrad=True), id="amsgrad"),
    pytest.param(dict(copy_dtype=torch.bfloat16), id="bf16_copy"),
    pytest.param(
        dict(amsgrad=True, copy_dtype=torch.float16, moment_dtype=torch.bfloat16, grad_dtype=torch.bfloat16),
        id="amsgrad_fp16_copy_bf16_moments_grads",
    ),
]


@pytest.mark.parametrize("config", TRAJECTORY_CONFIGS)
def test_nvme_trajectory_is_bitwise_the_host_tiers_and_the_direct_steps(nvme_dir, config):
    amsgrad = config.get("amsgrad", False)
    copy_dtype = config.get("copy_dtype")
    grad_dtype = config.get("grad_dtype", torch.float32)
    with ExitStack() as stack:
        nv = new_tier(NUMELS, NVME_FLAGS, nvme_dir, io_banks=3, **config)  # room for all
        stack.callback(nv.close)
        host = new_tier(NUMELS, None, None, **config)
        stack.callback(host.close)
        assert list(nv.nvme.values()) == NVME_FLAGS and nv.swap is not None and host.swap is None
        states = make_states(
            NUMELS, amsgrad=amsgrad, moment_dtype=config.get("moment_dtype", torch.float32), seed=1
        )
        load(nv, states)
        load(host, states)
        assert_tier_equals(nv, states, "loaded")
        outcomes = []
        for k, (spec_sgs, spec_inp, step_sgs, final, overflow) in enumerate(_trajectory_plan()):
            grads = make_grads(NUMELS, grad_dtype, seed=10 + k, scale=4.0)
            if amsgrad:
                spec_inp = {sg: AdamInputs(**{**i.__dict__, "amsgrad": True}) for sg, i in spec_inp.items()}
                final = {sg: AdamInputs(**{**i.__dict__, "amsgrad": True}) for sg, i in final.items()}
            for sg in spec_sgs:
                assert nv.stepping.speculate(sg, grads[sg], spec_inp[sg]), (
                    f"iteration {k}: nvme subgroup {sg}"
                )
                assert host.stepping.speculate(sg, grads[sg], spec_inp[sg])
            commits = {"nvme": {}, "host": {}}

            def recorder(name):
                def on_commit(sg, views):
                    assert sg not in commits[name], f"subgroup {sg} committed twice"
                    commits[name][sg] = {key: v.clone() for key, v in views.items()}

                return on_commit

            steps = {sg: (grads[sg], final[sg]) for sg in step_sgs}
            out = nv.stepping.finish(steps, overflow=overflow, on_commit=recorder("nvme"))
            assert out == host.stepping.finish(steps, overflow=overflow, on_commit=recorder("host")), k
            outcomes.append(out)
            copies = {}
            if not overflow:
                for sg in step_sgs:
                    copies[sg] = ref_step(states[sg], grads[sg], final[sg], copy_dtype)
            assert set(commits["nvme"]) == set(commits["host"]) == (set() if overflow else set(step_sgs))
            for sg, views in commits["nvme"].items():
                what = f"iteration {k} subgroup {sg} on_commit"
                assert_bitwise_equal(views["param"], states[sg]["p"], f"{what} param")
                assert_bitwise_equal(views["param"], commits["host"][sg]["param"], f"{what} param vs host")
                assert ("param_copy" in views) == (copy_dtype is not None)
                if copy_dtype is not None:
                    # elements outside every run were not stepped: their copy slot is not written
                    for off, n, _ in final[sg].ranges(NUMELS[sg]):
                        got = views["param_copy"][off : off + n]
                        assert_bitwise_equal(
                            got,
                            views["param"][off : off + n].to(copy_dtype),
                            f"{what} param_copy vs master cast",
                        )
                        assert_bitwise_equal(got, copies[sg][off : off + n], f"{what} param_copy vs kernel")
                        assert_bitwise_equal(
                            got,
                            commits["host"][sg]["param_copy"][off : off + n],
                            f"{what} param_copy vs host",
                        )
            for sg in range(len(NUMELS)):
                got = read_state(nv, sg)
                assert_state_equal(got, read_state(host, sg), f"iteration {k} subgroup {sg} nvme vs host")
                assert_state_equal(got, states[sg], f"iteration {k} subgroup {sg} vs direct steps")
        seen = {o for out in outcomes for o in out.values()}
        assert seen == {"committed", "redone", "stepped", "dropped"}, outcomes
        assert nv.stats["worker_restarts"] == 0


# ------------------------------------------------------------------ 2. rollback through slots
def test_a_dropped_step_leaves_the_committed_slot_and_state_bitwise_unchanged(nvme_dir):
    numels, nvme = [SLOT + 1, 10_000 + 17], [True, True]
    with ExitStack() as stack:
        tier = new_tier(numels, nvme, nvme_dir, amsgrad=True, io_banks=2)
        stack.callback(tier.close)
        states = make_states(numels, amsgrad=True, seed=2)
        load(tier, states)
        inp = inputs(7, amsgrad=True, grad_scale=1 / 1024)
        for r, how in enumerate(("overflow", "not_in_steps")):
            grads = make_grads(numels, seed=2 + r, scale=1024.0)
            slots = tier.file_slots.committed
            committed = [slot_bytes(tier, sg, slots[sg]) for sg in range(len(numels))]
            other = [slot_bytes(tier, sg, 1 - slots[sg]) for sg in range(len(numels))]
            for sg, g in enumerate(grads):
                assert tier.stepping.speculate(sg, g, inp)
            if how == "overflow":
                assert tier.stepping.finish({}, overflow=True) == {0: "dropped", 1: "dropped"}
            else:
                assert tier.stepping.finish({}) == {0: "dropped", 1: "dropped"}
            assert tier.stepping.speculated() == []
            assert tier.file_slots.committed == slots, f"{how}: the slot map flipped for a dropped step"
            for sg in range(len(numels)):
                assert slot_bytes(tier, sg, slots[sg]) == committed[sg], (
                    f"{how}: subgroup {sg}'s committed slot was written"
                )
                # the dropped step did write the other slot: the rollback is the slot map alone
                assert slot_bytes(tier, sg, 1 - slots[sg]) != other[sg]
            assert_tier_equals(tier, states, f"after the step dropped by {how}")
        # the step after the dropped ones starts from the original state
        grads = make_grads(numels, seed=9, scale=1024.0)
        assert set(tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}).values()) == {"stepped"}
        for s, g in zip(states, grads):
            ref_step(s, g, inp)
        assert_tier_equals(tier, states, "the step after the dropped ones")


@pytest.mark.parametrize(
    "change",
    [
        dict(lr=5e-4),
        dict(grad_scale=0.5),
        dict(grad_version=(1, 2)),
        dict(step=8),
        dict(weight_decay=0.0),
        dict(decoupled=False),
        dict(runs=((0, 3000, 8), (5000, 5017, 2))),
    ],
    ids=lambda c: next(iter(c)),
)
def test_redo_with_changed_inputs_is_bitwise_a_direct_step(nvme_dir, change):
    numels, nvme = [SLOT + 1, 10_000 + 17], [True, True]
    with ExitStack() as stack:
        tier = new_tier(numels, nvme, nvme_dir, amsgrad=True)
        stack.callback(tier.close)
        states = make_states(numels, amsgrad=True, seed=3)
        load(tier, states)
        grads = make_grads(numels, seed=3)
        a = inputs(7, grad_version=(1, 1), amsgrad=True)
        b = AdamInputs(**{**a.__dict__, **change})
        slots = tier.file_slots.committed
        for sg, g in enumerate(grads):
            assert tier.stepping.speculate(sg, g, a)
        final = {sg: (g, b if "runs" not in change or sg == 1 else a) for sg, g in enumerate(grads)}
        expect = {sg: "redone" if final[sg][1] != a else "committed" for sg in final}
        assert tier.stepping.finish(final) == expect
        tier.held.settle_writes()  # the writes behind the step land
        assert tier.file_slots.committed == {sg: 1 - s for sg, s in slots.items()}, (
            "commit and redo both flip the slot map"
        )
        for sg, (g, inp) in final.items():
            ref_step(states[sg], g, inp)
        assert_tier_equals(tier, states, f"redone with {change}")


# ------------------------------------------------------------------ 3. checksums
@pytest.mark.parametrize("where,speculated", [("first_byte", False), ("last_byte", True)])
def test_a_flipped_byte_in_a_committed_slot_fails_its_checksum_and_names_the_file(
    nvme_dir, where, speculated
):
    numels, nvme = [3000, 9000, 500], [True, True, False]
    bad = 1
    with ExitStack() as stack:
        tier = new_tier(numels, nvme, nvme_dir)
        stack.callback(tier.close)
        states = make_states(numels, seed=4)
        load(tier, states)
        g1, g2 = make_grads(numels, seed=4), make_grads(numels, seed=5)
        for sg, g in enumerate(g1):
            assert tier.stepping.speculate(sg, g, inputs(1))
        assert set(tier.stepping.finish({sg: (g, inputs(1)) for sg, g in enumerate(g1)}).values()) == {
            "committed"
        }
        for s, g in zip(states, g1):
            ref_step(s, g, inputs(1))
        after1 = clone_states(states)
        after2 = clone_states(states)
        for s, g in zip(after2, g2):
            ref_step(s, g, inputs(2))

        tier.held.settle_writes()  # the writes land, their banks go: step 2 reads the slots
        path, slot = tier.swap.file(bad), tier.file_slots.committed[bad]
        k = 0 if where == "first_byte" else tier.io_bytes - 1  # the CRC covers the padding too
        flip_byte(path, slot * tier.io_bytes + k)
        # the control: a flipped byte in the slot nobody reads (the next step overwrites it)
        flip_byte(tier.swap.file(0), (1 - tier.file_slots.committed[0]) * tier.io_bytes + 7)

        with pytest.raises(WorkerError) as info:
            if speculated:  # the swap-in starts at once: its error may surface in speculate()
                for sg, g in enumerate(g2):
                    assert tier.stepping.speculate(sg, g, inputs(2))
            tier.stepping.finish({sg: (g, inputs(2)) for sg, g in enumerate(g2)})
        msg = str(info.value)
        assert "checksum mismatch" in msg and path in msg and f"slot {slot}" in msg, msg
        assert f"subgroup {bad}" in msg, msg
        if tier.stepping.speculated():
            # a failed speculate()/finish() keeps the other speculations for a retry; the
            # state is read once they are dropped
            with pytest.raises(RuntimeError, match="speculative step pending"):
                tier.state(tier.stepping.speculated()[0])
            tier.stepping.finish({}, overflow=True)
        assert tier.stepping.speculated() == []
        with pytest.raises(OSError, match="checksum mismatch") as info:
            tier.state(bad)
        assert path in str(info.value)
        # every other subgroup is intact: at step 1, or at step 2 if it committed first
        for sg in range(len(numels)):
            if sg != bad:
                got = read_state(tier, sg)
                assert states_equal(got, after1[sg]) or states_equal(got, after2[sg]), (
                    f"subgroup {sg} is neither its step-1 nor its step-2 state"
                )
        # restored from a checkpoint, the subgroup steps on bitwise
        tier.load_state(bad, after1[bad]["p"], after1[bad]["m"], after1[bad]["v"])
        assert_state_equal(read_state(tier, bad), after1[bad], "restored")
        assert tier.stepping.finish({bad: (g2[bad], inputs(2))}) == {bad: "stepped"}
        assert_state_equal(read_state(tier, bad), after2[bad], "restored, then stepped")


# ------------------------------------------------------------------ 4. disk full
DISK_FULL_CHILD = r"""
import json, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as the Python that starts the worker does
import torch
import cpu_kernels as ck
from hybrid_opt.tiers.host import HostTier, AdamInputs

nvme_path = sys.argv[1]
PAGE = 4096
numels = [3000, 9000]
out = {}
def ref_step(s, g, step):
    ck.adam_step_(s[0], g, s[1], s[2], step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01)
def same(tier, refs):
    return all(all(torch.equal(a, b) for a, b in zip(
        (st["param"], st["exp_avg"], st["exp_avg_sq"]), ref))
        for st, ref in ((tier.state(sg), refs[sg]) for sg in range(len(numels))))

gen = torch.Generator().manual_seed(0)
tier = HostTier(numels, nvme=[True, True], nvme_path=nvme_path, slot_numel=4096, timeout_s=20)
io = out["io_bytes"] = tier.io_bytes
refs = [[torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1,
         torch.rand(n, generator=gen) * 1e-2] for n in numels]
for sg, r in enumerate(refs):
    tier.load_state(sg, *r)
grads = {s: [torch.randn(n, generator=gen) for n in numels] for s in range(1, 5)}
def step(s):
    return tier.stepping.finish({sg: (grads[s][sg], AdamInputs(s, 1e-3, 0.9, 0.999, 1e-8, 0.01))
                        for sg in range(len(numels))})
step(1)
for sg in range(len(numels)):
    ref_step(refs[sg], grads[1][sg], 1)
out["step1_ok"] = same(tier, refs)

# the disk fills: a write may reach 2 pages into slot 1 (slot 0 still fits). The worker was
# started before the limit, so it gets it by prlimit; the trainer (and any worker it
# restarts) by setrlimit.
limit = io + 2 * PAGE
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
resource.prlimit(tier.client.pid, resource.RLIMIT_FSIZE, (limit, hard))
out["limit"] = limit

# a tier built now cannot size its memory or files
dirs = sorted(os.listdir(nvme_path))
try:
    HostTier(numels, nvme=[True, True], nvme_path=nvme_path, slot_numel=4096, timeout_s=20)
    out["ctor_error"] = None
except Exception as e:
    out["ctor_error"] = dict(type=type(e).__name__, errno=getattr(e, "errno", None), message=str(e))
    out["ctor_left_nothing"] = sorted(os.listdir(nvme_path)) == dirs  # e (and its frames) alive

out["failed_at"] = None
for s in (2, 3, 4):
    slots = tier.file_slots.committed
    try:
        step(s)
    except Exception as e:
        out["failed_at"], out["failed_slots"] = s, slots
        out["error"] = dict(type=type(e).__name__, message=str(e))
        break
    for sg in range(len(numels)):
        ref_step(refs[sg], grads[s][sg], s)
out["slot_map_kept"] = tier.file_slots.committed == out.get("failed_slots")
out["files"] = [tier.swap.file(sg) for sg in range(len(numels))]
out["intact_after_failure"] = same(tier, refs)

# the trainer's own write into the full slot fails the same way; the committed slot stands
try:
    tier.load_state(0, torch.zeros(numels[0]))
    out["load_error"] = None
except OSError as e:
    out["load_error"] = dict(type=type(e).__name__, errno=e.errno, message=str(e))
out["intact_after_load_error"] = same(tier, refs)

# space again: the failed step is taken again and lands bitwise
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
resource.prlimit(tier.client.pid, resource.RLIMIT_FSIZE, (hard, hard))
s = out["failed_at"]
if s is not None:
    out["retry"] = sorted(set(step(s).values()))
    for sg in range(len(numels)):
        ref_step(refs[sg], grads[s][sg], s)
    out["retry_bitwise"] = same(tier, refs)
out["restarts"] = tier.stats["worker_restarts"]
tier.close()
out["left"] = os.listdir(nvme_path)
print(json.dumps(out))
"""


def test_disk_full_names_the_file_and_bytes_and_keeps_the_committed_state(nvme_dir):
    proc = subprocess.run(
        [sys.executable, "-c", DISK_FULL_CHILD, nvme_dir],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    io_bytes, limit = out["io_bytes"], out["limit"]
    assert out["step1_ok"]

    # a tier built under the limit fails (its shared memory, a file too, is sized first) and
    # leaves nothing in nvme_path
    ctor = out["ctor_error"]
    assert ctor is not None, "a tier was built though its memory and files cannot be sized"
    assert ctor["errno"] == errno.EFBIG and "File too large" in ctor["message"], ctor
    assert out["ctor_left_nothing"], "the failed constructor left its swap directory behind"

    # slot 0 still fits under the limit, slot 1 does not: the first write into slot 1 fails
    assert out["failed_at"] is not None, "no write failed under the file-size limit"
    assert out["failed_slots"] == {"0": 0, "1": 0}, out  # json's keys: the subgroup ids
    err = out["error"]
    assert err["type"] == "WorkerError", err
    msg = err["message"]
    assert any(f in msg for f in out["files"]), msg
    assert "File too large" in msg and "EFBIG" in msg, msg
    assert f"write of {io_bytes} bytes at offset {io_bytes}" in msg, msg
    assert f"{limit - io_bytes} bytes written" in msg, msg
    assert out["slot_map_kept"]
    assert out["intact_after_failure"], "the committed state changed after the failed step"

    load_err = out["load_error"]
    assert load_err is not None and load_err["errno"] == errno.EFBIG, load_err
    assert out["files"][0] in load_err["message"] and f"{io_bytes} bytes" in load_err["message"]
    assert out["intact_after_load_error"]

    assert out["retry"] == ["stepped"] and out["retry_bitwise"]
    assert out["restarts"] == 0, "the worker died instead of reporting EFBIG"
    assert out["left"] == []


# ------------------------------------------------------------------ 5. permissions and bad paths
def test_the_swap_directory_is_private_and_its_files_owner_only(nvme_dir):
    tier = new_tier([1000, 3000, 200], [True, True, False], nvme_dir)
    try:
        d = tier.swap.path
        assert os.path.dirname(d) == os.path.realpath(nvme_dir)
        assert os.path.basename(d).startswith(f"{PREFIX}{os.getpid()}-")
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert sorted(os.listdir(d)) == [".owner.lock", "sg0.state", "sg1.state"]
        for sg in (0, 1):
            st = os.stat(tier.swap.file(sg))
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
            assert st.st_size == 2 * tier.io_bytes and tier.io_bytes % 4096 == 0
        assert os.listdir(nvme_dir) == [os.path.basename(d)]
    finally:
        tier.close()
    assert os.listdir(nvme_dir) == []


def _unwritable_dir(nvme_dir):
    """A directory this process cannot write: mode 0500 where permission bits bind; as root
    (which they do not bind) a read-only mount, else None."""
    os.chmod(nvme_dir, 0o500)
    if not os.access(nvme_dir, os.W_OK):
        return nvme_dir
    os.chmod(nvme_dir, 0o700)
    for cand in ("/proc/sys",):  # read-only for root too in a container
        if os.path.isdir(cand) and not os.access(cand, os.W_OK):
            return cand
    return None


BAD_PATHS = [
    ("missing", FileNotFoundError, r"does not exist"),
    ("a_file", NotADirectoryError, r"is not a directory"),
    ("unwritable", PermissionError, r"not writable"),
    ("none", ValueError, r"needs nvme_path"),
]


@pytest.mark.parametrize("kind,exc,match", BAD_PATHS, ids=[b[0] for b in BAD_PATHS])
@pytest.mark.parametrize("who", ["HostTier", "HybridAdamW"])
def test_a_bad_nvme_path_fails_at_construction_before_any_worker_starts(nvme_dir, who, kind, exc, match):
    if kind == "missing":
        path = os.path.join(nvme_dir, "no", "such")
    elif kind == "a_file":
        path = os.path.join(nvme_dir, "file")
        open(path, "w").close()
    elif kind == "unwritable":
        path = _unwritable_dir(nvme_dir)
        if path is None:
            pytest.skip(
                "running as root with no read-only directory: permission bits do not "
                "stop root's writes, so there is no unwritable nvme_path to try"
            )
    else:
        path = None
    before, listing = child_pids(), sorted(os.listdir(nvme_dir))
    try:
        with pytest.raises(exc, match=match) as info:
            if who == "HostTier":
                new_tier([1000, 3000], [True, False], path)
            else:
                HybridAdamW(
                    nn.Linear(8, 8).parameters(),
                    offload_fraction=1.0,
                    nvme_fraction=0.25,
                    nvme_path=path,
                    subgroup_numel=16,
                )
    finally:
        os.chmod(nvme_dir, 0o700)
    if path is not None:
        assert os.path.abspath(path) in str(info.value)
    assert child_pids() == before, "a worker was started before the path was checked"
    assert sorted(os.listdir(nvme_dir)) == listing


# ------------------------------------------------------------------ 6. nothing left behind
def test_close_leaves_nothing_in_nvme_path_and_is_idempotent(nvme_dir):
    tier = new_tier([1000, 9000], [True, True], nvme_dir, amsgrad=True)
    pid, d = tier.client.pid, tier.swap.path
    grads = make_grads(list(tier.numels.values()), seed=6)
    for sg, g in enumerate(grads):
        tier.stepping.speculate(sg, g, inputs(1, amsgrad=True))  # left pending: close() must cope
    tier.close()
    tier.close()
    assert os.listdir(nvme_dir) == [] and not os.path.exists(d)
    assert wait_gone(pid, 5.0)


@pytest.mark.parametrize(
    "bad",
    [dict(worker_cores=[10_000]), dict(worker_share=0.0)],
    ids=["worker_fails_to_start", "bad_worker_share"],
)
def test_a_constructor_that_fails_leaves_nothing_in_nvme_path(nvme_dir, bad):
    before = child_pids()
    with pytest.raises((ValueError, RuntimeError)) as info:
        new_tier([1000, 3000], [True, True], nvme_dir, **bad)
    # while the exception (and its traceback, holding the half-built tier) is still alive:
    # the clean-up must not wait for the garbage collector
    assert info.value is not None and os.listdir(nvme_dir) == []
    assert wait_until(lambda: child_pids() <= before, 5.0)


KILLED_TRAINER = """
import sys, time
from hybrid_opt.tiers.host import HostTier
# two tiers: the test kills b's worker first, so only a's worker is left to clean up
a = HostTier([1000, 3000], nvme=[True, True], nvme_path=sys.argv[1], slot_numel=4096)
b = HostTier([1000, 3000], nvme=[True, False], nvme_path=sys.argv[1], slot_numel=4096)
print(a.swap.path, a.client.pid, b.swap.path, b.client.pid, flush=True)
time.sleep(120)  # killed long before this ends
"""


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_trainers_directory_is_removed_by_its_worker_or_swept_at_the_next_start(nvme_dir):
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, nvme_dir],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers, tiers = [], []
    try:
        line = trainer.stdout.readline().split()
        assert len(line) == 4, f"no tiers from the trainer: {line!r} {trainer.stderr.read()[-2000:]}"
        dir_a, dir_b = line[0], line[2]
        workers = [int(line[1]), int(line[3])]
        assert os.path.isdir(dir_a) and os.path.isdir(dir_b)
        # while their trainer lives, its directories are not stale
        tiers.append(new_tier([100], [True], nvme_dir))
        assert tiers[0].swap.swept == [] and os.path.isdir(dir_a) and os.path.isdir(dir_b)

        os.kill(workers[1], signal.SIGKILL)  # b's worker cannot clean up for its trainer
        assert wait_gone(workers[1], 5.0)
        trainer.kill()  # SIGKILL: no close(), no atexit, no finalizer runs
        trainer.wait(timeout=10)
        assert wait_until(lambda: not os.path.exists(dir_a), 5.0), (
            "the worker did not remove its dead trainer's swap directory"
        )
        assert wait_gone(workers[0], 5.0), "the worker outlived its trainer"
        assert os.path.isdir(dir_b) and os.listdir(dir_b), "the stale directory to sweep is gone"

        dead = _dead_pid()
        fake = os.path.join(nvme_dir, f"{PREFIX}{dead}-xyz")
        os.mkdir(fake)
        with open(os.path.join(fake, "sg0.state"), "wb") as f:
            f.write(b"\0" * 4096)
        alive = os.path.join(nvme_dir, f"{PREFIX}{tiers[0].client.pid}-abc")  # a live process
        keep = [alive, os.path.join(nvme_dir, f"{PREFIX}notapid"), os.path.join(nvme_dir, "keep-me")]
        for d in keep:
            os.mkdir(d)
        tiers.append(new_tier([100], [True], nvme_dir))
        assert sorted(tiers[1].swap.swept) == sorted([os.path.abspath(dir_b), os.path.abspath(fake)])
        assert not os.path.exists(dir_b) and not os.path.exists(fake)
        assert all(os.path.isdir(d) for d in keep), "a directory that is not stale was removed"
        assert os.path.isdir(tiers[0].swap.path), "a live tier's directory in this process was swept"
    finally:
        for t in tiers:
            t.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        trainer.stdout.close()
        trainer.stderr.close()
        for pid in workers:
            if not wait_gone(pid, 0):
                os.kill(pid, signal.SIGKILL)
    assert sorted(os.listdir(nvme_dir)) == sorted(os.path.basename(d) for d in keep)


# ------------------------------------------------------------------ 7. worker faults
FAULT_NUMELS, FAULT_NVME = [3000, 9000, 500], [True, True, False]


@pytest.mark.parametrize(
    "fault,io_banks",
    [
        ("before_step:2", 4),
        ("after_step:3", 4),
        ("mid_step:2", 4),
        ("after_step:9", 1),  # one io bank pair: finish() waits for banks while the worker dies
    ],
)
def test_a_killed_worker_is_replaced_and_the_nvme_trajectory_is_bitwise_unchanged(
    monkeypatch, nvme_dir, fault, io_banks
):
    monkeypatch.setenv(FAULT_ENV, fault)
    # inline=False: the worker steps what finish() waits for (sharing every core, the trainer
    # would: tiers/inline_steps.py), so the kill can land in those steps too
    tier = new_tier(
        FAULT_NUMELS, FAULT_NVME, nvme_dir, amsgrad=True, staging_slots=2, io_banks=io_banks, inline=False
    )
    try:
        first_pid, swap_dir = tier.client.pid, tier.swap.path
        states = make_states(FAULT_NUMELS, amsgrad=True, seed=7)
        load(tier, states)
        outcomes = []
        # committed, redone (lr changed after speculation), plain
        for step, change, spec in ((1, {}, True), (2, dict(lr=5e-4), True), (3, {}, False)):
            grads = make_grads(FAULT_NUMELS, seed=30 + step)
            inp = inputs(step, amsgrad=True)
            if spec:
                for sg, g in enumerate(grads):
                    tier.stepping.speculate(sg, g, inp)  # False when the bank pool is spent
            final = AdamInputs(**{**inp.__dict__, **change})
            outcomes.append(tier.stepping.finish({sg: (g, final) for sg, g in enumerate(grads)}))
            for s, g in zip(states, grads):
                ref_step(s, g, final)
            assert_tier_equals(tier, states, f"{fault}: step {step}")
        if io_banks == 4:
            assert [set(o.values()) for o in outcomes] == [{"committed"}, {"redone"}, {"stepped"}]
        assert tier.stats["worker_restarts"] == 1
        assert tier.client.pid != first_pid and wait_gone(first_pid, 5.0)
        assert sorted(os.listdir(swap_dir)) == [".owner.lock", "sg0.state", "sg1.state"]
    finally:
        tier.close()
    assert os.listdir(nvme_dir) == []


@pytest.mark.parametrize("nvme", [[True, True], [True, True, False]], ids=["nvme_only", "with_resident"])
def test_inverse_mode_nvme_speculations_survive_a_killed_worker_bitwise(nvme_dir, nvme):
    """rollback='inverse' steps only resident subgroups in place; an nvme subgroup's step reads
    its committed file slot and writes the other, so the tasks a dead worker left of it are sent
    again, as in exact mode: its speculation commits bitwise. Only the resident subgroup is
    named torn, and no later finish() or state() waits out the timeout."""
    numels = [3000, 9000, 500][: len(nvme)]
    tier = new_tier(numels, nvme, nvme_dir, rollback="inverse", timeout_s=5.0, staging_slots=8)
    try:
        states = make_states(numels, seed=23)
        load(tier, states)
        grads = make_grads(numels, seed=23)
        old = tier.client.pid
        os.kill(old, signal.SIGSTOP)  # every task of the speculation is still queued at the kill
        assert all(tier.stepping.speculate(sg, g, inputs(1)) for sg, g in enumerate(grads))
        os.kill(old, signal.SIGKILL)
        assert wait_gone(old, 5.0)
        steps = {sg: (g, inputs(1)) for sg, g in enumerate(grads)}
        t0 = time.monotonic()
        if len(nvme) == 3:
            with pytest.raises(TornState, match=r"SIGKILL.*subgroups \[2\] may be torn"):
                tier.stepping.finish(steps)
            del steps[2]
        assert tier.stepping.finish(steps) == {0: "committed", 1: "committed"}
        assert time.monotonic() - t0 < 4.0
        for sg in (0, 1):
            ref_step(states[sg], grads[sg], inputs(1))
            assert_state_equal(read_state(tier, sg), states[sg], f"subgroup {sg}")
        assert tier.stats["worker_restarts"] == 1 and tier.stepping.speculated() == []
    finally:
        tier.close()


# ------------------------------------------------------------------ 8. the optimizer
class Net(nn.Module):
    """Linear(16,32)-ReLU-Linear(32,4) plus tiny params: 692 elements, 11 subgroups of 64."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.tiny = nn.ParameterList(nn.Parameter(0.1 * torch.randn(4 if k % 2 else 1)) for k in range(6))

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x)))
        for k, t in enumerate(self.tiny):
            out = out + t * (k + 1) / 6
        return out


def make_net(seed=0):
    torch.manual_seed(seed)
    return Net()


def make_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def loss_fn(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def train(model, opt, batches):
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()


def nvme_adamw(params, nvme_dir, nvme_fraction=0.5, **kw):
    opt = HybridAdamW(
        params, offload_fraction=1.0, nvme_fraction=nvme_fraction, nvme_path=nvme_dir, subgroup_numel=64, **kw
    )
    tiers = opt.plan.tiers
    assert 0 < tiers.count(NVME) < len(tiers), f"not a mixed host/nvme placement: {opt.plan}"
    return opt


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
def test_hybrid_adamw_with_half_the_state_on_nvme_matches_torch_adamw(nvme_dir, amsgrad):
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    ours_model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **kw)
    with nvme_adamw(ours_model.parameters(), nvme_dir, **kw) as ours:
        for i, batch in enumerate(make_batches(20)):
            for model, opt in ((ours_model, ours), (ref_model, ref)):
                opt.zero_grad()
                loss_fn(model, batch).backward()
                opt.step()
            for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
                assert_close(a, b, msg=f"step {i} {name}")
        sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert set(sd["state"]) == set(ref_sd["state"])
        for i, ref_st in ref_sd["state"].items():
            assert set(sd["state"][i]) == set(ref_st)
            assert float(sd["state"][i]["step"]) == float(ref_st["step"]) == 20
            for k, v in ref_st.items():
                if k != "step":
                    assert_close(sd["state"][i][k], v, msg=f"state[{i}][{k}]")
    assert os.listdir(nvme_dir) == []


MANY_FILES = r"""
import resource, sys, torch
from hybrid_opt import HybridAdamW
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024 if sys.argv[3:] == ["hard"] else hard))  # the usual soft limit
n = int(sys.argv[2])
ours, ref = (torch.nn.Parameter(torch.linspace(-1, 1, n * 64)) for _ in range(2))
torch_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
with HybridAdamW([ours], lr=1e-2, subgroup_numel=64, offload_fraction=1.0, nvme_fraction=1.0,
                 nvme_path=sys.argv[1]) as opt:
    files = opt.plan.tiers.count("nvme")
    for i in range(3):
        for p, o in ((ours, opt), (ref, torch_opt)):
            o.zero_grad()
            (p * p * (i + 1)).sum().backward()
            o.step()
    err = float((ours - ref).abs().max())
    print(files, resource.getrlimit(resource.RLIMIT_NOFILE)[0], err)
"""


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4000, reason="hard RLIMIT_NOFILE < 4000")
def test_thousands_of_nvme_files_train_under_the_usual_soft_limit_of_open_files(nvme_dir):
    """1,500 nvme subgroups (a 6B-param model's state at the default subgroup size) under a soft
    RLIMIT_NOFILE of 1,024: the files open (the soft limit is raised as needed, no EMFILE), the
    worker's pipes keep descriptors below select()'s 1,024, and the configuration naming them
    travels in a file the worker inherits (not on its command line: E2BIG)."""
    out = subprocess.run(
        [sys.executable, "-c", MANY_FILES, nvme_dir, "1500"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    files, soft, err = out.stdout.split()
    assert int(files) == 1500 and int(soft) > 1500, out.stdout
    assert float(err) < 1e-5, out.stdout


def test_nvme_files_that_fit_under_a_hard_limit_of_1024_still_train(nvme_dir):
    """800 nvme subgroups under soft = hard = 1,024 open files: they fit, so no error (the limit
    reservation first asked for 256 descriptors of room on top and refused them)."""
    out = subprocess.run(
        [sys.executable, "-c", MANY_FILES, nvme_dir, "800", "hard"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    files, soft, err = out.stdout.split()
    assert int(files) == 800 and int(soft) == 1024 and float(err) < 1e-5, out.stdout


def test_a_worker_configuration_over_a_command_lines_limit_reaches_the_worker(nvme_dir):
    """The worker's configuration over 128 KiB (the bound on one command-line argument: ~9,000
    nvme files' descriptors) still starts a worker that steps."""
    tier = new_tier([100], [True], nvme_dir)
    try:
        tier.client.layout["padding"] = "x" * (200 * 1024)  # read at each launch: a restart
        old = tier.client.pid
        os.kill(old, signal.SIGKILL)
        assert wait_gone(old, 5.0)
        tier.client.restart()
        assert tier.client.pid != old and tier.client.ping(timeout_s=30.0) is not None
    finally:
        tier.close()


def _save_load(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_with_nvme_continues_bitwise(nvme_dir):
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, max_grad_norm=0.5)
    batches = make_batches(12)
    model = make_net()
    with ExitStack() as stack:
        opt = stack.enter_context(nvme_adamw(model.parameters(), nvme_dir, **kw))
        train(model, opt, batches[:6])
        sd = _save_load(opt.state_dict())
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train(model, opt, batches[6:])
        end_sd = opt.state_dict()

        model2 = make_net(seed=123)  # another init: everything must come from the checkpoint
        model2.load_state_dict(weights)
        opt2 = stack.enter_context(nvme_adamw(model2.parameters(), nvme_dir, **kw))
        assert opt2.plan.tiers == opt.plan.tiers
        opt2.load_state_dict(sd)
        train(model2, opt2, batches[6:])
        for (name, a), b in zip(model.named_parameters(), model2.parameters()):
            assert_bitwise_equal(b.detach(), a.detach(), f"resumed {name}")
        sd2 = opt2.state_dict()
        assert set(sd2["state"]) == set(end_sd["state"])
        for i, st in end_sd["state"].items():
            assert set(sd2["state"][i]) == set(st)
            for k, v in st.items():
                assert torch.equal(sd2["state"][i][k], v), (i, k)
    assert os.listdir(nvme_dir) == []


def test_a_directory_whose_owner_holds_its_lock_is_not_swept_whatever_its_pid(tmp_path):
    """Another container sharing the disk has its own pid namespace: its owner's pid may be
    "dead" here, but the owner's flock on the lock file says it lives."""
    from hybrid_opt.swap import LOCK, sweep_stale

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    live = tmp_path / f"hybrid_opt-{proc.pid}-other"
    live.mkdir()
    fd = os.open(live / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert sweep_stale(str(tmp_path)) == [] and live.exists()
    finally:
        os.close(fd)  # the owner is gone: now it is stale
    assert sweep_stale(str(tmp_path)) == [str(live)] and not live.exists()


def test_a_full_disk_during_step_rolls_back_the_step_counts_of_what_was_not_stepped(nvme_dir):
    """The worker's writes hit a file-size limit. A step commits before its writes land, so its
    own writes fail behind it: its state stays committed, in memory. The next step sends them
    again first; when they fail again it raises naming the cause, and changes nothing (params,
    state, step counts). Once the disk takes them, training steps on."""
    import resource

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4096)) for _ in range(4)]
    with HybridAdamW(
        params, lr=1e-3, offload_fraction=1.0, nvme_fraction=1.0, nvme_path=nvme_dir, subgroup_numel=4096
    ) as opt:
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        # the next write goes to the slot after the committed one: let only its first page in
        nxt = 1 - debug_view(opt).file_slot(0)
        limit = nxt * debug_view(opt).host.io_bytes + 4096
        old = resource.prlimit(opt.worker_pid, resource.RLIMIT_FSIZE)
        resource.prlimit(opt.worker_pid, resource.RLIMIT_FSIZE, (limit, old[1]))
        try:
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()  # committed; its writes fail behind it
            assert debug_view(opt).writes_behind() == [0, 1, 2, 3]
            before = _snapshot(opt)  # the committed state, read from memory
            values = [p.detach().clone() for p in params]
            for p in params:
                p.grad = torch.randn_like(p)
            with pytest.raises(RuntimeError, match=r"(?s)failed in the host/nvme tier.*File too large"):
                opt.step()
        finally:
            resource.prlimit(opt.worker_pid, resource.RLIMIT_FSIZE, old)
        _assert_state_is(opt, before, "after a step whose writes could not land")
        assert all(int(s["step"]) == 3 for s in before.values())
        assert all(torch.equal(p, v) for p, v in zip(params, values))
        opt.step()  # the disk takes the writes now: the same step goes through
        assert all(int(s["step"]) == 4 for s in opt.state_dict()["state"].values())
        debug_view(opt).settle_writes()
        assert debug_view(opt).writes_behind() == []


# ------------------------------------------------------------------ 9. restoring a bad nvme state
def _four_nvme_params(nvme_dir, **kw):
    """Four params of one subgroup each, all on nvme."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4096)) for _ in range(4)]
    opt = HybridAdamW(
        params,
        lr=1e-3,
        offload_fraction=1.0,
        nvme_fraction=1.0,
        nvme_path=nvme_dir,
        subgroup_numel=4096,
        **kw,
    )
    assert opt.plan.tiers == [NVME] * 4
    return params, opt


def _grad_step(opt, params, seed, which=range(4)):
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g)
        p.grad = grad if i in which else None
    opt.step()


def _snapshot(opt):
    sd = opt.state_dict()
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}


def _assert_state_is(opt, want, what):
    got = opt.state_dict()["state"]
    assert set(got) == set(want), what
    for i, st in want.items():
        for k, v in st.items():
            assert torch.equal(got[i][k], v), f"{what}: param {i} {k}"


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_checkpoint_replaces_a_corrupt_nvme_slot_and_the_step_error_says_so(nvme_dir, speculative):
    """A committed slot that fails its checksum: step() says nothing was stepped and that stepping
    again cannot help; load_state_dict(checkpoint) never reads the corrupt slot, so it loads."""
    params, opt = _four_nvme_params(nvme_dir, speculative=speculative)
    with opt:
        _grad_step(opt, params, 1)
        ckpt = copy.deepcopy(opt.state_dict())
        _grad_step(opt, params, 2)
        view = debug_view(opt)
        # the next step finds its state in memory (read ahead, or the bank the write behind this
        # one writes from): the corruption must come before it reads the slot, so those go first
        assert speculative or 2 in view.reads_ahead()
        view.drop_reads_ahead()
        flip_byte(view.nvme_file(2), view.file_slot(2) * view.host.io_bytes + 100)
        with pytest.raises(RuntimeError, match="checksum mismatch") as info:
            _grad_step(opt, params, 3)
        msg = str(info.value)
        assert "call step() again" not in msg, msg
        assert "subgroups [2]" in msg and "load_state_dict()" in msg, msg
        opt.load_state_dict(ckpt)
        _assert_state_is(opt, ckpt["state"], "loaded over a corrupt slot")
        _grad_step(opt, params, 3)  # and it steps on


def _loaded_nvme_tier(stack, nvme_dir, numels, seed, **kw):
    """An all-nvme tier (closed with `stack`) loaded with make_states(numels, seed): (tier, states)."""
    tier = new_tier(numels, [True] * len(numels), nvme_dir, **kw)
    stack.callback(tier.close)
    states = make_states(numels, seed=seed)
    load(tier, states)
    return tier, states


def _step_every_subgroup(tier, states, grads, inp):
    """finish() of every subgroup with `grads` and `inp`, and the same step of `states` by the
    reference; returns finish()'s outcome."""
    out = tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)})
    for s, g in zip(states, grads):
        ref_step(s, g, inp)
    return out


def test_a_steps_writes_land_behind_it_and_the_next_step_reads_their_banks(nvme_dir, monkeypatch):
    """finish() commits an nvme step before its write lands: the slot map flips once it has (the
    next finish() settles it first). Meanwhile state() reads the bank the step wrote, and the next
    step reads that bank, not the file: no read at all while the pool holds every subgroup, and
    bitwise the direct steps throughout."""
    from hybrid_opt.tiers.host_step import HostStepping

    reads = []
    real = HostStepping._send_swap_in
    monkeypatch.setattr(
        HostStepping, "_send_swap_in", lambda self, sg, spec: reads.append(sg) or real(self, sg, spec)
    )
    numels = [3000, 9000]
    with ExitStack() as stack:
        tier, states = _loaded_nvme_tier(stack, nvme_dir, numels, 21, io_banks=3)
        for step in (1, 2, 3):
            slots = tier.file_slots.committed
            del reads[:]
            out = _step_every_subgroup(tier, states, make_grads(numels, seed=60 + step), inputs(step))
            assert set(out.values()) == {"stepped"}
            assert reads == ([0, 1] if step == 1 else []), f"step {step} read {reads}"
            # step 1's writes were settled by step 2's finish(): each step flips the map once
            assert tier.held.writes_behind == [0, 1]
            assert tier.file_slots.committed == (
                slots if step == 1 else {sg: 1 - s for sg, s in slots.items()}
            )
            assert_tier_equals(tier, states, f"step {step}, from the banks")
        tier.held.settle_writes()
        assert tier.held.writes_behind == []
        assert_tier_equals(tier, states, "from the slots")


def test_a_worker_killed_while_the_writes_behind_a_step_land_writes_them_again(nvme_dir):
    """The worker dies (SIGKILL) right after finish() returned, its writes still in flight: the
    state stays in the banks, the new worker writes them again, and every slot then holds the
    committed state; bitwise the direct steps."""
    numels = [3000, 9000]
    with ExitStack() as stack:
        tier, states = _loaded_nvme_tier(stack, nvme_dir, numels, 29, io_banks=3)
        for step in (1, 2):
            _step_every_subgroup(tier, states, make_grads(numels, seed=80 + step), inputs(step))
            if step == 1:
                pid = tier.client.pid
                os.kill(pid, signal.SIGKILL)
                assert wait_gone(pid, 5.0)
                assert tier.held.writes_behind == [0, 1]
                assert_tier_equals(tier, states, "from the banks, the worker dead")
        tier.held.settle_writes()
        assert tier.stats["worker_restarts"] == 1
        assert_tier_equals(tier, states, "from the slots")


def test_a_speculation_short_of_banks_takes_a_landed_write_behinds_bank(nvme_dir):
    """Two nvme subgroups, a pool of two banks: after a step, the bank the last write came from
    holds its subgroup's state. Once that write has landed, a speculation that finds no other
    bank takes it (the state is in the slot), instead of waiting for finish(); bitwise."""
    numels = [3000, 3000]
    with ExitStack() as stack:
        tier, states = _loaded_nvme_tier(stack, nvme_dir, numels, 23, io_banks=1)
        for step in (1, 2):
            grads = make_grads(numels, seed=70 + step)
            inp = inputs(step)
            if step == 2:
                assert tier.held.writes_behind, "no write behind step 1"
                assert wait_until(lambda: tier.io.poll() is not None and not tier.io.pieces_in_flight, 10.0)
                # subgroup 1's write came last: its bank is the pool's second; subgroup 0's
                # speculation needs two banks
                assert tier.held.writes_behind == [1]
                assert tier.stepping.speculate(0, grads[0], inp), "the speculation found no bank"
            out = _step_every_subgroup(tier, states, grads, inp)
            assert out == ({0: "stepped", 1: "stepped"} if step == 1 else {0: "committed", 1: "stepped"}), out
            assert_tier_equals(tier, states, f"step {step}")


def test_a_speculation_that_may_wait_waits_for_the_write_behind_its_last_step(nvme_dir):
    """Subgroup 0's 48 MB write goes out behind its step, the small subgroup 1 steps meanwhile,
    and the worker is stopped (SIGSTOP) as subgroup 1 commits: finish() returns with that write
    in flight. speculate(wait=False), as inside backward, is refused for subgroup 0;
    speculate(wait=True) waits for the write (the worker resumes 0.3 s later) and speculates, and
    the step commits. Both steps bitwise the direct steps, the first read from the banks."""
    numels = [1 << 22, 3000]
    with ExitStack() as stack:
        tier, states = _loaded_nvme_tier(stack, nvme_dir, numels, 31, io_banks=3)
        pid = tier.client.pid
        stack.callback(os.kill, pid, signal.SIGCONT)  # never left stopped

        def stop_the_worker(sg, views):
            if sg == 1:
                os.kill(pid, signal.SIGSTOP)

        grads = make_grads(numels, seed=91)
        out = tier.stepping.finish(
            {sg: (g, inputs(1)) for sg, g in enumerate(grads)}, on_commit=stop_the_worker
        )
        assert out == {0: "stepped", 1: "stepped"}
        for st, g in zip(states, grads):
            ref_step(st, g, inputs(1))
        assert tier.held.writes_behind == [0, 1]
        assert tier.io.pieces_in_flight, "subgroup 0's write landed before the worker stopped"
        assert_tier_equals(tier, states, "step 1, from the banks, the worker stopped")

        grads = make_grads(numels, seed=92)
        assert not tier.stepping.speculate(0, grads[0], inputs(2), wait=False)
        resume = threading.Timer(0.3, os.kill, (pid, signal.SIGCONT))
        resume.start()
        for sg in (0, 1):
            assert tier.stepping.speculate(sg, grads[sg], inputs(2)), f"subgroup {sg} refused"
        resume.join()
        out = _step_every_subgroup(tier, states, grads, inputs(2))
        assert out == {0: "committed", 1: "committed"}
        assert_tier_equals(tier, states, "step 2")


def test_only_a_committed_banks_views_outlive_the_commit(nvme_dir):
    """step() queues a CUDA copy into the model without waiting only from views that keep their
    bytes until finish() returns: a resident subgroup's committed bank, not an nvme bank (a later
    step may take it back) nor a pooled q8 copy slot (the commit hands it on)."""
    with ExitStack() as stack:
        tier = new_tier([3000, 3000], [True, False], nvme_dir)
        stack.callback(tier.close)
        assert not tier.stepping.views_outlive_commit(0)
        assert tier.stepping.views_outlive_commit(1)
        params = [torch.zeros(4096, dtype=torch.bfloat16)]
        q8 = HostTier(
            [4096],
            exp_avg_dtype="q8",
            exp_avg_sq_dtype="q8",
            remainders=True,
            params=params,
            copy_dtype=torch.bfloat16,
            quantized=[True],
            slot_numel=4096,
            timeout_s=TIMEOUT_S,
        )
        stack.callback(q8.close)
        assert q8.pool.copy_of is not None and not q8.stepping.views_outlive_commit(0)


def test_plain_steps_read_the_next_steps_slots_ahead_and_a_load_drops_those_reads(nvme_dir):
    """Without speculation a step ends by reading the nvme slots its successor will step from
    (HostStepping.read_ahead: under the next forward and backward, not in step()). The next step
    steps from them bitwise as from a read of its own; load_state_dict in between drops them, so
    the step after it steps from the loaded state."""
    params, opt = _four_nvme_params(nvme_dir, speculative=False)
    os.makedirs(os.path.join(nvme_dir, "ref"))
    ref_params, ref = _four_nvme_params(os.path.join(nvme_dir, "ref"), speculative=True)
    with opt, ref:
        _grad_step(opt, params, 1)
        _grad_step(ref, ref_params, 1)
        view = debug_view(opt)
        assert view.reads_ahead(), "no read ahead of the next step"
        ckpt = copy.deepcopy(opt.state_dict())  # state_dict() drops them (Speculator.drop)
        for seed in (2, 3):
            _grad_step(opt, params, seed)
            _grad_step(ref, ref_params, seed)
        assert view.reads_ahead()
        opt.load_state_dict(ckpt)
        ref.load_state_dict(ckpt)
        assert not view.reads_ahead()  # read before the load wrote the slots: dropped
        _grad_step(opt, params, 4)
        _grad_step(ref, ref_params, 4)
        _assert_state_is(opt, _snapshot(ref), "steps from the slots read ahead, then the loaded state")
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q)


def test_a_load_that_fails_part_way_leaves_every_subgroup_and_hyperparameter_as_it_was(nvme_dir):
    """The trainer's writes hit a file-size limit part-way through load_state_dict: the nvme
    subgroups written before the failure go back to their committed slots, no hyperparameter is
    set, and the same checkpoint loads once the disk takes it."""
    import resource

    params, opt = _four_nvme_params(nvme_dir)
    with opt:
        _grad_step(opt, params, 1)
        ckpt = copy.deepcopy(opt.state_dict())
        ckpt["param_groups"][0]["lr"] = 0.5
        _grad_step(opt, params, 2, which=(0, 1))  # their slots flip, the others' do not
        view = debug_view(opt)
        host = view.host
        assert [view.file_slot(sg) for sg in view.host_subgroups()] == [1, 1, 0, 0]
        before = _snapshot(opt)
        # a load writes each file's other slot: slot 0 (subgroups 0, 1) is let in, slot 1 is not
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (host.io_bytes, old[1]))
        try:
            with pytest.raises(OSError, match=r"(?s)nvme subgroup 2.*File too large.*Nothing was loaded"):
                opt.load_state_dict(ckpt)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, handler)
        assert [view.file_slot(sg) for sg in view.host_subgroups()] == [1, 1, 0, 0]
        assert opt.param_groups[0]["lr"] == 1e-3
        _assert_state_is(opt, before, "after a failed load")
        opt.load_state_dict(ckpt)
        _assert_state_is(opt, ckpt["state"], "loaded")
        assert opt.param_groups[0]["lr"] == 0.5


def _stepped_twins(nvme_dir) -> tuple:
    """(params, opt, twin's params, twin): two optimizers of four nvme params, one step taken."""
    params, opt = _four_nvme_params(nvme_dir)
    twin_params, twin = _four_nvme_params(nvme_dir)
    for o, ps in ((opt, params), (twin, twin_params)):
        _grad_step(o, ps, 1)
    return params, opt, twin_params, twin


@pytest.mark.parametrize("how", ["unlink", "rmtree"])
def test_an_nvme_file_removed_from_outside_keeps_its_state_and_says_so(nvme_dir, how):
    """A tmp cleaner removes a swap file (or the whole directory): the optimizer's own descriptors
    still reach it, so training and state_dict() go on bitwise; a warning names the file, the
    nvme tier and what to do."""
    params, opt, twin_params, twin = _stepped_twins(nvme_dir)
    with opt, twin:
        host = debug_view(opt).host
        path = debug_view(opt).nvme_file(1)
        if how == "unlink":
            os.unlink(path)
        else:
            shutil.rmtree(host.swap.path)
        with pytest.warns(RuntimeWarning, match="removed or replaced from outside") as rec:
            for o, ps in ((opt, params), (twin, twin_params)):
                _grad_step(o, ps, 2)
            debug_view(opt).drop_reads_ahead()  # the writes land: state_dict() reads the files
            _assert_state_is(opt, _snapshot(twin), "after the file was removed")
        (msg,) = [str(w.message) for w in rec if path in str(w.message)]  # once per file
        assert "nvme tier" in msg and "nvme_path" in msg and "tmp cleaners" in msg, msg
        for a, b in zip(params, twin_params):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ 10. removed files and a new worker
def _worker_has_the_trainers_files(tier):
    """Each nvme file's descriptor in the worker is the trainer's own open file (inherited:
    the same inode, removed or not), with the trainer's O_DIRECT flag."""
    pid = tier.client.pid
    for sg in [s for s in range(len(tier.numels)) if tier.nvme[s]]:
        fd = tier.files.fd(sg)
        assert os.path.samestat(os.stat(f"/proc/{pid}/fd/{fd}"), os.fstat(fd)), f"subgroup {sg}"
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            flags = int(next(ln for ln in f if ln.startswith("flags:")).split()[1], 8)
        assert flags & os.O_DIRECT == fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT, f"subgroup {sg}"
        if fs_type(tier.swap.root) in ("ext4", "xfs"):
            assert flags & os.O_DIRECT, f"subgroup {sg}: the worker's I/O is not O_DIRECT"


@pytest.mark.parametrize("fault", ["mid_step:7", "killed_between_steps"])
def test_a_worker_restarted_after_the_nvme_files_were_removed_from_outside_steps_them_bitwise(
    monkeypatch, nvme_dir, fault
):
    """A tmp cleaner removes the swap directory after step 1, then the worker dies: mid-step
    (its 7th step task, step 2's second) or killed between steps. The new worker inherits the
    trainer's descriptors of the removed files, as the first one did, so the trajectory is
    bitwise unchanged and stays O_DIRECT (a worker opening the files by path would fail every
    later step with FileNotFoundError)."""
    if fault != "killed_between_steps":
        monkeypatch.setenv(FAULT_ENV, fault)
    tier = new_tier(
        FAULT_NUMELS, FAULT_NVME, nvme_dir, amsgrad=True, staging_slots=2, inline=False
    )  # as above
    try:
        first_pid = tier.client.pid
        _worker_has_the_trainers_files(tier)
        states = make_states(FAULT_NUMELS, amsgrad=True, seed=11)
        load(tier, states)
        for step in (1, 2, 3):
            if step == 2:
                shutil.rmtree(tier.swap.path)
                if fault == "killed_between_steps":
                    os.kill(first_pid, signal.SIGKILL)
                    assert wait_gone(first_pid, 5.0)
            grads = make_grads(FAULT_NUMELS, seed=40 + step)
            inp = inputs(step, amsgrad=True)
            assert set(tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}).values()) == {
                "stepped"
            }
            for s, g in zip(states, grads):
                ref_step(s, g, inp)
            tier.held.settle_writes()  # the writes land: state() reads the files
            # the first read of a removed file warns, once per file
            warned = pytest.warns(RuntimeWarning, match="removed or replaced from outside")
            with warned if step == 2 else ExitStack():
                assert_tier_equals(tier, states, f"{fault}: step {step}")
        assert tier.stats["worker_restarts"] == 1
        assert tier.client.pid != first_pid and wait_gone(first_pid, 5.0)
        _worker_has_the_trainers_files(tier)
    finally:
        tier.close()
    assert os.listdir(nvme_dir) == []


@pytest.mark.parametrize("how", ["unlink", "rmtree"])
def test_nvme_files_removed_from_outside_survive_a_killed_worker_and_a_checkpoint_round_trip(nvme_dir, how):
    """The optimizer: every nvme file removed from outside (one by one, or the directory),
    then the worker killed between steps. Training goes on bitwise as an undisturbed twin's
    (params and state), state_dict() reads the removed files, and loading it back into the
    optimizer (written through the same descriptors) steps on bitwise."""
    params, opt, twin_params, twin = _stepped_twins(nvme_dir)
    with opt, twin:
        host = debug_view(opt).host
        if how == "unlink":
            for name in os.listdir(host.swap.path):
                if name.endswith(".state"):
                    os.unlink(os.path.join(host.swap.path, name))
        else:
            shutil.rmtree(host.swap.path)
        old = host.client.pid
        os.kill(old, signal.SIGKILL)
        assert wait_gone(old, 5.0)
        with pytest.warns(RuntimeWarning, match="removed or replaced from outside"):
            for seed in (2, 3):
                for o, ps in ((opt, params), (twin, twin_params)):
                    _grad_step(o, ps, seed)
            debug_view(opt).drop_reads_ahead()  # the writes land: state_dict() reads the files
            _assert_state_is(opt, _snapshot(twin), "after the files were removed and the worker killed")
        assert host.stats["worker_restarts"] == 1 and host.client.pid != old
        for a, b in zip(params, twin_params):
            assert torch.equal(a, b)
        ckpt = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(ckpt)
        _assert_state_is(opt, ckpt["state"], "loaded back into the removed files")
        for o, ps in ((opt, params), (twin, twin_params)):
            _grad_step(o, ps, 4)
        _assert_state_is(opt, _snapshot(twin), "a step after the load")
        for a, b in zip(params, twin_params):
            assert torch.equal(a, b)
    assert os.listdir(nvme_dir) == []


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2400, reason="hard RLIMIT_NOFILE < 2400")
def test_a_worker_whose_request_pipe_is_numbered_past_select_waits_on_a_low_duplicate(nvme_dir):
    """With over 1,024 descriptors open in the trainer (the user's own), the worker inherits its
    request pipe numbered above FD_SETSIZE, where readable() must poll() in whole milliseconds
    (its 0.5 ms waits between polls of nvme I/O became 1 ms). It reads a duplicate numbered
    below (worker/protocol.py low_numbered) — and steps as before."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held, tier = [], None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2400), hard))
        held.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(1100))
        tier = new_tier([100, 100], [True, True], nvme_dir)
        reads = []  # the worker's pipe descriptors opened for reading: its request pipe
        for fd in os.listdir(f"/proc/{tier.client.pid}/fd"):
            if os.readlink(f"/proc/{tier.client.pid}/fd/{fd}").startswith("pipe:"):
                with open(f"/proc/{tier.client.pid}/fdinfo/{fd}") as f:
                    flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
                if flags & os.O_ACCMODE == os.O_RDONLY:
                    reads.append(int(fd))
        assert len(reads) == 1 and reads[0] < 1024, reads
        assert tier.client.ping(timeout_s=30.0) is not None
    finally:
        if tier is not None:
            tier.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2400, reason="hard RLIMIT_NOFILE < 2400")
def test_many_nvme_files_are_numbered_past_select_leaving_the_low_numbers_free(nvme_dir):
    """300 nvme subgroups (from 256 on, tiers/nvme_files.py) under a soft limit of 1,024: the
    limit is raised and the files numbered from 1,024 up, so what the process opens next — the
    worker's pipes, the user's sockets — is still numbered where select() takes it (opened
    lowest-first the files took 3-302 and left 700; 1,500 of them left none). The tier steps
    through them (and its worker, which inherits them with their numbers)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    tier = first = None
    try:
        # a tier built while another one's files are open up there (a move builds the new tier
        # before closing the old one): its files go past those, not back below 1,024
        first = new_tier([64] * 300, [True] * 300, nvme_dir)
        assert min(_state_fds(first)) >= 1024
        tier = new_tier([64] * 300, [True] * 300, nvme_dir)
        first.close()
        ours = _state_fds(tier)
        assert len(ours) == 300 and min(ours) >= 1024, sorted(ours)[:5]
        probe = os.open(os.devnull, os.O_RDONLY)
        os.close(probe)
        assert probe < 1024
        states = make_states([64] * 300, seed=3)
        load(tier, states)
        grads = make_grads([64] * 300, seed=4)
        inp = inputs(1)
        assert set(tier.stepping.finish({sg: (g, inp) for sg, g in enumerate(grads)}).values()) == {"stepped"}
        for s, g in zip(states, grads):
            ref_step(s, g, inp)
        assert_tier_equals(tier, states, "300 files numbered past select's range")
    finally:
        for t in (first, tier):
            if t is not None:
                t.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _state_fds(tier) -> list:
    """The descriptors this process holds on `tier`'s nvme state files."""
    ours = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # listdir's own descriptor, closed since
            continue
        if link.startswith(tier.swap.path + os.sep) and link.endswith(".state"):
            ours.append(int(fd))
    return ours


def test_more_swap_ins_than_the_workers_read_queue_wait_their_turn(nvme_dir):
    """600 host subgroups, 570 on nvme, a spare bank each (the default where memory allows):
    the prefetch sends one swap-in per free bank — 608 at once, more than the worker's read
    engine takes (queue_depth 256: 'the queue is full', and the step failed, 1-3 steps in).
    The worker holds them back until there is room (and a swap-out until the write engine
    has room); the steps match the host tier's without nvme bitwise."""
    torch.manual_seed(0)
    want = torch.randn(600 * 64)
    p, q = nn.Parameter(want.clone()), nn.Parameter(want.clone())
    with (
        HybridAdamW(
            [p], lr=1e-3, subgroup_numel=64, offload_fraction=1.0, nvme_fraction=0.95, nvme_path=nvme_dir
        ) as opt,
        HybridAdamW([q], lr=1e-3, subgroup_numel=64, offload_fraction=1.0) as ref,
    ):
        assert len(opt.plan.subgroups("nvme")) == 570
        for i in range(4):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        assert_bitwise_equal(p.detach(), q.detach(), "nvme 0.95 vs host-only params after 4 steps")


def _worker_read_bytes(opt) -> int:
    """The bytes the worker has read from storage, as its kernel counts them (/proc/PID/io:
    O_DIRECT reads count)."""
    pid = debug_view(opt).host.client.pid
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
    except (OSError, StopIteration):
        pytest.skip("the kernel does not count this process's reads (/proc/PID/io)")


def test_a_frozen_layers_nvme_subgroup_is_not_read_at_every_step(nvme_dir):
    """A param without grads (a frozen layer) on nvme: its subgroup is stepped by no step, so
    nothing reads it ahead of the next one. Before, read_ahead read its slot after every step
    and the next step gave the bank back unread: 786,432 bytes read a step for a 64Ki-element layer.
    The worker's reads as the OS counts them: none in the steady state. Unfrozen, the layer
    steps from its committed slot, bitwise as a host-only run of the same steps."""
    torch.manual_seed(0)
    sizes = (64 * 1024, 64 * 1024, 64 * 1024)
    init = [torch.randn(n) for n in sizes]
    params = [nn.Parameter(t.clone()) for t in init]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=1e-3, subgroup_numel=64 * 1024, offload_fraction=1.0)
    with (
        HybridAdamW(params, nvme_fraction=1.0, nvme_path=nvme_dir, **kw) as opt,
        HybridAdamW(ref_params, **kw) as ref,
    ):
        view = debug_view(opt)
        frozen = [sg for sg in range(3) if view.on_nvme(sg)][0]
        assert all(view.on_nvme(sg) for sg in range(3))

        def step(seed, with_frozen):
            gen = torch.Generator().manual_seed(seed)
            for k, (p, q) in enumerate(zip(params, ref_params)):
                g = torch.randn(p.shape, generator=gen)
                p.grad = q.grad = None if (k == frozen and not with_frozen) else g
                if q.grad is not None:
                    q.grad = g.clone()
            opt.step()
            ref.step()

        step(1, False)
        step(2, False)
        before = _worker_read_bytes(opt)
        for seed in range(3, 7):
            step(seed, False)
            assert frozen not in view.reads_ahead()
        assert _worker_read_bytes(opt) - before == 0, "the worker read nvme state in the steady state"
        assert torch.equal(params[frozen].detach(), init[frozen]), "a param without grads changed"
        for seed in (7, 8):
            step(seed, True)
        for p, q in zip(params, ref_params):
            assert_bitwise_equal(p.detach(), q.detach(), "nvme with a frozen layer vs host-only")
