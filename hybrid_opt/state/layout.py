"""Subgroup layout: each param group's parameters of one (device, dtype), cut into subgroups over
their concatenation — packed, and never copied.

A subgroup is at most `subgroup_numel` consecutive elements, held as a list of param slices
(param, offset, numel); it never spans param groups or (device, dtype) buckets. Invariant: every
param keeps its own memory, read and written in place through its slices (`Subgroup.read` /
`write`); with q8 moments a cut never splits a block of 256. Design notes: docs/internals.md."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

from hybrid_opt.distributed.local_shards import is_dtensor, is_sharded, local_of
from hybrid_opt.state.state_format import Q8_BLOCK, q8_quantized


def own_contiguous(p) -> None:
    """A non-contiguous plain param gets contiguous memory of its own (a slice is one 1-D
    range of it); a sharded param's local part is never rebound (model_flat checks it)."""
    if not is_sharded(p) and not p.data.is_contiguous():
        with torch.no_grad():
            p.data = p.data.contiguous()


def model_flat(p) -> torch.Tensor:
    """The 1-D tensor of this rank's elements of param `p`, in p's own memory: a DTensor's
    local shard, a process_group chunk, or the param's data (its own version counter, as
    `p.data` has: the tiers' writes are step()'s, not the user's — storage.py)."""
    if is_sharded(p):
        local = local_of(p)
        if not local.is_contiguous():
            raise ValueError(
                f"a DTensor parameter's local shard must be contiguous (FSDP2's Shard(0) "
                f"shards are), got shape {tuple(local.shape)} stride {local.stride()} "
                f"with placements {tuple(p.placements) if is_dtensor(p) else '?'}: "
                f"shard it on dim 0"
            )
        return local.view(-1)
    return p.data.view(-1)


@dataclass
class ParamSlice:
    """Elements [param_offset, param_offset + numel) of a parameter, at sub_offset in its subgroup."""

    param_index: int  # torch's state_dict numbering: position over all groups
    param: torch.Tensor
    param_offset: int
    sub_offset: int
    numel: int
    view: torch.Tensor | None = None  # the param's elements, in its memory (repoint() sets it)

    def __post_init__(self):
        if self.view is None:
            self.repoint()

    def repoint(self) -> None:
        """Views the param's memory now (it was given new memory: storage.py)."""
        self.view = model_flat(self.param)[self.param_offset : self.param_offset + self.numel]

    def grad_view(self) -> torch.Tensor | None:
        g = local_of(self.param.grad)
        if g is None:
            return None
        return g.reshape(-1)[self.param_offset : self.param_offset + self.numel]

    def grad_address(self) -> tuple | None:
        """(address of this slice's first grad element, grad dtype) where the grad is
        contiguous — what a launch reading `grad_view()` in place would read — else None. No
        tensor is made: the device tier keys its prepared launches on it every step."""
        g = local_of(self.param.grad)
        if g is None or not g.is_contiguous():
            return None
        return g.data_ptr() + self.param_offset * g.element_size(), g.dtype


