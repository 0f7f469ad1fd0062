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
import threading
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


def _start(script: str, out_dir: str, args, *, nproc: int, nnodes: int, node_rank: int,
           port: int, env: dict | None, tag: str = "") -> subprocess.Popen:
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
           f"--master-port={port}", os.path.join(SCRIPTS, script), *map(str, args)]
    full_env = dict(os.environ, DIST_OUT=out_dir, OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]),
                    TORCHELASTIC_ERROR_FILE=os.path.join(out_dir, f"error{tag}.json"))
    full_env.update(env or {})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True, cwd=out_dir)


def _load_results(script: str, out_dir: str, ranks, out: str) -> list:
    import pytest
    import torch
    results = []
    for r in ranks:
        path = os.path.join(out_dir, f"rank{r}.pt")
        if not os.path.exists(path):
            pytest.fail(f"{script}: rank {r} exited 0 but saved no result; output:\n{out[-6000:]}")
        results.append(torch.load(path, weights_only=False))
    return results


def launch(script: str, out_dir: str, *args, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
           port: int | None = None, timeout_s: float = 120.0, env: dict | None = None) -> list:
    """Runs tests/dist_scripts/<script> on `nproc` ranks (per node; `nnodes` > 1: this call
    is node `node_rank` of a static rendezvous on localhost:`port`). Returns the ranks'
    saved results (those of this node), or fails with the output of every rank."""
    import pytest
    port = port or free_port()
    t0 = time.monotonic()
    proc = _start(script, out_dir, args, nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                  port=port, env=env)
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
    return _load_results(script, out_dir, range(node_rank * nproc, (node_rank + 1) * nproc), out)


def launch_nodes(script: str, out_dir: str, *args, nnodes: int = 2, timeout_s: float = 120.0,
                 env: dict | None = None) -> list:
    """`nnodes` torchrun launches on localhost, one rank each, joined by a static rendezvous
    (node 0 hosts the store): how a multi-node job starts, one launcher per node. One deadline
    for all: past it, every launcher's whole tree is killed and the test fails with each
    node's output. Returns the ranks' saved results in rank order."""
    import pytest
    port = free_port()
    procs = [_start(script, out_dir, args, nproc=1, nnodes=nnodes, node_rank=k, port=port,
                    env=env, tag=f"-node{k}") for k in range(nnodes)]
    deadline = time.monotonic() + timeout_s
    outs = [""] * nnodes

    def drain(k: int) -> None:  # each node's pipe drained at once: none blocks on a full pipe
        outs[k] = procs[k].communicate()[0]
    threads = [threading.Thread(target=drain, args=(k,), daemon=True) for k in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for proc in procs:
            _kill_tree(proc)
        for t in threads:
            t.join(10)
        text = "\n".join(f"--- node {k}:\n{o[-4000:]}" for k, o in enumerate(outs))
        pytest.fail(f"{script} on {nnodes} nodes: no result within {timeout_s:.0f} s (every "
                    f"launcher, rank and worker killed); each node's output:\n{text}")
    text = "\n".join(f"--- node {k}:\n{o[-4000:]}" for k, o in enumerate(outs))
    if any(proc.returncode != 0 for proc in procs):
        pytest.fail(f"{script} on {nnodes} nodes failed (exits {[p.returncode for p in procs]}); "
                    f"each node's output:\n{text}")
    return _load_results(script, out_dir, range(nnodes), text)
