"""The optimizer's distributed part: ZeroSharding (process_group=, zero.py) or its no-op twin
NoSharding, so that single-process code carries no `if zero is None` branches — both answer
the same calls, and NoSharding's do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybrid_opt.seams import Sharding


def sharding_for(params: list, process_group, release_grads: bool) -> Sharding:
    """ZeroSharding over `params` where a process_group is given (registered before the
    layout: each param's slices are then of its dim-0 chunk), else NoSharding."""
    if process_group is None:
        return NoSharding()
    from hybrid_opt.distributed.zero import ZeroSharding

    return ZeroSharding(params, process_group, release_grads=release_grads)


class NoSharding:
    """Every param whole on this rank: nothing to reduce, gather or check."""

    active = False

    def install(self, on_reduced, is_boundary) -> None:
        pass

    def wait_gathered(self) -> None:
        pass

    def begin_step(self, failure, found, grad_scale, scaler, key) -> tuple:
        return found, failure

    def end_step(self, stepped: bool = True) -> None:
        pass

    def zero_grad(self, set_to_none: bool) -> None:
        pass

    def expect_commits(self, pending: dict, direct: bool) -> None:
        pass

    def committed(self, key) -> None:
        pass

    def gather(self, direct: bool = False) -> None:
        pass

    def comm_tensors(self) -> list:
        return []

    def shard(self) -> dict | None:
        """(rank, world) whose chunks this optimizer's state holds; None: whole params."""
        return None

    def check_owner(self, saved: dict | None) -> None:
        pass  # a plain optimizer: a state_dict is whole

    def close(self) -> None:
        pass
