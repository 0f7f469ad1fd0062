"""The one documented introspection surface of an optimizer's insides: `debug_view(opt)`.

Tests (and benchmarks) check behaviour through the public API; what only they need to see —
the subgroups, the tiers, the speculation outcomes, the ledger — they read here, and nowhere
else reaches through `opt.parts`, so an internal move changes this module, not every test.
Reads are copies or plain values where they can be; a property hands a part's own object out
only where a test must act on it (call a tier's method, flip a byte of its file, patch a method
to inject a fault), and says so. Grouped by part: layout, ledger, placement, host tier, device
tier, speculation and stats, param guard, sharding. docs/usage.md documents it.
"""

from __future__ import annotations


class DebugView:
    """A read-mostly view of one optimizer's parts (docs/code-map.md), made by `debug_view`."""

    def __init__(self, opt):
        self._parts = opt.parts

    # ------------------------------------------------------------------ layout
    @property
    def subgroups(self) -> list:
        """The subgroups in layout order (a copy of the list; `.index` is the subgroup's id)."""
        return list(self._parts.layout.subgroups)

    @property
    def param_index(self):
        """Each laid-out param's index in the optimizer (the layout's param -> index map)."""
        return self._parts.layout.index

    @property
    def param_steps(self) -> list:
        """Each param's step count, by param index (a copy)."""
        return list(self._parts.layout.steps)

    @property
    def amsgrad(self) -> bool:
        """Whether the layout keeps max_exp_avg_sq (any group has amsgrad)."""
        return self._parts.layout.amsgrad

    def params(self) -> list:
        """The laid-out params, by param index."""
        return list(self._parts.layout.params())

    @property
    def layout(self):
        """The Layout itself: for a test that patches what it reports (`cuda()`)."""
        return self._parts.layout

    # ------------------------------------------------------------------ ledger
    @property
    def steps_taken(self) -> int:
        """The steps the optimizer has taken (skipped ones not counted)."""
        return self._parts.ledger.steps_taken

    @property
    def rank_failure(self):
        """The failure this rank keeps from an earlier step (rank_faults.py), or None."""
        return self._parts.ledger.rank_failure

    @property
    def ledger(self):
        """The StepLedger itself: for a test that injects a kept rank failure."""
        return self._parts.ledger

    # ------------------------------------------------------------------ placement
    @property
    def placement(self):
        """The Placement itself (plan_for, move_memory, room checks, relayout, byte counts): for
        tests that call or patch its moves and budgets."""
        return self._parts.placement

    @property
    def planner(self):
        """ "auto"'s AutoPlanner (samples, refit, predict, moves, budgets), or None."""
        return self._parts.placement.auto

    @property
    def fractions(self) -> tuple:
        """(off the device, on nvme) as laid out now."""
        return tuple(self._parts.placement.fractions)

    # ------------------------------------------------------------------ host tier
    @property
    def host(self):
        """The HostTier (banks, arena, worker, nvme files; by layout subgroup index), or None
        without one: for tests that inspect or act on its insides."""
        return self._parts.placement.host

    @property
    def host_stats(self) -> dict:
        """The host tier's counters (stepped, committed, redone, worker_restarts, ...), a copy."""
        host = self._parts.placement.host
        return {} if host is None else dict(host.stats)

    def host_subgroups(self) -> list:
        """The layout subgroups the host tier holds (host and nvme), in the tier's own order."""
        host = self._parts.placement.host
        return [] if host is None else list(host.numels)

    def on_nvme(self, sg: int) -> bool:
        """Whether host-tier subgroup `sg` (a layout index) lives in an nvme file."""
        return bool(self.host.nvme[sg])

    def host_quantized(self, sg: int) -> bool:
        """Whether host-tier subgroup `sg` keeps q8 moments."""
        return self.host.quantized(sg)

    def nvme_file(self, sg: int) -> str:
        """The path of nvme subgroup `sg`'s state file."""
        return self.host.swap.file(sg)

    def file_slot(self, sg: int) -> int:
        """The slot of nvme subgroup `sg`'s file that holds its committed state (0 or 1). Acts:
        the writes behind the last step land first (settle_writes)."""
        self.settle_writes()
        return self.host.file_slots.slot(sg)

    def committed_bank(self, sg: int) -> int:
        """The bank that holds host-tier subgroup `sg`'s committed state."""
        return self.host.pool.committed[sg]

    def reads_ahead(self) -> list:
        """The nvme subgroups whose next step finds their state in memory: their committed slot
        read ahead of it (HostStepping.read_ahead), or the bank their last step wrote, its write
        landing behind it; sorted; [] without a host tier."""
        host = self._parts.placement.host
        return [] if host is None else sorted(host.held.reads_ahead)

    def writes_behind(self) -> list:
        """The nvme subgroups committed while the write behind their last step may still be
        landing (their state is in a bank until it has), sorted; [] without a host tier."""
        host = self._parts.placement.host
        return [] if host is None else sorted(host.held.writes_behind)

    def settle_writes(self) -> None:
        """Acts: the writes behind the last step land (a bounded wait; one that failed is sent
        again, and raises if it fails again), and their slots become the committed ones."""
        self.host.held.settle_writes()

    def drop_reads_ahead(self) -> None:
        """Acts: ends the reads ahead of the next step and the writes behind the last one, and
        frees their banks, so the next step reads every nvme slot from its file (a test that
        changes a slot behind the optimizer's back does so first)."""
        self.host.held.settle_writes()
        self.host.held.release_reads()

    # ------------------------------------------------------------------ device tier
    @property
    def device(self):
        """The DeviceTier (its master, state, remainder maps and byte count)."""
        return self._parts.placement.device

    # ------------------------------------------------------------------ speculation, stats
    @property
    def speculation_error(self):
        """The error a speculative step in backward hit, kept for step() to raise, or None."""
        return self._parts.speculator.error

    @property
    def outcomes(self) -> dict:
        """The last host step's outcome per subgroup index ("committed", "redone", ...), a copy."""
        return dict(self._parts.stats.outcome_by_sg)

    @property
    def last_plan(self):
        """The last step's StepPlan (step_plan.py: what it decided), or None before the first."""
        return self._parts.stats.last_plan

    @property
    def last_outcome(self):
        """The last step's StepOutcome (what its tiers did), or None before the first."""
        return self._parts.stats.last_outcome

    @property
    def clock(self):
        """The clock that times backward and the device step (None until first used)."""
        return self._parts.stats.clock

    @property
    def unread_samples(self) -> list:
        """The steps whose clock marks the scheduler has not read yet, oldest first (a copy)."""
        return list(self._parts.stats.unread_samples)

    @property
    def step_stats(self):
        """The StepStats itself: for a test that swaps its clock."""
        return self._parts.stats

    # ------------------------------------------------------------------ param guard
    @property
    def guard(self):
        """The ParamGuard (check(), restart_masters): for tests that run or count it."""
        return self._parts.guard

    # ------------------------------------------------------------------ sharding
    @property
    def sharding(self):
        """The sharding part (ZeroSharding with process_group=, else the no-op NoSharding)."""
        return self._parts.sharding


def debug_view(opt) -> DebugView:
    """The introspection surface of `opt` (a HybridAdam / HybridAdamW), for tests."""
    return DebugView(opt)
