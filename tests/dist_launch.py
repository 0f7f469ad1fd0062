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
import re
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


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _dist_marks() -> list:
    import pytest
    from helpers import FSDP2_ON_GLOO, FSDP2_ON_GLOO_REASON, TORCH_VERSION

    return [
        pytest.mark.skipif(TORCH_VERSION < FSDP2_ON_GLOO, reason=FSDP2_ON_GLOO_REASON),
        pytest.mark.skipif(not _gloo(), reason="torch.distributed with the gloo backend is not available"),
    ]


def __getattr__(name):
    # DIST_MARKS, the distributed test modules' pytestmark (FSDP2 needs torch >= 2.6, every
    # launch gloo), made on first use: benchmarks/bench_dist.py imports this module without pytest
    if name == "DIST_MARKS":
        return _dist_marks()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def free_port() -> int:
    """A port free now — and possibly taken by another process before torchrun binds it: only
    launch_nodes uses one (retrying on a collision); launch lets the store pick its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what torchrun's output says when the store's port was taken between free_port() and its bind
_PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
PORT_ATTEMPTS = 3


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


def _start(
    script: str,
    out_dir: str,
    args,
    *,
    nproc: int,
    nnodes: int,
    node_rank: int,
    port: int | None,
    env: dict | None,
    tag: str = "",
) -> subprocess.Popen:
    os.makedirs(out_dir, exist_ok=True)
    # no port: --standalone, whose store binds port 0 itself — concurrent launches (pytest-xdist,
    # two CI jobs on one machine) can never collide, as they could on a port chosen beforehand
    where = (
        ["--standalone"]
        if port is None
        else [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        # the agent's per-run log directory under the test's own folder, not a new /tmp/torchelastic_*
        # left behind by every launch
        f"--log-dir={os.path.join(out_dir, f'torchelastic{tag}')}",
        *where,
        os.path.join(SCRIPTS, script),
        *map(str, args),
    ]
    full_env = dict(
        os.environ,
        DIST_OUT=out_dir,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]),
        TORCHELASTIC_ERROR_FILE=os.path.join(out_dir, f"error{tag}.json"),
    )
    full_env.update(env or {})
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
        cwd=out_dir,
    )


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


def launch(
    script: str,
    out_dir: str,
    *args,
    nproc: int = 2,
    nnodes: int = 1,
    node_rank: int = 0,
    port: int | None = None,
    timeout_s: float = 120.0,
    env: dict | None = None,
) -> list:
    """Runs tests/dist_scripts/<script> on `nproc` ranks (per node; `nnodes` > 1: this call
    is node `node_rank` of a static rendezvous on localhost:`port`). Returns the ranks'
    saved results (those of this node), or fails with the output of every rank."""
    if nnodes > 1 and port is None:
        raise ValueError(
            "launch: a node of a several-node launch needs the port every node "
            "shares (launch_nodes picks one)"
        )
    proc = _start(script, out_dir, args, nproc=nproc, nnodes=nnodes, node_rank=node_rank, port=port, env=env)
    out = wait_bounded(proc, f"{script} {' '.join(map(str, args))}", timeout_s)
    return _load_results(script, out_dir, range(node_rank * nproc, (node_rank + 1) * nproc), out)


def wait_bounded(proc: subprocess.Popen, what: str, timeout_s: float) -> str:
    """The output of `proc` (started in a session of its own, stdout piped as text) once it
    exits 0; past `timeout_s` every process under it is killed; either failure fails the test
    with the ranks' output."""
    import pytest

    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(
            f"{what}: no result within {timeout_s:.0f} s (every rank and worker killed); "
            f"the ranks' output:\n{out[-6000:]}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {proc.returncode}) after {time.monotonic() - t0:.1f} s; "
            f"the ranks' output:\n{out[-8000:]}"
        )
    return out


def launch_nodes(
    script: str, out_dir: str, *args, nnodes: int = 2, timeout_s: float = 120.0, env: dict | None = None
) -> list:
    """`nnodes` torchrun launches on localhost, one rank each, joined by a static rendezvous
    (node 0 hosts the store): how a multi-node job starts, one launcher per node. One deadline
    for all: past it, every launcher's whole tree is killed and the test fails with each
    node's output. The shared port is chosen before the launch, so another process can take it
    first: a launch whose store found its port taken is run again on a new port (at most
    PORT_ATTEMPTS times, within the same deadline). Returns the ranks' saved results in rank
    order."""
    import pytest

    deadline = time.monotonic() + timeout_s
    for attempt in range(PORT_ATTEMPTS):
        procs, outs = _run_nodes(script, out_dir, args, nnodes, free_port(), env, deadline)
        text = "\n".join(f"--- node {k}:\n{o[-4000:]}" for k, o in enumerate(outs))
        if procs is None:
            pytest.fail(
                f"{script} on {nnodes} nodes: no result within {timeout_s:.0f} s (every "
                f"launcher, rank and worker killed); each node's output:\n{text}"
            )
        failed = any(proc.returncode != 0 for proc in procs)
        if failed and attempt + 1 < PORT_ATTEMPTS and any(_PORT_TAKEN.search(o) for o in outs):
            continue  # the store's port was taken between free_port() and its bind
        if failed:
            pytest.fail(
                f"{script} on {nnodes} nodes failed (exits {[p.returncode for p in procs]}); "
                f"each node's output:\n{text}"
            )
        return _load_results(script, out_dir, range(nnodes), text)


def _run_nodes(script, out_dir, args, nnodes, port, env, deadline):
    """(launchers, their outputs) once every launcher ended; (None, outputs) past the deadline,
    every launcher's tree killed."""
    procs = [
        _start(
            script, out_dir, args, nproc=1, nnodes=nnodes, node_rank=k, port=port, env=env, tag=f"-node{k}"
        )
        for k in range(nnodes)
    ]
    outs = [""] * nnodes

    def drain(k: int) -> None:  # each node's pipe drained at once: none blocks on a full pipe
        outs[k] = procs[k].communicate()[0]

    threads = [threading.Thread(target=drain, args=(k,), daemon=True) for k in range(nnodes)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        threads[0].join(min(0.2, max(0.0, deadline - time.monotonic())))
        if not threads[0].is_alive() and _PORT_TAKEN.search(outs[0]) and procs[0].returncode:
            # node 0 could not host the store: the other nodes would wait for it (or join a
            # stranger's store on that port) until the deadline
            for proc in procs[1:]:
                _kill_tree(proc)
            break
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for proc in procs:
            _kill_tree(proc)
        for t in threads:
            t.join(10)
        return None, outs
    return procs, outs
