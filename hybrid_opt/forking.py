"""What a child of os.fork() lets go of: the descriptors and mappings of the trainer that back an
optimizer (its shared memory, nvme files, worker pipes).

A DataLoader's workers and multiprocessing's fork children inherit every descriptor and mapping of
the trainer. Held there, they kept the optimizer's memory and disk allocated after close() for as
long as the child lived, and kept its worker from seeing the trainer's exit (EOF on its request
pipe). Each object that owns one registers itself here (`let_go_in_child`); after a fork the child
calls its `let_go()`, which drops it without touching what it refers to: the parent still uses it.
Invariant: a child never closes, writes or unmaps anything of the parent's but its own copies.
Design notes: docs/internals.md."""

from __future__ import annotations

import os
import weakref

_HOLDERS: weakref.WeakSet = weakref.WeakSet()


def let_go_in_child(holder) -> None:
    """`holder.let_go()` runs in every child forked from now on (while `holder` lives)."""
    _HOLDERS.add(holder)


def _after_fork_in_child() -> None:
    for holder in list(_HOLDERS):
        try:
            holder.let_go()
        except Exception:  # a fork must never fail for it: what is left is only held longer
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
