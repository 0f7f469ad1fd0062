"""torch.optim's contract around the state dict and the params, where PyTorch's own optimizer
tests found ours apart (issue 36, item 5), each case beside torch.optim.AdamW(foreach=False) on
the same model at offload 0 (the device tier), 1.0 (the host tier's worker) and nvme (every
subgroup in files):

- `param_names`: a checkpoint of an optimizer built from `named_parameters()` loaded into one
  built from `parameters()` (and the other way, and each into its own kind) leaves the groups'
  names as torch's load_state_dict leaves them;
- `opt.state` entries under keys that are not params (a state_dict pre hook's bookkeeping):
  state_dict() and save_state_dict() carry them, load_state_dict() keeps the checkpoint's;
- params on the meta device (deferred init): taken at offload 0 as torch takes them, refused at
  construction where the host or nvme tier would copy their values, saying what to do; built
  after `to_empty()`, every placement follows torch;
- `param_groups.extend(param_groups)` (torch's test for pytorch#36831): state_dict(),
  save_state_dict() and load_state_dict() refuse it as step() does, before anything changes.
"""

import copy
import re

import pytest
import torch
from helpers import needs_named_params
from test_optimizer import (
    SUBGROUP,
    Net,
    assert_params_close,
    assert_state_close,
    lockstep,
    loss_fn,
    make_batches,
    make_net,
    save_load,
)

from hybrid_opt import HybridAdamW

HYPER = dict(lr=1e-2, weight_decay=0.1)
PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "host": dict(offload_fraction=1.0),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=1.0),
}


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvme"))


def _ours(params, placement, nvme_dir):
    kw = dict(PLACEMENTS[placement])
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = nvme_dir
    return HybridAdamW(params, subgroup_numel=SUBGROUP, **HYPER, **kw)


def _torch(params):
    return torch.optim.AdamW(params, foreach=False, **HYPER)


def _params_only(sd: dict) -> dict:
    """`sd` with only the params' entries in its state (assert_state_close compares those)."""
    listed = {i for g in sd["param_groups"] for i in g["params"]}
    return dict(sd, state={k: v for k, v in sd["state"].items() if k in listed})


# ============================================================================= 1. param_names
GROUPS = {
    "named": lambda m, prefix="": m.named_parameters(prefix=prefix),
    "plain": lambda m, prefix="": m.parameters(),
}


def _names(groups: list) -> list:
    return [g.get("param_names") for g in groups]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize(
    "saved, loaded", [("named", "plain"), ("plain", "named"), ("named", "named"), ("plain", "plain")]
)
@needs_named_params
def test_param_names_go_through_a_checkpoint_as_torchs_do(placement, saved, loaded, nvme_dir):
    """torch keeps a named optimizer's `param_names` in its state dict's groups, and its
    load_state_dict gives each group the checkpoint's names where it has them, else keeps the
    group's own: a plain optimizer loaded from a named checkpoint is named from then on (its
    state_dict says so), a named one loaded from a plain checkpoint keeps its names, and a named
    one takes a named checkpoint's names. Ours dropped the checkpoint's names."""
    batches = make_batches(5)
    model, ref_model = make_net(), make_net()
    # the saving optimizer's names differ from the loading one's: whose a group keeps shows
    with _ours(GROUPS[saved](model, "saved"), placement, nvme_dir) as ours:
        ref = _torch(GROUPS[saved](ref_model, "saved"))
        lockstep(model, ours, ref_model, ref, batches[:2])
        sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert _names(sd["param_groups"]) == _names(ref_sd["param_groups"])
        sd = save_load(sd)
    with _ours(GROUPS[loaded](model), placement, nvme_dir) as ours:
        ref = _torch(GROUPS[loaded](ref_model))
        ours.load_state_dict(sd)
        ref.load_state_dict(save_load(ref_sd))
        names = [n for n, _ in model.named_parameters(prefix="saved" if saved == "named" else "")]
        expected = [names] if "named" in (saved, loaded) else [None]
        assert _names(ours.param_groups) == _names(ref.param_groups) == expected
        assert (
            _names(ours.state_dict()["param_groups"]) == _names(ref.state_dict()["param_groups"]) == expected
        )
        lockstep(model, ours, ref_model, ref, batches[2:])
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(model, ref_model)


# ============================================================================= 2. entries that are not params'
def _note(opt):
    """A state_dict pre hook's bookkeeping in `opt.state`, under keys that are not params."""
    opt.state["ema"] = {"decay": torch.tensor(0.999), "warmup": 3}
    opt.state["saves"] = opt.state.get("saves", 0) + 1


