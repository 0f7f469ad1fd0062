"""What a torch.optim user does with an optimizer, met as torch meets it or refused clearly.

torch.optim's protocol beyond step(): the state_dict / load_state_dict hooks, edits of
`param_groups`, hyperparameters set after construction, copies, Ctrl-C inside step(). Each
case runs ours beside torch.optim.AdamW(foreach=False) (or beside a hybrid twin that never
saw the refused call) on the device tier (the CPU kernel in the trainer) and the host tier
(the worker process).
"""

import copy
import pickle
import re
import signal
import warnings

import pytest
import torch
from test_failures_mid_step import _assert_state_equal, _counts, _params, _state, _Trio
from test_optimizer import (
    SUBGROUP,
    assert_params_close,
    assert_state_close,
    loss_fn,
    make_batches,
    make_net,
    train,
)

from hybrid_opt import HybridAdamW

OFFLOAD = {"device": 0.0, "host": 1.0}


def _pair(placement):
    model = make_net()
    theirs = copy.deepcopy(model)
    ours = HybridAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=SUBGROUP, offload_fraction=OFFLOAD[placement]
    )
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    return model, ours, theirs, ref


# ============================================================================= state_dict hooks
@pytest.mark.parametrize("placement", ["device", "host"])
def test_state_dict_hooks_run_as_torch_runs_them(placement):
    """A state_dict post hook sees the whole state (the moments too: it ran on torch's step-only
    mirror before) and what it returns or adds is the state_dict; load_state_dict's pre hook
    may change what is loaded and its post hook runs after (neither ran before)."""
    model, ours, theirs, ref = _pair(placement)
    try:
        batches = make_batches(4)
        for m, o in ((model, ours), (theirs, ref)):
            train(m, o, batches[:2])
        calls = {id(ours): [], id(ref): []}

        def post(opt, sd):
            calls[id(opt)].append(("post", sorted(next(iter(sd["state"].values())))))
            sd["extra"] = 1

        def load_pre(opt, sd):
            calls[id(opt)].append("load_pre")
            sd = copy.deepcopy(sd)
            sd["param_groups"][0]["lr"] = 5e-3
            return sd

        for o in (ours, ref):
            o.register_state_dict_pre_hook(lambda opt: calls[id(opt)].append("pre"))
            o.register_state_dict_post_hook(post)
            o.register_load_state_dict_pre_hook(load_pre)
            o.register_load_state_dict_post_hook(lambda opt: calls[id(opt)].append("load_post"))
        sds = [o.state_dict() for o in (ours, ref)]
        assert all(sd["extra"] == 1 for sd in sds)
        for o, sd in zip((ours, ref), sds):
            o.load_state_dict(sd)
        assert (
            calls[id(ours)]
            == calls[id(ref)]
            == ["pre", ("post", ["exp_avg", "exp_avg_sq", "step"]), "load_pre", "load_post"]
        )
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 5e-3
        for m, o in ((model, ours), (theirs, ref)):
            train(m, o, batches[2:])
        assert_params_close(model, theirs)
    finally:
        ours.close()


# ============================================================================= copies
def test_copying_or_pickling_the_optimizer_is_refused_saying_what_to_do():
    """torch pickles an optimizer as its defaults, state and param_groups; ours made a copy
    without its parts, whose step() then blamed a subclass that skipped __init__."""
    model = make_net()
    with HybridAdamW(model.parameters(), subgroup_numel=SUBGROUP, offload_fraction=1.0) as opt:
        train(model, opt, make_batches(1))
        for copier in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(TypeError, match=r"cannot be pickled or copied.*opt\.state_dict\(\)"):
                copier(opt)
        train(model, opt, make_batches(1))  # the original is untouched


# ============================================================================= param_groups edits
def _append(opt, model):
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.randn(5)))


def _remove(opt, model):
    opt.param_groups[0]["params"].pop(2)


def _replace(opt, model):
    opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.randn_like(model.fc1.bias))


def _new_group(opt, model):
    opt.param_groups.append(dict(opt.param_groups[0], params=[torch.nn.Parameter(torch.randn(3))]))


