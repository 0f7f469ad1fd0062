"""State banks: which bank holds each subgroup's committed state, and the spare pool.

Exact rollback without copying: a speculative step reads the committed bank and writes a
spare one; commit moves the subgroup's pointer to the spare and returns the old bank to
the pool; rollback returns the spare. All banks have one capacity, so any bank can serve
any subgroup. The pool is bounded: when it is empty, speculation waits for validation.
"""

from __future__ import annotations


class BankPool:
    """Banks 0..n_banks-1: one committed bank per resident subgroup, the rest free.

    nvme subgroups have no committed bank (their state is in files): they borrow free banks
    for the duration of a step.
    """

    def __init__(self, resident: list[int], n_spares: int, copy_slots: bool = False, dormant=()):
        """copy_slots: the arena keeps the model-dtype copies in n_spares copy slots, not in the
        banks: every bank no subgroup has committed holds one (copy_of), and a commit hands the
        new committed bank's slot to the old one (its copy is in the model's param by then).
        dormant: spare banks not handed out until wake() (their memory is not allocated yet)."""
        self.committed = {sg: k for k, sg in enumerate(resident)}
        self.dormant = sorted(dormant)
        asleep = set(self.dormant)
        self.free = [b for b in range(len(resident), len(resident) + n_spares) if b not in asleep][::-1]
        self.n_banks = len(resident) + n_spares
        self.copy_of: dict | None = {len(resident) + k: k for k in range(n_spares)} if copy_slots else None

    def acquire(self, k: int = 1) -> list[int] | None:
        """k free banks, or None (taking nothing) when fewer are free."""
        if len(self.free) < k:
            return None
        return [self.free.pop() for _ in range(k)]

    def wake(self, banks: list[int]) -> None:
        """Dormant `banks` join the pool (their memory is in use now: HostTier.wake_spares)."""
        for b in banks:
            self.dormant.remove(b)
            self.free.insert(0, b)  # handed out after the banks already in use

    def release(self, bank: int) -> None:
        assert bank not in self.free and bank not in self.committed.values(), f"bank {bank} released twice"
        self.free.append(bank)

    def commit(self, subgroup: int, bank: int) -> None:
        """The subgroup's state is now `bank`; its old committed bank joins the pool."""
        old = self.committed[subgroup]
        self.committed[subgroup] = bank
        if self.copy_of is not None:
            self.copy_of[old] = self.copy_of.pop(bank)
        self.free.append(old)
