"""Checkpoints: state_dict() gathers every tier's state into torch.optim.AdamW's format, and
load_state_dict() scatters such a state dict back into the tiers.

Functions of (layout, placement, param groups). A bf16/fp16 param's fp32 master travels under
`master_param`, which torch ignores; a q8 moment travels as stored (codes and absmaxes), never
expanded; a bitsandbytes 8-bit Adam checkpoint loads as q8 (`from_bitsandbytes`), and
`fp32_entries` gives the fp32 form for `save_state_dict(f, fp32=True)`. Design notes:
docs/internals.md."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import torch

from cpu_kernels.reference import decode_remainder_reference
from hybrid_opt.distributed.dtensor_state import dtensor_like, local_shard_of
from hybrid_opt.distributed.local_shards import is_dtensor, is_sharded, local_of
from hybrid_opt.distributed.q8_shards import (
    absmax_dtensor,
    absmax_local_shape,
    local_absmax_of,
    local_codes_of,
)
from hybrid_opt.distributed.zero_gather import SHARD_KEY
from hybrid_opt.mapped import Piece, map_tensor
from hybrid_opt.notes import add_note
from hybrid_opt.placement.plan import DEVICE, NVME
from hybrid_opt.state.layout import subgroups_label
from hybrid_opt.state.state_format import ABSMAX, Q8_BLOCK, Q8_ZERO_CODE, q8_blocks, q8_quantized
from hybrid_opt.state.torch_extras import keep_unowned, unowned_entries
from hybrid_opt.tiers.device import encode_remainder_on

_COMPARE_CHUNK = 1 << 18  # elements _master_stands casts at once: a load's temporaries stay small


def _master_stands(saved: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether the param is still a rounding of the saved fp32 master: torch's cast (nearest
    even: an fp32-master optimizer's param) or, for bf16, the remainder encoding's high half
    (nearest, ties away from zero: the param of an optimizer with store_param_remainders).
    Compared a chunk at a time: no cast of a whole param is made (a load holds the saved dict
    already; issue 38 item 4 measures its peak)."""
    if saved.shape != param.shape:
        return False
    saved, param = saved.reshape(-1), param.reshape(-1)
    chunks = [slice(c, c + _COMPARE_CHUNK) for c in range(0, param.numel(), _COMPARE_CHUNK)]
    if param.dtype == torch.float32 or all(torch.equal(saved[c].to(param.dtype), param[c]) for c in chunks):
        return param.dtype != torch.float32 or all(torch.equal(saved[c].float(), param[c]) for c in chunks)
    if param.dtype != torch.bfloat16:
        return False
    from cpu_kernels.reference import encode_remainder_reference

    return all(
        torch.equal(encode_remainder_reference(saved[c].float().contiguous())[0], param[c]) for c in chunks
    )


