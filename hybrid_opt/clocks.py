"""Clocks for the scheduler's measurements: the time between two marks, in the time base of
where the work runs.

On a CPU-only host the trainer runs the work itself, so perf_counter between two marks is
the work's time. On CUDA the trainer only queues kernels: perf_counter around a backward or
a device step measures their launch, not the GPU's time in them. There a mark is a CUDA
event recorded on the current stream, and the time between two marks is read only once the
later one has completed (`Event.query()`): reading never waits on the GPU, so a
measurement is taken a step late rather than adding a host synchronisation to the step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid_opt.seams import Clock


class HostClock:
    """perf_counter marks: the trainer's own time (CPU-only hosts)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float | None:
        """Seconds from `start` to `end`; always known at once."""
        return end - start


class CudaClock:
    """CUDA-event marks on the current stream of `device`: GPU time between them."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float | None:
        """Seconds of GPU time from `start` to `end`, or None while the GPU has not reached
        them yet (ask again later: this never waits)."""
        if not (end.query() and start.query()):
            return None
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device | str) -> Clock:
    """The clock that measures work on `device`: GPU time on CUDA, host time elsewhere."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()
