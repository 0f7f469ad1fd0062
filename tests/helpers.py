"""Helpers shared by several test modules (the tests directory is on sys.path)."""
import os
import time

import psutil
import torch


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
        s = dict(p=torch.randn(n, generator=gen),
                 m=(torch.randn(n, generator=gen) * 0.1).to(moment_dtype),
                 v=(torch.rand(n, generator=gen) * 1e-2).to(moment_dtype))
        if amsgrad:
            s["vmax"] = (s["v"].float() * 2 * torch.rand(n, generator=gen)).to(moment_dtype)
        states.append(s)
    return states


def make_grads(numels, dtype=torch.float32, *, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for n in numels]


def wait_gone(pid, timeout_s):
    """True once `pid` no longer runs (gone, or a zombie awaiting its reaper)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