def _check_saved_state(saved_state: dict, params: list) -> None:
    """Each saved state tensor has its param's number of elements (a DTensor's or a full
    tensor's: the global count) and each step count is a number, else ValueError naming the
    param, the key and what to do."""
    for idx, entry in saved_state.items():
        if not isinstance(entry, dict):
            raise ValueError(
                f"loaded state dict: the state of parameter {idx} is a "
                f"{type(entry).__name__}, not a dict; load a state_dict() of this "
                f"model's optimizer"
            )
        n = params[idx].numel()
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            t = entry.get(key)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(
                    f"loaded state dict: parameter {idx}'s {key!r} must be a float "
                    f"tensor, got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
            if t.numel() != n:
                raise ValueError(
                    f"loaded state dict: parameter {idx}'s {key!r} has {t.numel()} "
                    f"elements, the parameter {n} {tuple(params[idx].shape)}: the "
                    f"checkpoint is another model's (or its params are in another "
                    f"order); nothing was loaded"
                )
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            codes, absmax = entry.get(key + Q8_KEY), entry.get(key + ABSMAX)
            if codes is None and absmax is None:
                continue
            if not (
                isinstance(codes, torch.Tensor)
                and codes.dtype == torch.uint8
                and codes.numel() == n
                and isinstance(absmax, torch.Tensor)
                and absmax.dtype == torch.float32
                and absmax.numel() == q8_blocks(n)
            ):
                raise ValueError(
                    f"loaded state dict: parameter {idx}'s q8 {key!r} must be "
                    f"{key + Q8_KEY!r} (uint8, {n} elements) and {key + ABSMAX!r} "
                    f"(float32, {q8_blocks(n)}: one per block of {Q8_BLOCK} of the "
                    f"parameter's {n} elements), got "
                    f"{_described(codes)} and {_described(absmax)}; nothing was loaded"
                )
        rem = entry.get("master_remainder")
        if isinstance(rem, torch.Tensor) and rem.dtype == torch.int16 and rem.numel() != n:
            raise ValueError(
                f"loaded state dict: parameter {idx}'s 'master_remainder' has "
                f"{rem.numel()} elements, the parameter {n} {tuple(params[idx].shape)}: "
                f"the checkpoint is another model's; nothing was loaded"
            )
        if "step" in entry:
            try:
                float(entry["step"])
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(
                    f"loaded state dict: parameter {idx}'s 'step' must be a number or "
                    f"a 1-element tensor, got {entry['step']!r}"
                ) from None


Q8_KEY = "_q8"  # a q8 moment's codes in a state dict: the moment's key + this (its absmax: + ABSMAX)


def _described(t) -> str:
    if not isinstance(t, torch.Tensor):
        return "none" if t is None else type(t).__name__
    return f"{t.dtype} with {t.numel()} elements"


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
    made only when asked for (saving.py writes one and drops it before the next).

    Every tensor is a view of the memory that holds the state, with a storage of its own
    (torch.save writes exactly its bytes): the device tier's tensors, the host tier's
    committed banks, an nvme subgroup's committed slot (checksum-verified, mapped
    copy-on-write: clean page cache, not a copy). A param spread over several subgroups gets
    their pieces mapped side by side (mapped.py). What the entry holds across a later step:
    host and nvme tensors keep the values they had when taken (their memory is copied into
    memory of their own before a step writes it: host_views.py); device-tier tensors are the
    tier's own, stepped in place, as torch's are. A copy is made only where no view can
    exist: a param spread over CUDA subgroups, over subgroups cut off a page boundary (tiny
    ones: layout.PAGE_CUT_FROM), or over the device and host tiers (which keep their views
    differently).

    A bf16 param whose master is kept as remainders carries `master_remainder` (int16: with
    the param, its high half, it decodes to the fp32 master) instead of an fp32
    `master_param` that no tier stores."""
    params = list(layout.params())
    pieces: dict = {}  # param index -> [(subgroup, slice)]
    for sg in layout.subgroups:
        for sl in sg.slices:
            pieces.setdefault(sl.param_index, []).append((sg, sl))
    verified: set = set()  # the nvme slots whose checksums this call has read
    # never stepped: torch has no state for it either
    for idx in (i for i in range(len(params)) if layout.steps[i]):
        p = local_of(params[idx])  # a DTensor's state is its local shard's, wrapped below
        entry = {"step": torch.tensor(float(layout.steps[idx]), dtype=torch.float32)}
        laid = (
            pieces[idx][0][0].dtype if pieces.get(idx) else p.dtype
        )  # a param cast since keeps its layout's
        # by the param's global size, as the layout decides: every rank gives the same keys
        fmt = state_format.for_subgroup(q8_quantized(params[idx], state_format.quantized_moments))
        blocks = absmax_local_shape(params[idx])
        for key, name in _entry_keys(layout, idx, laid, fmt):
            t = _state_tensor(placement, pieces.get(idx, []), name, p, verified, fmt, blocks)
            if not is_sharded(params[idx]):
                entry[key] = t
            elif name.endswith(ABSMAX):  # a DTensor of the absmax's own global shape (q8_shards.py)
                entry[key] = absmax_dtensor(t, params[idx])
            else:  # torch.optim.AdamW's state under FSDP2 is zeros_like(p): DTensors like the param
                entry[key] = dtensor_like(t, params[idx])
        yield idx, entry


def fp32_master(entry: dict, param) -> torch.Tensor | None:
    """The fp32 master of `param` from its entry of a state_dict()["state"]: its
    `master_param`, or decoded from the bf16 param (the master's high half) and its
    `master_remainder`; None for an fp32 param (its own master). A DTensor param and entry
    give this rank's local part."""
    if "master_param" in entry:
        return entry["master_param"]
    if "master_remainder" not in entry:
        return None
    rem, p = entry["master_remainder"], local_of(param).detach()  # local_of knows the param itself
    rem = rem.to_local() if is_dtensor(rem) else rem
    return decode_remainder_reference(p.reshape(-1), rem.reshape(-1).to(p.device)).view(p.shape)


def fp32_entries(entries, params: list):
    """(param index, entry) of `entries` (iter_state's) with the moments in fp32, as
    torch.optim.AdamW keeps them: a q8 moment dequantized (map[code] * absmax), a bf16 one
    upcast, fp32 ones as they are (views, no copy); a 16-bit param's fp32 master under
    `master_param` (decoded from `master_remainder`). Each is made when asked for, so a save
    holds one param's fp32 state at a time."""
    from cpu_kernels.q8_reference import Q8Blocks, dequantize_blocks

    for idx, entry in entries:
        out = {"step": entry["step"]}
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if name + Q8_KEY in entry:
                # a sharded param's: this rank's codes and blocks (its blocks are the param's:
                # q8_shards.py), dequantized into a DTensor like the param
                codes, absmax = (local_of(entry[name + k]) for k in (Q8_KEY, ABSMAX))
                # on the CPU, where the map is (the file's bytes go through it anyway)
                q = Q8Blocks(codes.reshape(-1).cpu(), absmax.reshape(-1).cpu())
                moment = dequantize_blocks(q, name == "exp_avg").view(codes.shape)
                out[name] = dtensor_like(moment, params[idx]) if is_sharded(params[idx]) else moment
            elif name in entry:
                out[name] = entry[name].float()
        master = fp32_master(entry, params[idx])
        if master is not None:
            master = master.float()
            out["master_param"] = (
                dtensor_like(master, params[idx])
                if is_sharded(params[idx]) and not is_dtensor(master)
                else master
            )
        yield idx, out


def _entry_keys(layout, idx: int, dtype, state_format) -> list:
    """[(torch's key, the tiers' name)] of param `idx`'s entry. An fp32 param is its own
    master: it has none."""
    keys = []
    for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if layout.group_of(idx)["amsgrad"] else ()):
        if state_format.is_q8(name):
            keys += [(name + Q8_KEY, name), (name + ABSMAX, name + ABSMAX)]
        else:
            keys.append((name, name))
    if dtype != torch.float32:
        keys.append(
            ("master_remainder", "remainder")
            if state_format.remainders_for(dtype)
            else ("master_param", "master")
        )
    return keys


