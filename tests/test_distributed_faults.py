"""Faults under torch.distributed (FSDP2, 2 gloo ranks) and a two-"node" launch.

- A worker SIGKILLed on rank 1 (between steps, or inside backward) is replaced there and its
  unfinished tasks resent (exact mode): both ranks' trajectories equal the uninterrupted run's
  bit for bit.
- A rank whose host tier fails raises the cause there and the other rank fails at the same
  step (or the next one, when the failure came after the ranks' decision) naming it, within a
  bounded time: the failure flag rides in the decision all_reduce (hybrid_opt/distributed/rank_faults.py).
  A rank that exits leaves the other a failed collective, not a hang.
- Two torchrun launches with --nnodes 2 (static rendezvous on localhost, one rank per node)
  match single-process torch.

One launch each (about 8 s and 10 s here), bounded by the harness (tests/dist_launch.py).
"""

import os
import sys

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch, launch_nodes
from tolerances import DIST_RTOL

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402

pytestmark = DIST_MARKS

SCENARIOS = [
    "plain",
    "kill_between",
    "kill_backward",
    "fail_speculation",
    "nvme_lost",
    "zero_host_fails",
    "zero_check_fails",
    "zero_init",
    "rank_gone",
]
PG_TIMEOUT_S = 20  # fsdp_faults.py's process group timeout
# "no wait": well under the timeout a hang would reach, with room for a loaded 2-core CI machine
# (4 processes there share 2 cores; the peer may be restarting its worker when it gets there)
NO_HANG_S = PG_TIMEOUT_S / 2


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_faults")
    return launch("fsdp_faults.py", str(out), *SCENARIOS, timeout_s=120)


def _assert_trajectory(params_per_step, ref_params, what):
    for step, (ours, ref) in enumerate(zip(params_per_step, ref_params)):
        for k, (a, b) in enumerate(zip(ours, ref)):
            err = C.rel_err(a, b)
            assert err <= DIST_RTOL, f"{what}: step {step} param {k}: relative error {err:.2e}"