@dataclass
class Subgroup:
    index: int
    group: int  # param group index
    numel: int
    dtype: torch.dtype
    device: torch.device
    slices: list = field(default_factory=list)
    ready_rank: int = 0  # 0 = grads complete first in backward (about reverse param order)
    quantized: bool = False  # its q8 moments are q8 (its params have at least Q8_MIN_NUMEL elements)
    # write()'s cuts of a whole subgroup (its slices' views, split sizes, which parts are kept), made
    # on first use and forgotten when a slice views new memory (repoint)
    _whole_write: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def _spans(self, a: int, b: int, slices=None):
        """(slice, lo, hi) of each slice overlapping subgroup elements [a, b), [lo, hi) in
        subgroup elements; `slices`: only those (a subset of this subgroup's)."""
        for sl in self.slices if slices is None else slices:
            lo, hi = max(a, sl.sub_offset), min(b, sl.sub_offset + sl.numel)
            if lo < hi:
                yield sl, lo, hi

    def pieces(self, a: int = 0, b: int | None = None, slices=None):
        """(slice view part, start, end) of each slice overlapping subgroup elements [a, b),
        [start, end) relative to a; `slices`: only those (a subset of this subgroup's)."""
        b = self.numel if b is None else b
        for sl, lo, hi in self._spans(a, b, slices):
            yield sl.view[lo - sl.sub_offset : hi - sl.sub_offset], lo - a, hi - a

    def read(self, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Elements [a, b) of the model's params: a view where one slice holds them all (written
        through), else a new contiguous tensor."""
        parts = list(self.pieces(a, b))
        if len(parts) == 1:
            return parts[0][0]
        return (
            torch.cat([v for v, _, _ in parts])
            if parts
            else torch.empty(0, dtype=self.dtype, device=self.device)
        )

    def read_into(
        self, dst: torch.Tensor, a: int = 0, b: int | None = None, non_blocking: bool = False
    ) -> None:
        """dst (b - a elements, any device and float dtype) takes the model's elements [a, b)."""
        parts = list(self.pieces(a, b))
        _copy([dst[lo:hi] for _, lo, hi in parts], [v for v, _, _ in parts], non_blocking)

    def write(
        self, src: torch.Tensor, a: int = 0, b: int | None = None, slices=None, non_blocking: bool = False
    ) -> None:
        """The model's elements [a, b) (of `slices` only, when given) take src's (b - a elements,
        any device and float dtype: converted), in one batched copy."""
        src = src.reshape(-1)
        b = self.numel if b is None else b
        # all of it (every slice live: `slices` is a subset, so as long as all of them): the cuts
        # of the last such write, which are the same every step
        whole = a == 0 and b == self.numel and (slices is None or len(slices) == len(self.slices))
        n = src.numel()
        if whole and self._whole_write is not None and self._whole_write[0] == n:
            _, dsts, sizes, keep = self._whole_write
        else:
            dsts, bounds = [], []  # each piece's destination, and its [lo, hi) in src
            for sl, lo, hi in self._spans(a, b, slices):
                own = lo == sl.sub_offset and hi == sl.sub_offset + sl.numel  # its own view: no tensor made
                dsts.append(sl.view if own else sl.view[lo - sl.sub_offset : hi - sl.sub_offset])
                bounds.append((lo - a, hi - a))
            sizes, keep = _cuts(bounds, n)
            if whole:
                self._whole_write = n, dsts, sizes, keep
        parts = src.split_with_sizes(sizes)
        with torch.no_grad():
            _copy(dsts, [parts[k] for k in keep], non_blocking)

    def repoint(self, sl: ParamSlice) -> None:
        """Slice `sl` of this subgroup views its param's memory now (it was given new memory:
        storage.py); write() cuts anew."""
        sl.repoint()
        self._whole_write = None


def _cuts(bounds: list, numel: int) -> tuple:
    """(sizes, keep): src[lo:hi] for each (lo, hi) of `bounds` (ascending, not overlapping) of a src
    of `numel` elements are src.split_with_sizes(sizes)[k] for k in keep. One split over the pieces
    and the gaps between them makes the views in one call rather than one slicing each."""
    sizes, keep, at = [], [], 0
    for lo, hi in bounds:
        if lo > at:
            sizes.append(lo - at)  # a gap: cut, not kept
        keep.append(len(sizes))
        sizes.append(hi - lo)
        at = hi
    if at < numel:
        sizes.append(numel - at)
    return sizes, keep


def _copy(dsts: list, srcs: list, non_blocking: bool) -> None:
    """dsts[k].copy_(srcs[k]) for all k in one call. A blocking copy between the host and a
    GPU is queued asynchronously and waited for once: one host sync, not one per slice."""
    if not dsts:
        return
    cross = (
        not non_blocking
        and dsts[0].device != srcs[0].device
        and "cuda" in (dsts[0].device.type, srcs[0].device.type)
    )
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0], non_blocking=non_blocking or cross)
    else:
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking or cross)
    if cross:
        gpu = dsts[0].device if dsts[0].device.type == "cuda" else srcs[0].device
        torch.cuda.current_stream(gpu).synchronize()


