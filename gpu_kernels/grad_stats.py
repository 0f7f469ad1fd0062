"""Gradient statistics for validation: global sum of squares and a non-finite flag over a list of
grads, bitwise reproducible; torch's clip coefficient from them, on the device.

Invariant: two stages and no float atomics (fp32 per lane, fp64 partials per chunk, summed in slot
order), so the bits never depend on which program finishes first. Design notes: docs/internals.md."""

import torch

from . import _runtime
from ._runtime import lazy_jit

tl = _runtime.language()

_GRAD_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_META = 2  # numel, address

# stage 1 streams one tensor: bigger chunks than Adam's keep the partials few (stage 2 is a
# single program); stage 2 reads REDUCE_BLOCK partials per step.
LAUNCH_CONFIG = {
    "cuda": dict(BLOCK=2048, ITERS=8, num_warps=8, REDUCE_BLOCK=8192, reduce_warps=16),
    "cpu": dict(BLOCK=4096, ITERS=1, num_warps=4, REDUCE_BLOCK=4096, reduce_warps=4),
}

_tables = _runtime.TableCache()


@lazy_jit
def _sum_squares_chunk(g_ptr, start, numel, MASKED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        if MASKED:
            g = tl.load(g_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + offs).to(tl.float32)
        acc += g * g
        # NaN fails every ordered compare; ±inf is the only value above FLT_MAX
        bad = tl.maximum(bad, ((g != g) | (tl.abs(g) > 3.4028234663852886e38)).to(tl.int32))
    return acc, bad


@lazy_jit
def _grad_stats_partials_kernel(
    meta_ptr,
    chunk_ptr,
    partial_sq_ptr,
    partial_flag_ptr,
    slot_offset,
    META: tl.constexpr,
    GRAD_CODE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    # program_id is int32: widen before it scales anything
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(chunk_ptr + 2 * pid)
    chunk = tl.load(chunk_ptr + 2 * pid + 1)
    row = meta_ptr + tensor * META
    numel = tl.load(row)
    if GRAD_CODE == 1:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    elif GRAD_CODE == 2:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float16))
    if ALIGNED:
        # loaded addresses carry no alignment facts; this keeps 16-byte vector loads
        g_ptr = tl.multiple_of(g_ptr, 16)

    start = chunk * (BLOCK * ITERS)
    # whole chunks run unmasked (a mask on `offs < numel` would break vectorisation)
    if start + BLOCK * ITERS <= numel:
        acc, bad = _sum_squares_chunk(g_ptr, start, numel, False, BLOCK, ITERS)
    else:
        acc, bad = _sum_squares_chunk(g_ptr, start, numel, True, BLOCK, ITERS)
    slot = slot_offset + pid
    tl.store(partial_sq_ptr + slot, tl.sum(acc.to(tl.float64), axis=0))
    tl.store(partial_flag_ptr + slot, tl.max(bad, axis=0))


@lazy_jit
def _grad_stats_combine_kernel(
    partial_sq_ptr, partial_flag_ptr, n_partials, sum_sq_ptr, found_inf_ptr, BLOCK: tl.constexpr
):
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    # a while loop rather than range(0, n_partials, BLOCK): triton<3.9's interpreter cannot
    # iterate over a range bounded by a runtime argument
    start = n_partials * 0
    while start < n_partials:
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_partials
        acc += tl.load(partial_sq_ptr + offs, mask=mask, other=0.0)
        bad = tl.maximum(bad, tl.load(partial_flag_ptr + offs, mask=mask, other=0))
        start += BLOCK
    tl.store(sum_sq_ptr, tl.sum(acc, axis=0).to(sum_sq_ptr.dtype.element_ty))
    tl.store(found_inf_ptr, tl.max(bad, axis=0).to(found_inf_ptr.dtype.element_ty))


def _check_grads(grads):
    if not isinstance(grads, (list, tuple)):
        raise TypeError(f"grads must be a list or tuple of tensors, got {type(grads).__name__}")
    device = None
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}] must be a tensor, got {type(g).__name__}")
        if g.dtype not in _GRAD_DTYPES:
            raise TypeError(f"grads[{i}] has dtype {g.dtype}; expected one of: float32, bfloat16, float16")
        if device is None:
            device = g.device
        elif g.device != device:
            raise ValueError(
                f"grads[{i}] is on {g.device} but grads[0] is on {device}; "
                "one launch needs every tensor on the same device"
            )
        if not g.is_contiguous():
            raise ValueError(f"grads[{i}] is not contiguous; the kernel reads memory linearly")
    return device