def _unowned(state) -> dict:
    """The entries of `state` (opt.state or a state dict's) under keys that are not params."""
    return {k: v for k, v in state.items() if not isinstance(k, (torch.Tensor, int))}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_state_entries_that_are_not_params_go_through_a_checkpoint_as_torchs_do(
    placement, nvme_dir, tmp_path
):
    """torch's state_dict() packs every entry of `opt.state`, a key that is not a param kept as
    it is, and its load_state_dict() keeps the checkpoint's such entries (replacing opt.state
    whole: one the checkpoint lacks is gone). Ours dropped them from state_dict() and from
    save_state_dict()'s file, and kept the stale ones on load."""
    batches = make_batches(5)
    model, ref_model = make_net(), make_net()
    with _ours(model.parameters(), placement, nvme_dir) as ours:
        ref = _torch(ref_model.parameters())
        lockstep(model, ours, ref_model, ref, batches[:2])
        for o in (ours, ref):
            o.register_state_dict_pre_hook(_note)
        sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert list(_unowned(sd["state"])) == list(_unowned(ref_sd["state"])) == ["ema", "saves"]
        assert list(sd["state"]) == list(ref_sd["state"])  # the params' entries first, in torch's order
        assert sd["state"]["saves"] == ref_sd["state"]["saves"] == 1
        assert sd["state"]["ema"]["warmup"] == 3 and torch.equal(
            sd["state"]["ema"]["decay"], torch.tensor(0.999)
        )
        assert_state_close(_params_only(sd), _params_only(ref_sd))
        # save_state_dict's file, streamed one param at a time, and with a post hook whole
        for post in (False, True):
            if post:
                ours.register_state_dict_post_hook(lambda opt, sd: None)
            ours.save_state_dict(tmp_path / "opt.pt")
            saved = torch.load(tmp_path / "opt.pt", weights_only=True)
            ref_saved = save_load(ref.state_dict())
            assert list(saved["state"]) == list(ref_saved["state"])
            assert saved["state"]["saves"] == ref_saved["state"]["saves"] == 2 + post
            assert torch.equal(saved["state"]["ema"]["decay"], ref_saved["state"]["ema"]["decay"])
            assert_state_close(_params_only(saved), _params_only(ref_saved))
    with _ours(model.parameters(), placement, nvme_dir) as ours:
        ref = _torch(ref_model.parameters())
        for o in (ours, ref):
            o.state["stale"] = {"from": "before the load"}
        ours.load_state_dict(saved)
        ref.load_state_dict(ref_saved)
        assert list(_unowned(ours.state)) == list(_unowned(ref.state)) == ["ema", "saves"]
        assert ours.state["saves"] == ref.state["saves"] == 3
        lockstep(model, ours, ref_model, ref, batches[2:])
        assert _unowned(ours.state_dict()["state"]).keys() == {"ema", "saves"}
        assert_state_close(_params_only(ours.state_dict()), _params_only(ref.state_dict()))
    assert_params_close(model, ref_model)


# ============================================================================= 3. meta params
def _meta_net():
    with torch.device("meta"):
        return Net()


def _materialise(model):
    """Deferred init's second half: memory on the CPU, then the weights' values (seeded)."""
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


@needs_named_params
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_meta_params_are_taken_on_the_device_tier_refused_offloaded_and_train_once_materialised(
    placement, nvme_dir
):
    """torch builds an optimizer over meta params; so does ours at offload 0, while the host and
    nvme tiers, which copy each param's values into its fp32 master when they lay it out, raised
    a bare `NotImplementedError: Cannot copy out of meta tensor`. They refuse at construction
    now with a ValueError naming the param, the meta device and the fix; built after
    materialising (to_empty() and the init), every placement follows torch."""
    meta = _meta_net()
    _torch(meta.named_parameters())
    if placement == "device":
        _ours(meta.named_parameters(), placement, nvme_dir).close()
    else:
        with pytest.raises(
            ValueError,
            match=r"(?s)parameter 0 \(fc1\.weight\) is on the meta device.*"
            r"offload_fraction=1\.0.*fp32 master.*"
            r"Build the optimizer after materialising the model: "
            r"model\.to_empty\(device=\.\.\.\)",
        ):
            _ours(meta.named_parameters(), placement, nvme_dir)
    model, ref_model = _materialise(_meta_net()), _materialise(_meta_net())
    with _ours(model.parameters(), placement, nvme_dir) as ours:
        ref = _torch(ref_model.parameters())
        lockstep(model, ours, ref_model, ref, make_batches(4))
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(model, ref_model)


