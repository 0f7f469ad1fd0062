"""The step as a function of the optimizer's parts (parts.Parts): `step()` reads top to bottom
over its stages — the checks, what it reads in one host sync, the decision all ranks share,
the work it hands the tiers, the host and device steps, the record — and the accounting of a
step that fails part-way (step_failures.py). None of them keeps state of its own.
"""

from __future__ import annotations

import dataclasses
import math
import time
from types import MappingProxyType

import torch

from hybrid_opt import distributed as D
from hybrid_opt.distributed import rank_faults as RF
from hybrid_opt.notes import add_note
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.state.checkpoint import looks_like_state_init_step
from hybrid_opt.state.layout import subgroups_label
from hybrid_opt.step_failures import failure_of
from hybrid_opt.step_plan import SKIP, STATE_INIT, TAKE, StepInputs, StepOutcome, StepPlan, StepStart
from hybrid_opt.step_work import DeviceWork, HostWork
from hybrid_opt.tiers.device import read_scalars
from hybrid_opt.worker.client import TornInterrupt, TornState


def step(parts, inputs: StepInputs) -> None:
    """One step, top to bottom: check, read the step's scalars (one sync), decide the plan,
    let the tiers execute it (host tiers with on-commit gathers, then the device tier), record
    the outcome and refit."""
    t_step = time.perf_counter()
    start = precheck(parts, inputs)
    stepped = False
    try:
        inputs, start = begin_step(parts, inputs, start)
        start = after_backward(parts, start)
        if start.failure is not None and not start.decides:
            raise start.failure
        plan = plan_step(parts, inputs, start)
        execute(parts, inputs, plan, t_step)
        stepped = True
    finally:
        parts.sharding.end_step(stepped)  # the next backward starts a new reduction


def begin_step(parts, inputs: StepInputs, start: StepStart) -> tuple:
    """The sharding part's start of the step (its reductions landed): (the inputs with its
    found_inf, the start with its failure). An error there joins the decision flagged, as
    precheck's do, so that no rank raises while the others wait for it in the decision."""
    found_inf = inputs.found_inf
    try:
        found_inf, failure = parts.sharding.begin_step(
            start.failure, inputs.found_inf, inputs.grad_scale, parts.speculator.grad_scaler, inputs.key
        )
        start = dataclasses.replace(start, failure=failure)
    except Exception as e:
        if not start.decides:
            raise
        start = dataclasses.replace(start, failure=start.failure or e)
    # found_inf from here on is the sharding part's (release_grads adds this rank's flag).
    # GradScaler.step hands found_inf without grad_scale for grads the user's unscale_
    # unscaled in place after backward, which bumps no version: every speculation is stale
    unscaled = inputs.found_inf is not None and inputs.grad_scale is None
    return dataclasses.replace(inputs, found_inf=found_inf, unscaled=unscaled), start


# ---------------------------------------------------------------------- the decision
def plan_step(parts, inputs: StepInputs, start: StepStart) -> StepPlan:
    """The step decided once (step_plan.StepPlan): read the scalars in one host sync, agree on
    them with the other ranks, and lay out every subgroup's work. A rank that failed raises
    here, on every rank, in the decision (rank_faults.py)."""
    sharded = parts.sharding.active
    # torch.distributed.checkpoint's lr-0 step on a fresh optimizer: decided here from this
    # rank's grads when no decision all_reduce runs (no collective either way); else every
    # rank's vote rides it, so no rank skips the collective that another enters
    init = start.failure is None and looks_like_state_init_step(parts.layout, inputs.decoupled)
    if init and not start.decides:
        return StepPlan(STATE_INIT, sharded)
    parts.ledger.saw_amp(inputs.found_inf)  # GradScaler.step sets found_inf
    found, scale_v, norm_sq, edited = step_scalars(parts, inputs, start)
    if start.decides:
        norm_sq, found, all_init = decide(parts, inputs, start.failure, norm_sq, found, init)
        if all_init:
            return StepPlan(STATE_INIT, sharded)
    if found is not None and found != 0.0:  # GradScaler saw inf/nan: skipped, as torch does
        return StepPlan(SKIP, sharded)
    scaled = inputs.grad_scale is not None
    inv_scale = 1.0 / scale_v if scaled else 1.0
    norm, clip = clipped(parts, norm_sq, inv_scale, inputs.max_grad_norm)
    assert start.groups is not None  # the checks refused nothing, or the decision raised
    device_work, host_work = collect_work(parts, start.groups)
    scale = inv_scale * clip
    host_steps, actions, host_error = {}, {}, None
    try:
        host_steps, actions = parts.speculator.host_work(host_work, scale, edited, inputs.unscaled)
    except BaseException as e:  # the worker, asked for a DTensor grad's staged sums, failed
        host_error = e
    return StepPlan(
        TAKE,
        sharded,
        norm,
        clip,
        inv_scale,
        scaled,
        scale,
        tuple(device_work),
        MappingProxyType(host_work),
        MappingProxyType(host_steps),
        MappingProxyType(actions),
        host_error,
    )


