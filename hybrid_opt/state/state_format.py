"""How the optimizer state is stored: the moments' dtypes (fp32, bf16, `"q8"`) and the fp32 master's
encoding (`store_param_remainders`).

One StateFormat serves every tier; its byte counts are what the scheduler, the cost model and
`hybrid-opt plan` count. Invariant: the update always uses the fp32 moments before they are
rounded or quantized for storage. Design notes: docs/internals.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Q8 = "q8"
MOMENT_DTYPES = (torch.float32, torch.bfloat16, Q8)
Q8_BLOCK = 256  # elements per absmax
Q8_MIN_NUMEL = 4096  # smaller params keep fp32 moments (bitsandbytes' and torchao's rule)
Q8_BYTES = 1 + 4 / Q8_BLOCK  # a code and its share of the block's fp32 absmax


def q8_blocks(numel: int) -> int:
    """The absmax count of `numel` elements of a q8 moment (the last block may be partial)."""
    return -(-numel // Q8_BLOCK)


def q8_quantized(p, quantize: bool) -> bool:
    """Whether param `p`'s q8 moments are q8 under a q8 format (`quantize`): by its global element
    count, so every rank of a sharded param (one whose part is small or empty too) keeps one
    process's format and state_dict keys (DCP pairs them by key)."""
    return quantize and p.numel() >= Q8_MIN_NUMEL


def q8_absmax_shape(shape) -> tuple:
    """The shape of a q8 moment's absmax for a param of `shape`, shaped like the param where its
    blocks allow: a param whose last dim holds whole blocks (or a 1-D one) gets the param's shape
    with that dim counted in blocks — absmax[..., k] scales codes[..., 256k : 256k + 256], and a
    dim-0 cut of the param at any world size cuts its absmax alike (a DTensor's state reshards
    with it); any other param one absmax per block of its flat index, (ceil(numel / 256),)."""
    shape = tuple(shape)
    if len(shape) == 1 or (len(shape) > 1 and shape[-1] % Q8_BLOCK == 0):
        return shape[:-1] + (q8_blocks(shape[-1]),)
    return (q8_blocks(math.prod(shape)),)


# a zero moment's code: the index of 0.0 in the signed map (exp_avg) and the unsigned one
Q8_ZERO_CODE = {"exp_avg": 127, "exp_avg_sq": 0, "max_exp_avg_sq": 0}
ABSMAX = "_absmax"  # a q8 moment's absmax tensor: the moment's name + this


def stored_numel(name: str, numel: int) -> int:
    """The element count of stored tensor `name` of a subgroup of `numel` elements: one per
    element, one per block of 256 for a q8 moment's absmax."""
    return q8_blocks(numel) if name.endswith(ABSMAX) else numel


def absmaxes_of(state: dict) -> dict:
    """The q8 absmax tensors of a tier's `state` (its `<moment>_absmax` entries)."""
    return {k: v for k, v in state.items() if k.endswith(ABSMAX)}


def _itemsize(dt) -> float:
    return Q8_BYTES if dt == Q8 else dt.itemsize


