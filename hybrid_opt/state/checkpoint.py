"""Checkpoints: state_dict() gathers every tier's state into torch.optim.AdamW's format, and
load_state_dict() scatters such a state dict back into the tiers.

Functions of (layout, placement, param groups) the optimizer's state_dict() and
load_state_dict() call. The fp32 master of a bf16/fp16 param travels under the
extra key `master_param`, which torch ignores.
"""
from __future__ import annotations

import copy

from collections import OrderedDict

import torch

from hybrid_opt.distributed import dtensor_like, is_dtensor, is_sharded, local_of, local_shard_of
from hybrid_opt.placement.plan import DEVICE, NVME
from hybrid_opt.distributed.zero_gather import SHARD_KEY
from hybrid_opt.state.layout import subgroups_label


def _master_stands(saved: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether the param is still a rounding of the saved fp32 master: torch's cast (nearest
    even: an fp32-master optimizer's param) or, for bf16, the remainder encoding's high half
    (nearest, ties away from zero: the param of an optimizer with store_param_remainders)."""
    if param.dtype == torch.float32 or torch.equal(saved.to(param.dtype), param):
        return param.dtype != torch.float32 or torch.equal(saved.float(), param)
    if param.dtype != torch.bfloat16:
        return False
    from cpu_kernels.reference import encode_remainder_reference
    return torch.equal(encode_remainder_reference(saved.float().contiguous())[0], param)


def _check_saved_state(saved_state: dict, params: list) -> None:
    """Each saved state tensor has its param's number of elements (a DTensor's or a full
    tensor's: the global count) and each step count is a number, else ValueError naming the
    param, the key and what to do."""
    for idx, entry in saved_state.items():
        if not isinstance(entry, dict):
            raise ValueError(f"loaded state dict: the state of parameter {idx} is a "
                             f"{type(entry).__name__}, not a dict; load a state_dict() of this "
                             f"model's optimizer")
        n = params[idx].numel()
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            t = entry.get(key)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"loaded state dict: parameter {idx}'s {key!r} must be a float "
                                 f"tensor, got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.numel() != n:
                raise ValueError(f"loaded state dict: parameter {idx}'s {key!r} has {t.numel()} "
                                 f"elements, the parameter {n} {tuple(params[idx].shape)}: the "
                                 f"checkpoint is another model's (or its params are in another "
                                 f"order); nothing was loaded")
        if "step" in entry:
            try:
                float(entry["step"])
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"loaded state dict: parameter {idx}'s 'step' must be a number or "
                                 f"a 1-element tensor, got {entry['step']!r}") from None


def committed_shell(parts, post_hooks: dict, torch_state_dict) -> tuple:
    """(torch_state_dict() — torch's Optimizer.state_dict: param_groups, params as indices — of
    the committed state, its "state" still to fill; the post hooks it then goes through, held
    back meanwhile). Between backward and step() the pending speculations are dropped (step()
    steps those subgroups itself); a param written since the last step restarts its master."""
    parts.speculator.drop()
    parts.guard.check_written()
    post = OrderedDict(post_hooks)  # torch's: run once the state is in
    post_hooks.clear()
    try:
        sd = torch_state_dict()
    finally:
        post_hooks.update(post)
    if parts.sharding.shard() is not None:  # whose chunks these are (torch ignores the key; DCP drops it)
        sd[SHARD_KEY] = parts.sharding.shard()
    return sd, post


def gather_state(layout, placement, state_format) -> dict:
    """torch's `state` of the optimizer, from the tiers (iter_state's entries)."""
    return dict(iter_state(layout, placement, state_format))


def iter_state(layout, placement, state_format):
    """(param index, its entry of torch's `state`) of each stepped param, in index order, each
    made only when asked for (saving.py writes one and drops it before the next). Where each
    param's state lands: a param wholly on the device tier gets views of the tier's buffers
    when its elements lie in one subgroup (references, as torch returns its own state tensors:
    copy them to keep a snapshot), else copies on its device; a param with any element on the
    host or nvme tier gets CPU tensors of its own (they outlive close()). An nvme subgroup's
    file is read once, and its copy dropped after the last param that needs it."""
    params = list(layout.params())
    pieces: dict = {}  # param index -> [(subgroup, slice)]
    for sg in layout.subgroups:
        for sl in sg.slices:
            pieces.setdefault(sl.param_index, []).append((sg, sl))
    # never stepped: torch has no state for it either
    stepped = [idx for idx in range(len(params)) if layout.steps[idx]]
    last_use = {}  # subgroup index -> the last stepped param that reads its state
    for idx in stepped:
        for sg, _ in pieces.get(idx, ()):
            last_use[sg.index] = idx
    sub_state: dict = {}  # subgroup states in use (an nvme one is a copy read from its file)
    for idx in stepped:
        p = local_of(params[idx])  # a DTensor's state is its local shard's, wrapped below
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if layout.group_of(idx)["amsgrad"] else [])
        if p.dtype != torch.float32:
            keys.append("master")
        # an fp32 param's master is the param itself, and on the device tier an fp32 subgroup
        # holding several params would make it a copy of all of them: asked for only where
        # `keys` has it (a subgroup's params share its dtype and group, so their keys agree)
        master = "master" in keys
        parts = pieces.get(idx, [])
        on_device = all(placement.plan.tiers[sg.index] == DEVICE for sg, _ in parts)
        if on_device and len(parts) == 1:
            sg, sl = parts[0]
            if sg.index not in sub_state:
                sub_state[sg.index] = placement.state_of(sg, master)
            st = sub_state[sg.index]
            a, b = sl.sub_offset, sl.sub_offset + sl.numel
            flat = {k: st[k][a:b] for k in keys}
            if "master" in flat and placement.device.has_remainders(sg.index):
                # decoded once per subgroup, then each param's own elements: a view of the
                # decoded subgroup would make torch.save write all of it once per param
                flat["master"] = flat["master"].clone()
            if last_use[sg.index] == idx:
                del sub_state[sg.index]
            del st  # a decoded master lives no longer than its last param needs it
        else:
            where = p.device if on_device else torch.device("cpu")
            # moments in the format's dtypes (bf16 when compressed), the master in fp32
            flat = {k: torch.empty(p.numel(), dtype=_state_dtype(state_format, k), device=where) for k in keys}
            for sg, sl in parts:
                if sg.index not in sub_state:
                    sub_state[sg.index] = placement.state_of(sg, master)
                a, b = sl.sub_offset, sl.sub_offset + sl.numel
                for k in keys:
                    flat[k][sl.param_offset:sl.param_offset + sl.numel].copy_(sub_state[sg.index][k][a:b])
                if last_use[sg.index] == idx:
                    del sub_state[sg.index]
        entry = {"step": torch.tensor(float(layout.steps[idx]), dtype=torch.float32)}
        for k in keys:
            t = flat[k].view(p.shape)
            # torch.optim.AdamW's state under FSDP2 is zeros_like(p): DTensors like the param
            entry["master_param" if k == "master" else k] = (
                dtensor_like(t, params[idx]) if is_sharded(params[idx]) else t)
        del flat, t
        box = [entry]
        del entry
        yield idx, box.pop()  # the consumer holds its only reference: dropped, it is freed at once


def _state_dtype(fmt, key: str) -> torch.dtype:
    return {"exp_avg": fmt.exp_avg_dtype, "exp_avg_sq": fmt.exp_avg_sq_dtype,
            "max_exp_avg_sq": fmt.exp_avg_sq_dtype}.get(key, torch.float32)


def saved_state_of(groups: list, state_dict: dict, params: list) -> dict:
    """{param index: its saved state} of `state_dict` for the optimizer's `groups`, checked
    before anything is written (a load that fails half-way would leave some subgroups loaded
    and the others not: the committed state must stay whole)."""
    groups, saved_groups = groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match "
                         "the size of optimizer's group")
    # saved ids map to our positions in order (as torch does)
    id_map = {}
    for s in saved_groups:
        for pid in s["params"]:
            id_map[pid] = len(id_map)
    saved_state = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
    _check_saved_state(saved_state, params)
    return saved_state


def wants_amsgrad(state_dict: dict) -> bool:
    """Whether the checkpoint needs amsgrad's running max of v."""
    return any(s.get("amsgrad", False) for s in state_dict["param_groups"])


def saved_hyperparameters(groups: list, state_dict: dict, keep=()) -> list:
    """Each group's hyperparameters as the checkpoint has them, to set once its state is loaded:
    copies, as torch's load_state_dict deep-copies them (a Tensor lr a scheduler fills in place
    stays the checkpoint's, not shared with its optimizer or another one loaded from it)."""
    skip = ("params", "param_names", *keep)  # `keep`: the keys the loader keeps its own of
    return [{k: copy.deepcopy(v) for k, v in s.items() if k not in skip}
            for s in state_dict["param_groups"][:len(groups)]]


def _source(param, entry: dict, key: str, held: dict, idx: int):
    """A param's saved tensor for tier key `key` as 1-D (a copy only for a strided tensor or a
    shard), or None (zeros); the master is the param itself unless the saved one stands (one
    that does not, of a 16-bit param, goes into `held` under `idx`: ParamGuard.hold_masters)."""
    saved = entry.get("master_param" if key == "master" else key)
    if is_sharded(param):  # this rank's shard of a DTensor or of a full tensor
        saved = local_shard_of(saved, param)
    elif is_dtensor(saved):  # a sharded checkpoint into a plain param
        saved = saved.full_tensor()
    p = local_of(param)
    if key == "master":
        src = p.detach()
        # a master stands only while the param is still its rounding: torch carries our extra
        # key along without updating it, so after training elsewhere the param itself is the
        # truth (and a load never writes params). Compared on the param's device: a
        # map_location="cpu" file may load into a CUDA model
        if saved is not None and _master_stands(saved.to(p.device), src):
            src = saved
        elif saved is not None and p.dtype != torch.float32:
            held[idx] = saved.reshape(-1)
    else:
        src = saved
    return None if src is None else src.reshape(-1)


def prepare_sources(layout, params: list, saved_state: dict, held: dict) -> dict:
    """{(param index, tier key): its 1-D source or None} for every param a subgroup holds, made
    before anything is written: what can fail in making them (a shard, a gather, a device) fails
    while every tier is still as it was, and what is left to write is copies. `held` gets the
    saved masters that do not stand yet (_source)."""
    keys = _state_keys(layout.amsgrad)
    laid = sorted({sl.param_index for sg in layout.subgroups for sl in sg.slices})
    return {(idx, k): _source(params[idx], saved_state.get(idx, {}), k, held, idx) for idx in laid for k in keys}


def _fill(st: dict, sg, sources: dict) -> None:
    """Subgroup `sg`'s state tensors `st` (state_of's keys) take its params' saved elements."""
    for sl in sg.slices:
        a, b = sl.sub_offset, sl.sub_offset + sl.numel
        for k, view in st.items():
            src = sources[(sl.param_index, k)]
            if src is None:
                view[a:b].zero_()
            else:
                view[a:b].copy_(src[sl.param_offset:sl.param_offset + sl.numel])


def _blank_state(sg, host, state_format) -> dict:
    """Zeroed tensors of an nvme subgroup's state (state_of's keys and the tier's dtypes): what
    a load writes its file from, never reading the file's current contents (a checkpoint is
    how a corrupt slot is replaced)."""
    return {k: torch.zeros(sg.numel, dtype=_state_dtype(state_format, k)) for k in _state_keys(host.amsgrad)}


def _state_keys(amsgrad: bool) -> tuple:
    """A subgroup's state tensors, as the tiers' state_of names them."""
    return ("master", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def scatter_state(layout, placement, sources: dict) -> None:
    """Writes the prepared `sources` into the tiers; a failure leaves every subgroup as it was.

    The nvme subgroups go first: a load writes each file's other slot and flips its committed
    slot (host.load_state), so putting back the slot map (and, with remainders, the params'
    high halves) undoes it without the old contents ever being read. The resident subgroups
    (device and host tiers: memory copies from sources already made) go last; should one
    still fail (an interrupt, a device fault) the nvme subgroups are put back and the error
    says which resident subgroups took the checkpoint."""
    tiers, host = placement.plan.tiers, placement.host
    nvme = [sg for sg in layout.subgroups if tiers[sg.index] == NVME]
    resident = [sg for sg in layout.subgroups if tiers[sg.index] != NVME]
    marks = host.file_marks() if nvme else {}
    highs = {}  # remainder subgroups' params (their masters' high halves) as they were
    done: list = []
    try:
        for sg in nvme:
            local = placement.host_local[sg.index]
            if host.remainders[local]:
                highs[sg.index] = (sg, sg.read().clone())
            st = _blank_state(sg, host, placement.state_format)
            _fill(st, sg, sources)
            host.load_state(local, st["master"], st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"))
    except BaseException as e:
        host.restore_file_marks(marks)
        for done_sg, high in highs.values():
            done_sg.write(high)
        _load_failed(e, f"load_state_dict failed writing nvme subgroup {sg.index}: {e}. Nothing was "
                        f"loaded: every subgroup, step count and hyperparameter is as before the "
                        f"call (each nvme file's committed slot was never written)")
    try:
        for sg in resident:
            st = placement.state_of(sg)
            _fill(st, sg, sources)
            placement.load(sg, st)  # remainders: encoded back
            done.append(sg)
    except BaseException as e:
        if nvme:
            host.restore_file_marks(marks)
            for done_sg, high in highs.values():
                done_sg.write(high)
        rest = [s for s in resident if s not in done]
        _load_failed(e, f"load_state_dict failed loading subgroup {sg.index} ({tiers[sg.index]} "
                        f"tier): {e}. {subgroups_label(done)} already hold the checkpoint's state; "
                        f"{subgroups_label(rest)}{' and the nvme tier' * bool(nvme)} are as before the "
                        f"call, as are the step counts and hyperparameters: call "
                        f"load_state_dict again")


def _load_failed(e: BaseException, message: str) -> None:
    """Raises `e` restated as `message` (its type kept); KeyboardInterrupt and the like as they
    are, `message` noted on them."""
    if not isinstance(e, Exception):
        if hasattr(e, "add_note"):
            e.add_note(message)
        raise e
    from hybrid_opt.placement import restated
    raise restated(e, message) from e


def looks_like_state_init_step(layout, decoupled: bool) -> bool:
    """torch.distributed.checkpoint's `_init_optim_state`: on an optimizer whose `state` is
    empty it sets every grad to zeros and steps once with lr 0. On a fresh optimizer that
    step leaves what torch.optim.AdamW's leaves — step 1, zero moments, params unchanged —
    so it is taken without any host work (StepLedger.state_init_step). This rank's verdict, from
    its own grads (a shard's, a chunk's): under torch.distributed step() makes it one
    decision (every rank's vote rides the decision all_reduce; a real lr-0 step where they
    differ leaves the same params). Adam's L2 decay would put weight_decay * param into the
    moments: that case takes a real step."""
    if any(layout.steps):
        return False
    for g in layout.param_groups:
        lr = g["lr"]
        if float(lr.item() if isinstance(lr, torch.Tensor) else lr) != 0.0:
            return False
        if not g.get("decoupled_weight_decay", decoupled) and g["weight_decay"] != 0:
            return False
    grads = [local_of(p.grad) for p in layout.params() if p.grad is not None]
    if not grads or any(g.is_sparse for g in grads):
        return False
    return not bool(torch.stack([g.any() for g in grads]).any())  # one host sync on a GPU



def load(parts, state_dict: dict, torch_state, keep=()) -> None:
    """load_state_dict() into the optimizer's parts (optimizer.Parts), the optimizer open and
    its pending gathers landed; `keep`: group keys the optimizer keeps as they are (AdamW's
    decoupled_weight_decay, as torch's AdamW does; Adam takes an AdamW checkpoint's)."""
    layout, placement = parts.layout, parts.placement
    # params given new memory since the last step are re-adopted first (storage.py): done at
    # the next step() instead, it would restart the masters this load sets
    parts.guard.check()
    parts.speculator.drop()
    params = list(layout.params())
    saved = saved_state_of(layout.param_groups, state_dict, params)
    if wants_amsgrad(state_dict) and not layout.amsgrad:
        # the checkpoint needs a running max of v that this optimizer never laid out: lay the
        # tiers out again with it (the state is loaded into them right below)
        layout.set_amsgrad(True)
        try:
            placement.rebuild()
        except BaseException:
            layout.set_amsgrad(False)  # the tiers are as they were (moves.py): so is the layout
            raise
    hyper = saved_hyperparameters(layout.param_groups, state_dict, keep)
    held: dict = {}
    scatter_state(layout, placement, prepare_sources(layout, params, saved, held))
    for g, h in zip(layout.param_groups, hyper):  # set once the state stands: a failed load keeps them
        g.update(h)
    steps = {idx: int(float(st["step"])) for idx, st in saved.items() if "step" in st}
    # each param's step count, torch's state mirror made again, this rank back in step
    parts.ledger.loaded(torch_state, steps)
    parts.guard.record()  # with remainders a load writes the params' high halves
    parts.guard.hold_masters(held)  # the model's weights may be loaded next
