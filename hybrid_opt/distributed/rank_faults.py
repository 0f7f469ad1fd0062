"""One rank's failed step, made every rank's: the "I failed" flag that rides in the step's one
decision all_reduce, so a failure on one rank never leaves the others waiting in a collective.

A failure before the decision makes every rank raise at the same step with nothing stepped; one
after it raises on the failing rank at once and rides the flag into its next step(). Invariant:
the failing rank still joins the collectives the others run. Design notes: docs/internals.md."""

from __future__ import annotations

import torch

from hybrid_opt.distributed.ranks import collective_device, torch_dist, world_size
from hybrid_opt.notes import add_note


class PeerStepFailed(RuntimeError):
    """Raised on the ranks whose own step was fine when another rank's step failed; `ranks`
    lists the failing global ranks (their own error is raised on them)."""

    def __init__(self, ranks: list, message: str):
        super().__init__(message)
        self.ranks = list(ranks)


def agree(
    norm_sq,
    found,
    failure: BaseException | None,
    init_vote: bool | None = None,
    device: torch.device | None = None,
):
    """The decision all_reduce (decision.py's norm² and found_inf) with each
    rank's failure flag beside them: returns (global norm², global found_inf) when no rank
    failed; otherwise raises on every rank — `failure` itself on a failing rank, PeerStepFailed
    on the others. norm_sq / found may be None (not needed this step). With `init_vote` (this
    rank's local verdict that the step is torch.distributed.checkpoint's state-init step) a
    third value is returned: whether every rank voted so — one answer for all ranks. `device`:
    the params' (an nccl group reduces there)."""
    dist = torch_dist()
    if dist is None or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return (norm_sq, found) if init_vote is None else (norm_sq, found, bool(init_vote))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = failure is not None
    buf = torch.tensor(
        [
            0.0 if norm_sq is None else float(norm_sq),
            0.0 if found is None else float(found),
            1.0 if failed else 0.0,
            float(rank) if failed else 0.0,
            0.0 if init_vote else 1.0,
        ],
        dtype=torch.float64,
        device=collective_device(dist, device),
    )
    try:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    except Exception as e:
        raise RuntimeError(
            f"[rank {rank}] the step's decision all_reduce failed: another rank "
            f"exited (its process died or its script ended) or stopped calling "
            f"step() past the process group's timeout; check the other ranks' "
            f"output for the cause. {type(e).__name__}: {e}"
        ) from failure or e
    total_sq, total_found, n_failed, rank_sum, not_init = buf.tolist()
    if n_failed == 0:
        out = (None if norm_sq is None else total_sq), (None if found is None else total_found)
        return out if init_vote is None else out + (not_init == 0.0,)
    n_failed = int(round(n_failed))
    if n_failed == 1:
        ranks = [int(round(rank_sum))]
    else:  # rare: several ranks failed at once; a second reduction names them all
        flags = torch.zeros(world, dtype=torch.float64, device=buf.device)
        flags[rank] = 1.0 if failed else 0.0
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
    if failure is not None:  # `failed`
        others = [r for r in ranks if r != rank]
        raise _same_kind(
            failure,
            f"{failure}\n[rank {rank}] every rank of the group stops at this "
            f"step (the others raise PeerStepFailed naming rank {rank}"
            + (f"; ranks {others} failed too" if others else "")
            + ")",
        ) from failure
    names = ", ".join(map(str, ranks))
    raise PeerStepFailed(
        ranks,
        f"rank {names}'s step failed (its cause is raised on rank {names}); "
        f"rank {rank} did not step either (the step was dropped before any tier "
        f"stepped: state and step counts are the previous step's, unless this "
        f"rank's previous step already went through while rank {names}'s failed "
        f"after the decision). Fix the cause on rank {names}, then reload a "
        f"checkpoint on every rank",
    )


def _same_kind(failure: BaseException, message: str) -> RuntimeError:
    """`message` raised as the failure's own type where that is a RuntimeError taking one
    message (GradsEditedError: callers catch it by type), else as a RuntimeError."""
    if isinstance(failure, RuntimeError):
        try:
            return type(failure)(message)
        except Exception:
            pass
    return RuntimeError(message)


def decision_runs(max_grad_norm, found_t) -> bool:
    """Whether this step's decision all_reduce runs (the same answer on every rank: it depends
    on the optimizer's arguments and on the scaler, which every rank uses alike)."""
    return (found_t is not None or max_grad_norm is not None) and world_size() > 1


OUT_OF_STEP_NOTE = (
    "\nUnder torch.distributed the other ranks have taken this step: the ranks "
    "are out of step. This rank's next step() makes every rank raise; reload a "
    "checkpoint on every rank."
)


ZERO_PARAMS_NOTE = (
    " process_group mode: this rank still joined the params' all-gathers, so its "
    "params hold the other ranks' updated chunks and its own chunk as its tiers "
    "left it (the previous step's, or this one's for the subgroups that committed)."
)


def with_cause(message: str, cause: BaseException) -> RuntimeError:
    err = RuntimeError(message)
    err.__cause__ = cause
    return err


def out_of_step(err: BaseException) -> RuntimeError:
    """The failure a rank keeps after its step failed once the others had stepped: raised by
    its next step() on every rank (cleared by load_state_dict)."""
    return with_cause(
        f"this rank's previous step failed after the other ranks had stepped (the "
        f"ranks are out of step: reload a checkpoint on every rank): {err}",
        err,
    )


def quietly(cleanup, failure: BaseException) -> None:
    """Runs cleanup (dropping speculated steps) on a failure path; its own error, likely the
    same fault again, becomes a note on `failure` rather than replacing it."""
    try:
        cleanup()
    except Exception as e:
        add_note(failure, f"(dropping the speculated steps failed too: {e})")
