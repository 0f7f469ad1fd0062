"""Host steps the trainer runs itself: on a CPU-only host, a step that step() waits for.

There the trainer and the worker share every core, and the trainer sleeps while the worker steps.
Sent to the worker, a step costs two copies on top of its kernel: the grads into a staging slot
and the new params back out of the bank. Run here, the same kernel (worker/arena_steps.py, the
same bits) reads each grad where backward left it and writes the bank in place; only the params'
copy back remains (Intel Xeon, 2 cores, the bench GPT at offload 1: docs/benchmarks.md).

The worker keeps everything else: speculated steps during backward, the nvme subgroups' swaps (a
step's read lands before the trainer steps it; its write goes after), and every step on a host
whose cores are split (a GPU host)."""

from __future__ import annotations

import dataclasses
import time

from hybrid_opt.shm import address
from hybrid_opt.worker import protocol as proto
from hybrid_opt.worker.arena_steps import ArenaSteps


class InlineSteps:
    """Runs step tasks on the trainer's own mapping of the arena, each to its Result as the
    worker would send it back (an error, too, comes back as a Result: HostIO raises it)."""

    def __init__(self, arena, layout: dict):
        self._steps = ArenaSteps(layout, address(arena.mm))
        self.count = 0  # pieces stepped here

    def quantized(self, sg: int) -> bool:
        """Whether `sg`'s moments are q8 codes (its pieces' grads must be whole in a slot: a
        block of 256 is never split across two kernel calls)."""
        return sg in self._steps.quantized

    def step(self, t: proto.Task, segments=None) -> proto.Result:
        """Step task `t`. segments: [(byte offset in the piece, address, bytes)] of its grads
        where they lie (every one nonzero), all stepped in one kernel call; None: the grads
        are in its staging slot (ArenaSteps.step: a step the trainer waits for measures no grad
        stats; only a speculation's are read, HostStepping.piece_stats)."""
        t0 = time.perf_counter_ns()
        try:
            r = self._steps.step(t, segments)
        except Exception as e:  # the worker's way (Worker._run): HostIO raises it, naming it
            r = proto.Result(
                t.op, t.task_id, proto.STATUS_ERROR, t.subgroup, message=f"{type(e).__name__}: {e}"
            )
        self.count += 1
        return dataclasses.replace(r, elapsed_ns=time.perf_counter_ns() - t0)
