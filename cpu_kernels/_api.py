"""The tensor API of cpu_kernels: argument checks, then one call into the C library."""

from __future__ import annotations

import ctypes
import math

import torch

from . import _lib
from ._lib import DT_BF16, DT_F16, DT_F32, AdamArgs, InverseArgs, lib

_DTYPE_CODES = {torch.float32: DT_F32, torch.bfloat16: DT_BF16, torch.float16: DT_F16}


def _check_tensor(t, name, dtypes, numel=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a CPU tensor, got a tensor on {t.device}; the host "
            f"tier's kernels read host memory (use gpu_kernels for device tensors)"
        )
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (the param's)")
    return t


def _span(t):
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_no_overlap(outs, ins):
    for oname, o in outs:
        ob, oe = _span(o)
        for iname, i in ins:
            ib, ie = _span(i)
            if ob < ie and ib < oe:
                raise ValueError(
                    f"{oname} overlaps {iname}: bank mode writes new state "
                    f"elsewhere and must leave the inputs untouched"
                )


def _check_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    for name, v in (
        ("lr", lr),
        ("beta1", beta1),
        ("beta2", beta2),
        ("eps", eps),
        ("weight_decay", weight_decay),
        ("grad_scale", grad_scale),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(v).__name__}")
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v}")
    if lr < 0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if weight_decay < 0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step count after this update), got {step!r}")


_STATE_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COPY_DTYPES = (torch.bfloat16, torch.float16)


def _check_param(param, remainder, param_copy, out, remainder_out) -> bool:
    """The master: an fp32 param, or (returns True) a bf16 param with its int16 remainders,
    with bank mode's remainder_out; param_copy has no meaning with remainders."""
    if remainder is not None:
        _check_tensor(param, "param", (torch.bfloat16,))
        if param_copy is not None:
            raise ValueError(
                "param_copy cannot be combined with remainder: with remainders "
                "`param` already is the bf16 model param the step writes; drop "
                "param_copy"
            )
        _check_tensor(remainder, "remainder", (torch.int16,), param.numel())
        if out is None and remainder_out is not None:
            raise ValueError(
                "remainder_out is for bank mode only: pass out= as well, or drop "
                "remainder_out to update remainder in place"
            )
        if out is not None and remainder_out is None:
            raise ValueError(
                "bank mode with remainders needs remainder_out= (an int16 tensor "
                "for the new remainders): the inputs must stay unchanged"
            )
        return True
    if remainder_out is not None:
        raise ValueError("remainder_out needs remainder= (the int16 low halves the step reads)")
    if isinstance(param, torch.Tensor) and param.dtype == torch.bfloat16:
        raise TypeError(
            "param must have dtype in ['torch.float32'], got torch.bfloat16: a "
            "bf16 param needs remainder= (its fp32 master's low halves)"
        )
    _check_tensor(param, "param", (torch.float32,))
    return False


def adam_step_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=1.0,
    max_exp_avg_sq=None,
    param_copy=None,
    out=None,
    remainder=None,
    remainder_out=None,
):
    """One Adam (decoupled=False, L2) or AdamW step over contiguous CPU tensors.

    param: fp32 master; grad: fp32/bf16/fp16, multiplied by `grad_scale` in the same pass
    (1/loss_scale x clip coefficient; negative for maximize); exp_avg and exp_avg_sq: each
    fp32 or bf16, independently (rounded to nearest even; the fp32 value before rounding
    feeds the param update); max_exp_avg_sq (amsgrad) in exp_avg_sq's dtype. `param_copy`: a
    bf16/fp16 tensor receiving the updated param, rounded exactly as torch's cast.
    `out=(param_out, exp_avg_out, exp_avg_sq_out[, max_exp_avg_sq_out])`: bank mode, the
    new state is written there (non-temporal stores) and the inputs stay bitwise unchanged.
    `remainder`: int16 low halves of the fp32 master; `param` is then the bf16 model param
    (the master's high half, see `encode_remainder`): the master is decoded, stepped and
    encoded back into param and remainder — or, in bank mode, into out[0] (bf16) and
    `remainder_out` (int16). `param_copy` has no meaning then (param already is the copy).
    `step` is the step count after this update (1 on the first).
    """
    a = adam_call(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale=grad_scale,
        max_exp_avg_sq=max_exp_avg_sq,
        param_copy=param_copy,
        out=out,
        remainder=remainder,
        remainder_out=remainder_out,
    )
    if a.n:
        lib.hybrid_adam_step(ctypes.byref(a))
    return param if out is None else out[0]


