"""The host tier's compressed state: how a bank is laid out for a StateFormat, and a bf16 subgroup's
fp32 master kept as remainders (bf16 high half + int16 low half) in banks, swap files and the
model's own param.

    master | m | v | [vmax]  (page-aligned: the state block a swap moves)  | [copy]

All banks have one capacity, so any bank serves any subgroup. Bytes per element and q8's absmax
regions: docs/internals.md."""

from __future__ import annotations

import torch

from hybrid_opt.shm import CACHE_LINE, PAGE, ArenaLayout, align_up
from hybrid_opt.state.layout import PAGE_CUT
from hybrid_opt.state.state_format import ABSMAX, Q8, Q8_ZERO_CODE, q8_blocks

# a moment's bank region
MOMENT_REGION = {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "vmax"}


def bank_layout(
    capacity: int,
    fmt,
    amsgrad: bool,
    copy_dtype,
    rem_mode: str,
    q8_mode: str = "none",
    small_capacity: int | None = None,
    pooled_copy: bool = False,
):
    """(regions {name: byte offset}, io_bytes, bank bytes) for banks of `capacity` elements.
    pooled_copy: the model-dtype copy is not a bank region (its "copy" offset is -1) but one of the
    arena's copy slots, lent to the banks no subgroup has committed (BankPool.copy_of).
    rem_mode: "none", "all" (every subgroup keeps remainders: no fp32 region) or "some".
    q8_mode: "none" (no quantized subgroup: q8 moments are fp32), "all" (every subgroup is
    quantized: 1-byte code regions) or "some": subgroups of small params (at most
    `small_capacity` elements, default `capacity`) keep fp32 in place of q8 moments, in the same
    region, so a q8 moment's region holds `capacity` codes or `small_capacity` fp32 elements,
    whichever is larger (the layout cuts small params' subgroups at a quarter of the size, so
    the codes' width decides: layout.py). With "all"/"some" each q8 moment has an absmax region
    beside."""
    bank = ArenaLayout()
    # where the layout cuts subgroups on pages (layout.PAGE_CUT), every region starts on one, at
    # no cost (each region is whole pages): state_dict() maps a param's pieces of several banks
    # (or nvme slots, laid out alike) side by side (mapped.py)
    align = PAGE if capacity % PAGE_CUT == 0 else CACHE_LINE
    if rem_mode == "all":
        regions = {"rem": bank.add("rem", capacity * 2, align)}
    else:
        regions = {"p": bank.add("p", capacity * 4, align)}
        if rem_mode == "some":
            regions["rem"] = regions["p"]

    small = capacity if small_capacity is None else small_capacity

    def nbytes(dt):
        if dt != Q8:
            return capacity * dt.itemsize
        if q8_mode == "none":
            return capacity * 4
        return max(capacity, 4 * small) if q8_mode == "some" else capacity

    ms, vs = nbytes(fmt.exp_avg_dtype), nbytes(fmt.exp_avg_sq_dtype)
    regions["m"] = bank.add("m", ms, align)
    regions["v"] = bank.add("v", vs, align)
    regions["vmax"] = bank.add("vmax", vs, align) if amsgrad else 0
    if q8_mode != "none":
        for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            if fmt.is_q8(name):
                region = MOMENT_REGION[name] + ABSMAX
                regions[region] = bank.add(region, q8_blocks(capacity) * 4, CACHE_LINE)
    # the state block (master..vmax) is what a swap moves: page-aligned for O_DIRECT
    io_bytes = bank.pad(PAGE)
    if pooled_copy:
        regions["copy"] = -1
    else:
        regions["copy"] = bank.add("copy", capacity * 2) if copy_dtype is not None else 0
    return regions, io_bytes, align_up(bank.nbytes, PAGE)


class TensorParams:
    """A contiguous tensor seen as a subgroup's model elements (layout.Subgroup's read_into /
    write / numel / dtype / device): what a caller outside the optimizer hands the tier."""

    def __init__(self, t: torch.Tensor):
        self.t, self.numel, self.dtype, self.device = t.view(-1), t.numel(), t.dtype, t.device

    def read_into(self, dst: torch.Tensor, non_blocking: bool = False) -> None:
        dst.copy_(self.t, non_blocking=non_blocking)

    def write(self, src: torch.Tensor) -> None:
        with torch.no_grad():
            self.t.copy_(src.reshape(-1))


