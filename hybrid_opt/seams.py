"""The seams with more than one implementation, as typing.Protocols, checked by mypy: the
sharding part (ZeroSharding for process_group=, else NoSharding; FSDP2's params arrive sharded
and need none), a clock (HostClock, CudaClock), a tier (what DeviceTier and HostTier share).
The implementations match them by shape and import nothing from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch


class Sharding(Protocol):
    """The optimizer's distributed part (`opt.parts.sharding`): reductions of the grads during
    backward, gathers of the updated params after the step. `active` False: every param is
    whole on this rank and every call does nothing."""

    active: bool

    def install(self, on_reduced: Callable[[torch.Tensor], Any], is_boundary: Callable[[], bool]) -> None:
        """Reduce hooks on the params; `on_reduced(p)` once p's averaged chunk is in place."""
        ...

    def wait_gathered(self) -> None:
        """Every pending gather landed: the params are current."""
        ...

    def begin_step(
        self,
        failure: Exception | None,
        found: torch.Tensor | None,
        grad_scale: torch.Tensor | None,
        scaler: Any,
        key: int,
    ) -> tuple:
        """step()'s start, the reductions landed: (found_inf, the failure so far)."""
        ...

    def end_step(self, stepped: bool = True) -> None:
        """After step(), taken or skipped: the next backward starts a new reduction."""
        ...

    def zero_grad(self, set_to_none: bool) -> None: ...

    def expect_commits(self, pending: dict, direct: bool) -> None:
        """The host subgroups whose commits this step's gathers wait for."""
        ...

    def committed(self, key: int) -> None:
        """Subgroup `key` committed: the gathers of its buckets may start."""
        ...

    def gather(self, direct: bool = False) -> None:
        """The rest of this step's gathers launched."""
        ...

    def comm_tensors(self) -> list:
        """The tensors of its comm memory (allocated.py's "comm")."""
        ...

    def shard(self) -> dict | None:
        """{"rank", "world"} whose chunks the optimizer's state holds; None: whole params."""
        ...

    def check_owner(self, saved: dict | None) -> None:
        """load_state_dict: refuses a state_dict holding another rank's chunks."""
        ...

    def close(self) -> None: ...


class Clock(Protocol):
    """Marks in the time base of where the work runs (clocks.py): a mark is a perf_counter
    reading or a CUDA event."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float | None:
        """Seconds from mark `start` to mark `end`, or None while they cannot be read yet."""
        ...


class Tier(Protocol):
    """What either tier answers for the subgroups it holds (by its own index of them)."""

    def quantized(self, index: int) -> bool:
        """Whether subgroup `index`'s moments are q8 codes."""
        ...

    def close(self) -> None:
        """Its memory and files freed."""
        ...


if TYPE_CHECKING:  # each implementation checked against its Protocol by mypy; nothing runs here
    from hybrid_opt.clocks import CudaClock, HostClock
    from hybrid_opt.distributed.sharding import NoSharding
    from hybrid_opt.distributed.zero import ZeroSharding
    from hybrid_opt.tiers.device import DeviceTier
    from hybrid_opt.tiers.host import HostTier

    def _implementations(
        none: NoSharding, zero: ZeroSharding, host: HostClock, cuda: CudaClock, dt: DeviceTier, ht: HostTier
    ) -> None:
        shardings: list[Sharding] = [none, zero]
        clocks: list[Clock] = [host, cuda]
        tiers: list[Tier] = [dt, ht]
        del shardings, clocks, tiers