def _state_tensor(
    placement, parts: list, name: str, p, verified: set, fmt, absmax_shape: tuple
) -> torch.Tensor:
    """Param `p`'s state `name` over its `parts` [(subgroup, slice)], shaped like p (a q8
    absmax: `absmax_shape`, one per block of p's flat index), in `fmt` (the param's format): a
    view where one can exist (iter_state), else a copy."""
    located = []  # per part: a mapped.Piece, or the device tier's tensor slice
    per_block = name.endswith(ABSMAX)
    shape = absmax_shape if per_block else p.shape
    for sg, sl in parts:
        a, b = sl.sub_offset, sl.sub_offset + sl.numel
        if per_block:  # the layout starts each slice of a q8 subgroup on a block
            a, b = a // Q8_BLOCK, q8_blocks(b)
        if placement.plan.tiers[sg.index] == DEVICE:
            piece = placement.device.piece(sg.index, name, a, b)
            located.append(piece if piece is not None else placement.device.tensor(sg.index, name)[a:b])
        else:
            located.append(placement.host.views.piece(sg.index, name, a, b, verified))
    dtype = torch.float32 if per_block else torch.uint8 if fmt.is_q8(name) else fmt.dtype_of(name)
    if not located:
        return torch.zeros(shape, dtype=dtype, device=p.device)
    # pieces of one tier only: a device piece is stepped in place while a host or nvme one is
    # kept as it was taken (host_views.py), and one tensor cannot do both
    one_tier = len({placement.plan.tiers[sg.index] == DEVICE for sg, _ in parts}) == 1
    if one_tier and all(isinstance(x, Piece) for x in located):
        t = map_tensor(located, dtype, shape)
        if t is not None:
            return t
    if len(located) == 1 and isinstance(located[0], torch.Tensor):
        return _own_storage(located[0]).view(shape)
    # no view can exist: one copy, on the device where every piece is there, else on the host
    on_device = all(isinstance(x, torch.Tensor) for x in located)
    out = torch.empty(math.prod(shape), dtype=dtype, device=p.device if on_device else "cpu")
    at = 0
    for x in located:
        # a known gap, typed as it runs: map_tensor gives None where the kernel refuses the
        # mapping (too many mappings), and that raises AttributeError here
        src = x if isinstance(x, torch.Tensor) else map_tensor([x], dtype, (x.nbytes // dtype.itemsize,))
        out[at : at + src.numel()].copy_(src)  # type: ignore[union-attr,arg-type]
        at += src.numel()  # type: ignore[union-attr]
        del src
    return out.view(shape)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of contiguous `t`'s memory whose storage is exactly its bytes (a storage
    slice, which keeps the tensor's own storage alive): torch.save writes those, not the
    whole subgroup's tensor, and copies one param at a time off an accelerator."""
    nbytes = t.numel() * t.element_size()
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[start : start + nbytes]
    # torch's stubs list set_(source, offset, size, stride) only; stride is optional at run time
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (t.numel(),))  # type: ignore[call-overload]


def saved_state_of(groups: list, state_dict: dict, params: list) -> dict:
    """{param index: its saved state} of `state_dict` for the optimizer's `groups`, checked
    before anything is written (a load that fails half-way would leave some subgroups loaded
    and the others not: the committed state must stay whole)."""
    groups, saved_groups = groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    # saved ids map to our positions in order (as torch does)
    id_map: dict = {}
    for s in saved_groups:
        for pid in s["params"]:
            id_map[pid] = len(id_map)
    saved_state = {
        id_map[k]: from_bitsandbytes(v, id_map[k], params[id_map[k]].numel())
        for k, v in state_dict["state"].items()
        if k in id_map
    }
    _check_saved_state(saved_state, params)
    return saved_state


BNB_QUANT_STATE = "__bnb_optimizer_quant_state__"  # where bitsandbytes nests state1.. (hidden from FSDP)
# bitsandbytes' per-param keys: (codes or fp32 moment, absmax, map, our moment, signed map)
_BNB_MOMENTS = (
    ("state1", "absmax1", "qmap1", "exp_avg", True),
    ("state2", "absmax2", "qmap2", "exp_avg_sq", False),
)
_BNB_KEYS = {
    "state1",
    "state2",
    "absmax1",
    "absmax2",
    "qmap1",
    "qmap2",
    "max1",
    "max2",
    "new_max1",
    "new_max2",
    "gnorm_vec",
    "unorm_vec",
    BNB_QUANT_STATE,
}


def from_bitsandbytes(entry, idx: int, numel: int):
    """A param's saved state in our keys: a bitsandbytes 8-bit Adam entry (`state1` / `state2`,
    flat or nested under BNB_QUANT_STATE as bitsandbytes' state_dict() nests them) becomes
    `exp_avg_q8` + `exp_avg_absmax` and `exp_avg_sq_q8` + `exp_avg_sq_absmax` (its uint8 codes and
    fp32 absmaxes as they are: the same maps and blocks of 256), or `exp_avg` / `exp_avg_sq`
    where bitsandbytes kept fp32 state (a param under its min_8bit_size); any other entry as it
    is. Its percentile-clipping / max_unorm history (`gnorm_vec`, `unorm_vec`) has no counterpart
    here and is dropped. Refused with a ValueError: a map (`qmap1` / `qmap2`) that is not ours
    (its codes would mean other values), absmaxes in other blocks than 256 (bitsandbytes before
    blocks of 256, or block_wise=False), a 1-state optimizer's entry (not Adam's)."""
    if not isinstance(entry, dict) or not (BNB_QUANT_STATE in entry or "state1" in entry):
        return entry
    flat = {k: v for k, v in entry.items() if k != BNB_QUANT_STATE}
    if isinstance(entry.get(BNB_QUANT_STATE), dict):
        flat.update(entry[BNB_QUANT_STATE])
    where = f"loaded state dict: parameter {idx}'s bitsandbytes state"
    if "state2" not in flat or "state1" not in flat:
        raise ValueError(
            f"{where} has {sorted(k for k in flat if k in _BNB_KEYS)}, not Adam's "
            f"'state1' and 'state2': only an Adam/AdamW 8-bit checkpoint loads; nothing was loaded"
        )
    if "max1" in flat:
        raise ValueError(
            f"{where} is not blockwise ('max1': block_wise=False): its codes share one "
            f"scale per tensor, ours one per block of {Q8_BLOCK}; nothing was loaded"
        )
    out = {k: v for k, v in flat.items() if k not in _BNB_KEYS}
    from cpu_kernels.q8_reference import dynamic_map

    for state, absmax_key, qmap_key, name, signed in _BNB_MOMENTS:
        t = flat[state]
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8):
            out[name] = t  # fp32 state (a small param): torch's moment
            continue
        absmax, qmap = flat.get(absmax_key), flat.get(qmap_key)
        if not isinstance(absmax, torch.Tensor) or absmax.numel() != q8_blocks(numel):
            raise ValueError(
                f"{where}: {absmax_key!r} has {_described(absmax)}, not "
                f"{q8_blocks(numel)} (one per block of {Q8_BLOCK} of the parameter's "
                f"{numel} elements): a checkpoint of bitsandbytes with blocks of another "
                f"size cannot load as codes; nothing was loaded"
            )
        if qmap is not None:
            ours, theirs = dynamic_map(signed), qmap.detach().float().cpu().reshape(-1)
            if theirs.numel() != ours.numel() or not torch.equal(theirs, ours):
                differ = (
                    int((theirs != ours).sum())
                    if theirs.numel() == ours.numel()
                    else f"{theirs.numel()} values against 256"
                )
                raise ValueError(
                    f"{where}: its map {qmap_key!r} is not ours (bitsandbytes' "
                    f"create_dynamic_map(signed={signed}) as built on AVX2 x86; "
                    f"{differ} values differ), so its codes would mean other values "
                    f"here. Dequantize it ({qmap_key}[{state}] * {absmax_key} per block of "
                    f"{Q8_BLOCK}) into an fp32 {name!r} and load that; nothing was loaded"
                )
        out[name + Q8_KEY], out[name + ABSMAX] = t, absmax
    return out