def adam_call(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=1.0,
    max_exp_avg_sq=None,
    param_copy=None,
    out=None,
    remainder=None,
    remainder_out=None,
    check=True,
):
    """adam_step_'s arguments as one C call, made but not run: `adam_steps_` runs a list of them
    at once. Checked as adam_step_ checks them; with check=False taken as they are, for a caller
    that checks its tensors once and steps them every step (the device tier on a CPU host). The
    call holds raw addresses: the tensors must outlive its run."""
    if check:
        _check_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
        rem = _check_param(param, remainder, param_copy, out, remainder_out)
        n = param.numel()
        _check_tensor(grad, "grad", _GRAD_DTYPES, n)
        _check_tensor(exp_avg, "exp_avg", _STATE_DTYPES, n)
        _check_tensor(exp_avg_sq, "exp_avg_sq", _STATE_DTYPES, n)
        if max_exp_avg_sq is not None:  # the running max of exp_avg_sq, held in its dtype
            _check_tensor(max_exp_avg_sq, "max_exp_avg_sq", (exp_avg_sq.dtype,), n)
        if param_copy is not None:
            _check_tensor(param_copy, "param_copy", _COPY_DTYPES, n)
        ins = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
        if max_exp_avg_sq is not None:
            ins.append(("max_exp_avg_sq", max_exp_avg_sq))
        if rem:  # in place too: remainder is written, so it must not alias anything it reads
            _check_no_overlap([("remainder", remainder)], ins)
            ins.append(("remainder", remainder))
        if out is not None:
            want = 4 if max_exp_avg_sq is not None else 3
            if not isinstance(out, (tuple, list)) or len(out) != want:
                raise ValueError(
                    f"out must be a tuple of {want} tensors (param_out, exp_avg_out, "
                    f"exp_avg_sq_out{', max_exp_avg_sq_out' if want == 4 else ''})"
                )
            names = (
                "out[0] (param_out)",
                "out[1] (exp_avg_out)",
                "out[2] (exp_avg_sq_out)",
                "out[3] (max_exp_avg_sq_out)",
            )
            like = (param, exp_avg, exp_avg_sq, exp_avg_sq)  # each output in its input's dtype
            for k, t in enumerate(out):
                _check_tensor(t, names[k], (like[k].dtype,), n)
            written = [(names[k], t) for k, t in enumerate(out)]
            if rem:
                _check_tensor(remainder_out, "remainder_out", (torch.int16,), n)
                _check_no_overlap([("remainder_out", remainder_out)], written)
                written.append(("remainder_out", remainder_out))
            _check_no_overlap(written, ins)
        if param_copy is not None:
            _check_no_overlap([("param_copy", param_copy)], ins)
    p = param.data_ptr()
    if out is None:
        m, v = exp_avg.data_ptr(), exp_avg_sq.data_ptr()
        outs = (p, m, v, None if max_exp_avg_sq is None else max_exp_avg_sq.data_ptr())
    else:
        outs = (
            out[0].data_ptr(),
            out[1].data_ptr(),
            out[2].data_ptr(),
            out[3].data_ptr() if len(out) > 3 else None,
        )
    rem_ptr = rem_out_ptr = None
    if remainder is not None:
        rem_ptr = remainder.data_ptr()
        rem_out_ptr = rem_ptr if out is None else remainder_out.data_ptr()
    # positional, in AdamArgs' field order: a third of the time of setting each field by name
    a = AdamArgs(
        param.numel(),
        p,
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        None if max_exp_avg_sq is None else max_exp_avg_sq.data_ptr(),
        *outs,
        None if param_copy is None else param_copy.data_ptr(),
        _DTYPE_CODES[grad.dtype],
        _DTYPE_CODES[exp_avg.dtype],
        0 if param_copy is None else _DTYPE_CODES[param_copy.dtype],
        1 if decoupled else 0,
        step,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        float(grad_scale),
        rem_ptr,
        rem_out_ptr,
        _DTYPE_CODES[exp_avg_sq.dtype],
    )
    return a


def adam_steps_(calls) -> None:
    """Runs `adam_call`'s calls as one: a single parallel region whose threads split the calls'
    elements taken end to end, so a list of small tensors shares the cores and pays one fork and
    join (each call bit for bit as adam_step_ would step it). No call may write what another
    reads or writes. `calls` may also be an AdamArgs array (packed by `_lib.packer`), run as it is."""
    _lib.adam_steps(calls if isinstance(calls, ctypes.Array) else list(calls))