def check_params(params, numels: list, fmt, copy_dtype) -> tuple:
    """(per subgroup: whether it keeps remainders — a bf16 param, fmt.store_param_remainders;
    the params as model elements: layout.Subgroups, or contiguous tensors wrapped). A tier with
    no bf16 param keeps fp32 masters: remainders change nothing there."""
    if not fmt.store_param_remainders:
        return [False] * len(numels), None
    if params is None or len(params) != len(numels):
        raise ValueError(
            f"remainders=True needs params=: the model's elements of each of the "
            f"{len(numels)} subgroups, in numels' order (the masters' high halves), "
            f"got {None if params is None else len(params)}"
        )
    seen = []
    for k, (p, n) in enumerate(zip(params, numels)):
        if isinstance(p, torch.Tensor):
            if p.numel() != n or not p.is_contiguous():
                raise ValueError(
                    f"params[{k}] must be a contiguous tensor of {n} elements "
                    f"(subgroup {k}'s params), got {tuple(p.shape)}"
                )
            p = TensorParams(p)
        elif getattr(p, "numel", None) != n or not hasattr(p, "write"):
            raise ValueError(
                f"params[{k}] must be a contiguous tensor or a layout.Subgroup of {n} "
                f"elements, got {type(p).__name__}"
            )
        seen.append(p)
    params = seen
    flags = [fmt.remainders_for(p.dtype) for p in params]
    if any(flags) and copy_dtype != torch.bfloat16:
        raise ValueError(
            f"remainders=True with bf16 params needs a bf16 host tier "
            f"(copy_dtype=torch.bfloat16), got copy_dtype={copy_dtype}: the bank's "
            f"bf16 copy region holds the masters' high halves"
        )
    return flags, (params if any(flags) else None)