# ---------------------------------------------------------------------- the execution
def execute(parts, inputs: StepInputs, plan: StepPlan, t_step: float) -> None:
    """The tiers execute the plan: host tiers first, then the device tier; the outcome goes to
    the stats, or with the plan to the failure's accounting."""
    if plan.kind == STATE_INIT:
        return _state_init_step(parts, inputs)
    ledger, placement, stats = parts.ledger, parts.placement, parts.stats
    if plan.kind == SKIP:
        ledger.skipped()
        stats.skipped(placement.host, len(parts.speculator.drop_pending()), plan)
        return None
    # the step counts advance; put back if the step fails with nothing stepped
    ledger.begin(inputs.torch_state, plan)
    why = parts.checks.device_scale_error(plan.device_work, plan.scale)
    if why is not None:
        fail(parts, inputs, plan, StepOutcome(), ValueError(why), None)
    # host tiers first: a failure there (a full disk, a worker error) then leaves the device
    # tier unstepped, and the step counts of every parameter no committed subgroup holds
    # are put back, so a checkpoint taken afterwards is the previous step for them
    t_host = time.perf_counter()
    expect_gathers(parts, plan, inputs.overlap)
    host_outcome: dict = {}
    committed: set = set()
    if plan.host_work:
        try:
            if plan.host_error is not None:
                raise plan.host_error
            host_outcome = step_host(parts, plan, committed)
        except BaseException as e:  # each param stepped or untouched (step_failures.py)
            outcome = StepOutcome(committed=frozenset(committed), torn=_torn_subgroups(parts, e, plan))
            fail(parts, inputs, plan, outcome, e, "the host/nvme tier")
    t_device = time.perf_counter()
    # "auto" times the device step on the device's clock (GPU time on CUDA: clocks.py)
    auto, device = placement.auto, placement.device
    d0 = stats.mark() if auto is not None else None
    try:
        device.step(list(plan.device_work), plan.scale)  # after the host tiers committed
    except BaseException as e:
        done, unsure = device.progress
        outcome = StepOutcome(
            MappingProxyType(host_outcome), frozenset(plan.host_work), tuple(done), tuple(unsure)
        )
        fail(parts, inputs, plan, outcome, e, "the device tier")
    parts.guard.record()  # this step's writes to the params are not the user's (storage.py)
    d1 = stats.mark() if auto is not None else None
    t_end = time.perf_counter()
    if plan.sharded:
        gather_params(parts, inputs.overlap)
        t_end = time.perf_counter()
    done = tuple(range(len(plan.device_work)))
    outcome = StepOutcome(
        MappingProxyType(host_outcome),
        frozenset(committed),
        done,
        times=(t_step, t_host, t_device, t_end),
        device_marks=(d0, d1),
    )
    record_step(parts, plan, outcome)
    return None


def _state_init_step(parts, inputs: StepInputs) -> None:
    """The state-init step (checkpoint.looks_like_state_init_step): the step counts advance,
    the tiers (all zeros, masters equal to the params) stay as they are."""
    parts.speculator.drop_pending()
    parts.ledger.state_init_step(inputs.torch_state, clipping=(inputs.max_grad_norm is not None))


