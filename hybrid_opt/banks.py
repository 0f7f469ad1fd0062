"""State banks: which bank holds each subgroup's committed state, and the spare pool.

Exact rollback without copying: a speculative step reads the committed bank and writes a
spare one; commit moves the subgroup's pointer to the spare and returns the old bank to
the pool; rollback returns the spare. All banks have one capacity, so any bank can serve
any subgroup. The pool is bounded: when it is empty, speculation waits for validation.
"""
from __future__ import annotations


class BankPool:
    def __init__(self, n_subgroups: int, n_spares: int):
        self.committed = list(range(n_subgroups))
        self.free = list(range(n_subgroups, n_subgroups + n_spares))
        self.n_banks = n_subgroups + n_spares

    def acquire(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, bank: int) -> None:
        assert bank not in self.free and bank not in self.committed, f"bank {bank} released twice"
        self.free.append(bank)

    def commit(self, subgroup: int, bank: int) -> None:
        """The subgroup's state is now `bank`; its old committed bank joins the pool."""
        old = self.committed[subgroup]
        self.committed[subgroup] = bank
        self.free.append(old)
