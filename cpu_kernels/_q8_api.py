"""The tensor API of the host tier's q8 Adam step (issue 38): argument checks, then one call into
the C library (cpu_kernels/csrc/q8_*.c), bitwise `q8_reference.q8_adam_step_reference`."""

from __future__ import annotations

import torch

from ._api import _DTYPE_CODES, _check_hyper, _check_no_overlap, _check_param, _check_tensor
from ._lib import DT_F32
from ._q8_lib import BLOCK, DT_Q8, Q8AdamArgs, q8_adam_step_raw
from .q8_reference import Q8Blocks

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COPY_DTYPES = (torch.bfloat16, torch.float16)


def _is_q8(moment) -> bool:
    # q8_reference's Q8Blocks, or gpu_kernels' (the same fields)
    return isinstance(moment, tuple) and hasattr(moment, "codes") and hasattr(moment, "absmax")


def _check_moment(moment, name, n, like=None, like_name=None):
    """A moment's checks: fp32/bf16 tensor or Q8Blocks over n elements; `like`: the format it must
    share (max_exp_avg_sq: exp_avg_sq's; an output: its input's). Returns (kind, tensors)."""
    if like is not None and _is_q8(like) != _is_q8(moment):
        want = "Q8Blocks (codes, absmax)" if _is_q8(like) else f"a {like.dtype} tensor"
        got = (
            "Q8Blocks"
            if _is_q8(moment)
            else type(moment).__name__
            if not isinstance(moment, torch.Tensor)
            else f"a {moment.dtype} tensor"
        )
        raise TypeError(f"{name} must have {like_name}'s format, {want}; got {got}")
    if _is_q8(moment):
        _check_tensor(moment.codes, f"{name}.codes", (torch.uint8,), n)
        blocks = -(-n // BLOCK)
        _check_tensor(moment.absmax, f"{name}.absmax", (torch.float32,))
        if moment.absmax.numel() != blocks:
            raise ValueError(
                f"{name}.absmax has {moment.absmax.numel()} elements; param's {n} elements "
                f"need {blocks} (one per block of {BLOCK})"
            )
        return DT_Q8, [(f"{name}.codes", moment.codes), (f"{name}.absmax", moment.absmax)]
    if not isinstance(moment, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor (fp32 or bf16) or Q8Blocks (codes, absmax), "
            f"got {type(moment).__name__}"
        )
    dtypes = (like.dtype,) if like is not None else _MOMENT_DTYPES
    _check_tensor(moment, name, dtypes, n)
    return _DTYPE_CODES[moment.dtype], [(name, moment)]


def _data(moment):
    return (
        (moment.codes.data_ptr(), moment.absmax.data_ptr()) if _is_q8(moment) else (moment.data_ptr(), None)
    )


def q8_adam_step_(
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
    """One Adam (decoupled=False, L2) or AdamW step over contiguous CPU tensors whose moments may be
    q8, bitwise `q8_reference.q8_adam_step_reference` at every SIMD level and thread count.

    exp_avg and exp_avg_sq: each independently `Q8Blocks(codes uint8 [n], absmax fp32
    [ceil(n/256)])` (signed map for exp_avg, unsigned for exp_avg_sq), or an fp32 / bf16 tensor;
    max_exp_avg_sq (amsgrad) in exp_avg_sq's format. The other arguments are `adam_step_`'s: param
    the fp32 master (or, with `remainder`, the bf16 param whose master is decoded, stepped and
    encoded back); grad fp32/bf16/fp16 times `grad_scale`; `param_copy` a bf16/fp16 copy of the new
    param; `out=(param_out, exp_avg_out, exp_avg_sq_out[, max_exp_avg_sq_out])` bank mode, each
    in its input's format (Q8Blocks for a q8 moment), the inputs left bitwise unchanged, with
    `remainder_out` for the new remainders. The update uses the fp32 moments before they are
    quantized again (each block with a fresh absmax). `step` counts this update (1 on the first).
    """
    _check_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    rem = _check_param(param, remainder, param_copy, out, remainder_out)
    n = param.numel()
    _check_tensor(grad, "grad", _GRAD_DTYPES, n)
    m_code, m_parts = _check_moment(exp_avg, "exp_avg", n)
    v_code, v_parts = _check_moment(exp_avg_sq, "exp_avg_sq", n)
    ins = [("param", param), ("grad", grad), *m_parts, *v_parts]
    if max_exp_avg_sq is not None:
        _, x_parts = _check_moment(max_exp_avg_sq, "max_exp_avg_sq", n, exp_avg_sq, "exp_avg_sq")
        ins += x_parts
    if param_copy is not None:
        _check_tensor(param_copy, "param_copy", _COPY_DTYPES, n)
        _check_no_overlap([("param_copy", param_copy)], ins)
    if rem:  # written in place too: it must not alias anything the step reads
        _check_no_overlap([("remainder", remainder)], ins)
        ins.append(("remainder", remainder))
    inputs = (param, exp_avg, exp_avg_sq, max_exp_avg_sq)
    if out is None:
        outs = inputs
    else:
        want = 4 if max_exp_avg_sq is not None else 3
        if not isinstance(out, (tuple, list)) or len(out) != want or _is_q8(out):
            raise ValueError(
                f"out must be a tuple of {want} (param_out, exp_avg_out, exp_avg_sq_out"
                f"{', max_exp_avg_sq_out' if want == 4 else ''}), each in its input's format"
            )
        names = (
            "out[0] (param_out)",
            "out[1] (exp_avg_out)",
            "out[2] (exp_avg_sq_out)",
            "out[3] (max_exp_avg_sq_out)",
        )
        _check_tensor(out[0], names[0], (param.dtype,), n)
        written = [(names[0], out[0])]
        for k in range(1, want):
            like_name = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[k - 1]
            written += _check_moment(out[k], names[k], n, inputs[k], like_name)[1]
        if rem:
            _check_tensor(remainder_out, "remainder_out", (torch.int16,), n)
            written.append(("remainder_out", remainder_out))
        for k, item in enumerate(written):  # the outputs must not share memory with each other
            _check_no_overlap([item], written[k + 1 :])
        _check_no_overlap(written, ins)
        outs = tuple(out) + (None,) * (4 - len(out))
    if n == 0:
        return param if out is None else out[0]

    a = Q8AdamArgs()
    a.n = n
    a.param, a.grad, a.param_out = param.data_ptr(), grad.data_ptr(), outs[0].data_ptr()
    a.exp_avg, a.exp_avg_absmax = _data(exp_avg)
    a.exp_avg_sq, a.exp_avg_sq_absmax = _data(exp_avg_sq)
    a.exp_avg_out, a.exp_avg_absmax_out = _data(outs[1])
    a.exp_avg_sq_out, a.exp_avg_sq_absmax_out = _data(outs[2])
    if max_exp_avg_sq is not None:
        a.max_exp_avg_sq, a.max_exp_avg_sq_absmax = _data(max_exp_avg_sq)
        a.max_exp_avg_sq_out, a.max_exp_avg_sq_absmax_out = _data(outs[3])
    a.param_copy = param_copy.data_ptr() if param_copy is not None else None
    a.grad_dtype = _DTYPE_CODES[grad.dtype]
    a.exp_avg_dtype, a.exp_avg_sq_dtype = m_code, v_code
    a.copy_dtype = _DTYPE_CODES[param_copy.dtype] if param_copy is not None else DT_F32
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
    if rem:
        a.remainder = remainder.data_ptr()
        a.remainder_out = (remainder if out is None else remainder_out).data_ptr()
    q8_adam_step_raw(a)
    return param if out is None else out[0]


__all__ = ["q8_adam_step_", "Q8Blocks"]