def encode_remainder(master):
    """fp32 master -> (bf16 param, int16 remainder), losslessly (Transformer Engine's
    `store_param_remainders` encoding): the param is the master's high 16 bits rounded to
    nearest with ties away from zero (high half + 1 when the low half's top bit is set), the
    remainder its low 16 bits. 16-bit wrap-around: a finite master >= 0x7F7F8000 in magnitude
    gives an inf param; a NaN with high half 0x7FFF / 0xFFFF and that carry gives -0.0 / +0.0;
    `decode_remainder` restores every one of the 2^32 bit patterns exactly."""
    _check_tensor(master, "master", (torch.float32,))
    param = torch.empty(master.shape, dtype=torch.bfloat16)
    rem = torch.empty(master.shape, dtype=torch.int16)
    if master.numel():
        lib.hybrid_remainder_encode(master.data_ptr(), param.data_ptr(), rem.data_ptr(), master.numel())
    return param, rem


def decode_remainder(param, remainder):
    """(bf16 param, int16 remainder) -> the fp32 master: subtract the encoding's carry (the
    remainder's top bit) from the param's bits in 16-bit wrap-around, join the halves."""
    _check_tensor(param, "param", (torch.bfloat16,))
    _check_tensor(remainder, "remainder", (torch.int16,), param.numel())
    master = torch.empty(param.shape, dtype=torch.float32)
    if param.numel():
        lib.hybrid_remainder_decode(param.data_ptr(), remainder.data_ptr(), master.data_ptr(), param.numel())
    return master


def grad_stats(grad):
    """(sum of squares as a Python float accumulated in fp64, all_finite) in one pass.

    Bitwise the same for any thread count and SIMD level: fixed 16384-element chunks with
    16 fp64 lanes each, combined in a fixed order. all_finite is exact: squares of finite
    fp32 values cannot overflow fp64, so the sum is finite exactly when every element is.
    """
    _check_tensor(grad, "grad", _GRAD_DTYPES)
    out = ctypes.c_double(0.0)
    if (
        grad.numel()
        and lib.hybrid_grad_stats(grad.data_ptr(), _DTYPE_CODES[grad.dtype], grad.numel(), ctypes.byref(out))
        != 0
    ):
        raise MemoryError("grad_stats: could not allocate the per-chunk partial sums")
    return out.value, math.isfinite(out.value)


def grad_stats_many(grads) -> list:
    """grad_stats of each of `grads` (contiguous CPU tensors), bit for bit, in one parallel region
    whose threads split all their chunks: a list of small grads shares the cores."""
    grads = list(grads)
    for k, g in enumerate(grads):
        _check_tensor(g, f"grads[{k}]", _GRAD_DTYPES)
    sums = _lib.grad_sums([(g.data_ptr(), _DTYPE_CODES[g.dtype], g.numel()) for g in grads])
    return [(s, math.isfinite(s)) for s in sums]


def adam_inverse_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=1.0,
):
    """Undo, in place, the adam_step_ that was taken with these same arguments.

    Computed in fp64 from the post-step state (fp32 param and moments). An element whose
    grad or recovered state is not finite is left as it is (never NaN, never zeroed); v is
    clamped at 0. Needs beta1 > 0, beta2 > 0 and lr * weight_decay != 1 (AdamW) to be
    invertible; amsgrad's running max cannot be inverted and has no inverse here.
    """
    _check_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    if beta1 == 0.0 or beta2 == 0.0:
        raise ValueError(
            "the inverse step needs beta1 > 0 and beta2 > 0 (with a zero beta the "
            "previous moment is not recoverable); use rollback='exact'"
        )
    if decoupled and lr * weight_decay == 1.0:
        raise ValueError(
            "the inverse step needs lr * weight_decay != 1 (the decay zeroed the param); use rollback='exact'"
        )
    _check_tensor(param, "param", (torch.float32,))
    n = param.numel()
    _check_tensor(grad, "grad", _GRAD_DTYPES, n)
    _check_tensor(exp_avg, "exp_avg", (torch.float32,), n)
    _check_tensor(exp_avg_sq, "exp_avg_sq", (torch.float32,), n)
    if n == 0:
        return param
    a = InverseArgs()
    a.n = n
    a.param, a.grad, a.exp_avg, a.exp_avg_sq = (
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
    )
    a.grad_dtype = _DTYPE_CODES[grad.dtype]
    a.decoupled = 1 if decoupled else 0
    a.step = step
    a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale = (
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        float(grad_scale),
    )
    lib.hybrid_adam_inverse(ctypes.byref(a))
    return param


