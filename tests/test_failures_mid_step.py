"""A failure loses nothing: bad input to step() is refused before anything changes; a tier that
fails part-way leaves each parameter stepped (count advanced) or untouched (count as before),
the error naming which (and a torn one); add_param_group that fails takes the group out again.

Every failing call is compared with an optimizer that never saw it: after "Nothing was
stepped", fixing the cause and calling step() again continues bitwise (torch.equal) as that
one does, and within fp32 rounding of torch.optim.AdamW(foreach=False); after a partly applied
step, reloading the checkpoint taken before it does. Placements: all on the device tier (the
CPU kernel in the trainer here), mixed, all on the host tier (the worker process).
"""

import copy
import os
import re
import signal
import time

import pytest
import torch
from helpers import needs_kernels, wait_gone
from test_optimizer import (
    SUBGROUP,
    assert_params_close,
    assert_state_close,
    loss_fn,
    make_batches,
    make_net,
    train,
)

import cpu_kernels
from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.testing import debug_view

OFFLOAD = {"device": 0.0, "mixed": 0.5, "host": 1.0}
HYPER = dict(lr=1e-2, weight_decay=0.1)


def _hybrid(params, placement, **kw):
    return HybridAdamW(params, subgroup_numel=SUBGROUP, offload_fraction=OFFLOAD[placement], **HYPER, **kw)


def _fail_on_call(m, owner, name: str, n: int, error: Exception) -> list:
    """Patches owner.name (m: monkeypatch or its context) so that its n-th call raises `error`
    and every other call runs the real one; returns the list its calls append to."""
    real, calls = getattr(owner, name), []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*a, **k)

    m.setattr(owner, name, failing)
    return calls


def _state(opt) -> dict:
    return {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}


def _assert_state_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for i in a:
        assert set(a[i]) == set(b[i]), i
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), (i, k)


def _params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _assert_bitwise(model, opt, ref_model, ref) -> None:
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert_state_close(opt.state_dict(), ref.state_dict(), exact=True)


def _param_in(opt, device: bool) -> int:
    """Index of the first param with a slice on the device tier (device), or with none."""
    where: dict = {}
    for sg in debug_view(opt).subgroups:
        for sl in sg.slices:
            where.setdefault(sl.param_index, set()).add(opt.plan.tiers[sg.index] == DEVICE)
    return min(i for i, s in where.items() if (True in s) == device)


class _Trio:
    """Ours, a hybrid twin that never sees the failure, and torch.optim.AdamW, on copies of
    one model; `steps` batches already trained by all three."""

    def __init__(self, placement, steps=2, groups=None, ours_kw=None, before_ours=None, after_ours=None):
        self.model = make_net()
        self.ref_model, self.torch_model = copy.deepcopy(self.model), copy.deepcopy(self.model)
        split = groups or (lambda m: m.parameters())
        self.ref = _hybrid(split(self.ref_model), placement)
        if before_ours is not None:
            before_ours()
        self.ours = _hybrid(split(self.model), placement, **(ours_kw or {}))
        if after_ours is not None:
            after_ours()
        self.torch = torch.optim.AdamW(split(self.torch_model), foreach=False, **HYPER)
        self.batches = make_batches(steps + 4)
        self.done = steps
        for m, o in self._all():
            train(m, o, self.batches[:steps])

    def _all(self):
        return ((self.model, self.ours), (self.ref_model, self.ref), (self.torch_model, self.torch))

    def backward(self):
        """Our grads for the next batch (the failing call's)."""
        self.ours.zero_grad()
        loss_fn(self.model, self.batches[self.done]).backward()

    def others_step(self):
        """The twin and torch take the step ours failed."""
        for m, o in self._all()[1:]:
            train(m, o, [self.batches[self.done]])
        self.done += 1

    def finish(self):
        """The rest of the batches for all three; ours is the twin bitwise and torch within fp32."""
        for m, o in self._all():
            train(m, o, self.batches[self.done :])
        _assert_bitwise(self.model, self.ours, self.ref_model, self.ref)
        assert_state_close(self.ours.state_dict(), self.torch.state_dict())
        assert_params_close(self.model, self.torch_model)

    def close(self):
        self.ours.close()
        self.ref.close()


def _counts(opt, model) -> list:
    return [float(opt.state[p]["step"]) if p in opt.state else 0.0 for p in model.parameters()]