def wants_amsgrad(state_dict: dict) -> bool:
    """Whether the checkpoint needs amsgrad's running max of v."""
    return any(s.get("amsgrad", False) for s in state_dict["param_groups"])


def saved_hyperparameters(groups: list, state_dict: dict, keep=()) -> list:
    """Each group's hyperparameters as the checkpoint has them, to set once its state is loaded:
    copies, as torch's load_state_dict deep-copies them (a Tensor lr a scheduler fills in place
    stays the checkpoint's, not shared with its optimizer or another one loaded from it)."""
    skip = ("params", "param_names", *keep)  # `keep`: the keys the loader keeps its own of
    return [
        {k: copy.deepcopy(v) for k, v in s.items() if k not in skip}
        for s in state_dict["param_groups"][: len(groups)]
    ]


def _saved(param, entry: dict, key: str):
    """The checkpoint's tensor under `key` for this rank's elements of `param` (a copy only for
    a shard or a gathered DTensor), or None."""
    saved = entry.get(key)
    if saved is None:
        return None
    if is_sharded(param):  # this rank's shard of a DTensor or of a full tensor
        return local_shard_of(saved, param)
    if is_dtensor(saved):  # a sharded checkpoint into a plain param
        return saved.full_tensor()
    return saved


def _source(param, entry: dict, key: str, held: dict, idx: int, q8: bool = False):
    """A param's saved tensor for tier state `key` as 1-D, or None (zeros). "remainder": the
    checkpoint's `master_remainder` of a bf16 param (int16; one torch cast to another dtype is
    no remainder), held under `idx` (ParamGuard.hold_masters: weights loaded after the
    optimizer's state decode with it, as the checkpoint's did). "master": the param itself
    unless the saved `master_param` stands (one that does not, of a 16-bit param, is held).
    A moment the tier keeps as q8 (`q8`): a Q8Blocks of the checkpoint's codes and absmax, or its
    float moment quantized; a q8 moment of the checkpoint into a float tier: dequantized."""
    p = local_of(param)
    if key == "remainder":
        saved = _saved(param, entry, "master_remainder")
        ok = saved is not None and saved.dtype == torch.int16 and p.dtype == torch.bfloat16
        if ok:
            held[idx] = saved.reshape(-1)
        return saved.reshape(-1) if ok else None
    if key != "master":
        saved = _saved(param, entry, key)
        codes, absmax = entry.get(key + Q8_KEY), entry.get(key + ABSMAX)
        if codes is not None and is_sharded(param):  # this rank's codes and its blocks' absmaxes
            codes, absmax = local_codes_of(codes, param), local_absmax_of(absmax, param)
        elif codes is not None and is_dtensor(codes):  # a sharded checkpoint into a plain param
            codes = codes.full_tensor()
            absmax = absmax.full_tensor() if is_dtensor(absmax) else absmax  # type: ignore[union-attr]
        signed = key == "exp_avg"
        from cpu_kernels.q8_reference import Q8Blocks, dequantize_blocks, quantize_blocks

        if q8:  # the tier stores codes and absmaxes: a float moment (torch's AdamW) is quantized
            if codes is not None:  # a q8 entry holds both
                return Q8Blocks(codes.reshape(-1), absmax.reshape(-1))  # type: ignore[union-attr]
            return (
                None if saved is None else quantize_blocks(saved.detach().reshape(-1).float().cpu(), signed)
            )
        if saved is None and codes is not None:  # a q8 checkpoint into a float tier
            # a q8 entry holds both codes and absmax
            return dequantize_blocks(Q8Blocks(codes.reshape(-1).cpu(), absmax.reshape(-1).cpu()), signed)  # type: ignore[union-attr]
        return None if saved is None else saved.reshape(-1)
    saved = _saved(param, entry, "master_param")
    src = p.detach()
    # a master stands only while the param is still its rounding: torch carries our extra
    # key along without updating it, so after training elsewhere the param itself is the
    # truth (and a load never writes params). Compared on the param's device: a
    # map_location="cpu" file may load into a CUDA model
    if saved is not None and _master_stands(saved.to(p.device), src):
        src = saved
    elif saved is not None and p.dtype != torch.float32:
        held[idx] = saved.reshape(-1)
    return src.reshape(-1)


