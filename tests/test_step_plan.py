"""The step as data (hybrid_opt/step_plan.py): the plan step() decides says, for every host
subgroup, whether its speculation is committed, redone or the subgroup is stepped, and the
outcome the tiers report is that plan carried out; a skipped step plans nothing; the plan's
norm and clip coefficient are the ones the step used."""

import gc
import weakref

import pytest
import torch
from torch import nn

from hybrid_opt import HybridAdamW
from hybrid_opt.step_plan import COMMIT, REDO, SKIP, STEP, TAKE, StepOutcome, StepPlan
from hybrid_opt.testing import debug_view

SPLIT = 0.5  # the worker on cores of its own: it speculates whatever the last step did
DONE = {COMMIT: "committed", REDO: "redone", STEP: "stepped"}


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def last_step(opt) -> tuple[StepPlan, StepOutcome]:
    view = debug_view(opt)
    return view.last_plan, view.last_outcome


def train_step(model, opt, seed: int, scaler=None) -> None:
    torch.manual_seed(100 + seed)
    x = torch.randn(16, 64)
    opt.zero_grad()
    loss = model(x).square().mean()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def host_subgroups(opt) -> set:
    return {sg.index for sg in debug_view(opt).subgroups}


@pytest.mark.parametrize("spare_banks", [None, 2], ids=["all-speculated", "two-banks"])
def test_each_host_subgroup_is_done_as_the_plan_says(spare_banks):
    """Without clipping, a speculated subgroup's inputs are the final ones: COMMIT, and the
    outcome says committed; with two spare banks the subgroups that found none are STEP."""
    model = make_mlp()
    with HybridAdamW(
        model.parameters(), lr=1e-3, offload_fraction=1.0, subgroup_numel=1024,
        worker_share=SPLIT, spare_banks=spare_banks,
    ) as opt:  # fmt: skip
        for i in range(3):
            train_step(model, opt, i)
            plan, outcome = last_step(opt)
            assert plan.kind == TAKE and plan.clip == 1.0 and plan.norm is None and plan.scale == 1.0
            assert set(plan.host_work) == set(plan.host_actions) == host_subgroups(opt)
            assert {i: DONE[a] for i, a in plan.host_actions.items()} == dict(outcome.host)
            assert outcome.committed == frozenset(plan.host_work)
            actions = set(plan.host_actions.values())
            # nothing changes a speculation's inputs here: none is redone (a subgroup that found
            # no free staging slot while the worker was busy is stepped at step())
            assert REDO not in actions and (i == 0 or COMMIT in actions), plan.host_actions
            if spare_banks == 2:
                assert STEP in actions and list(plan.host_actions.values()).count(COMMIT) <= 2


def test_clipping_that_bites_redoes_every_speculation_with_the_plans_coefficient():
    """Speculation assumes clipping will not bite; when it does, the plan redoes each
    speculated subgroup, and its norm and coefficient are what the step reports."""
    model = make_mlp()
    with HybridAdamW(
        model.parameters(), lr=1e-3, offload_fraction=1.0, subgroup_numel=1024,
        worker_share=SPLIT, max_grad_norm=1e-3,
    ) as opt:  # fmt: skip
        for i in range(2):
            train_step(model, opt, i)
            plan, outcome = last_step(opt)
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            assert plan.kind == TAKE and plan.clip < 1.0
            assert plan.norm == opt.last_grad_norm
            assert plan.norm == pytest.approx(norm.item(), rel=1e-5)
            assert plan.scale == plan.inv_scale * plan.clip
            assert set(plan.host_actions.values()) <= {REDO, STEP}
            assert REDO in plan.host_actions.values()
            assert {i: DONE[a] for i, a in plan.host_actions.items()} == dict(outcome.host)


def test_an_overflow_plans_a_skip_and_nothing_for_the_tiers():
    model = make_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=1.0, subgroup_numel=1024) as opt:
        train_step(model, opt, 0, scaler)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        plan, outcome = last_step(opt)
        assert plan.kind == SKIP and opt.step_was_skipped
        assert not plan.host_work and not plan.device_work and not outcome.host
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_plan_and_its_inputs_are_immutable():
    model = make_mlp()
    with HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=0.5, subgroup_numel=1024) as opt:
        train_step(model, opt, 0)
        plan, outcome = last_step(opt)
        with pytest.raises(AttributeError):
            plan.clip = 0.5
        with pytest.raises(TypeError):
            plan.host_work[0] = None
        with pytest.raises(AttributeError):
            outcome.committed = frozenset()
        device = {w.index for w in plan.device_work}
        assert device and device.isdisjoint(plan.host_work)
        assert device | set(plan.host_work) == host_subgroups(opt)


@pytest.mark.parametrize("offload", [0.5, 1.0])
def test_the_plan_kept_for_introspection_holds_no_grad(offload):
    """The last plan stays readable, but not its grads: once zero_grad() lets them go, they are
    freed, as under torch.optim (kept, a second set of grads would stay allocated)."""
    model = make_mlp()
    with HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=offload, subgroup_numel=1024) as opt:
        for i in range(2):
            train_step(model, opt, i)
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad()
        gc.collect()
        assert debug_view(opt).last_plan.host_work
        assert [r() is None for r in grads] == [True] * len(grads)