# ============================================================================= bad input: nothing changes
@pytest.mark.parametrize(
    "placement,kind",
    [("device", "dtype"), ("mixed", "dtype"), ("device", "shape"), ("mixed", "shape"), ("host", "shape")],
)
def test_a_bad_grad_is_refused_before_anything_changes(placement, kind):
    """A grad the device tier's kernel refuses (float64: torch lets it through with
    grad_dtype=None or .data) or whose element count is not its param's (through .data; the
    host tier must not step the first elements of a larger one silently): step() raises naming
    the param before any tier steps — state, params and step counts torch.equal to before —
    and once the grad is fixed, step() continues bitwise as if the call never happened."""
    t = _Trio(placement)
    try:
        i = _param_in(t.ours, device=placement != "host")
        p = list(t.model.parameters())[i]
        t.backward()
        good = p.grad.clone()
        p.grad.data = good.double() if kind == "dtype" else torch.randn(p.numel() + 1)
        state, params, counts = _state(t.ours), _params(t.model), _counts(t.ours, t.model)
        with pytest.raises((TypeError, ValueError)) as err:
            t.ours.step()
        # the state first (what was broken), then the message
        assert _counts(t.ours, t.model) == counts
        _assert_state_equal(_state(t.ours), state)
        assert all(torch.equal(a, b) for a, b in zip(_params(t.model), params))
        assert re.search(rf"parameter {i}'s grad .*Nothing was stepped", str(err.value)), str(err.value)
        p.grad = good
        t.ours.step()
        t.others_step()
        t.finish()
    finally:
        t.close()


def test_a_group_hyperparameter_out_of_range_is_refused_before_any_group_steps():
    """A group's lr set out of range after construction (the kernels refuse it) is refused before
    any group steps: the first group is not stepped in place and no step count advances before
    the second group's kernel call would raise."""
    t = _Trio(
        "device",
        groups=lambda m: [
            dict(params=list(m.fc1.parameters())),
            dict(params=list(m.fc2.parameters()) + list(m.tiny)),
        ],
    )
    try:
        t.backward()
        t.ours.param_groups[1]["lr"] = -1.0
        state, params = _state(t.ours), _params(t.model)
        counts = _counts(t.ours, t.model)
        with pytest.raises(ValueError) as err:
            t.ours.step()
        assert _counts(t.ours, t.model) == counts
        _assert_state_equal(_state(t.ours), state)
        assert all(torch.equal(a, b) for a, b in zip(_params(t.model), params))
        assert re.search(r"param group 1: Invalid learning rate: -1.0.*Nothing was stepped", str(err.value))
        t.ours.param_groups[1]["lr"] = HYPER["lr"]
        t.ours.step()
        t.others_step()
        t.finish()
    finally:
        t.close()


# ============================================================================= failures part-way
def _classify(state_before, state_after, state_now, params_before, params_after, params_now) -> dict:
    """Per param: "untouched" (all its state as before), "stepped" (as the twin's after the
    step) or "torn" (neither)."""
    out = {}
    for i in range(len(params_now)):
        now = [params_now[i]] + [state_now.get(i, {}).get(k) for k in ("exp_avg", "exp_avg_sq")]
        before = [params_before[i]] + [state_before.get(i, {}).get(k) for k in ("exp_avg", "exp_avg_sq")]
        after = [params_after[i]] + [state_after[i][k] for k in ("exp_avg", "exp_avg_sq")]
        if all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(now, before)):
            out[i] = "untouched"
        elif all(a is not None and torch.equal(a, b) for a, b in zip(now, after)):
            out[i] = "stepped"
        else:
            out[i] = "torn"
    return out


def _listed(message: str, what: str) -> set:
    m = re.search(rf"parameters \[([0-9, ]*)\] {what}", message)
    return {int(x) for x in m.group(1).split(",") if x.strip()} if m else set()