@pytest.mark.parametrize("when", ["kill_between", "kill_backward"])
def test_worker_sigkill_on_one_rank_recovers_bitwise(faults, when):
    """Rank 1's worker SIGKILLed after step 1 / inside step 2's backward: rank 1 starts a new
    worker (a new pid, one restart), rank 0 never notices, and every param on both ranks after
    every step equals the uninterrupted run's bitwise (which itself follows torch)."""
    r0, r1 = faults[0][when], faults[1][when]
    assert r1["killed"] and r1["restarts"][-1] == 1 and r1["worker_pids"][-1] != r1["killed"][0]
    assert r0["restarts"][-1] == 0 and not r0["killed"]
    for rank, res in enumerate(faults):
        assert not res[when]["errors"]
        for step, (a, b) in enumerate(zip(res[when]["params"], res["plain"]["params"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{when} rank {rank} step {step}"
    ref_params, _ = C.reference("AdamW", max_grad_norm=1.0)
    _assert_trajectory(faults[0]["plain"]["params"], ref_params, "uninterrupted")


def test_failure_before_the_decision_stops_every_rank_at_that_step(faults):
    """Rank 1's speculative host step fails in step 2's backward: rank 1 raises its cause,
    rank 0 raises PeerStepFailed naming rank 1 — same step, no wait (the flag rode in the
    decision all_reduce). Nothing was stepped anywhere, so when training goes on the
    trajectory is torch's with step 2 skipped."""
    r0, r1 = faults[0]["fail_speculation"], faults[1]["fail_speculation"]
    (e1,) = r1["errors"]
    (e0,) = r0["errors"]
    assert e1["step"] == e0["step"] == 1
    assert (
        e1["type"] == "RuntimeError" and "injected fault: the swap file could not be written" in e1["message"]
    )
    assert "every rank of the group stops at this step" in e1["message"]
    assert e0["type"] == "PeerStepFailed" and e0["ranks"] == [1]
    assert e0["message"].startswith("rank 1's step failed") and e0["seconds"] < NO_HANG_S
    ref_params, _ = C.reference("AdamW", max_grad_norm=1.0, skip={1})
    for rank, res in enumerate((r0, r1)):
        _assert_trajectory(res["params"], ref_params, f"fail_speculation rank {rank}")


def test_real_nvme_fault_on_one_rank_names_the_cause_and_stops_every_rank(faults):
    """Rank 1's swap files truncated after step 1 (the state on disk lost): rank 1's step 2
    raises the worker's error naming the file; rank 0 raises PeerStepFailed naming rank 1 at
    that step or — when rank 1's failure came after the ranks' decision, rank 0 having stepped —
    at the next one, where rank 1's step() says the ranks are out of step. Every later step
    raises on both, none waits."""
    r0, r1 = faults[0]["nvme_lost"], faults[1]["nvme_lost"]
    assert r1["truncated"] >= 1
    first1 = r1["errors"][0]
    assert first1["step"] == 1 and "short read" in first1["message"] and ".state" in first1["message"]
    first0 = r0["errors"][0]
    assert first0["type"] == "PeerStepFailed" and first0["ranks"] == [1]
    assert first0["step"] in (1, 2)
    if first0["step"] == 2:  # rank 1 failed after the decision: it said so, then stopped rank 0
        assert "the other ranks have taken this step" in first1["message"]
        assert "out of step" in r1["errors"][1]["message"]
    assert [e["step"] for e in r0["errors"]] == list(range(first0["step"], C.STEPS))
    assert [e["step"] for e in r1["errors"]] == list(range(1, C.STEPS))
    assert max(e["seconds"] for e in r0["errors"] + r1["errors"]) < NO_HANG_S


def test_rank_that_exits_leaves_the_other_a_failed_collective_not_a_hang(faults):
    """Rank 1 exits after step 2's backward without calling step(): rank 0's step() raises
    within the process group's timeout (gloo reports the closed connection at once), saying the
    decision all_reduce failed because another rank exited or stopped calling step()."""
    (err,) = faults[0]["rank_gone"]["errors"]
    assert err["step"] == 1 and err["seconds"] < PG_TIMEOUT_S + 5
    assert "decision all_reduce failed: another rank exited" in err["message"]
    assert not faults[1]["rank_gone"]["errors"]


def test_process_group_host_failure_after_the_decision_keeps_the_collectives_aligned(faults):
    """process_group mode: rank 1's host step fails at step 2, after the decision (rank 0 has
    stepped). Rank 1 still joins the params' all-gathers before raising, so the ranks'
    collectives stay paired: rank 0's step 2 completes, both ranks' params then hold rank 0's
    updated chunk (torch's step 2 there) and rank 1's chunk of step 1, and at every later step
    both raise at once (rank 1 that it is out of step, rank 0 PeerStepFailed naming it) — no
    abort, no wait."""
    r0, r1 = faults[0]["zero_host_fails"], faults[1]["zero_host_fails"]
    assert [e["step"] for e in r1["errors"]] == [1, 2, 3]
    assert "injected fault: the host step failed" in r1["errors"][0]["message"]
    assert "out of step" in r1["errors"][1]["message"]
    assert [(e["step"], e["type"], e["ranks"]) for e in r0["errors"]] == [
        (2, "PeerStepFailed", [1]),
        (3, "PeerStepFailed", [1]),
    ]
    assert max(e["seconds"] for e in r0["errors"] + r1["errors"]) < NO_HANG_S
    ref_params, _ = C.reference("AdamW", max_grad_norm=1.0, n=2)
    _assert_trajectory(r0["params"][:1], ref_params, "zero_host_fails rank 0")
    for p1, p0, old, ref in zip(r1["params"][1], r0["params"][1], r0["params"][0], ref_params[1]):
        rows = -(-p0.shape[0] // 2)  # rank 0's chunk: rows [0, ceil(rows / 2))
        assert torch.equal(p1, p0) and torch.equal(p1[rows:], old[rows:])
        assert C.rel_err(p0[:rows], ref[:rows]) <= DIST_RTOL


def test_process_group_error_before_the_decision_rides_the_failure_flag(faults):
    """process_group mode: rank 1's step() refuses a param whose memory was cast (its
    _check_storage fails, before the decision): it still runs the step's collectives with its
    failure flag set, so rank 1 raises its cause and rank 0 PeerStepFailed at that step, at once."""
    r0, r1 = faults[0]["zero_check_fails"], faults[1]["zero_check_fails"]
    (e1,), (e0,) = r1["errors"], r0["errors"]
    assert e1["step"] == e0["step"] == 1 and "every rank of the group stops at this step" in e1["message"]
    assert e0["type"] == "PeerStepFailed" and e0["ranks"] == [1]
    assert max(e0["seconds"], e1["seconds"]) < NO_HANG_S


def test_state_init_step_is_one_decision_across_ranks(faults):
    """lr-0 first steps on fresh process_group optimizers (DCP's state-init step): A, rank 1's
    kept failure is raised (not swallowed by the init step) and rank 0 raises PeerStepFailed;
    B, the averaged grads are zero in rank 0's chunks only — its local check says "init step",
    rank 1's does not: both vote in the decision all_reduce and both take the real (lr-0) step,
    the same step counts, params unchanged, no wait."""
    r0, r1 = faults[0]["zero_init"], faults[1]["zero_init"]
    assert [(e["step"], e["type"]) for e in r0["errors"]] == [("A", "PeerStepFailed")]
    assert [e["step"] for e in r1["errors"]] == ["A"] and "injected: a failure kept" in r1["errors"][0][
        "message"
    ]
    assert max(e["seconds"] for e in r0["errors"] + r1["errors"]) < NO_HANG_S
    assert r0["steps"][1] == r1["steps"][1] == [1] * 6
    initial = [p.detach() for p in C.build_model().parameters()]
    for res in (r0, r1):
        assert all(torch.equal(a, b) for a, b in zip(res["params"][1], initial))


def test_torchrun_two_nodes_on_localhost_matches_single_process(tmp_path):
    """Two torchrun launches (--nnodes 2 --nproc-per-node 1, static rendezvous on 127.0.0.1):
    both ranks follow single-process torch. node.py sees each rank alone on its node
    (LOCAL_WORLD_SIZE 1), so each takes every core for itself and its worker: here both
    "nodes" are one 2-core machine, so the two ranks' workers share cores (oversubscribed)."""
    names = ["adamw_1d_nvme", "adam_1d_host"]
    ranks = launch_nodes("fsdp_train.py", str(tmp_path), *names, nnodes=2, timeout_s=120)
    for name in names:
        kind = "AdamW" if name.startswith("adamw") else "Adam"
        ref_params, ref_norms = C.reference(kind, max_grad_norm=1.0)
        for rank, res in enumerate(ranks):
            _assert_trajectory(res[name]["params"], ref_params, f"2 nodes {name} rank {rank}")
            assert res[name]["norms"] == pytest.approx(ref_norms, rel=1e-5)
            assert res[name]["node"] == (0, 1)
        assert ranks[0][name]["norms"] == ranks[1][name]["norms"]
    cores = os.sched_getaffinity(0)
    if len(cores) >= 2:  # each "node" split all of this machine's cores: the same worker cores
        assert ranks[0][names[0]]["worker_cpus"] == ranks[1][names[0]]["worker_cpus"]


ZERO_TIMEOUT_S = 5  # zero_timeout.py's default group timeout


@pytest.fixture(scope="module")
def zero_timeouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_timeout")
    return launch("zero_timeout.py", str(out), ZERO_TIMEOUT_S, timeout_s=120)


def test_process_group_mode_waits_for_the_users_timeout_not_a_fixed_bound(zero_timeouts):
    """process_group mode's own group and each of its waits take the timeout of the group the
    user gave: a 5 s default group fails rank 1's reduction about 5 s into the backward its peer
    is late for (it waited without error before: its group had gloo's 30 min, each wait a fixed
    300 s), and a 2 h group is not cut to 300 s."""
    for res in zero_timeouts:
        assert res["long"]["group_s"] == res["long"]["wait_s"] == 2 * 3600, res["long"]
        assert res["long"]["error"] is None and res["long"]["steps"] == 2, res["long"]
        assert res["short"]["group_s"] == res["short"]["wait_s"] == ZERO_TIMEOUT_S, res["short"]
    late = zero_timeouts[1]["short"]
    assert late["steps"] == 1 and late["error"] == "RuntimeError", late
    assert f"within the process group's timeout ({ZERO_TIMEOUT_S} s)" in late["message"], late["message"]
    # a loaded 2-core machine: the wait starts once backward has run its hooks
    assert 0.8 * ZERO_TIMEOUT_S <= late["seconds"] <= ZERO_TIMEOUT_S + NO_HANG_S, late["seconds"]
    assert zero_timeouts[0]["short"]["steps"] == 1 and zero_timeouts[0]["short"]["error"] is not None


def test_agree_in_one_process_is_the_local_decision_or_the_local_failure():
    """Without a world (no torch.distributed group) there is no collective: the decision is
    the rank's own values, and a failure is raised as is (the one-process behaviour)."""
    from hybrid_opt.distributed import rank_faults as RF

    assert RF.agree(2.5, None, None) == (2.5, None)
    assert not RF.decision_runs(1.0, torch.zeros(1))
    cause = RuntimeError("the worker died")
    with pytest.raises(RuntimeError) as info:
        RF.agree(2.5, 0.0, cause)
    assert info.value is cause


def test_an_nccl_decision_reduces_on_the_params_gpu_not_the_current_one(monkeypatch):
    """A script that moves its model to cuda:{local_rank} without torch.cuda.set_device leaves
    every rank's current device at 0: the decision's buffer, and node detection's gather
    (node.derive_from_dist), follow the params' device."""
    from hybrid_opt.distributed.ranks import collective_device

    class Nccl:
        def get_backend(self):
            return "nccl"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collective_device(Nccl(), torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert collective_device(Nccl(), None) == torch.device("cuda", 0)
    assert collective_device(Nccl(), torch.device("cpu")) == torch.device("cuda", 0)