class StateBanks:
    """A HostTier's banks in its arena: views of their regions, the state as stored (fp32 master,
    or remainders) and its encode/decode, and which banks are still unwritten (populated in
    the background: a bank's first use waits for its pages)."""

    def __init__(
        self,
        arena,
        *,
        numels: dict,
        fmt,
        amsgrad: bool,
        copy_dtype,
        remainders: dict,
        params: dict | None,
        regions: dict,
        bank_offset: int,
        bank_stride: int,
        io_bytes: int,
        n_banks: int,
        quantized: dict,
        copy_of: dict | None = None,
        copy_offset: int = 0,
        copy_stride: int = 0,
    ):
        """`numels`, `remainders`, `params`, `quantized`: by subgroup id (HostTier's). `copy_of`:
        the pool's {bank: copy slot} (BankPool.copy_of, kept by it) where the copies are in copy
        slots at `copy_offset` + slot x `copy_stride` of the arena, not in the banks."""
        self.arena = arena
        self.numels, self.fmt, self.amsgrad, self.copy_dtype = dict(numels), fmt, amsgrad, copy_dtype
        # per subgroup, its format: q8 moments fp32 where its params are small (layout.py)
        self.formats = {sg: fmt.for_subgroup(q) for sg, q in quantized.items()}
        self._remainders = dict(remainders)
        # each remainder subgroup's model param (the high halves); {} when none keeps remainders
        self._params: dict = params if params is not None else {}
        self._regions, self._bank_offset, self._bank_stride = dict(regions), bank_offset, bank_stride
        self.io_bytes = io_bytes
        self._copy_of, self._copy_offset, self._copy_stride = copy_of, copy_offset, copy_stride
        # banks no one has written yet: the arena's pages are zero, load_state need not zero them
        self._fresh = set(range(n_banks))

    @property
    def bank_offset(self) -> int:
        """Byte offset of bank 0 in the arena (read-only)."""
        return self._bank_offset

    @property
    def bank_stride(self) -> int:
        """Bytes from one bank to the next (read-only): a bank's size in the arena."""
        return self._bank_stride

    @property
    def remainders(self) -> dict:
        """{subgroup id: whether it keeps its master as remainders} (a copy)."""
        return dict(self._remainders)

    def keeps_remainders(self, sg: int) -> bool:
        return self._remainders[sg]

    def view(self, bank: int, region: str, numel: int, dtype) -> torch.Tensor:
        """`numel` elements of `dtype` at `region` of `bank` (a view into the arena)."""
        return self.arena.tensor(
            self._bank_offset + bank * self._bank_stride + self._regions[region], numel, dtype
        )

    @property
    def pools_copies(self) -> bool:
        """Whether the model-dtype copies are pooled slots lent to banks (a q8 tier with exact
        rollback), not bank regions."""
        return self._copy_of is not None

    def copy_addr(self, bank: int | None) -> int:
        """Byte offset in the arena of the copy slot `bank` holds; -1 where the copies are bank
        regions (no copy slots), or for no bank (in place)."""
        if self._copy_of is None or bank is None:
            return -1
        return self._copy_offset + self._copy_of[bank] * self._copy_stride

    def _copy_view(self, bank: int, numel: int, dtype) -> torch.Tensor:
        """The model-dtype copy `bank` holds (its region, or the copy slot lent to it)."""
        if self._copy_of is None:
            return self.view(bank, "copy", numel, dtype)
        return self.arena.tensor(self.copy_addr(bank), numel, dtype)

    def region_offset(self, region: str) -> int:
        """Byte offset of `region` inside a bank (and inside an nvme slot, laid out alike)."""
        return self._regions[region]

    def state_block(self, bank: int) -> torch.Tensor:
        """The bytes a swap moves: the bank's first io_bytes (master..vmax)."""
        return self.arena.tensor(self._bank_offset + bank * self._bank_stride, self.io_bytes, torch.uint8)

    def wait_populated(self, banks, timeout_s: float) -> None:
        """Banks the background population has not reached yet are waited for, so no step
        pays first-touch faults (for as long as the population progresses: a stall past the worker
        timeout raises); they are written from now on."""
        self.arena.wait_populated_ranges(
            [(self._bank_offset + b * self._bank_stride, self._bank_stride) for b in banks], timeout_s
        )
        self._fresh.difference_update(banks)

    def take_fresh(self, bank: int) -> bool:
        """Whether `bank` was never written (its pages still zero); it is written from now on."""
        fresh = bank in self._fresh
        self._fresh.discard(bank)
        return fresh

    def quantized(self, sg: int) -> bool:
        """Whether subgroup `sg` keeps a q8 moment (its pieces are stepped by the q8 kernel)."""
        return self.formats[sg].quantized_moments

    def has_copy(self, bank: int) -> bool:
        """Whether `bank` holds a model-dtype copy: its region, or a copy slot (copy slots: the
        banks no subgroup has committed)."""
        return self._copy_of is None or bank in self._copy_of

    def copy_addrs(self, in_bank: int, out_bank: int | None) -> tuple:
        """A step's (in, out) copy: arena offsets of the copy slots it reads the high half from
        and writes the new copy to (-1: the banks' regions). A committed in bank holds none: the
        step's out slot holds the committed high half then (fill_high), stepped in place."""
        out = self.copy_addr(out_bank)
        return (self.copy_addr(in_bank) if self.has_copy(in_bank) else out), out

    def stored_state(self, bank: int, sg: int, high: bool = True, high_bank: int | None = None) -> dict:
        """The regions a subgroup's state occupies in `bank`, as stored: param (fp32 master) or
        high (bf16 high half, the copy region) + remainder (int16); the moments (a q8 one: its
        uint8 codes under its name, its fp32 absmaxes under the name + "_absmax"). A committed
        bank with no copy slot: high is the model's param (where the committed high half is) read
        into `high_bank`'s copy slot (a free bank's, lent by the caller), else into a new tensor;
        `high=False` leaves it out."""
        n, fmt = self.numels[sg], self.formats[sg]
        if self._remainders[sg]:
            out = {"remainder": self.view(bank, "rem", n, torch.int16)}
            if high and self.has_copy(bank):
                out["high"] = self._copy_view(bank, n, torch.bfloat16)
            elif high:
                if high_bank is not None:
                    out["high"] = self._copy_view(high_bank, n, torch.bfloat16)
                else:
                    out["high"] = torch.empty(n, dtype=torch.bfloat16)
                self._params[sg].read_into(out["high"])
        else:
            out = {"param": self.view(bank, "p", n, torch.float32)}
        for name, dtype in fmt.stored_moments(self.amsgrad).items():
            if name.endswith(ABSMAX):
                region = MOMENT_REGION[name[: -len(ABSMAX)]] + ABSMAX
                out[name] = self.view(bank, region, q8_blocks(n), dtype)
            else:
                out[name] = self.view(bank, MOMENT_REGION[name], n, dtype)
        return out

    def zero_moments(self, stored: dict, sg: int) -> None:
        """The moments of `stored` (stored_state's) set to zero: a q8 exp_avg's codes are the
        signed map's zero code (127), not 0 (which is -0.99 x a zero absmax: -0.0)."""
        for name, t in stored.items():
            if name in MOMENT_REGION and self.formats[sg].is_q8(name):
                t.fill_(Q8_ZERO_CODE[name])
            elif name in MOMENT_REGION or name.endswith(ABSMAX):
                t.zero_()

    def bank_state(self, bank: int, sg: int) -> dict:
        """state()'s keys: param (the fp32 master: a view, or decoded into a new tensor for a
        remainder subgroup), exp_avg, exp_avg_sq[, max_exp_avg_sq] (views)."""
        st = self.stored_state(bank, sg)
        if self._remainders[sg]:
            import cpu_kernels

            master = cpu_kernels.decode_remainder(st.pop("high"), st.pop("remainder"))
            st = {"param": master, **st}
        return st

    def commit_views(self, bank: int, sg: int) -> dict:
        """What on_commit sees: the new fp32 master, and the model-dtype copy when written. A
        subgroup that keeps remainders gives only param_copy (the bf16 param: the master's high
        half) — decoding its master at every commit would cost a pass nobody reads."""
        if self._remainders[sg]:
            return {"param_copy": self._copy_view(bank, self.numels[sg], torch.bfloat16)}
        out = {"param": self.view(bank, "p", self.numels[sg], torch.float32)}
        if self.copy_dtype is not None:  # copy slots: taken before the commit hands the slot on
            out["param_copy"] = self._copy_view(bank, self.numels[sg], self.copy_dtype)
        return out

    def store_master(self, bank: int, sg: int, master, stored: dict | None = None) -> torch.Tensor | None:
        """Writes an fp32 master into `bank` (`master`: a tensor, or the model's elements —
        layout.Subgroup — read straight into the bank); returns the bf16 high half for the
        model's param when the subgroup keeps remainders (the caller writes it once the state
        stands). `stored`: stored_state(bank, sg) as the caller holds it (a committed bank's high
        half, with copy slots, is a tensor of its own: the caller writes that one into the model)."""
        st = self.stored_state(bank, sg) if stored is None else stored
        if not isinstance(master, torch.Tensor):
            if not self._remainders[sg]:
                master.read_into(st["param"])  # no gathered copy of the params first
                return None
            master = master.read()
        if not self._remainders[sg]:
            st["param"].copy_(master.reshape(-1))
            return None
        import cpu_kernels

        high, rem = cpu_kernels.encode_remainder(master.detach().reshape(-1).float().cpu().contiguous())
        st["remainder"].copy_(rem)
        st["high"].copy_(high)
        return high

    def write_param(self, sg: int, high: torch.Tensor) -> None:
        """The model's param takes the encoded high half (on CUDA an H2D copy): it differs from
        master.to(torch.bfloat16) only on exact ties (rounded away from zero, not to even)."""
        self._params[sg].write(high)

    def read_high(self, sg: int, bank: int) -> None:
        """A remainder subgroup's high half (the model's param) into `bank`'s copy region, now:
        its file holds only the low halves."""
        self._params[sg].read_into(self._copy_view(bank, self.numels[sg], torch.bfloat16))

    def refill_high(self, sg: int, addr: int, offset: int, numel: int) -> None:
        """Elements [offset, offset + numel) of the committed high half (the model's param) into
        the copy slot at arena offset `addr`: a piece stepped in place there is sent again to a
        new worker (the one that died may have written part of it)."""
        high = torch.empty(self.numels[sg], dtype=torch.bfloat16)
        self._params[sg].read_into(high)
        self.arena.tensor(addr + offset * 2, numel, torch.bfloat16).copy_(high[offset : offset + numel])

    def fill_high(self, sg: int, bank: int, stager_for):
        """nvme with remainders: the model's param (the committed master's high half; the file
        holds only the low half) into `bank`'s copy region before the step reads it. CPU: a
        copy now (returns None); CUDA: a D2H copy on the grads' side stream (returns its event;
        the caller sends the step's tasks only once it has landed). stager_for(src): the
        stager for the param's device, or None (HostIO.stager_for)."""
        dst = self._copy_view(bank, self.numels[sg], torch.bfloat16)
        src = self._params[sg]
        stager = stager_for(src)
        if stager is None:
            src.read_into(dst)
            return None
        return stager.copy(lambda: src.read_into(dst, non_blocking=True))


def _independent_moment_dtypes() -> bool:
    """Whether this build of cpu_kernels steps exp_avg and exp_avg_sq of different dtypes
    (its AdamArgs has exp_avg_sq_dtype)."""
    from cpu_kernels import _lib

    return any(name == "exp_avg_sq_dtype" for name, *_ in _lib.AdamArgs._fields_)