# ---------------------------------------------------------------------- the checks and reads
def precheck(parts, inputs: StepInputs) -> StepStart:
    """The start of step() (step_plan.StepStart): this rank's failure so far, whether the ranks'
    decision all_reduce runs, each param group's hyperparameters. A failure on this rank joins
    the decision flagged, so every rank raises at this step instead of waiting for this one in
    a collective (rank_faults.py); with no decision to join it is raised here, as in one
    process."""
    failure = _speculation_failed(parts, parts.ledger.rank_failure)
    # process_group: always, so that a grad edit one rank refuses (zero_edits.py) stops every
    # rank at this step (one 5-value all_reduce beside the step's reduce-scatters)
    decides = RF.decision_runs(inputs.max_grad_norm, inputs.found_inf) or (
        parts.sharding.active and D.world_size() > 1
    )
    if failure is not None and not decides:
        raise failure
    hps = None
    try:
        parts.guard.check()  # a param whose memory was replaced is re-adopted (storage.py)
        # what a tier would fail on part-way (step_failures.py)
        hps = parts.checks.check_inputs(inputs.torch_state)
    except Exception as e:
        if not decides:
            raise
        failure = failure or e  # the step's collectives still run here, the error in the flag
    return StepStart(failure, decides, hps)


def _speculation_failed(parts, failure):
    """The failure so far, with the error of a speculative host step that failed since the
    last look (the first stands); the pending speculations are then dropped (quietly: the
    step still joins the others' collective)."""
    spec = parts.speculator
    if spec.error is None:
        return failure
    err = spec.take_error()
    failure = failure or RF.with_cause(f"a speculative host step during backward failed: {err}", err)
    RF.quietly(spec.drop, failure)
    return failure


def after_backward(parts, start: StepStart) -> StepStart:
    """What backward left, once the reductions landed: the failure so far (a speculative step
    launched by the reductions' last hooks that failed included), and the grad-edit checks of
    the speculated DTensor grads for step_scalars' one read (none on a failed step, none for
    other grads, whose versions show every edit). A check that raises joins the decision
    flagged, as precheck's do."""
    failure = _speculation_failed(parts, start.failure)
    if failure is not None or parts.speculator.fingerprints is None:
        return dataclasses.replace(start, failure=failure)
    try:
        checks = tuple(parts.speculator.grad_edit_checks())
    except Exception as e:
        if not start.decides:
            raise
        return dataclasses.replace(start, failure=e)
    return dataclasses.replace(start, edit_checks=checks)


def step_scalars(parts, inputs: StepInputs, start: StepStart) -> tuple:
    """(found_inf, loss scale, norm² or None, the grad-edit flags) as floats, read in one host
    sync: on a GPU, clipping's norm² is queued first so that it, found_inf and the loss scale
    reach the host in one small copy (docs/usage.md: host syncs), with the flags of DTensor
    grads edited since speculation staged them (CUDA; grad_edits.py: Speculator.host_work)."""
    layout = parts.layout
    queue_norm = (inputs.max_grad_norm is not None) and start.failure is None and layout.cuda()
    norm_sq = D.grad_norm_sq(layout.params()) if queue_norm else None
    found, scale_v, norm_sq, *edited = read_scalars(
        (inputs.found_inf, inputs.grad_scale, norm_sq, *start.edit_checks)
    )
    return found, scale_v, norm_sq, edited


def decide(parts, inputs: StepInputs, failure, norm_sq, found, init: bool) -> tuple:
    """One decision for all ranks: norm² and found_inf summed in one all_reduce, with every
    rank's failure flag and state-init vote (rank_faults.py); (norm², found, all_init). A
    rank that failed (or a collective that did) raises here on every rank, nothing stepped."""
    if (inputs.max_grad_norm is not None) and norm_sq is None:
        norm_sq = D.grad_norm_sq(parts.layout.params()) if failure is None else 0.0
    try:
        sgs = parts.layout.subgroups
        device = sgs[0].device if sgs else None
        norm_sq, found, all_init = RF.agree(norm_sq, found, failure, init_vote=init, device=device)
    except Exception as e:
        RF.quietly(parts.speculator.drop, e)
        parts.speculator.forget_ready()
        raise
    if not all_init and found is not None:
        D.globalize_scaler_found_inf(parts.speculator.grad_scaler, inputs.key, found)
    return norm_sq, found, all_init


