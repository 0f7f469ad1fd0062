"""Step statistics: per-tier figures of the last step (`stats`), and the measured times fed
back to the scheduler of "auto", which may refit the placement.

A mixin of the optimizer class.
"""
from __future__ import annotations

import warnings

from hybrid_opt.plan import DEVICE, HOST, NVME


class StepStatsMixin:
    """`stats` of each step, and the scheduler's feedback loop."""

    def _schedule(self, device_work: list, step_s: float) -> None:
        """Feeds the scheduler this step's measured times, puts its prediction next to them in
        `stats`, and moves subgroups between tiers when a refit says it pays."""
        from hybrid_opt.scheduler import Sample
        tiers = self.stats["tiers"]
        backward_s = None if self._bwd_first is None else self._bwd_last - self._bwd_first
        self._bwd_first = self._bwd_last = None
        self._auto.observe(Sample(
            backward_s=backward_s, step_s=step_s, device_s=self.stats["device_s"],
            host_wait_s=self.stats["host_wait_s"],
            device_elements=sum(sl.numel for _, sl, _, _ in device_work),
            host_worker_s=tiers[HOST]["worker_s"], host_elements=tiers[HOST]["elements"],
            hidden_s=self.stats["hidden_s"]))
        if self._auto.due(self._steps_taken):
            decision = self._auto.refit(*self._fractions, self.plan.spare_banks)
            if decision is not None and not self._room_to_move():
                self.plan.reason = "refit: a move would pay, but a copy of the state does not fit in free memory"
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
            self.stats["measured"] = {"step_s": step_s, "backward_s": backward_s,
                                      "device_s": self.stats["device_s"],
                                      "worker_s": self.stats["worker_s"],
                                      "host_wait_s": self.stats["host_wait_s"]}

    def _record_stats(self, host_steps, device_work, host_wait_s, device_s, norm, clip) -> None:
        """Per-tier figures of this step: subgroups, state bytes, the trainer's time in it,
        the worker's time on it, and how much of the worker's time hid under backward."""
        tiers = {t: {"subgroups": 0, "elements": 0, "state_bytes": 0, "worker_s": 0.0,
                     "committed": 0, "redone": 0, "stepped": 0, "dropped": 0}
                 for t in (DEVICE, HOST, NVME)}
        for sg in self._subgroups:
            t = tiers[self.plan.tiers[sg.index]]
            t["subgroups"] += 1
            t["elements"] += sg.numel
            t["state_bytes"] += sg.numel * (16 if self._amsgrad_layout else 12)
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