@pytest.fixture
def swap_on_conversion():
    """torch.__future__'s flag on for one test: to_empty() keeps the module's Parameter objects."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def test_meta_params_at_offload_0_after_to_empty_do_what_torchs_do():
    """Built before to_empty() at offload 0, ours does what torch's does: to_empty() puts new
    Parameter objects in the module, both optimizers keep the meta ones, which get no grads, and
    neither steps the materialised model (same trajectory: none; build the optimizer after).
    A move to the host tier (replan) is refused as construction refuses it."""
    model, ref_model = _meta_net(), _meta_net()
    with _ours(model.parameters(), "device", None) as ours:
        ref = _torch(ref_model.parameters())
        with pytest.raises(ValueError, match=r"parameter 0 is on the meta device.*offload_fraction=1\.0"):
            ours.replan(1.0)
        _materialise(model)
        _materialise(ref_model)
        start = copy.deepcopy(model)
        lockstep(model, ours, ref_model, ref, make_batches(3))
        assert ours.state_dict()["state"] == ref.state_dict()["state"] == {}
    assert_params_close(model, ref_model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))


def test_meta_params_at_offload_0_kept_by_to_empty_are_refused_at_step_as_a_moved_param(swap_on_conversion):
    """Where to_empty() keeps the Parameter objects (torch.__future__.set_swap_module_params_on_
    conversion(True)) torch's optimizer steps them; ours laid them out on the meta device and
    refuses them at step() as any param moved after construction (docs/usage.md), naming the
    fix: build the optimizer after materialising."""
    model, ref_model = _meta_net(), _meta_net()
    with _ours(model.parameters(), "device", None) as ours:
        ref = _torch(ref_model.parameters())
        _materialise(model)
        _materialise(ref_model)
        batch = make_batches(1)[0]
        for m, o in ((model, ours), (ref_model, ref)):
            loss_fn(m, batch).backward()
        ref.step()
        assert ref.state_dict()["state"]  # torch stepped the materialised params
        with pytest.raises(
            RuntimeError,
            match=r"parameter 0 was moved or cast after HybridAdamW was "
            r"built.*on meta to .*on cpu.*Build the optimizer after",
        ):
            ours.step()


# ============================================================================= 4. param_groups.extend(param_groups)
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_param_groups_extended_with_themselves_are_refused_by_checkpoints_as_by_step(
    placement, nvme_dir, tmp_path
):
    """torch's test for pytorch#36831 lists every param twice (`param_groups.extend(param_groups)`)
    and its state_dict() packs the second group as the first (the same indices). Ours lays each
    param out once, when it joins: step() refused the list, state_dict() raised a bare
    IndexError. Now state_dict(), save_state_dict() and load_state_dict() refuse it as step()
    does, before anything changes, and with the list put back training goes on as torch's."""
    batches = make_batches(5)
    model, ref_model = make_net(), make_net()
    with _ours(model.parameters(), placement, nvme_dir) as ours:
        ref = _torch(ref_model.parameters())
        lockstep(model, ours, ref_model, ref, batches[:2])
        ref_before = ref.state_dict()
        ref.param_groups.extend(ref.param_groups)
        ref_sd = ref.state_dict()
        assert [g["params"] for g in ref_sd["param_groups"]] == [ref_before["param_groups"][0]["params"]] * 2
        before = copy.deepcopy(ours.state_dict())
        ours.param_groups.extend(ours.param_groups)
        calls = {
            "state_dict": ours.state_dict,
            "save_state_dict": lambda: ours.save_state_dict(tmp_path / "opt.pt"),
            "load_state_dict": lambda: ours.load_state_dict(before),
        }
        for name, call in calls.items():
            with pytest.raises(
                ValueError,
                match=rf"(?s)HybridAdamW\.{name}\(\): param_groups\[1\]\['params'\] "
                rf"was edited.*add_param_group\(\).*put the list back to call "
                rf"{name}\(\) \(del opt\.param_groups\[n:\].*Nothing was changed",
            ):
                call()
        assert not (tmp_path / "opt.pt").exists()
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_fn(m, batches[2]).backward()
        with pytest.raises(
            ValueError, match=re.escape("HybridAdamW.step(): param_groups[1]['params'] was edited")
        ):
            ours.step()
        del ours.param_groups[1:]
        del ref.param_groups[1:]
        after = ours.state_dict()
        for i, st in before["state"].items():
            assert all(torch.equal(v, after["state"][i][k]) for k, v in st.items()), i
        ours.step()
        ref.step()
        lockstep(model, ours, ref_model, ref, batches[3:])
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(model, ref_model)