def _clear_groups(opt, model):
    opt.param_groups.clear()  # raised a bare IndexError


EDITS = {
    "append": _append,
    "remove": _remove,
    "replace": _replace,
    "new_group": _new_group,
    "clear": _clear_groups,
}


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_params_edited_in_param_groups_are_refused_before_anything_changes(placement, edit):
    """torch steps whatever param_groups holds now; ours lays each param's state out when it
    joins. A param appended or removed is refused by step() before anything changes (no bare
    KeyError, no step counts advanced, no removed param stepped), and with the list put back
    training continues bitwise as the twin that never saw the edit."""
    t = _Trio(placement)
    try:
        t.backward()
        groups = [dict(g, params=list(g["params"])) for g in t.ours.param_groups]
        state, params, counts = _state(t.ours), _params(t.model), _counts(t.ours, t.model)
        EDITS[edit](t.ours, t.model)
        with pytest.raises(
            ValueError,
            match=r"(?s)param_groups\[\d\]\['params'\] was edited.*"
            r"add_param_group.*Nothing was stepped",
        ):
            t.ours.step()
        t.ours.param_groups[:] = [dict(g) for g in groups]
        for g, kept in zip(t.ours.param_groups, groups):  # the same dicts' lists, put back
            g["params"] = kept["params"]
        assert _counts(t.ours, t.model) == counts
        _assert_state_equal(_state(t.ours), state)
        assert all(torch.equal(a, b) for a, b in zip(_params(t.model), params))
        t.ours.step()
        t.others_step()
        t.finish()
    finally:
        t.close()


# ============================================================================= hyperparameters after construction
@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("lr", [float("nan"), -1.0])
def test_a_bad_lr_set_after_construction_is_refused_on_every_tier(placement, lr):
    """A NaN or negative lr set after construction is refused on either tier (stepping with it
    would leave NaN masters, no way back), before anything changes, and step() with the lr
    fixed continues bitwise."""
    t = _Trio(placement)
    try:
        t.backward()
        state, params, counts = _state(t.ours), _params(t.model), _counts(t.ours, t.model)
        t.ours.param_groups[0]["lr"] = lr
        with pytest.raises(
            ValueError,
            match=rf"param group 0: .*(finite|Invalid learning rate).*"
            rf"{placement} tier's kernel.*Nothing was stepped",
        ):
            t.ours.step()
        assert _counts(t.ours, t.model) == counts
        _assert_state_equal(_state(t.ours), state)
        assert all(torch.equal(a, b) for a, b in zip(_params(t.model), params))
        t.ours.param_groups[0]["lr"] = 1e-2
        t.ours.step()
        t.others_step()
        t.finish()
    finally:
        t.close()


# ============================================================================= Ctrl-C in step()
def test_ctrl_c_inside_step_says_what_it_left(monkeypatch):
    """A KeyboardInterrupt part-way through the host tier's commits propagates as it is (so
    Ctrl-C still stops the program), with a note naming the params stepped and not: a
    checkpoint saved in its handler is otherwise a torn step nobody knows about."""
    from hybrid_opt.state.layout import Subgroup

    t = _Trio("host", ours_kw=dict(speculative=False))
    try:
        real, writes = Subgroup.write, []

        def interrupted(self, *a, **k):
            writes.append(1)
            if len(writes) == 3:
                signal.raise_signal(signal.SIGINT)
            return real(self, *a, **k)

        t.backward()
        monkeypatch.setattr(Subgroup, "write", interrupted)
        # Ctrl-C raises KeyboardInterrupt, whatever handler an earlier test left
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with warnings.catch_warnings(record=True) as said:  # Python 3.10's notes (hybrid_opt.notes)
                warnings.simplefilter("always")
                t.ours.step()
        except KeyboardInterrupt as e:
            err = e
        else:
            pytest.fail(f"step() returned after {len(writes)} subgroup writes (SIGINT handler: {previous})")
        finally:
            signal.signal(signal.SIGINT, previous)
        if hasattr(err, "add_note"):
            notes = "\n".join(getattr(err, "__notes__", []))
        else:
            notes = "\n".join(str(w.message) for w in said if issubclass(w.category, RuntimeWarning))
        # the third subgroup's commit: fc1.weight (parameter 0, 8 subgroups) stepped in part
        assert re.search(r"The step was partly applied: parameters \[0\] only in part \(torn\)", notes), notes
    finally:
        monkeypatch.undo()
        t.close()


