"""Step statistics: per-tier figures of the last step (`stats`), and the measured times fed
back to the scheduler of "auto", which may refit the placement.

Backward and the device step are timed with the clock of the params' device (clocks.py):
perf_counter on a CPU host; CUDA events on a GPU, read once the GPU has passed them, so a
step's sample reaches the scheduler a step or two late instead of the step waiting for it.

The optimizer's StepStats part; a refit itself is the placement's (placement.py).
"""

from __future__ import annotations

import collections
import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING

from hybrid_opt.lifetime import weak_method
from hybrid_opt.placement.plan import DEVICE, HOST, NVME
from hybrid_opt.state.state_format import StateFormat
from hybrid_opt.step_plan import StepOutcome, StepPlan

if TYPE_CHECKING:
    from hybrid_opt.seams import Clock

# steps whose CUDA-event marks may wait to be read; past that the oldest sample is dropped
# (the GPU is that far behind the trainer: a sample lost, never an unbounded queue)
MAX_UNREAD_SAMPLES = 4


class StepStats:
    """`stats` of each step, the clock that times backward and the device step, and the
    measured samples fed to the scheduler of "auto"."""

    def __init__(self, layout, state_format: StateFormat):
        self.layout = layout
        self.state_format = state_format
        self.last: dict = {}  # the optimizer's `stats`: the last step's figures
        self.clock: Clock | None = None  # the params' device's clock (clocks.py), made on first use
        # steps whose marks the clock cannot read yet
        self.unread_samples: collections.deque = collections.deque()
        self._measured: dict | None = None  # the latest sample read: `stats["measured"]`
        # the host tier's per-subgroup worker seconds at the last step
        self._prev_worker_s: dict | None = None
        self.outcome_by_sg: dict = {}  # the last host step's outcome per subgroup index
        self.last_plan: StepPlan | None = None  # the last step taken, as decided (step_plan.py)
        self.last_outcome: StepOutcome | None = None  # ... and as its tiers did it
        self._bwd_first = self._bwd_last = None
        self._hooks: list = []

    # ------------------------------------------------------------------ the clock
    def mark(self):
        """A mark of the clock that times work on the params' device: a perf_counter reading
        on a CPU host, a CUDA event recorded on the current stream on a GPU."""
        if self.clock is None:
            from hybrid_opt.clocks import clock_for

            first = next(iter(self.layout.params()), None)
            self.clock = clock_for(first.device if first is not None else "cpu")
        return self.clock.mark()

    def time_backward(self) -> None:
        """ "auto": the scheduler times backward from the first grad accumulated to the last:
        hooks on the first and last trainable params only (grads complete in about reverse
        parameter order; a Python hook on every param would itself slow backward)."""
        self.remove_hooks()
        trainable = [p for p in self.layout.params() if p.requires_grad]
        for p in {id(q): q for q in trainable[:1] + trainable[-1:]}.values():
            self._hooks.append(p.register_post_accumulate_grad_hook(weak_method(self._on_grad_timed)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad_timed(self, p) -> None:
        # a CUDA event on a GPU: backward's GPU time, not its launch (clocks.py)
        now = self.mark()
        if self._bwd_first is None:
            self._bwd_first = now
        self._bwd_last = now

    # ------------------------------------------------------------------ a step's figures
    def skipped(self, host, dropped: int, step: StepPlan) -> None:
        """Stats of a skipped step (an overflow, `step`), not of the last one that was taken."""
        self.last_plan, self.last_outcome = step, StepOutcome()
        self.last = {
            "host": dict(host.stats) if host is not None else {},
            "speculation": dict(committed=0, redone=0, stepped=0, dropped=dropped)
            if host is not None
            else None,
            "grad_norm": None,
            "clip_coef": None,
        }

    def new_host_tier(self) -> None:
        """A move laid out a new host tier: its per-subgroup worker times start again."""
        self._prev_worker_s = None

    def record(self, plan, host, step: StepPlan, outcome: StepOutcome) -> None:
        """Per-tier figures of a step taken (`step`, and `outcome`: what its tiers did): subgroups,
        state bytes, the trainer's time in it, the host steps' time on it (`worker_s`: the
        worker's tasks, and the trainer's own steps where it runs them, tiers/inline_steps.py),
        and how much of that hid under backward. `plan`: the placement's."""
        t_step, t_host, t_device, t_end = outcome.times
        host_wait_s, device_s = t_device - t_host, t_end - t_device
        counts = {k: 0 for k in ("committed", "redone", "stepped", "dropped")}
        for v in outcome.host.values():
            counts[v] += 1
        self.outcome_by_sg = dict(outcome.host)
        # kept for introspection without its gatherers, which hold this step's grads: kept, they
        # would outlive zero_grad() and keep a second set of grads allocated into the next step
        self.last_plan = dataclasses.replace(step, host_steps=MappingProxyType({}))
        self.last_outcome = outcome
        tiers = {
            t: {
                "subgroups": 0,
                "elements": 0,
                "state_bytes": 0,
                "worker_s": 0.0,
                "committed": 0,
                "redone": 0,
                "stepped": 0,
                "dropped": 0,
            }
            for t in (DEVICE, HOST, NVME)
        }
        fmt = self.state_format
        for sg in self.layout.subgroups:
            tier = plan.tiers[sg.index]
            t = tiers[tier]
            t["subgroups"] += 1
            t["elements"] += sg.numel
            # the master (none for an fp32 param on the device: its own), or a remainder, and
            # the moments, in the optimizer's state format; on nvme the file's bytes
            t["state_bytes"] += sg.numel * fmt.for_subgroup(sg.quantized).state_bytes(
                sg.dtype, self.layout.amsgrad, own_master=tier == DEVICE
            )
        if host is not None:
            prev = self._prev_worker_s or {}
            now = dict(host.io.worker_seconds)
            for index, seconds in now.items():
                tiers[plan.tiers[index]]["worker_s"] += seconds - prev.get(index, 0.0)
            self._prev_worker_s = now
            for index, result in self.outcome_by_sg.items():
                tiers[plan.tiers[index]][result] += 1
        tiers[DEVICE]["trainer_s"] = device_s
        off = tiers[HOST]["worker_s"] + tiers[NVME]["worker_s"]
        for name in (HOST, NVME):
            tiers[name]["trainer_wait_s"] = host_wait_s * (tiers[name]["worker_s"] / off if off else 0.0)
        # the worker's time that did not make step() wait was hidden under backward
        hidden = max(0.0, off - host_wait_s)
        self.last = {
            "tiers": tiers,
            "host_wait_s": host_wait_s,
            "device_s": device_s,
            "hidden_s": hidden,
            "worker_s": off,
            "speculation": counts if step.host_work else None,
            "grad_norm": step.norm,
            "clip_coef": step.clip,
        }

    # ------------------------------------------------------------------ "auto"'s samples
    def queue_sample(self, steps_taken: int, device_work: list, step_s: float, device_marks: tuple) -> None:
        """This step's sample for the scheduler, read once the clock can (device_marks: the
        clock's marks around the device step)."""
        st, tiers = self.last, self.last["tiers"]
        fields = dict(
            step_s=step_s,
            host_wait_s=st["host_wait_s"],
            device_host_s=st["device_s"],
            device_elements=sum(w.slice.numel for w in device_work),
            host_worker_s=tiers[HOST]["worker_s"],
            host_elements=tiers[HOST]["elements"],
            hidden_s=st["hidden_s"],
        )
        report = {"step_s": step_s, "worker_s": st["worker_s"], "host_wait_s": st["host_wait_s"]}
        self.unread_samples.append(
            (steps_taken, (self._bwd_first, self._bwd_last), device_marks, fields, report)
        )
        self._bwd_first = self._bwd_last = None

    def observe(self, auto) -> None:
        """Feeds the scheduler every unread step whose marks the clock can read now, oldest
        first (it never waits on the GPU: a step it cannot read yet is read at a later one)."""
        from hybrid_opt.placement.scheduler import Sample

        unread, clock = self.unread_samples, self.clock
        while unread:
            assert clock is not None  # a sample holds marks the clock made
            step, (b0, b1), (d0, d1), fields, report = unread[0]
            device_s = clock.seconds(d0, d1)
            backward_s = None if b0 is None else clock.seconds(b0, b1)
            if device_s is None or (b0 is not None and backward_s is None):
                break
            unread.popleft()
            auto.observe(Sample(backward_s=backward_s, device_s=device_s, **fields))
            self._measured = dict(report, step=step, backward_s=backward_s, device_s=device_s)
        while len(unread) > MAX_UNREAD_SAMPLES:
            unread.popleft()

    def predicted(self, prediction) -> None:
        """The scheduler's prediction for the placement now, next to the latest measured step."""
        if prediction is None:
            return
        tiers = self.last["tiers"]
        b = prediction.breakdown
        off = b["host_work"]
        e_off = tiers[HOST]["elements"] + tiers[NVME]["elements"]
        for name in (HOST, NVME):
            tiers[name]["predicted_worker_s"] = off * tiers[name]["elements"] / e_off if e_off else 0.0
        tiers[DEVICE]["predicted_s"] = b["device_step"]
        self.last["predicted"] = {
            "step_s": prediction.step_seconds,
            "backward_s": b["backward"] + b["backward_contention"],
            "device_s": b["device_step"],
            "worker_s": off,
            "host_exposed_s": b["host_exposed"],
        }
        if self._measured is not None:
            # the latest step the clock could read: this one on a CPU host, on a GPU usually
            # the one before (its "step" says which)
            self.last["measured"] = dict(self._measured)