def clipped(parts, norm_sq, inv_scale: float, max_grad_norm) -> tuple:
    """(the global grad norm, the clip coefficient): (None, 1.0) without clipping. The norm
    costs a pass over every grad: a CPU host sums it here, once the step is known not skipped."""
    if max_grad_norm is None:
        return None, 1.0
    if norm_sq is None:
        norm_sq = D.grad_norm_sq(parts.layout.params())
    norm = math.sqrt(norm_sq) * inv_scale
    coef = max_grad_norm / (norm + 1e-6)
    return norm, coef if (coef < 1.0 or coef != coef) else 1.0  # torch clamps at 1; NaN stays


def collect_work(parts, groups: list) -> tuple:
    """(the device tier's DeviceWork entries, {host subgroup index: HostWork}) of this step;
    `groups`: each param group's hyperparameters (StepChecks.check_inputs)."""
    layout = parts.layout
    tiers, steps = parts.placement.plan.tiers, layout.steps
    device_work: list[DeviceWork] = []
    host_work: dict[int, HostWork] = {}
    for sg in layout.subgroups:
        live = [sl for sl in sg.slices if sl.param.grad is not None]
        if not live:
            continue
        hp = groups[sg.group]
        if tiers[sg.index] == DEVICE:
            # the count after this step: the ledger advances it as the step begins
            device_work.extend(DeviceWork(sg.index, sl, hp, steps[sl.param_index] + 1) for sl in live)
        else:
            host_work[sg.index] = HostWork(sg, live, hp)
    return device_work, host_work


# ---------------------------------------------------------------------- the tiers' work
def expect_gathers(parts, plan: StepPlan, overlap: bool) -> None:
    """process_group: each bucket's gather starts as the subgroups holding its chunks commit;
    the device tier's params count as committed when step() gathers what is left."""
    if plan.sharded:
        pending: dict[int | str, list] = {i: [sl.param for sl in w.live] for i, w in plan.host_work.items()}
        pending["device"] = [w.slice.param for w in plan.device_work]
        parts.sharding.expect_commits(pending, direct=not overlap)


def step_host(parts, plan: StepPlan, committed: set) -> dict:
    """The host and nvme tiers' step: each speculated subgroup validated (committed, or redone
    from the live grads), the others stepped; each subgroup's new params written into the model
    as its step commits (`committed` gathers their indices). Returns {subgroup index:
    "committed" | "redone" | "stepped" | "dropped"}."""
    placement, spec, sharding = parts.placement, parts.speculator, parts.sharding
    stepping = placement.host.stepping
    queued: set = set()  # the CUDA devices with copies into the model queued, not waited for

    def copy_params(k: int, views: dict) -> None:
        # the new params reach the model only once their step is committed
        sg, live = plan.host_work[k].sg, plan.host_work[k].live
        src = views["param_copy"] if (sg.dtype != torch.float32 and "param_copy" in views) else views["param"]
        # one batched copy into the live slices. On CUDA from memory that stays as it is until
        # finish() returns (a committed bank), it is queued and waited for once, after the last
        # commit: the trainer goes on staging grads meanwhile. Otherwise (an nvme bank a later
        # step may take back, a pooled copy slot) it is waited for now: one host sync per
        # subgroup, not per slice
        lazy = sg.device.type == "cuda" and stepping.views_outlive_commit(k)
        sg.write(src, slices=live, non_blocking=lazy)
        if lazy:
            queued.add(sg.device)
        committed.add(sg.index)
        sharding.committed(sg.index)  # process_group: its buckets' gathers may start (zero_gather.py)

    try:
        outcome = stepping.finish(dict(plan.host_steps), on_commit=copy_params)
    finally:
        spec.forget_staged()
        for device in queued:  # the queued copies land before step() returns (failed or not)
            torch.cuda.current_stream(device).synchronize()
    spec.stepped()
    if not spec.config.speculative:
        # no step reads the nvme slots during backward: the next step's reads start now, under
        # the next forward and backward (a speculated step reads its own during backward)
        placement.host.stepping.read_ahead()
    return dict(outcome)