def layout_group(
    params: list,
    group: int,
    first_index: int,
    subgroup_numel: int,
    first_subgroup: int,
    quantize: bool = False,
) -> list:
    """The subgroups of one param group: its params of each (device, dtype) — and with
    `quantize` (a q8 moment format) of each (device, dtype, quantized) — in param order, cut
    over their concatenation (module docstring). Nothing is copied; a non-contiguous plain
    param is given contiguous memory of its own first."""
    buckets: dict = {}
    for k, p in enumerate(params):
        own_contiguous(p)
        local = local_of(p)
        quantized = q8_quantized(p, quantize)
        buckets.setdefault((local.device, local.dtype, quantized), []).append(
            (first_index + k, p, local.numel())
        )
    subgroups: list = []
    for (device, dtype, quantized), members in buckets.items():
        # small params beside quantized ones keep fp32 in place of q8 moments: cut at a quarter,
        # their moments fit a bank's 1-byte code regions (compressed.bank_layout) — else every
        # bank of the host tier would need 4-byte ones
        numel = max(_ALIGN, subgroup_numel // 4) if quantize and not quantized else subgroup_numel
        subgroups.extend(
            _cut(members, group, device, dtype, numel, first_subgroup + len(subgroups), quantized)
        )
    return subgroups


def auto_subgroup_numel(numel: int, cap: int) -> int:
    """subgroup_numel=None: at most `cap` elements, and small enough that this rank's `numel`
    elements make MIN_SUBGROUPS subgroups — host steps speculate and overlap backward one
    subgroup at a time, so a model (or a rank's shard) cut into 2 or 3 would overlap little —
    but not below MIN_AUTO_SUBGROUP_NUMEL (a worker task's fixed cost)."""
    want = -(-numel // MIN_SUBGROUPS)
    a = _cut_alignment(want)  # a page-cut size: _cut keeps it, and the count MIN_SUBGROUPS
    return max(MIN_AUTO_SUBGROUP_NUMEL, min(cap, -(-want // a) * a))


MIN_SUBGROUPS = 8
MIN_AUTO_SUBGROUP_NUMEL = 1 << 16
_ALIGN = 64  # subgroup sizes in whole cache lines of fp32 (the host tier's bank alignment)


def bank_padding(numels: list) -> float:
    """Elements the host tier's banks hold per element of `numels` (cost_model.Workload's
    bank_padding): every bank has the largest subgroup's capacity (aligned)."""
    total = sum(numels)
    return len(numels) * _align(max(numels)) / total if total else 1.0


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# subgroups of at least PAGE_CUT_FROM elements are cut at multiples of PAGE_CUT: a page of every
# state dtype (2048 bf16/int16 elements, two pages of fp32), so the pieces of a param that spans
# subgroups map side by side as one tensor (mapped.py: state_dict() copies nothing); smaller
# subgroups (tests, tiny models) keep the cache-line cut
PAGE_CUT = mmap.PAGESIZE // 2  # 2048 with 4 KiB pages
PAGE_CUT_FROM = 16 * PAGE_CUT


def _cut_alignment(subgroup_numel: int) -> int:
    return PAGE_CUT if subgroup_numel >= PAGE_CUT_FROM else _ALIGN


def _cut(
    members: list, group: int, device, dtype, subgroup_numel: int, first: int, quantized: bool = False
) -> list:
    """Subgroups over the concatenation of `members` [(param index, param, local numel)]: as
    few as `subgroup_numel` allows, of one size (aligned: _cut_alignment), the last shorter by
    less than one alignment per subgroup — so the tiers' banks and files, sized for the largest, hold
    elements, not padding. A parameter may span several. `quantized`: q8 blocks are never
    split (the size a multiple of 256, a param with a partial last block ends its subgroup:
    module docstring)."""
    total = sum(n for _, _, n in members)
    a = _cut_alignment(subgroup_numel)
    if quantized:
        # whole blocks; on pages, a page of 1-byte codes (2 x PAGE_CUT), so that a param's codes
        # in several subgroups map side by side in state_dict() (mapped.side_by_side)
        a = 2 * PAGE_CUT if a == PAGE_CUT else max(a, Q8_BLOCK)
        if subgroup_numel < Q8_BLOCK:
            raise ValueError(
                f"subgroup_numel={subgroup_numel} cannot hold one q8 block of {Q8_BLOCK} "
                f"elements: give subgroup_numel >= {Q8_BLOCK} with a q8 moment format"
            )
    cap = subgroup_numel // a * a if a > _ALIGN else subgroup_numel
    count = -(-total // cap)
    size = min(cap, -(-(-(-total // count)) // a) * a) if count else cap
    subgroups: list = []
    sg = None
    for idx, p, n in members:
        off = 0
        while off < n:
            if sg is None or sg.numel == size:
                sg = Subgroup(first + len(subgroups), group, 0, dtype, device, quantized=quantized)
                subgroups.append(sg)
            take = min(n - off, size - sg.numel)
            sg.slices.append(ParamSlice(idx, p, off, sg.numel, take))
            sg.numel += take
            off += take
        if quantized and n % Q8_BLOCK:
            sg = None  # its partial last block ends the subgroup: the next param starts a block
    return subgroups


def subgroups_label(sgs) -> str:
    """'subgroups [..] (params [..])' of subgroups `sgs`, for messages."""
    params = sorted({sl.param_index for sg in sgs for sl in sg.slices})
    return f"subgroups {[sg.index for sg in sgs]} (params {params})"


def assign_ready_ranks(subgroups: list) -> None:
    """Grads complete in about reverse parameter order: the last subgroup is ready first."""
    for rank, sg in enumerate(sorted(subgroups, key=lambda s: -s.index)):
        sg.ready_rank = rank


class Layout:
    """The optimizer's layout: its subgroups, each param's index and each param's step count
    (torch's state['step']), over the optimizer's own `param_groups` (read, never written)."""

    def __init__(self, param_groups: list, subgroup_numel: int, amsgrad: bool, quantize: bool = False):
        self.param_groups = param_groups
        self.subgroup_numel = subgroup_numel
        self.amsgrad = amsgrad  # whether the tiers lay out amsgrad's running max
        self.quantize = quantize  # a q8 moment format: quantized and small params apart
        self.subgroups: list = []
        self.index: dict = {}  # param -> its index in the optimizer's order
        self.laid_out: list = []  # the params, in that order (what param_groups must still hold)
        self.steps: list = []  # per-parameter step counts

    def params(self):
        for g in self.param_groups:
            yield from g["params"]

    def add_group(self, gi: int) -> list:
        """Lays out param group `gi` (the last one) after those laid out; its new subgroups."""
        params = self.param_groups[gi]["params"]
        first = len(self.steps)
        for k, p in enumerate(params):
            self.index[p] = first + k
        self.laid_out.extend(params)
        self.steps.extend([0] * len(params))
        sgs = layout_group(params, gi, first, self.subgroup_numel, len(self.subgroups), self.quantize)
        self.subgroups.extend(sgs)
        assign_ready_ranks(self.subgroups)
        return sgs

    def drop_group(self, gi: int, params: int, subgroups: int) -> None:
        """Takes group `gi`'s layout out again (a failed add_param_group): back to `params`
        params and `subgroups` subgroups."""
        for p in self.param_groups[gi]["params"]:
            self.index.pop(p, None)
        del self.laid_out[params:], self.steps[params:]
        del self.subgroups[subgroups:]
        assign_ready_ranks(self.subgroups)

    def check_joining(self, group: dict, defaults: dict, sharded: bool) -> None:
        """add_param_group after construction: refuses a group this layout cannot take."""
        if sharded:
            raise NotImplementedError(
                "add_param_group with process_group=: the new params "
                "would need their chunks laid out on every rank; build "
                "the optimizer with all its param groups"
            )
        if group.get("amsgrad", defaults["amsgrad"]) and not self.amsgrad:
            raise ValueError(
                "add_param_group: an amsgrad group cannot join an optimizer built "
                "without amsgrad; construct it with amsgrad=True"
            )
        have = {p.device for p in self.params()}
        new = {
            t.device
            for t in (i[1] if isinstance(i, tuple) else i for i in group["params"])
            if isinstance(t, torch.Tensor)
        }
        if have and new - have:
            raise ValueError(
                f"add_param_group: all parameters must be on one device; the "
                f"optimizer's are on {sorted(map(str, have))}, the new group's on "
                f"{sorted(map(str, new))}: move the group to that device first"
            )

    def set_amsgrad(self, on: bool) -> None:
        self.amsgrad = on

    def advance_steps(self) -> None:
        """Per-parameter step counts: only params with a grad advance (torch's rule). Walks the
        params in their order (step() checked that param_groups still hold them so), not through
        the index: a tensor's hash is a Python call."""
        steps = self.steps
        for i, p in enumerate(self.laid_out):
            if p.grad is not None:
                steps[i] += 1

    def group_of(self, idx: int) -> dict:
        for g in self.param_groups:
            n = len(g["params"])
            if idx < n:
                return g
            idx -= n
        raise IndexError(idx)

    def param_label(self, i: int) -> str:
        """'parameter i (its name)' for messages: the name where the group has param_names."""
        names = [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]
        return f"parameter {i}" + (f" ({names[i]})" if i < len(names) and names[i] is not None else "")

    def cuda(self) -> bool:
        return bool(self.subgroups) and self.subgroups[0].device.type == "cuda"
