"""Pure-torch fp64 references of the cpu_kernels entry points (the tests' ground truth)."""
from __future__ import annotations

import math

import torch


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
                        weight_decay, decoupled=True, grad_scale=1.0, max_exp_avg_sq=None):
    """Returns the new (param, exp_avg, exp_avg_sq, max_exp_avg_sq) in fp64; inputs untouched."""
    p = param.double()
    g = grad.double() * grad_scale
    m, v = exp_avg.double(), exp_avg_sq.double()
    if decoupled:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    vmax = None
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(max_exp_avg_sq.double(), v)
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    denom = (vmax if vmax is not None else v).sqrt() / bc2_sqrt + eps
    p = p - (lr / bc1) * m / denom
    return p, m, v, vmax


def grad_stats_reference(grad):
    """(sum of squares in fp64, all finite)."""
    g = grad.double()
    return float((g * g).sum()), bool(torch.isfinite(grad).all())


def adam_inverse_reference(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
                           weight_decay, decoupled=True, grad_scale=1.0):
    """The state before the step that produced (param, exp_avg, exp_avg_sq), in fp64."""
    p1, m1, v1 = param.double(), exp_avg.double(), exp_avg_sq.double()
    g = grad.double() * grad_scale
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    p0 = p1 + (lr / bc1) * m1 / (v1.sqrt() / bc2_sqrt + eps)
    if decoupled:
        p0 = p0 / (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p0
    m0 = (m1 - (1.0 - beta1) * g) / beta1
    v0 = ((v1 - (1.0 - beta2) * g * g) / beta2).clamp_min(0.0)
    return p0, m0, v0
