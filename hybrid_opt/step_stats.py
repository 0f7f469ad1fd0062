"""Step statistics: per-tier figures of the last step (`stats`), and the measured times fed
back to the scheduler of "auto", which may refit the placement.

Backward and the device step are timed with the clock of the params' device (clocks.py):
perf_counter on a CPU host; CUDA events on a GPU, read once the GPU has passed them, so a
step's sample reaches the scheduler a step or two late instead of the step waiting for it.

A mixin of the optimizer class.
"""
from __future__ import annotations

import collections
import warnings

from hybrid_opt.plan import DEVICE, HOST, NVME
from hybrid_opt.state_format import StateFormat

# steps whose CUDA-event marks may wait to be read; past that the oldest sample is dropped
# (the GPU is that far behind the trainer: a sample lost, never an unbounded queue)
MAX_UNREAD_SAMPLES = 4


class StepStatsMixin:
    """`stats` of each step, and the scheduler's feedback loop."""

    def _mark(self):
        """A mark of the clock that times work on the params' device: a perf_counter reading
        on a CPU host, a CUDA event recorded on the current stream on a GPU."""
        clock = self.__dict__.get("_clock")
        if clock is None:
            from hybrid_opt.clocks import clock_for
            first = next(iter(self._layout.params()), None)
            clock = self._clock = clock_for(first.device if first is not None else "cpu")
        return clock.mark()

    def _observe_measured(self) -> None:
        """Feeds the scheduler every unread step whose marks the clock can read now, oldest
        first (it never waits on the GPU: a step it cannot read yet is read at a later one)."""
        from hybrid_opt.scheduler import Sample
        unread = self._unread_samples
        while unread:
            step, (b0, b1), (d0, d1), fields, report = unread[0]
            device_s = self._clock.seconds(d0, d1)
            backward_s = None if b0 is None else self._clock.seconds(b0, b1)
            if device_s is None or (b0 is not None and backward_s is None):
                break
            unread.popleft()
            self._auto.observe(Sample(backward_s=backward_s, device_s=device_s, **fields))
            self._measured = dict(report, step=step, backward_s=backward_s, device_s=device_s)
        while len(unread) > MAX_UNREAD_SAMPLES:
            unread.popleft()

    def _schedule(self, device_work: list, step_s: float, device_marks: tuple) -> None:
        """Feeds the scheduler the measured times of the steps it can read now, puts its
        prediction next to the latest of them in `stats`, and moves subgroups between tiers
        when a refit says it pays. device_marks: the clock's marks around the device step."""
        tiers = self.stats["tiers"]
        unread = self.__dict__.setdefault("_unread_samples", collections.deque())
        fields = dict(step_s=step_s, host_wait_s=self.stats["host_wait_s"], device_host_s=self.stats["device_s"],
                      device_elements=sum(w.slice.numel for w in device_work),
                      host_worker_s=tiers[HOST]["worker_s"], host_elements=tiers[HOST]["elements"],
                      hidden_s=self.stats["hidden_s"])
        report = {"step_s": step_s, "worker_s": self.stats["worker_s"],
                  "host_wait_s": self.stats["host_wait_s"]}
        unread.append((self._ledger.steps_taken, (self._bwd_first, self._bwd_last), device_marks, fields, report))
        self._bwd_first = self._bwd_last = None
        self._observe_measured()
        if self._auto.due(self._ledger.steps_taken):
            self._observe_device_memory()  # "auto" on CUDA: the device budget beside the activations
            decision = self._auto.refit(*self._fractions, self.plan.spare_banks)
            if decision is not None and not self._room_to_move(decision):
                self.plan.reason = ("refit: a move would pay, but it does not fit in free memory: "
                                    f"{self._room_shortfall(self._fraction_plan(decision))}")
                decision = None
            if decision is not None:
                try:
                    self._move(decision)
                except Exception as e:  # the plan before is back, state and all (see _move)
                    warnings.warn(f"refit: moving to offload_fraction={decision.offload_fraction:g}, "
                                  f"nvme_fraction={decision.nvme_fraction:g} failed; the plan stays as it "
                                  f"was: {type(e).__name__}: {e}", stacklevel=3)
                    self.plan.reason = f"refit: a move failed ({type(e).__name__})"
            elif self._auto.backward_s is not None:
                self.plan.prediction = self._auto.predict(*self._fractions, self.plan.spare_banks)
                self.plan.reason = "refit: kept"
        p = self.plan.prediction
        if p is not None:
            b = p.breakdown
            off = b["host_work"]
            e_off = tiers[HOST]["elements"] + tiers[NVME]["elements"]
            for name in (HOST, NVME):
                tiers[name]["predicted_worker_s"] = off * tiers[name]["elements"] / e_off if e_off else 0.0
            tiers[DEVICE]["predicted_s"] = b["device_step"]
            self.stats["predicted"] = {"step_s": p.step_seconds,
                                       "backward_s": b["backward"] + b["backward_contention"],
                                       "device_s": b["device_step"], "worker_s": off,
                                       "host_exposed_s": b["host_exposed"]}
        measured = self.__dict__.get("_measured")
        if p is not None and measured is not None:
            # the latest step the clock could read: this one on a CPU host, on a GPU usually
            # the one before (its "step" says which)
            self.stats["measured"] = dict(measured)

    def _record_stats(self, host_steps, device_work, host_wait_s, device_s, norm, clip) -> None:
        """Per-tier figures of this step: subgroups, state bytes, the trainer's time in it,
        the worker's time on it, and how much of the worker's time hid under backward."""
        tiers = {t: {"subgroups": 0, "elements": 0, "state_bytes": 0, "worker_s": 0.0,
                     "committed": 0, "redone": 0, "stepped": 0, "dropped": 0}
                 for t in (DEVICE, HOST, NVME)}
        fmt = getattr(self, "state_format", None) or StateFormat()
        for sg in self._layout.subgroups:
            tier = self.plan.tiers[sg.index]
            t = tiers[tier]
            t["subgroups"] += 1
            t["elements"] += sg.numel
            # the master (none for an fp32 param on the device: its own), or a remainder, and
            # the moments, in the optimizer's state format; on nvme the file's bytes
            t["state_bytes"] += sg.numel * fmt.state_bytes(sg.dtype, self._layout.amsgrad,
                                                           own_master=tier == DEVICE)
        if self._host is not None:
            prev = getattr(self, "_prev_worker_s", [0.0] * len(self._host.worker_seconds))
            now = list(self._host.worker_seconds)
            for index, local in self._host_local.items():
                tiers[self.plan.tiers[index]]["worker_s"] += now[local] - prev[local]
            self._prev_worker_s = now
            for index, outcome in getattr(self, "_last_outcome_by_sg", {}).items():
                tiers[self.plan.tiers[index]][outcome] += 1
        tiers[DEVICE]["trainer_s"] = device_s
        off = tiers[HOST]["worker_s"] + tiers[NVME]["worker_s"]
        for name in (HOST, NVME):
            tiers[name]["trainer_wait_s"] = host_wait_s * (tiers[name]["worker_s"] / off if off else 0.0)
        # the worker's time that did not make step() wait was hidden under backward
        hidden = max(0.0, off - host_wait_s)
        self.stats = {"tiers": tiers, "host_wait_s": host_wait_s, "device_s": device_s,
                      "hidden_s": hidden, "worker_s": off,
                      "speculation": getattr(self, "_last_outcome", None) if host_steps else None,
                      "grad_norm": norm, "clip_coef": clip}
