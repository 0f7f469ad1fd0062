"""Fingerprints of the DTensor grads a speculated host step read: in-place edits of FSDP2 grads
between backward and step() that no version counter sees.

For a speculated subgroup with DTensor grads, a deterministic sum of squares of the grads is
recorded at launch and recomputed from the live grads at step(); any difference redoes the step
from the live grads. Invariant: both sides are one deterministic function of the same bytes, so
bitwise equality means "not edited". Design notes: docs/internals.md."""

from __future__ import annotations

import torch

from hybrid_opt.distributed.local_shards import any_dtensor

WORKER = "worker"  # CPU grads: the worker's per-piece grad_stats are the launch fingerprint


def has_dtensor_grads(live: list) -> bool:
    return any_dtensor([sl.param.grad for sl in live])


def on_device(grad) -> bool:
    """Whether a grad's fingerprint is taken on its device (CUDA) rather than read from the
    worker's piece sums (tests force the device path on CPU tensors: Triton's interpreter)."""
    return grad.is_cuda


def _device_sum_sq(live: list) -> torch.Tensor:
    import gpu_kernels

    grads = [sl.grad_view().contiguous() for sl in live]
    return gpu_kernels.grad_stats(grads, sum_dtype=torch.float64)[0]


def _after(then: torch.Tensor, event) -> torch.Tensor:
    """`then`, ordered before what the current stream does next: a grad hook may run on
    another stream than step() (an event wait on the device, no host sync)."""
    if event is not None:
        torch.cuda.current_stream(then.device).wait_event(event)
    return then


def live_piece_sums(gather, pieces: list, dtype) -> list:
    """cpu_kernels.grad_stats of each piece [(offset, numel, _)] of the live grads, as staged:
    `gather(dst, offset, numel)` (tiers/grads.py: GradGatherer) writes them in `dtype`, the
    staging slots' dtype; a piece lying in one grad of that dtype is read in place."""
    import cpu_kernels

    out = []
    for offset, numel, _ in pieces:
        src = None
        spans = list(gather.overlaps(offset, numel))
        if len(spans) == 1:
            sl, a, b = spans[0]
            g = sl.grad_view()
            if a == offset and b == offset + numel and g is not None and g.dtype == dtype:
                src = g[a - sl.sub_offset : b - sl.sub_offset]
        if src is None:
            src = torch.empty(numel, dtype=dtype)
            gather(src, offset, numel)
        out.append(cpu_kernels.grad_stats(src.contiguous())[0])
    return out


class GradFingerprints:
    """Per speculated host subgroup (optimizer index) with DTensor grads: how its launch
    fingerprint is kept (WORKER, or a 0-dim fp64 CUDA tensor and the event of its stream), and
    which were found edited."""

    def __init__(self):
        self._launch: dict = {}  # subgroup index -> WORKER | (device tensor, its event)
        self._flags: dict = {}  # subgroup index -> 0-dim flag tensor queued for read_scalars
        self._live: dict = {}  # subgroup index -> the live grads' piece sums (CPU), from checks()
        self.edited: set = set()  # subgroup indices whose grads changed since launch

    def record(self, sgi: int, live: list) -> None:
        """At launch of sgi's speculation (its grads as staged)."""
        self._launch.pop(sgi, None)
        self.edited.discard(sgi)
        if not has_dtensor_grads(live):
            return
        g = next(sl.grad_view() for sl in live)
        if not on_device(g):
            self._launch[sgi] = WORKER
            return
        then, event = _device_sum_sq(live), None
        if then.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(then.device))
        self._launch[sgi] = (then, event)

    def forget(self, sgi: int) -> None:
        self._launch.pop(sgi, None)
        self._flags.pop(sgi, None)
        self._live.pop(sgi, None)
        self.edited.discard(sgi)

    def keep_only(self, pending) -> None:
        for sgi in [k for k in self._launch if k not in pending]:
            self.forget(sgi)

    def checks(self, live_of, gather_of, layout_of, dtype) -> list:
        """At step(), before its scalars are read. CUDA fingerprints: queues the comparison
        with the live grads (`live_of(sgi)`: its live slices, or [] when none now) and returns
        the 0/1 flags (0-dim device tensors, read with the step's other scalars and handed to
        `note`). CPU ones: sums the live grads' pieces now (`layout_of(sgi)`: the pieces, not
        waited for; `gather_of(sgi)`: its GradGatherer), while the worker may still be
        stepping: is_edited compares them once the worker's sums are in."""
        self._flags, self._live = {}, {}
        for sgi, then in self._launch.items():
            if then is not WORKER:
                live = live_of(sgi)
                if live:
                    self._flags[sgi] = (_device_sum_sq(live) != _after(*then)).to(torch.float64)
            else:
                pieces = layout_of(sgi)
                if pieces is not None:
                    self._live[sgi] = live_piece_sums(gather_of(sgi), pieces, dtype)
        return list(self._flags.values())

    def note(self, values) -> None:
        """The flags checks() returned, read back (floats, in the same order)."""
        for sgi, v in zip(list(self._flags), values):
            if v:
                self.edited.add(sgi)
        self._flags = {}

    def is_edited(self, sgi: int, gather, piece_stats, dtype) -> bool:
        """Whether sgi's grads changed since its speculation launched. CPU grads: the live
        grads' piece sums against the worker's (`piece_stats()`, host_step.py; waits for the
        speculation's pieces); CUDA grads: what `note` recorded."""
        kind = self._launch.get(sgi)
        if kind is None:
            return False
        if kind is WORKER:
            now = self._live.pop(sgi, None)
            pieces = piece_stats()
            if pieces is None:
                return False
            if now is None:  # checks() runs at every step() that commits; kept correct without it
                now = live_piece_sums(gather, pieces, dtype)
            if len(now) != len(pieces) or any(not (a == b) for (_, _, a), b in zip(pieces, now)):
                self.edited.add(sgi)
        return sgi in self.edited
