"""`fused_adam_`'s pure-torch reference (a test oracle beside the kernel in adam.py): the same
contract one tensor at a time, in fp64 or in the kernel's fp32 operations op for op."""

import math

import torch

from .remainders import decode_remainder, encode_remainder, round_to_bf16


@torch.no_grad()
def fused_adam_reference_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled=True,
    grad_scale=None,
    found_inf=None,
    max_exp_avg_sqs=None,
    param_copies=None,
    remainders=None,
    arithmetic="fp64",
):
    """`fused_adam_`'s contract in plain torch, one tensor at a time (a test oracle: it reads
    found_inf, lr and grad_scale on the host). arithmetic="fp64": computed in fp64, each result
    rounded to fp32 once (and from there to a bf16 moment or encoded with its remainder, as the
    kernel stores them). "fp32": the kernel's fp32 operations in its order on its fp32 scalars,
    one rounding each — bitwise what Triton's interpreter (numpy) computes, and the compiled
    kernel too (built without multiply-add contraction)."""
    if found_inf is not None and float(found_inf) != 0:
        return
    if arithmetic not in ("fp64", "fp32"):
        raise ValueError(f'arithmetic must be "fp64" or "fp32", got {arithmetic!r}')
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    scale = 1.0 if grad_scale is None else float(grad_scale)
    dtype = torch.float64 if arithmetic == "fp64" else torch.float32
    if arithmetic == "fp64":

        def k(x):
            return x

        lr = float(lr)
        step_size, decay = lr / bias_correction1, 1.0 - lr * weight_decay
    else:

        def k(x):  # a float argument as the kernel sees it
            return torch.tensor(float(x), dtype=torch.float32)

        if isinstance(lr, torch.Tensor) and lr.device == params[0].device:  # read in the kernel
            lr32 = lr.detach().to(torch.float32).reshape(())
            step_size, decay = lr32 / k(bias_correction1), 1.0 - lr32 * k(weight_decay)
        else:
            step_size, decay = k(float(lr) / bias_correction1), k(1.0 - float(lr) * weight_decay)
    scale, wd, beta2_, eps_ = k(scale), k(weight_decay), k(beta2), k(eps)
    one_minus_beta1, one_minus_beta2, bc2_sqrt = k(1.0 - beta1), k(1.0 - beta2), k(bias_correction2_sqrt)
    for i, param in enumerate(params):
        p = param if remainders is None else decode_remainder(param, remainders[i])
        p = p.to(dtype)
        g = grads[i].to(dtype) * scale
        m, v = exp_avgs[i].to(dtype), exp_avg_sqs[i].to(dtype)
        if weight_decay != 0:
            if decoupled:
                p = p * decay
            else:
                g = g + wd * p
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2_ + one_minus_beta2 * (g * g)
        v_hat = v
        if max_exp_avg_sqs is not None:
            v_hat = torch.maximum(max_exp_avg_sqs[i].to(dtype), v)
            vmax = max_exp_avg_sqs[i]
            vmax.copy_(round_to_bf16(v_hat.float()) if vmax.dtype == torch.bfloat16 else v_hat)
        # fp32: the correctly rounded sqrt (sqrt_rn) through fp64 (rounding twice is exact for
        # sqrt); torch's CPU fp32 sqrt is not (measured: ~0.7 % of values one ulp off, 2.13 AVX-512)
        p = (p - step_size * m / (v_hat.double().sqrt().to(dtype) / bc2_sqrt + eps_)).float()
        if remainders is None:
            param.copy_(p)
        else:
            hi, lo = encode_remainder(p)
            param.copy_(hi)
            remainders[i].copy_(lo)
        for dst, value in ((exp_avgs[i], m), (exp_avg_sqs[i], v)):
            dst.copy_(round_to_bf16(value.float()) if dst.dtype == torch.bfloat16 else value)
        if param_copies is not None and param_copies[i] is not None:
            param_copies[i].copy_(param)  # the cast of the fp32 result, as the kernel writes it
