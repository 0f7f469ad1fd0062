"""Runs a script on N ranks with torch.distributed.run and collects what each rank saved.

Each launch is bounded: the launcher runs in a session of its own, and past the deadline
every process under it — torchrun, the ranks, and their HybridAdamW workers (which start
sessions of their own, so a process-group kill alone would miss them) — is killed by pid,
and the test fails with the ranks' output. Each rank writes its results with
`save_result(obj)` (torch.save to $DIST_OUT/rank<RANK>.pt); `launch` returns them in rank
order. Both ranks and their workers share this machine's cores: rank scripts keep models
tiny and set OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "dist_scripts")
REPO = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kills the launcher and every descendant by pid (workers are in sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    psutil.wait_procs(family, timeout=5)


def launch(script: str, out_dir: str, *args, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
           port: int | None = None, timeout_s: float = 120.0, env: dict | None = None) -> list:
    """Runs tests/dist_scripts/<script> on `nproc` ranks (per node; `nnodes` > 1: this call
    is node `node_rank` of a static rendezvous on localhost:`port`). Returns the ranks'
    saved results (those of this node), or fails with the output of every rank."""
    import pytest
    import torch
    os.makedirs(out_dir, exist_ok=True)
    port = port or free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
           f"--master-port={port}", os.path.join(SCRIPTS, script), *map(str, args)]
    full_env = dict(os.environ, DIST_OUT=out_dir, OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]),
                    TORCHELASTIC_ERROR_FILE=os.path.join(out_dir, "error.json"))
    full_env.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True, cwd=out_dir)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"{script} {' '.join(map(str, args))}: no result within {timeout_s:.0f} s "
                    f"(every rank and worker killed); the ranks' output:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(map(str, args))} failed (exit {proc.returncode}) after "
                    f"{time.monotonic() - t0:.1f} s; the ranks' output:\n{out[-8000:]}")
    ranks = range(node_rank * nproc, (node_rank + 1) * nproc)
    results = []
    for r in ranks:
        path = os.path.join(out_dir, f"rank{r}.pt")
        if not os.path.exists(path):
            pytest.fail(f"{script}: rank {r} exited 0 but saved no result; output:\n{out[-6000:]}")
        results.append(torch.load(path, weights_only=False))
    return results
