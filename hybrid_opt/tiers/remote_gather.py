"""Remote gather: the worker reads a piece's grads straight from the trainer's memory
(process_vm_readv, the gather list of its task) instead of the trainer staging them, so
speculation costs backward no copy. HYBRID_OPT_REMOTE_GATHER=0 turns it off; a kernel that
forbids it (Yama ptrace scope 2-3, seccomp) is found by `probe` at start, and the trainer
stages grads itself. host_io.py decides per piece (only while the worker has little queued)
and names the grads' memory (HostIO._remote_segments).
"""
from __future__ import annotations

import os

import torch

from hybrid_opt.worker import protocol as P


def probe(send_and_wait, slot_view: torch.Tensor, slot: int) -> bool:
    """Whether the worker copies a probe from this process's memory into staging slot `slot`
    (`slot_view`: its memory) — a ping with a gather list; send_and_wait(task) -> its Result."""
    if os.environ.get("HYBRID_OPT_REMOTE_GATHER", "1") == "0":
        return False
    probe_t = torch.arange(1, 65, dtype=torch.float32)
    dst = slot_view.view(torch.uint8)[:probe_t.numel() * 4]
    dst.zero_()
    task = P.Task(P.OP_PING, 0, slot=slot, gather=P.pack_gather([(0, probe_t.data_ptr(), probe_t.numel() * 4)]))
    try:
        r = send_and_wait(task)
    except Exception:
        return False
    ok = r.status == P.STATUS_OK and torch.equal(dst.view(torch.float32), probe_t)
    dst.zero_()
    return ok