def gather_params(parts, overlap: bool) -> None:
    """process_group: the updated chunks sent to every rank. The params are current when step()
    returns (as DeepSpeed's ZeRO-2); the overlapped mode lands each bucket as its params are
    next used (zero.py), and a read outside a forward then needs wait_params() first: opt-in."""
    parts.sharding.gather(direct=not overlap)  # waited at once: into the params
    if not overlap:
        parts.sharding.wait_gathered()


# ---------------------------------------------------------------------- a failed step
def fail(parts, inputs: StepInputs, plan: StepPlan, outcome: StepOutcome, e: BaseException, where) -> None:
    """Raises `e` explained, after putting back the step count of every parameter the failed
    step did not touch (step_failures.py). `where`: the failing tier, None for input refused."""
    f = failure_of(inputs.owner, plan, outcome, e, where, lambda: _unreadable(parts, e, plan))
    parts.ledger.put_back(f.untouched, f.nothing_stepped)
    parts.ledger.sync_torch_state(inputs.torch_state)
    parts.guard.record()  # what was stepped was written by the step, not the user
    if not isinstance(e, Exception):  # KeyboardInterrupt and the like: counts fixed, as it is,
        add_note(e, str(f.error))  # and what it left said (a checkpoint saved on Ctrl-C)
        raise e
    if f.others_stepped:  # our next step() stops them all
        parts.ledger.out_of_step(f.error)
    if plan.sharded:
        # the others all-gather their stepped chunks now: this rank joins (its params then
        # hold their new chunks and its own chunk as its tiers left it), so the next
        # collectives still pair in order and its next step() stops every rank
        RF.quietly(lambda: gather_params(parts, inputs.overlap), f.error)
    raise f.error from e


def _unreadable(parts, e: BaseException, plan: StepPlan) -> str | None:
    """'subgroups [..] (params [..])' of this step's nvme subgroups whose committed slot no
    longer reads back (corrupt, cut short), or None: stepping again cannot mend those. Asked
    only after a host-tier error (not an interrupt); never raises over the step's own error."""
    host = parts.placement.host
    if not isinstance(e, Exception) or host is None or host.swap is None or host.closed:
        return None
    try:
        bad = host.unreadable(list(plan.host_work))
    except Exception:
        return None
    if not bad:
        return None
    return subgroups_label([parts.layout.subgroups[i] for i in sorted(bad)])


def _torn_subgroups(parts, e: BaseException, plan: StepPlan) -> frozenset:
    """The subgroups of this step (layout indices) that rollback='inverse' in-place steps,
    cut short, may have torn: the host tier names them (TornState)."""
    if not isinstance(e, (TornState, TornInterrupt)):  # Ctrl-C stays a KeyboardInterrupt: TornInterrupt
        return frozenset()
    return frozenset(i for i in e.subgroups if i in plan.host_work)


# ---------------------------------------------------------------------- the record
def record_step(parts, plan: StepPlan, outcome: StepOutcome) -> None:
    """This step's `stats`; under "auto" its measured times to the scheduler, which may refit."""
    t_step, _, _, t_end = outcome.times
    placement, stats, steps = parts.placement, parts.stats, parts.ledger.steps_taken
    stats.record(placement.plan, placement.host, plan, outcome)
    if placement.auto is not None:
        stats.queue_sample(steps, list(plan.device_work), t_end - t_step, outcome.device_marks)
        stats.observe(placement.auto)
        placement.refit(steps)
        stats.predicted(placement.plan.prediction)