# ============================================================================= opt.state reset
def _clear(opt, model):
    opt.state.clear()


def _rebind(opt, model):
    from collections import defaultdict

    opt.state = defaultdict(dict)


def _del_one(opt, model):
    del opt.state[model.fc1.bias]


RESETS = {"clear": _clear, "rebind": _rebind, "del_one": _del_one}


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("reset", sorted(RESETS))
def test_resetting_opt_state_the_torch_way_is_refused_and_the_documented_way_restarts(placement, reset):
    """torch restarts a param's moments when its `state` entry is gone; ours keeps them in the
    tiers, and silently kept them (a different trajectory, no warning). step() now refuses
    before anything changes, and the recipe its message gives (a state_dict without those
    entries, loaded) restarts them as torch does: within fp32 rounding of torch from then on."""
    model, ours, theirs, ref = _pair(placement)
    try:
        batches = make_batches(5)
        for m, o in ((model, ours), (theirs, ref)):
            train(m, o, batches[:2])
        ours.zero_grad()
        loss_fn(model, batches[2]).backward()
        before = _state(ours)
        RESETS[reset](ours, model)
        with pytest.raises(
            ValueError,
            match=r"(?s)opt\.state lost the entries of stepped parameters.*"
            r"load_state_dict.*Nothing was stepped",
        ):
            ours.step()
        sd = ours.state_dict()
        _assert_state_equal({i: {k: v for k, v in st.items()} for i, st in sd["state"].items()}, before)
        lost = [i for i, p in enumerate(model.parameters()) if "step" not in ours.state.get(p, {})]
        for i in lost:
            del sd["state"][i]
        ours.load_state_dict(sd)
        RESETS[reset](ref, theirs)  # torch: those params restart
        ours.step()
        ref.zero_grad()
        loss_fn(theirs, batches[2]).backward()
        ref.step()
        for m, o in ((model, ours), (theirs, ref)):
            train(m, o, batches[3:])
        assert_state_close(ours.state_dict(), ref.state_dict())
        assert_params_close(model, theirs)
    finally:
        ours.close()


# ============================================================================= one optimizer per param
def test_a_second_open_optimizer_over_the_same_params_is_warned_about():
    """Two of ours stepping one param diverged silently once offloaded (each writes the param
    through memory no version counter sees, so neither restarts its master from the other's
    write). A param given to a second open one warns, naming the fix; disjoint params, or the
    first one closed, do not."""
    import warnings

    model = make_net()
    first = HybridAdamW(model.parameters(), subgroup_numel=SUBGROUP, offload_fraction=1.0)
    try:
        with pytest.warns(
            UserWarning, match=r"an open HybridAdamW also steps.*Close the other first"
        ) as caught:
            second = HybridAdamW(model.fc1.parameters(), subgroup_numel=SUBGROUP, offload_fraction=1.0)
        assert caught[0].filename == __file__  # points at the user's line
        with pytest.warns(UserWarning, match=r"an open HybridAdamW also steps"):
            third = HybridAdamW(model.fc1.parameters(), subgroup_numel=SUBGROUP)
        second.close()
        with pytest.warns(UserWarning, match=r"an open HybridAdamW also steps"):  # the first still is
            fourth = HybridAdamW(model.fc1.parameters(), subgroup_numel=SUBGROUP)
        third.close()
        fourth.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            HybridAdamW(make_net().parameters(), subgroup_numel=SUBGROUP).close()  # disjoint
            first.close()
            HybridAdamW(model.parameters(), subgroup_numel=SUBGROUP).close()  # the first one closed
    finally:
        first.close()