@dataclass(frozen=True)
class StateFormat:
    exp_avg_dtype: torch.dtype | str = torch.float32  # str: Q8
    exp_avg_sq_dtype: torch.dtype | str = torch.float32
    store_param_remainders: bool = False

    def __post_init__(self):
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            dt = getattr(self, name)
            if dt not in MOMENT_DTYPES:
                raise TypeError(
                    f'{name} must be torch.float32 or torch.bfloat16 (or "q8": 8-bit '
                    f"blockwise moments), got {dt!r}"
                )
        if not isinstance(self.store_param_remainders, bool):
            raise TypeError(
                f"store_param_remainders must be a bool, got {type(self.store_param_remainders).__name__}"
            )

    @property
    def compressed_moments(self) -> bool:
        return self.exp_avg_dtype != torch.float32 or self.exp_avg_sq_dtype != torch.float32

    @property
    def quantized_moments(self) -> bool:
        """Whether a moment is q8 (for params of at least Q8_MIN_NUMEL elements)."""
        return Q8 in (self.exp_avg_dtype, self.exp_avg_sq_dtype)

    def unquantized(self) -> "StateFormat":
        """The format of a param too small to quantize: its q8 moments fp32."""
        if not self.quantized_moments:
            return self
        return StateFormat(
            torch.float32 if self.exp_avg_dtype == Q8 else self.exp_avg_dtype,
            torch.float32 if self.exp_avg_sq_dtype == Q8 else self.exp_avg_sq_dtype,
            self.store_param_remainders,
        )

    def for_subgroup(self, quantized: bool) -> "StateFormat":
        """The format a subgroup keeps: this one where its params are quantized (layout's
        Subgroup.quantized), else `unquantized()`."""
        return self if quantized else self.unquantized()

    def is_q8(self, name: str) -> bool:
        """Whether state `name` ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") is stored as q8."""
        return name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and self.dtype_of(name) == Q8

    def stored_moments(self, amsgrad: bool) -> dict:
        """{name: dtype} of the moment tensors a tier stores: a q8 moment `name` is its uint8
        codes under `name` and its fp32 absmax under `name + "_absmax"` (`stored_numel`)."""
        out: dict[str, torch.dtype | str] = {}
        for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            if self.is_q8(name):
                out[name], out[name + ABSMAX] = torch.uint8, torch.float32
            else:
                out[name] = self.dtype_of(name)
        return out

    @property
    def plain(self) -> bool:
        """fp32 moments, fp32 masters: the format torch's AdamW keeps."""
        return not self.compressed_moments and not self.store_param_remainders

    def check_rollback(self, rollback: str) -> None:
        """rollback='inverse' recomputes the previous state from the new one: bf16 rounding
        loses what it would need."""
        if rollback == "inverse" and self.compressed_moments:
            what = "q8 moments (quantizing" if self.quantized_moments else "bf16 moments (rounding to bf16"
            raise ValueError(
                f"rollback='inverse' cannot undo a step with {what} is not invertible); "
                "use rollback='exact' (the default) or "
                "exp_avg_dtype=exp_avg_sq_dtype=torch.float32"
            )

    def remainders_for(self, param_dtype: torch.dtype) -> bool:
        """Whether a param of `param_dtype` keeps its master as remainders (bf16 params only)."""
        return self.store_param_remainders and param_dtype == torch.bfloat16

    def dtype_of(self, name: str) -> torch.dtype | str:
        """The dtype a tier stores state `name` in: "master" (fp32), "remainder" (int16: a
        master's low half), "exp_avg", "exp_avg_sq", "max_exp_avg_sq"."""
        return {
            "master": torch.float32,
            "remainder": torch.int16,
            "exp_avg": self.exp_avg_dtype,
            "exp_avg_sq": self.exp_avg_sq_dtype,
            "max_exp_avg_sq": self.exp_avg_sq_dtype,
        }[name]

    def moment_bytes(self, amsgrad: bool = False) -> float:
        """Bytes per element of exp_avg, exp_avg_sq and (amsgrad) max_exp_avg_sq (a q8 moment:
        1 + 4/256, its code and its share of the block's absmax)."""
        v = _itemsize(self.exp_avg_sq_dtype)
        return _itemsize(self.exp_avg_dtype) + v + (v if amsgrad else 0)

    def master_bytes(self, param_dtype: torch.dtype, own_master: bool) -> int:
        """Bytes per element the master adds beside the model param: 0 where the param is its
        own master (`own_master`: an fp32 param stepped in place on the device tier), 2 for a
        remainder, else 4 (an fp32 master)."""
        if param_dtype == torch.float32 and own_master:
            return 0
        return 2 if self.remainders_for(param_dtype) else 4

    def state_bytes(self, param_dtype: torch.dtype, amsgrad: bool = False, own_master: bool = False) -> float:
        """Bytes per element of the state a tier stores for a param of `param_dtype`: master
        (or remainder) and moments. On the nvme tier these are the file's bytes (a remainder's
        high half is the model's param, read from it, not stored again)."""
        return self.master_bytes(param_dtype, own_master) + self.moment_bytes(amsgrad)

    def bank_bytes(self, param_dtype: torch.dtype, amsgrad: bool = False) -> float:
        """Bytes per element of a host-tier bank (committed, spare or nvme I/O bank): the state
        plus the model-dtype copy a bf16/fp16 param's bank keeps (with remainders that copy is
        the master's high half, so it is not counted twice)."""
        copy = 0 if param_dtype == torch.float32 else param_dtype.itemsize
        return self.state_bytes(param_dtype, amsgrad) + copy

    def adam_bytes(self, param_dtype: torch.dtype, grad_bytes: int, amsgrad: bool = False) -> float:
        """Bytes one Adam step moves per element (read + written; CPU and GPU Adam are
        memory-bound, so their time is proportional): the fp32 master read and written (an fp32
        param is its own) and a bf16/fp16 param's copy written — or, with remainders, the bf16
        param and its remainder each read and written; the grad read; each moment read and
        written. 28 for fp32 state; 18 for bf16 moments + remainders with bf16 grads."""
        moments = 2 * self.moment_bytes(amsgrad)
        if self.remainders_for(param_dtype):
            master = 2 * (2 + 2)
        elif param_dtype == torch.float32:
            master = 2 * 4
        else:
            master = 2 * 4 + param_dtype.itemsize
        return master + int(grad_bytes) + moments


# ---------------------------------------------------------------- command-line flags
DTYPE_NAMES: dict[str, torch.dtype | str] = {"fp32": torch.float32, "bf16": torch.bfloat16, "q8": Q8}


def add_arguments(ap, remainder_note: str = "") -> None:
    """The three options as command-line flags (`hybrid-opt plan`, the demo)."""
    ap.add_argument(
        "--exp-avg-dtype",
        choices=tuple(DTYPE_NAMES),
        default="fp32",
        help="HybridAdamW(exp_avg_dtype=): the first moment's dtype (default fp32)",
    )
    ap.add_argument(
        "--exp-avg-sq-dtype",
        choices=tuple(DTYPE_NAMES),
        default="fp32",
        help="HybridAdamW(exp_avg_sq_dtype=): the second moment's dtype (default fp32)",
    )
    ap.add_argument(
        "--store-param-remainders",
        action="store_true",
        help="HybridAdamW(store_param_remainders=True): a bf16 param's fp32 master kept "
        "as the bf16 param + an int16 remainder (2 B/param instead of 4)" + remainder_note,
    )


def from_arguments(args) -> StateFormat:
    """The StateFormat of flags parsed by add_arguments."""
    return StateFormat(
        DTYPE_NAMES[args.exp_avg_dtype], DTYPE_NAMES[args.exp_avg_sq_dtype], args.store_param_remainders
    )