def grad_stats(grads, *, sum_dtype=torch.float32):
    """(sum_of_squares, found_inf) over `grads` as 0-dim device tensors (see the module doc).

    grads: list of contiguous fp32/bf16/fp16 tensors on one device (mixed dtypes allowed).
    sum_of_squares has `sum_dtype` (float32, or float64 to keep the fp64 total); found_inf is
    fp32, 1.0 when any element is ±inf or NaN. Nothing is read back to the host. One stage-1
    launch per grad dtype present (and per 16-byte alignment), one stage-2 launch.
    """
    device = _check_grads(grads)
    if sum_dtype not in (torch.float32, torch.float64):
        raise TypeError(f"sum_dtype must be torch.float32 or torch.float64, got {sum_dtype}")
    if device is None:
        return torch.zeros((), dtype=sum_dtype), torch.zeros((), dtype=torch.float32)
    _runtime.require_runtime(device)
    config = _runtime.launch_config(LAUNCH_CONFIG, device)
    chunk = config["BLOCK"] * config["ITERS"]

    # groups in order of first appearance, so the slot order is a function of the list alone
    groups = {}
    for g in grads:
        ptr = g.data_ptr()
        groups.setdefault((_GRAD_DTYPES[g.dtype], _runtime.is_aligned(ptr)), []).append((g.numel(), ptr))
    # tables, buffers and launches on the grads' device and its current stream, not the
    # current device's
    with _runtime.device_guard(device):
        launches = []
        n_partials = 0
        for (grad_code, aligned), group in groups.items():
            key = (device, chunk, tuple(group))
            table = _tables.get(key, lambda: _build_table(group, chunk), device).get()
            meta, chunks = table[: len(group) * _META], table[len(group) * _META :]
            n_chunks = chunks.numel() // 2
            if n_chunks:
                launches.append((grad_code, aligned, meta, chunks, n_chunks, n_partials))
                n_partials += n_chunks

        sum_sq = torch.empty((), dtype=sum_dtype, device=device)
        found_inf = torch.empty((), dtype=torch.float32, device=device)
        # every slot is written by exactly one program before stage 2 reads it
        partial_sq = torch.empty(max(n_partials, 1), dtype=torch.float64, device=device)
        partial_flag = torch.empty(max(n_partials, 1), dtype=torch.int32, device=device)
        if n_partials == 0:
            partial_sq.zero_()
            partial_flag.zero_()
        for grad_code, aligned, meta, chunks, n_chunks, slot_offset in launches:
            _grad_stats_partials_kernel.launch(
                device,
                (n_chunks,),
                meta,
                chunks,
                partial_sq,
                partial_flag,
                slot_offset,
                META=_META,
                GRAD_CODE=grad_code,
                ALIGNED=aligned,
                BLOCK=config["BLOCK"],
                ITERS=config["ITERS"],
                num_warps=config["num_warps"],
                enable_fp_fusion=False,
            )
        _grad_stats_combine_kernel.launch(
            device,
            (1,),
            partial_sq,
            partial_flag,
            max(n_partials, 1),
            sum_sq,
            found_inf,
            BLOCK=config["REDUCE_BLOCK"],
            num_warps=config["reduce_warps"],
            enable_fp_fusion=False,
        )
    return sum_sq, found_inf


def _build_table(group, chunk):
    meta = torch.tensor(group, dtype=torch.int64).reshape(len(group), _META)
    chunks = _runtime.chunk_rows([numel for numel, _ in group], chunk)
    return torch.cat([meta.flatten(), chunks.flatten()])


def clip_coef(sum_sq, max_norm):
    """torch.nn.utils.clip_grad_norm_'s coefficient, min(1, max_norm / (‖g‖ + 1e-6)), from a
    sum of squares, as a 0-dim fp32 tensor on sum_sq's device (no host sync)."""
    if not isinstance(sum_sq, torch.Tensor):
        raise TypeError(f"sum_sq must be a tensor (grad_stats' first result), got {type(sum_sq).__name__}")
    max_norm = float(max_norm)
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    total_norm = sum_sq.float().sqrt()
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def grad_stats_reference(grads):
    """grad_stats in plain torch: fp64 sum of squares and torch's non-finite check."""
    if len(grads) == 0:
        return torch.zeros(()), torch.zeros(())
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    finite = torch.ones((), dtype=torch.bool, device=grads[0].device)
    for g in grads:
        g64 = g.double()
        total = total + (g64 * g64).sum()
        finite = finite & torch.isfinite(g).all()
    return total.float(), (~finite).float()