def _check_part_way(t, err: str, state, params, counts) -> dict:
    """The failed step left each param stepped or untouched (or torn, named), its count
    advanced or not accordingly; returns the classification."""
    t.others_step()
    kinds = _classify(state, _state(t.ref), _state(t.ours), params, _params(t.ref_model), _params(t.model))
    now = _counts(t.ours, t.model)
    for i, kind in kinds.items():
        assert now[i] == counts[i] + (kind != "untouched"), (i, kind, now[i], counts[i])
    stepped = {i for i, k in kinds.items() if k == "stepped"}
    torn = {i for i, k in kinds.items() if k == "torn"}
    if not stepped and not torn:
        assert "Nothing was stepped" in err
    else:
        assert "partly applied" in err and "Reload a checkpoint" in err
        assert _listed(err, "were stepped") == stepped
        assert _listed(err, "only in part") == torn
    return kinds


def _reload_and_finish(t, sd, params):
    """The error's advice for a partly applied step: reload the checkpoint taken before it."""
    t.ours.load_state_dict(sd)
    with torch.no_grad():
        for p, v in zip(t.model.parameters(), params):
            p.copy_(v)
    train(t.model, t.ours, [t.batches[t.done - 1]])
    t.finish()


# Net's layout (SUBGROUP 64): fc1.weight (param 0) fills subgroups 0-7, then fc1.bias (1) and
# fc2.weight (2) share 8, fc2.weight spans 8-10 with the tiny params; at mixed placement
# subgroups 0-5 (fc1.weight only) are on the device tier. On a CPU host the device tier steps
# all its slices in one cpu_kernels.adam_steps_ call, which writes all or nothing (launches that
# fail part way, on CUDA: test_cuda_path_reports_what_each_launch_wrote and the test after it).
# What each failure leaves:
STEPPED_BEFORE_FAILING = {
    ("device", 1): {},  # nothing
    ("mixed", 1): {0: "torn", **{i: "stepped" for i in range(1, 16)}},  # the host tier committed
}


@pytest.mark.parametrize("placement,fail_at", list(STEPPED_BEFORE_FAILING))
def test_a_device_kernel_failing_part_way_leaves_each_param_stepped_or_untouched(
    monkeypatch, placement, fail_at
):
    """cpu_kernels.adam_steps_ raises on its `fail_at`-th call of one step (the device tier's
    one call, in place; at mixed placement after the host tier committed):
    each param ends stepped with its count advanced or untouched with its count as before,
    a param whose slices were stepped only in part is named as torn, and the error lists
    them. Nothing stepped (device, first call): step() again continues bitwise; otherwise
    reloading the checkpoint from before the step does."""
    t = _Trio(placement)
    try:
        sd, params = copy.deepcopy(t.ours.state_dict()), _params(t.model)
        t.backward()
        state, counts = _state(t.ours), _counts(t.ours, t.model)
        with monkeypatch.context() as m:
            calls = _fail_on_call(
                m, cpu_kernels, "adam_steps_", fail_at, RuntimeError("injected: the device kernel failed")
            )
            with pytest.raises(RuntimeError) as err:
                t.ours.step()
        assert len(calls) == fail_at
        kinds = _check_part_way(t, str(err.value), state, params, counts)
        assert "failed in the device tier: injected" in str(err.value)
        want = STEPPED_BEFORE_FAILING[placement, fail_at]
        assert kinds == {i: want.get(i, "untouched") for i in kinds}
        if not want:
            t.ours.step()  # the same grads, the cause gone
            t.finish()
            return
        _reload_and_finish(t, sd, params)
    finally:
        t.close()


