"""What torch.optim's state dict holds besides the params' state the tiers keep: `state` entries
under keys that name no param, and the check that `param_groups` still lists the params laid out.

These entries go beside what checkpoint.py gathers and scatters, as torch keeps them. A state dict
is of the params laid out, in their order: after `param_groups` was edited in place it cannot be
made or loaded, refused before anything changes."""

from __future__ import annotations

import torch


def unowned_entries(state_dict: dict) -> dict:
    """The entries of `state_dict["state"]` under keys that name no param of its groups: torch's
    state_dict() carries such entries of `opt.state` as they are, and its load_state_dict()
    keeps them."""
    listed = {i for g in state_dict["param_groups"] for i in g["params"]}
    return {k: v for k, v in state_dict["state"].items() if k not in listed}


def keep_unowned(torch_state, entries: dict) -> None:
    """`opt.state`'s entries under keys that are not params become the loaded `entries`, as
    torch's load_state_dict() leaves them (it replaces `opt.state` whole: one the checkpoint
    does not have is gone). The params' entries, the step counts' mirror, are the ledger's."""
    for key in [k for k in torch_state if not isinstance(k, torch.Tensor)]:
        del torch_state[key]
    torch_state.update(entries)


def check_laid_out(layout, owner: str, call: str) -> None:
    """`param_groups` lists the params laid out, in their order, else ValueError naming the
    first group that differs (as step() refuses: step_failures.StepChecks)."""
    laid_out, i = layout.laid_out, 0
    for gi, group in enumerate(layout.param_groups):
        for p in group["params"]:
            if i >= len(laid_out) or p is not laid_out[i]:
                _edited(owner, call, gi, i)
            i += 1
    if i != len(laid_out):  # params removed (or every group: param_groups.clear())
        _edited(owner, call, max(len(layout.param_groups) - 1, 0), i)


def _edited(owner: str, call: str, gi: int, i: int) -> None:
    raise ValueError(
        f"{owner}.{call}(): param_groups[{gi}]['params'] was edited after the params "
        f"joined the optimizer (parameter {i} is not the one laid out there, or params "
        f"were added or removed, as param_groups.extend(param_groups) adds each one a "
        f"second time): its state belongs to the params laid out when they joined, and a "
        f"state dict is of those. Add params with add_param_group(), or build a new "
        f"optimizer for another set of params; put the list back to call {call}() "
        f"(del opt.param_groups[n:] after an extend). Nothing was changed."
    )