def prepare_sources(layout, params: list, saved_state: dict, held: dict, state_format) -> dict:
    """{(param index, tier key): its 1-D source or None} for every param a subgroup holds, made
    before anything is written: what can fail in making them (a shard, a gather, a device) fails
    while every tier is still as it was, and what is left to write is copies. `held` gets the
    saved masters (or remainders) a later write of the param's weights must keep (_source)."""
    quantized = {sl.param_index: sg.quantized for sg in layout.subgroups for sl in sg.slices}
    out = {}
    for idx in sorted(quantized):
        entry = saved_state.get(idx, {})
        fmt = state_format.for_subgroup(quantized[idx])
        for k in ("remainder",) + _state_keys(layout.amsgrad):
            out[(idx, k)] = _source(params[idx], entry, k, held, idx, fmt.is_q8(k))
    return out


_ENCODE_CHUNK = 1 << 20  # elements a load encodes at once: its temporaries stay small


def _fill(stored: dict, sg, sources: dict) -> None:
    """Subgroup `sg`'s stored state — a tier's own memory: the fp32 master ("param" on the host
    tier, "master" on the device tier; an fp32 device subgroup has none: its params are their
    master) or "remainder" (+ "high": where its high half goes; without it, the model's param
    itself), and the moments in the tier's dtypes — takes its params' saved elements, slice
    by slice: nothing the size of a subgroup is made."""
    for sl in sg.slices:
        a, b = sl.sub_offset, sl.sub_offset + sl.numel
        pa, pb = sl.param_offset, sl.param_offset + sl.numel
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k + ABSMAX in stored:  # q8: codes and the absmax of their blocks (each slice starts one)
                src = sources[(sl.param_index, k)]
                ca, cb, qa, qb = a // Q8_BLOCK, q8_blocks(b), pa // Q8_BLOCK, q8_blocks(pb)
                if src is None:
                    stored[k][a:b].fill_(Q8_ZERO_CODE[k])
                    stored[k + ABSMAX][ca:cb].zero_()
                else:
                    stored[k][a:b].copy_(src.codes[pa:pb])
                    stored[k + ABSMAX][ca:cb].copy_(src.absmax[qa:qb])
            elif k in stored:
                src = sources[(sl.param_index, k)]
                if src is None:
                    stored[k][a:b].zero_()
                else:
                    stored[k][a:b].copy_(src[pa:pb])
        master, rem = sources[(sl.param_index, "master")], sources[(sl.param_index, "remainder")]
        for k in ("param", "master"):
            if k not in stored:
                continue
            if rem is None:
                stored[k][a:b].copy_(master[pa:pb])
                continue
            for c in range(0, sl.numel, _ENCODE_CHUNK):  # a remainder checkpoint into an fp32 master
                n = min(_ENCODE_CHUNK, sl.numel - c)
                stored[k][a + c : a + c + n].copy_(
                    decode_remainder_reference(
                        sl.view[c : c + n], rem[pa + c : pa + c + n].to(sl.view.device)
                    )
                )
        if "remainder" not in stored:
            continue
        high = stored.get("high")
        if rem is not None:  # the param is the high half already
            stored["remainder"][a:b].copy_(rem[pa:pb])
            if high is not None:
                high[a:b].copy_(sl.view)
            continue
        for c in range(0, sl.numel, _ENCODE_CHUNK):
            n = min(_ENCODE_CHUNK, sl.numel - c)
            h, r = encode_remainder_on(master[pa + c : pa + c + n], stored["remainder"].device)
            stored["remainder"][a + c : a + c + n].copy_(r)
            with torch.no_grad():
                (high[a + c : a + c + n] if high is not None else sl.view[c : c + n]).copy_(h)