def bandwidth_probe_(param, grad, exp_avg, exp_avg_sq, *, split="chunks"):
    """The roofline: Adam's memory traffic (read 4 fp32 arrays, write 3 in place, 28 bytes
    per element) with trivial arithmetic, streamed as the level's kernels stream (32 elements
    a step, software prefetch 1 KiB ahead). `split`: "chunks" splits the work over threads as
    the kernels do (a run of whole 16Ki-element chunks a thread), "contiguous" gives each thread
    one range on 64-element bounds (torch's split); the faster of the two is the roof."""
    if split not in ("chunks", "contiguous"):
        raise ValueError(f"split must be 'chunks' or 'contiguous', got {split!r}")
    n = _check_tensor(param, "param", (torch.float32,)).numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(t, name, (torch.float32,), n)
    lib.hybrid_bw_inplace(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        1 if split == "contiguous" else 0,
    )


def bandwidth_probe_bank_(param, grad, exp_avg, exp_avg_sq, out):
    """The bank-mode roofline: read 4 fp32 arrays, write the 3 of `out` (non-temporal stores
    on AVX-512 and AVX2, as bank mode writes a spare bank), 28 bytes per element, trivial
    arithmetic, split over threads as the kernels split their work."""
    n = _check_tensor(param, "param", (torch.float32,)).numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(t, name, (torch.float32,), n)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError("out must be a tuple of 3 tensors (param_out, exp_avg_out, exp_avg_sq_out)")
    for k, t in enumerate(out):
        _check_tensor(t, f"out[{k}]", (torch.float32,), n)
    lib.hybrid_bw_bank(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out[0].data_ptr(),
        out[1].data_ptr(),
        out[2].data_ptr(),
        n,
    )


_PROBE_KINDS = ("read", "update", "write", "write_nt")  # kernels.h's BW_READ ... BW_WRITE_NT
_PROBE_DTYPES = (torch.float32, torch.int32, torch.bfloat16, torch.float16, torch.int16)


def bandwidth_probe_pattern_(*, read=(), update=(), write=(), write_nt=(), split="chunks", prefetch=1024):
    """The roofline of one access pattern: a kernel's own streams, moved as its register loop
    moves them (32 elements a step, the read and updated streams prefetched `prefetch` elements
    ahead: the kernels' 1024 by default, 0 to 65536), `write_nt` streams with
    non-temporal stores where line-aligned, as bank mode and the param copy leave) with
    trivial arithmetic, split over threads as the kernels split their work (`split="chunks"`)
    or as torch does ("contiguous"). Each argument is a sequence of 1-D tensors of one numel,
    2- or 4-byte elements: `read` is read only (a grad, bank mode's inputs), `update` read and
    written back in place (+1 to each element as an integer of its width, wrapping), `write`
    and `write_nt` written only (every byte set to 0xFF). Returns the XOR of every 16-bit word
    of the `read` tensors, which keeps the reads from being optimised away (and lets a test
    check that each was read)."""
    if split not in ("chunks", "contiguous"):
        raise ValueError(f"split must be 'chunks' or 'contiguous', got {split!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= 65536:
        raise ValueError(f"prefetch must be an int of elements in [0, 65536], got {prefetch!r}")
    groups = dict(zip(_PROBE_KINDS, (read, update, write, write_nt)))
    streams = [(kind, t) for kind, ts in groups.items() for t in ts]
    if not streams:
        raise ValueError("the pattern needs at least one stream")
    if len(streams) > 12:
        raise ValueError(f"at most 12 streams (kernels.h's BW_MAX_STREAMS), got {len(streams)}")
    n = None
    for k, (kind, t) in enumerate(streams):
        _check_tensor(t, f"{kind} stream {k}", _PROBE_DTYPES, n)
        n = t.numel()
    for k, (kind, t) in enumerate(streams):  # only read streams may share bytes
        for j, (other, u) in enumerate(streams[:k]):
            (tb, te), (ub, ue) = _span(t), _span(u)
            if (kind, other) != ("read", "read") and tb < ue and ub < te:
                raise ValueError(f"{kind} stream {k} overlaps {other} stream {j}")
    ns = len(streams)
    ptrs = (ctypes.c_void_p * ns)(*(t.data_ptr() for _, t in streams))
    sizes = (ctypes.c_int * ns)(*(t.element_size() for _, t in streams))
    kinds = (ctypes.c_int * ns)(*(_PROBE_KINDS.index(kind) for kind, _ in streams))
    x = lib.hybrid_bw_pattern(ptrs, sizes, kinds, ns, n, 1 if split == "contiguous" else 0, prefetch)
    if x < 0:  # the checks above should have caught it
        raise RuntimeError("hybrid_bw_pattern refused the stream list")
    return x
