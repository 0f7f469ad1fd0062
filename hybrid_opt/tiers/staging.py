"""Asynchronous grad staging: CUDA grads copied D2H on a side stream into the host tier's staging
slots, and the in-order queue of pieces that wait for their copies to land.

Invariant: a grad hook never synchronizes; a piece goes to the worker only once its copy's event
has completed (polled from later hooks, waited at step()). The queue depends only on an event's
`query()` / `synchronize()`, so it is tested on the CPU with a fake stager."""

from __future__ import annotations

from collections import deque

import torch


class CudaStager:
    """Copies into pinned host memory on a side stream of one CUDA device."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def copy(self, fill):
        """Runs `fill()` — which queues non-blocking copies and calls `keep_alive` on their
        sources — on the side stream, after everything already queued on the current stream
        (the grads were produced there); returns the event of the copies' completion."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            try:
                fill()
            except BaseException:
                # copies it queued before failing must land before the slot is reused (a
                # failure path: waiting is fine there)
                self.stream.synchronize()
                raise
        done = torch.cuda.Event()
        done.record(self.stream)
        return done


def keep_alive(src: torch.Tensor) -> None:
    """A CUDA tensor read by a copy queued on the current (side) stream: its memory is not
    reused before that copy has run, even when the grad is freed first (`p.grad = None`)."""
    if src.is_cuda:
        src.record_stream(torch.cuda.current_stream(src.device))


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)
    keep_alive(src)


def staging_device(grad):
    """The CUDA device of a grad (a tensor, or a provider with `cuda_device()`) or of model
    elements (anything with a `device`), or None when it is staged synchronously (CPU)."""
    if callable(grad):
        probe = getattr(grad, "cuda_device", None)
        return probe() if probe is not None else None
    return grad.device if grad.device.type == "cuda" else None


class CopyQueue(deque):
    """Pieces waiting to be sent to the worker, in launch order: a piece whose staging copy is
    in flight holds back every piece behind it (the worker runs tasks in arrival order, and an
    nvme write-back must follow its subgroup's steps). Each entry is (pieces, whole): `whole`
    marks one subgroup's pieces that are sent together once all are finite (inverse mode).
    A deque of those entries: its len() is how many wait (asked at every send and every wait,
    so a plain deque's, not a method of this module). A piece (host_io._Piece) is read for its
    `copy_done` event and marked only through its enqueue(), dequeue() and copy_landed()."""

    def push(self, pieces: list, whole: bool = False) -> None:
        for p in pieces:
            p.enqueue()
        self.append((pieces, whole))

    def ready(self, block: bool):
        """Pops the head entries, in order, while every copy in the head one has landed, handing
        each to the caller before the next is looked at (a generator); block: wait for them
        (event.synchronize — only where waiting is allowed, never in a grad hook)."""
        while self:
            pieces, whole = self[0]
            for p in pieces:
                if p.copy_done is not None:
                    if not p.copy_done.query():
                        if not block:
                            return
                        p.copy_done.synchronize()
                    p.copy_landed()
            self.popleft()
            for p in pieces:
                p.dequeue()
            yield pieces, whole

    def pieces(self) -> list:
        return [p for pieces, _ in self for p in pieces]