def _state_keys(amsgrad: bool) -> tuple:
    """A subgroup's state, as the tiers name it (and state_of's keys)."""
    return ("master", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def _writes_params(sg, sources: dict) -> bool:
    """Whether loading `sg` (a subgroup that keeps remainders) writes its params: a saved master
    that is not the param itself is encoded, and its high half becomes the param."""
    return any(
        sources[(sl.param_index, "remainder")] is None
        and sources[(sl.param_index, "master")].data_ptr() != sl.view.data_ptr()
        for sl in sg.slices
    )


def scatter_state(layout, placement, sources: dict) -> None:
    """Writes the prepared `sources` into the tiers' own memory (_fill); a failure leaves every
    subgroup as it was.

    The nvme subgroups go first: a load writes each file's other slot and flips its committed
    slot (host.fill_state), so putting back the slot map (and, where the load encodes a
    master into a remainder subgroup, the params' high halves) undoes it without the old
    contents ever being read. The resident subgroups (device and host tiers: memory copies
    from sources already made) go last; should one still fail (an interrupt, a device fault)
    the nvme subgroups are put back and the error says which resident subgroups took the
    checkpoint."""
    tiers, host = placement.plan.tiers, placement.host
    nvme = [sg for sg in layout.subgroups if tiers[sg.index] == NVME]
    resident = [sg for sg in layout.subgroups if tiers[sg.index] != NVME]
    marks = host.file_marks() if nvme else {}
    highs = {}  # params of remainder subgroups the load re-encodes (their high halves), as they were
    done: list = []

    def fill(sg):
        return lambda bank, stored, fresh: _fill(stored, sg, sources)

    try:
        for sg in nvme:
            if host.banks.keeps_remainders(sg.index) and _writes_params(sg, sources):
                highs[sg.index] = (sg, sg.read().clone())
            host.fill_state(sg.index, fill(sg))
    except BaseException as e:
        host.restore_file_marks(marks)
        for done_sg, high in highs.values():
            done_sg.write(high)
        _load_failed(
            e,
            f"load_state_dict failed writing nvme subgroup {sg.index}: {e}. Nothing was "
            f"loaded: every subgroup, step count and hyperparameter is as before the "
            f"call (each nvme file's committed slot was never written)",
        )
    try:
        for sg in resident:
            if tiers[sg.index] == DEVICE:
                _fill(placement.device.stored(sg.index), sg, sources)
            else:
                host.fill_state(sg.index, fill(sg))
            done.append(sg)
    except BaseException as e:
        if nvme:
            host.restore_file_marks(marks)
            for done_sg, high in highs.values():
                done_sg.write(high)
        rest = [s for s in resident if s not in done]
        _load_failed(
            e,
            f"load_state_dict failed loading subgroup {sg.index} ({tiers[sg.index]} "
            f"tier): {e}. {subgroups_label(done)} already hold the checkpoint's state; "
            f"{subgroups_label(rest)}{' and the nvme tier' * bool(nvme)} are as before the "
            f"call, as are the step counts and hyperparameters: call "
            f"load_state_dict again",
        )


def _load_failed(e: BaseException, message: str) -> None:
    """Raises `e` restated as `message` (its type kept); KeyboardInterrupt and the like as they
    are, `message` noted on them."""
    if not isinstance(e, Exception):
        add_note(e, message)
        raise e
    from hybrid_opt.placement.placement import restated

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
    decoupled_weight_decay, as torch's AdamW does; Adam takes an AdamW checkpoint's). As torch's
    load_state_dict: a group takes the checkpoint's `param_names` where it has them, and
    `opt.state`'s entries under keys that are not params become the checkpoint's (torch_extras)."""
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
    scatter_state(layout, placement, prepare_sources(layout, params, saved, held, placement.state_format))
    # set once the state stands: a failed load keeps them
    for g, h, s in zip(layout.param_groups, hyper, state_dict["param_groups"]):
        g.update(h)
        if "param_names" in s:  # torch's: a checkpoint's names replace the group's, its lack keeps them
            g["param_names"] = list(s["param_names"])
    steps = {idx: int(float(st["step"])) for idx, st in saved.items() if "step" in st}
    # each param's step count, torch's state mirror made again, this rank back in step
    parts.ledger.loaded(torch_state, steps)
    parts.guard.record()  # with remainders a load writes the params' high halves
    parts.guard.hold_masters(held)  # the model's weights may be loaded next
    keep_unowned(torch_state, unowned_entries(state_dict))