@pytest.mark.parametrize("task", [1, 3], ids=["first_task", "third_task"])
def test_a_worker_failing_in_step_leaves_each_param_stepped_or_untouched(monkeypatch, task):
    """offload 1, no speculation (every host step runs inside step(), one worker task per
    subgroup): the worker raises on the first or third step task of the third step. First:
    nothing committed, so nothing stepped — step() again continues bitwise. Third: the
    subgroups committed before it stay (fc1.weight, spanning 8 subgroups, is then torn) and
    the error names the params; reloading the checkpoint from before the step recovers.
    (first_task passed before this module's fixes too: the host tier's failure path already
    put the counts back; it guards that path, now shared with the device tier's.)"""
    n_tasks = -(-sum(p.numel() for p in make_net().parameters()) // SUBGROUP)  # tiny params share one

    def armed():  # only our optimizer's worker carries the fault (read at its start)
        monkeypatch.setenv("HYBRID_OPT_WORKER_FAULT", f"raise:{2 * n_tasks + task}")

    t = _Trio(
        "host",
        # the worker's cores split off: sharing them all (a CPU-only host), the trainer would
        # run these steps itself (tiers/inline_steps.py), and no worker could fail in them
        ours_kw=dict(speculative=False, worker_share=0.5),
        before_ours=armed,
        after_ours=lambda: monkeypatch.delenv("HYBRID_OPT_WORKER_FAULT"),
    )
    try:
        assert len(t.ours.plan.tiers) >= n_tasks and set(t.ours.plan.tiers) == {"host"}
        sd, params = copy.deepcopy(t.ours.state_dict()), _params(t.model)
        t.backward()
        state, counts = _state(t.ours), _counts(t.ours, t.model)
        with pytest.raises(
            RuntimeError, match="(?s)failed in the host/nvme tier.*HYBRID_OPT_WORKER_FAULT"
        ) as err:
            t.ours.step()
        kinds = _check_part_way(t, str(err.value), state, params, counts)
        if task == 1:
            assert set(kinds.values()) == {"untouched"}
            t.ours.step()
            t.finish()
            return
        assert kinds[0] == "torn" and "untouched" in kinds.values()
        _reload_and_finish(t, sd, params)
    finally:
        t.close()


@pytest.mark.parametrize("task", [1, 10], ids=["first_task", "tenth_task"])
def test_inverse_mode_worker_killed_in_step_names_what_was_stepped_and_what_may_be_torn(monkeypatch, task):
    """rollback='inverse', no speculation: the worker dies before its first or tenth step task
    of the third step. The subgroups it finished were stepped in place: they are committed,
    their params (tenth: fc1.weight and fc1.bias, subgroups 0-8) stepped with counts advanced;
    those it had in flight may be torn, and the error says so and to reload a checkpoint —
    never 'Nothing was stepped ... call step() again' (calling step() again would step the
    finished subgroups twice)."""
    n_tasks = -(-sum(p.numel() for p in make_net().parameters()) // SUBGROUP)

    def armed():  # only our optimizer's worker carries the fault (read at its start)
        monkeypatch.setenv("HYBRID_OPT_WORKER_FAULT", f"before_step:{2 * n_tasks + task}")

    t = _Trio(
        "host",
        ours_kw=dict(speculative=False, rollback="inverse", worker_share=0.5),  # as above
        before_ours=armed,
        after_ours=lambda: monkeypatch.delenv("HYBRID_OPT_WORKER_FAULT"),
    )
    try:
        sd, params = copy.deepcopy(t.ours.state_dict()), _params(t.model)
        t.backward()
        state, counts = _state(t.ours), _counts(t.ours, t.model)
        with pytest.raises(
            RuntimeError,
            match=r"(?s)failed in the host/nvme tier.*SIGKILL.*may be torn; "
            r"restore them from a checkpoint",
        ) as err:
            t.ours.step()
        msg = str(err.value)
        assert "Nothing was stepped" not in msg and "call step() again" not in msg
        assert "partly applied" in msg and "Reload a checkpoint" in msg
        stepped, maybe = _listed(msg, "were stepped"), _listed(msg, "may be torn")
        assert stepped == ({0, 1} if task == 10 else set()) and maybe and not stepped & maybe
        t.others_step()
        kinds = _classify(
            state, _state(t.ref), _state(t.ours), params, _params(t.ref_model), _params(t.model)
        )
        now = _counts(t.ours, t.model)
        for i, kind in kinds.items():
            if i in stepped:  # bitwise the twin's step
                assert kind == "stepped" and now[i] == counts[i] + 1, (i, kind)
            elif i in maybe:
                assert now[i] == counts[i] + 1, i
            else:
                assert kind == "untouched" and now[i] == counts[i], (i, kind)
        _reload_and_finish(t, sd, params)
    finally:
        t.close()


def test_a_worker_that_does_not_answer_is_replaced_and_the_step_goes_on():
    """A stopped worker (SIGSTOP; in life one swapped out or stuck): after the timeout step()
    kills and replaces it, sends its tasks again and goes on, warned of — bitwise torch's
    trajectory; the next backward does not wait for the worker (not the timeout once per
    subgroup), state_dict() works, and the step does not fail since nothing was lost."""
    t = _Trio("host", ours_kw=dict(worker_share=0.5))  # split: the worker steps (as above)
    try:
        debug_view(t.ours).host.client.timeout_s = 1.0  # the default two minutes, lowered
        old = t.ours.worker_pid
        os.kill(old, signal.SIGSTOP)
        t.backward()  # speculates: the tasks wait at the stopped worker
        with pytest.warns(
            RuntimeWarning,
            match=r"(?s)not stepped within 1 s: the worker \(pid \d+\) did "
            r"not answer, so it was killed.*check the machine",
        ):
            t.ours.step()
        assert wait_gone(old, 5) and t.ours.worker_pid not in (None, old)
        t.others_step()
        t0 = time.monotonic()
        t.backward()
        assert time.monotonic() - t0 < 2.0  # it waited the timeout once per subgroup (12 s)
        assert _state(t.ours)  # state_dict() works
        t.ours.step()
        t.others_step()
        t.finish()  # bitwise the twin that never saw the stop, torch's within fp32
    finally:
        t.close()


# ============================================================================= add_param_group
def _fail_layout(monkeypatch, opt):
    from hybrid_opt.state import layout

    # the new group's subgroups cannot be laid out (as a param whose memory cannot be viewed)
    _fail_on_call(
        monkeypatch, layout, "_cut", 1, RuntimeError("injected: DefaultCPUAllocator: can't allocate memory")
    )


def _fail_device_state(monkeypatch, opt):
    from hybrid_opt.placement import placement

    def oom(*a, **k):
        raise torch.OutOfMemoryError("injected: CUDA out of memory allocating the new group's state")

    monkeypatch.setattr(placement, "DeviceTier", oom)


def _fail_placement(monkeypatch, opt):
    def broken(target):
        raise OSError("injected: reading the free memory failed")

    monkeypatch.setattr(debug_view(opt).placement, "room_to_move", broken)


ADD_FAILURES = {
    "layout": (_fail_layout, RuntimeError),
    "device_state": (_fail_device_state, torch.OutOfMemoryError),
    "placement": (_fail_placement, OSError),
}


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("failure", list(ADD_FAILURES))
def test_add_param_group_that_fails_adds_nothing_and_training_goes_on(monkeypatch, failure, placement):
    """fc2 joins the optimizer after 2 steps and its layout fails part-way (its flat buffer,
    its device state, choosing where the grown model goes): the error (of the cause's type)
    says the group was not added; param_groups, the plan, the worker and every state tensor
    are as before, and training goes on bitwise with a twin that never tried; adding the
    group again then works, bitwise with the twin adding it: the group never stays in
    param_groups with part of a layout."""
    if failure == "placement" and placement == "device":
        pytest.skip("offload 0 never lays the grown model out again")
    inject, error = ADD_FAILURES[failure]
    first = lambda m: list(m.fc1.parameters()) + list(m.tiny)  # noqa: E731
    model, ref_model = make_net(), make_net()
    batches = make_batches(8)
    with _hybrid(first(model), placement) as opt, _hybrid(first(ref_model), placement) as ref:
        train(model, opt, batches[:2])
        train(ref_model, ref, batches[:2])
        state, tiers, worker, groups = (
            _state(opt),
            list(opt.plan.tiers),
            opt.worker_pid,
            len(opt.param_groups),
        )
        new = list(model.fc2.parameters())
        values = [p.detach().clone() for p in new]
        with monkeypatch.context() as m:
            inject(m, opt)
            with pytest.raises(error) as err:
                opt.add_param_group(dict(params=new, lr=5e-3))
        assert len(opt.param_groups) == groups and not any(p in debug_view(opt).param_index for p in new)
        assert "the new group failed, so it was not added" in str(err.value) and "injected" in str(err.value)
        assert (
            opt.plan.tiers == tiers
            and len(debug_view(opt).subgroups) == len(tiers)
            and opt.worker_pid == worker
        )
        assert len(debug_view(opt).param_steps) == len(list(debug_view(opt).params()))
        _assert_state_equal(_state(opt), state)
        assert all(torch.equal(p, v) for p, v in zip(new, values))
        train(model, opt, batches[2:4])
        train(ref_model, ref, batches[2:4])
        _assert_bitwise(model, opt, ref_model, ref)
        for m_, o in ((model, opt), (ref_model, ref)):
            o.add_param_group(dict(params=list(m_.fc2.parameters()), lr=5e-3))
            m_.zero_grad()
            train(m_, o, batches[4:])
        _assert_bitwise(model, opt, ref_model, ref)


# ============================================================================= the CUDA path's bookkeeping
def _two_launch_tier(device):
    """A device tier of two subgroups whose params are in groups with different lr: one
    fused_adam_ call (launch) each on CUDA."""
    from hybrid_opt.state import layout as L
    from hybrid_opt.tiers.device import DeviceTier
    from hybrid_opt.tiers.host import AdamInputs

    params = [torch.nn.Parameter(torch.randn(256, device=device)) for _ in range(2)]
    sgs = []
    for g, p in enumerate(params):
        sgs += L.layout_group([p], g, g, 256, len(sgs))
        p.grad = torch.randn_like(p)
    tier = DeviceTier(sgs, amsgrad=False)
    work = [
        (sg.index, sg.slices[0], AdamInputs(0, lr, 0.9, 0.999, 1e-8, 0.0), 1)
        for sg, lr in zip(sgs, (1e-2, 1e-3))
    ]
    return tier, work, params


@needs_kernels
def test_cuda_path_reports_what_each_launch_wrote(monkeypatch):
    """DeviceTier._step_cuda (on CUDA where a GPU is present, else on CPU tensors through
    TRITON_INTERPRET): its progress has a launch that succeeded as done, the one that raised as
    unsure (a fused_adam_ call may launch more than once); the entries after it in neither,
    and their state is untouched."""
    from helpers import KERNEL_DEVICE

    import gpu_kernels

    tier, work, params = _two_launch_tier(KERNEL_DEVICE)
    before = [p.detach().clone() for p in params]
    _fail_on_call(monkeypatch, gpu_kernels.FusedAdam, "step", 2, RuntimeError("injected: launch failed"))
    with pytest.raises(RuntimeError, match="injected"):
        tier._step_cuda(work, 1.0, None)
    assert tier.progress == ([0], [1])
    assert not torch.equal(params[0], before[0]) and torch.equal(params[1], before[1])


@pytest.mark.gpu
def test_cuda_a_bad_grad_and_a_failing_launch_leave_each_param_stepped_or_untouched(monkeypatch):
    """On CUDA (offload 0, two groups: two launches): a float64 grad is refused before
    anything changes; a second launch that fails leaves the first group stepped (counts
    advanced) and the second untouched (counts as before), the error naming them; step()
    after the float64 refusal continues bitwise as a twin that never saw it."""
    import gpu_kernels

    torch.manual_seed(0)
    make = lambda: [torch.nn.Parameter(torch.randn(1024, device="cuda")) for _ in range(2)]  # noqa: E731
    ps, qs = make(), None
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    groups = lambda xs: [dict(params=[xs[0]]), dict(params=[xs[1]], lr=1e-3)]  # noqa: E731
    with (
        HybridAdamW(groups(ps), offload_fraction=0.0, **HYPER) as opt,
        HybridAdamW(groups(qs), offload_fraction=0.0, **HYPER) as ref,
    ):
        grads = [torch.randn(1024, device="cuda") for _ in range(2)]
        for o, xs in ((opt, ps), (ref, qs)):
            for x, g in zip(xs, grads):
                x.grad = g.clone()
            o.step()
        ps[1].grad.data = grads[1].double()
        state = _state(opt)
        with pytest.raises(TypeError, match=r"parameter 1's grad .*Nothing was stepped"):
            opt.step()
        _assert_state_equal(_state(opt), state)
        ps[1].grad = grads[1].clone()
        opt.step()
        for x, g in zip(qs, grads):
            x.grad = g.clone()
        ref.step()
        assert all(torch.equal(a, b) for a, b in zip(ps, qs))
        _assert_state_equal(_state(opt), _state(ref))
        _fail_on_call(monkeypatch, gpu_kernels.FusedAdam, "step", 2, RuntimeError("injected: launch failed"))
        with pytest.raises(
            RuntimeError,
            match=r"(?s)failed in the device tier.*parameters \[0\] were stepped.*"
            r"parameters \[1\] only in part",
        ):
            opt.step()
        # the first launch wrote param 0 (stepped); the failing call's param 1 may have been
        # written in part (a call launches once per alignment group): reported as torn
        assert [float(opt.state[p]["step"]) for p in ps] == [3.0, 3.0]
