"""Fused multi-tensor Adam / AdamW: the Triton kernel, its launcher (`fused_adam_`) and a pure-torch
reference.

One launch steps a whole list of tensors: `torch.optim.AdamW(foreach=False)` / `Adam` with bias
correction, in fp32, with optional bf16 moments and remainders. `grad_scale`, `found_inf` and a
tensor `lr` are read inside the kernel, so a step queues no host sync. Invariant: compiled without
floating-point contraction, so every specialization and the reference give the same bits. The
formula: docs/internals.md."""

import math
import numbers

import torch

from . import _runtime
from ._runtime import lazy_jit
from .adam_reference import fused_adam_reference_  # noqa: F401  (the kernel's reference, beside it)

tl = _runtime.language()

# the kernel's dtype codes, one table per argument (they coincide)
_GRAD_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_COPY_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_MOMENT_DTYPES = {torch.float32: 1, torch.bfloat16: 2}
_SCALE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_FOUND_INF_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)

# one int64 row per tensor: numel, then the addresses of param, grad, exp_avg, exp_avg_sq,
# max_exp_avg_sq, param_copy, remainder (0 when absent)
_META = 8

# BLOCK elements per inner step, ITERS steps per program (CHUNK = BLOCK·ITERS elements per
# chunk-table row). CUDA: 8 streams per element keep enough bytes in flight at 4 warps per
# 1,024 elements; an architecture's own entry ("sm_90": ...) overrides "cuda" there
# (_runtime.launch_config): `bench_gpu_kernels.py --sweep` on that GPU prints the one to put
# here. The interpreter costs ~0.7 ms per program whatever its size, hence one large block.
LAUNCH_CONFIG = {
    "cuda": dict(BLOCK=1024, ITERS=4, num_warps=4),
    "cpu": dict(BLOCK=4096, ITERS=1, num_warps=4),
}

_tables = _runtime.TableCache()


@lazy_jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (uint32 holding 16), rounded to nearest even on the bits as torch's
    cast does: Triton's interpreter truncates fp32 -> bf16; this way every backend writes
    torch's bits. NaN stays a quiet NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return tl.where(x != x, 0x7FC0, bits)


@lazy_jit
def _load_widened(ptr, offs, mask, CODE: tl.constexpr):
    """A moment as fp32: fp32 as it is (CODE 1), bf16 bits shifted into the high half (CODE 2)."""
    if CODE == 2:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@lazy_jit
def _store_narrowed(ptr, offs, x, mask, CODE: tl.constexpr):
    if CODE == 2:
        tl.store(ptr + offs, _bf16_bits(x).to(tl.uint16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@lazy_jit
def _adam_chunk(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    vmax_ptr,
    c_ptr,
    r_ptr,
    start,
    limit,
    ok,
    scale,
    step_size,
    decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    bias_correction2_sqrt,
    MASKED: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    COPY_CODE: tl.constexpr,
    EXP_AVG_CODE: tl.constexpr,
    EXP_AVG_SQ_CODE: tl.constexpr,
    REMAINDER: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        if MASKED:
            mask = offs < limit
        else:
            # a uniform mask keeps the 16-byte vector accesses that `offs < limit` would
            # break (numel, loaded from the table, has no known divisibility)
            mask = (tl.zeros([BLOCK], dtype=tl.int32) + ok.to(tl.int32)) != 0
        if REMAINDER:
            # decode: undo the encoder's carry (mod 2**16: the shift drops the borrow) and
            # join the halves; p_ptr and r_ptr are both read as uint16 bits
            hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.uint32)
            lo = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.uint32)
            p = (((hi - (lo >> 15)) << 16) | lo).to(tl.float32, bitcast=True)
        else:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = _load_widened(m_ptr, offs, mask, EXP_AVG_CODE)
        v = _load_widened(v_ptr, offs, mask, EXP_AVG_SQ_CODE)
        if SCALE_MODE != 0:
            g = g * scale
        if WEIGHT_DECAY:
            if DECOUPLED:
                p = p * decay
            else:
                g = g + weight_decay * p
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        if AMSGRAD:
            # max_exp_avg_sq has exp_avg_sq's dtype (the launcher checks)
            v_hat = tl.maximum(_load_widened(vmax_ptr, offs, mask, EXP_AVG_SQ_CODE), v)
            _store_narrowed(vmax_ptr, offs, v_hat, mask, EXP_AVG_SQ_CODE)
        else:
            v_hat = v
        # IEEE sqrt and division (Triton's defaults are approximate), as torch computes them
        denom = tl.div_rn(tl.sqrt_rn(v_hat), bias_correction2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        if REMAINDER:
            # encode: the low half as it is; the high half rounded to nearest, ties away
            # (+1 when the low half's top bit is set), mod 2**16 as decode expects
            bits = p.to(tl.uint32, bitcast=True)
            lo = bits & 0xFFFF
            hi = ((bits >> 16) + (lo >> 15)) & 0xFFFF
            tl.store(p_ptr + offs, hi.to(tl.uint16), mask=mask)
            tl.store(r_ptr + offs, lo.to(tl.uint16), mask=mask)
        else:
            tl.store(p_ptr + offs, p, mask=mask)
        _store_narrowed(m_ptr, offs, m, mask, EXP_AVG_CODE)
        _store_narrowed(v_ptr, offs, v, mask, EXP_AVG_SQ_CODE)
        if COPY_CODE == 2:
            # _bf16_bits written out: the call changes the instruction order of today's
            # compiled code (measured on sm_90 PTX), inline it stays identical
            bits = p.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            bits = tl.where(p != p, 0x7FC0, bits)  # NaN stays a quiet NaN
            tl.store(c_ptr + offs, bits.to(tl.uint16), mask=mask)
        elif COPY_CODE != 0:
            tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _fused_adam_kernel(
    meta_ptr,
    chunk_ptr,
    lr_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    step_size,
    decay,
    bias_correction1,
    grad_scale,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    bias_correction2_sqrt,
    META: tl.constexpr,
    GRAD_CODE: tl.constexpr,
    COPY_CODE: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    EXP_AVG_CODE: tl.constexpr,
    EXP_AVG_SQ_CODE: tl.constexpr,
    REMAINDER: tl.constexpr,
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
    # bf16 state (params with remainders, bf16 moments) is read and written as its bits
    if REMAINDER:
        p_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint16))
    else:
        p_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    if EXP_AVG_CODE == 2:
        m_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint16))
    else:
        m_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if EXP_AVG_SQ_CODE == 2:
        v_ptr = tl.load(row + 4).to(tl.pointer_type(tl.uint16))
    else:
        v_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    if GRAD_CODE == 1:
        g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    elif GRAD_CODE == 2:
        g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float16))
    vmax_ptr = p_ptr  # unused unless AMSGRAD
    if AMSGRAD:  # max_exp_avg_sq has exp_avg_sq's dtype
        if EXP_AVG_SQ_CODE == 2:
            vmax_ptr = tl.load(row + 5).to(tl.pointer_type(tl.uint16))
        else:
            vmax_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    r_ptr = p_ptr  # unused unless REMAINDER
    if REMAINDER:
        r_ptr = tl.load(row + 7).to(tl.pointer_type(tl.uint16))
    c_ptr = p_ptr  # unused unless COPY_CODE
    if COPY_CODE == 1:
        c_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    elif COPY_CODE == 2:  # bf16, written as its bits (see _adam_chunk)
        c_ptr = tl.load(row + 6).to(tl.pointer_type(tl.uint16))
    elif COPY_CODE == 3:
        c_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float16))
    if ALIGNED:
        # addresses loaded from memory carry no alignment facts; without these hints the
        # compiler emits one scalar access per element instead of 16-byte vectors
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        vmax_ptr = tl.multiple_of(vmax_ptr, 16)
        c_ptr = tl.multiple_of(c_ptr, 16)
        r_ptr = tl.multiple_of(r_ptr, 16)

    ok = numel == numel  # true; a tensor, so both variants of _adam_chunk take one type
    limit = numel
    if HAS_FOUND_INF:
        # read on the device, no host sync; an overflow step masks every access off
        ok = tl.load(found_inf_ptr) == 0
        limit = numel * ok.to(tl.int64)
    scale = grad_scale
    if SCALE_MODE == 2:
        scale = tl.load(grad_scale_ptr).to(tl.float32)
    lr_step_size = step_size
    lr_decay = decay
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
        lr_step_size = tl.div_rn(lr, bias_correction1)
        lr_decay = 1.0 - lr * weight_decay

    start = chunk * (BLOCK * ITERS)
    # whole chunks (all but a tensor's last) run unmasked, so accesses stay vectorised
    if start + BLOCK * ITERS <= numel:
        _adam_chunk(
            p_ptr,
            g_ptr,
            m_ptr,
            v_ptr,
            vmax_ptr,
            c_ptr,
            r_ptr,
            start,
            limit,
            ok,
            scale,
            lr_step_size,
            lr_decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            bias_correction2_sqrt,
            False,
            SCALE_MODE,
            WEIGHT_DECAY,
            DECOUPLED,
            AMSGRAD,
            COPY_CODE,
            EXP_AVG_CODE,
            EXP_AVG_SQ_CODE,
            REMAINDER,
            BLOCK,
            ITERS,
        )
    else:
        _adam_chunk(
            p_ptr,
            g_ptr,
            m_ptr,
            v_ptr,
            vmax_ptr,
            c_ptr,
            r_ptr,
            start,
            limit,
            ok,
            scale,
            lr_step_size,
            lr_decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            bias_correction2_sqrt,
            True,
            SCALE_MODE,
            WEIGHT_DECAY,
            DECOUPLED,
            AMSGRAD,
            COPY_CODE,
            EXP_AVG_CODE,
            EXP_AVG_SQ_CODE,
            REMAINDER,
            BLOCK,
            ITERS,
        )


def _as_list(value, name, *, optional=False):
    if value is None and optional:
        return None
    if isinstance(value, (list, tuple)):
        return value
    raise TypeError(f"{name} must be a list or tuple of tensors, got {type(value).__name__}")


def _check_tensor(t, name, i, device, dtypes, numel, hint=""):
    where = f"{name}[{i}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{where} has dtype {t.dtype}; expected one of: {allowed}{hint}")
    if t.device != device:
        raise ValueError(
            f"{where} is on {t.device} but params[0] is on {device}; "
            "one launch needs every tensor on the same device"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{where} has {t.numel()} elements but params[{i}] has {numel}")
    if not t.is_contiguous():
        raise ValueError(
            f"{where} is not contiguous; the kernel reads memory linearly "
            "(pass .contiguous() or a flat buffer)"
        )


def _check_hyperparameters(step, lr, beta1, beta2, eps, weight_decay):
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int (the step count after this update, >= 1), got {step!r}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (bias correction divides by 1 - beta1**step), got {step}")
    if not isinstance(lr, torch.Tensor) and not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def fused_adam_(
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
):
    """Adam/AdamW step over lists of tensors, in place, in one launch (see the module doc).

    params: fp32 (bf16 with `remainders`). grads: fp32, bf16 or fp16. exp_avgs, exp_avg_sqs:
    fp32 or bf16, each tensor its own (bf16: the fp32 value feeds the update, stored rounded to
    nearest even); max_exp_avg_sqs (amsgrad): each of its exp_avg_sq's dtype. param_copies:
    bf16/fp16/fp32 tensors (or None entries) that receive the updated param. remainders: None,
    or one int16 tensor per param: params are then bf16 and hold the fp32 master's high half
    (see the module doc), and param_copies must be None (the param is the bf16 copy). Index i
    of every list must hold the same number of elements; all contiguous, all on one CUDA
    device (or CPU under TRITON_INTERPRET=1). `step` is the step count after this update (1 on
    the first step). `lr`: float or 1-element tensor. `grad_scale`: None, float or 1-element
    tensor on the device. `found_inf`: None or a 1-element tensor on the device; non-zero →
    nothing is written. Tensors are grouped by (grad, copy and moment dtypes, 16-byte
    alignment): one launch per group, a single launch in the usual case. Each call checks
    every tensor again; `FusedAdam` checks them once for a list stepped again and again.
    """
    _check_hyperparameters(step, lr, beta1, beta2, eps, weight_decay)
    launch = FusedAdam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs=max_exp_avg_sqs,
        param_copies=param_copies,
        remainders=remainders,
        _cache=_tables,
    )
    launch.step(
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


class FusedAdam:
    """`fused_adam_` over lists of tensors fixed once: every tensor is checked, grouped and its
    chunk table copied to the device here, so `step()` does no per-tensor work at all — one
    launch per group, whatever the number of tensors (1,000 tensors cost ~9 us each per
    fused_adam_ call on the H200's host, 2026-12-04: 5 % of the copy roof).

        launch = FusedAdam(params, grads, exp_avgs, exp_avg_sqs, param_copies=bf16_params)
        for t in range(1, steps + 1):
            ...  # grads written in place (the same tensors)
            launch.step(step=t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                        grad_scale=inv_scale, found_inf=found_inf)

    The tensors' addresses are in the tables: keep them alive and in place (the launch holds
    references, so they stay alive); tensors that move (`p.data = ...`, new grads) need a
    new FusedAdam. Arguments as `fused_adam_`'s; `step()` takes the per-step ones.
    `hold_grads=False` keeps no reference to the grads: their memory may then be freed and
    reused, and the caller must check that the grads it means are at those addresses.
    """

    def __init__(
        self,
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        *,
        max_exp_avg_sqs=None,
        param_copies=None,
        remainders=None,
        hold_grads=True,
        _cache=None,
    ):
        lists = _checked_lists(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders
        )
        # the tables hold their addresses: they must outlive them. hold_grads=False: the caller
        # sees to it that the grads at those addresses are alive and current at each step()
        # (the device tier checks the addresses every step, and a grad kept here would hold
        # its memory after the user's zero_grad)
        self._tensors = lists if hold_grads else lists[:1] + (None,) + lists[2:]
        self.amsgrad = max_exp_avg_sqs is not None
        self.remainders = remainders is not None
        self.device = lists[0][0].device if lists[0] else None
        self._launches = []  # (codes, aligned, meta rows in the table, chunks, DeviceTable) per group
        if self.device is None:
            return
        _runtime.require_runtime(self.device)
        config = _runtime.launch_config(LAUNCH_CONFIG, self.device)
        self._config = config
        chunk = config["BLOCK"] * config["ITERS"]
        for (codes, aligned), group in _groups(lists).items():
            n_chunks = sum(-(-row[0] // chunk) for row in group)
            if n_chunks == 0:
                continue
            if _cache is not None:  # fused_adam_'s calls: a list stepped again finds its table
                table = _cache.get(
                    (self.device, chunk, tuple(group)), lambda: _build_table(group, chunk), self.device
                )
            else:
                with _runtime.device_guard(self.device):
                    table = _runtime.DeviceTable(_build_table(group, chunk), self.device)
            self._launches.append((codes, aligned, len(group) * _META, n_chunks, table))

    def step(
        self, *, step, lr, beta1, beta2, eps, weight_decay, decoupled=True, grad_scale=None, found_inf=None
    ):
        _check_hyperparameters(step, lr, beta1, beta2, eps, weight_decay)
        if not self._launches:
            return
        device = self.device
        scale_mode, scale_value, scale_tensor = 0, 1.0, None
        if isinstance(grad_scale, torch.Tensor):
            scale_tensor = _runtime.scalar_tensor_arg(grad_scale, "grad_scale", device, _SCALE_DTYPES)
            scale_mode = 2
        elif grad_scale is not None:
            scale_value = float(grad_scale)
            scale_mode = 0 if scale_value == 1.0 else 1
        if found_inf is not None:
            if not isinstance(found_inf, torch.Tensor):
                raise TypeError(
                    "found_inf must be a 1-element tensor on the device (or None), "
                    f"got {type(found_inf).__name__}"
                )
            _runtime.scalar_tensor_arg(found_inf, "found_inf", device, _FOUND_INF_DTYPES)
        lr_tensor = None
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"lr must be a float or a 1-element tensor, got shape {tuple(lr.shape)}")
            if lr.device == device:
                lr_tensor = lr
            elif lr.device.type == "cpu":
                lr = float(lr)  # a CPU value is read without waiting on the device
            else:
                raise ValueError(f"lr is on {lr.device} but the tensors are on {device}")
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        if lr_tensor is None:
            step_size, decay = float(lr) / bias_correction1, 1.0 - float(lr) * weight_decay
        else:
            step_size, decay = 0.0, 1.0
        config = self._config
        # launches on the tensors' device and its current stream, not the current one's
        with _runtime.device_guard(device):
            for (
                grad_code,
                copy_code,
                exp_avg_code,
                exp_avg_sq_code,
            ), aligned, n_meta, n_chunks, entry in self._launches:
                table = entry.get()
                _fused_adam_kernel.launch(
                    device,
                    (n_chunks,),
                    table[:n_meta],
                    table[n_meta:],
                    lr_tensor if lr_tensor is not None else table,
                    scale_tensor if scale_tensor is not None else table,
                    found_inf if found_inf is not None else table,
                    float(step_size),
                    float(decay),
                    float(bias_correction1),
                    float(scale_value),
                    float(1.0 - beta1),
                    float(beta2),
                    float(1.0 - beta2),
                    float(eps),
                    float(weight_decay),
                    float(bias_correction2_sqrt),
                    META=_META,
                    GRAD_CODE=grad_code,
                    COPY_CODE=copy_code,
                    LR_ON_DEVICE=lr_tensor is not None,
                    SCALE_MODE=scale_mode,
                    HAS_FOUND_INF=found_inf is not None,
                    WEIGHT_DECAY=weight_decay != 0,
                    DECOUPLED=bool(decoupled),
                    AMSGRAD=self.amsgrad,
                    EXP_AVG_CODE=exp_avg_code,
                    EXP_AVG_SQ_CODE=exp_avg_sq_code,
                    REMAINDER=self.remainders,
                    ALIGNED=aligned,
                    BLOCK=config["BLOCK"],
                    ITERS=config["ITERS"],
                    num_warps=config["num_warps"],
                    enable_fp_fusion=False,
                )


def _seven_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders) -> tuple:
    """A launcher's seven arguments as lists (None where an optional one is absent), of one
    length, remainders and param_copies not both: what fused_adam_ and q8_adam_ check first."""
    params = _as_list(params, "params")
    grads = _as_list(grads, "grads")
    exp_avgs = _as_list(exp_avgs, "exp_avgs")
    exp_avg_sqs = _as_list(exp_avg_sqs, "exp_avg_sqs")
    max_exp_avg_sqs = _as_list(max_exp_avg_sqs, "max_exp_avg_sqs", optional=True)
    param_copies = _as_list(param_copies, "param_copies", optional=True)
    remainders = _as_list(remainders, "remainders", optional=True)
    n = len(params)
    for name, lst in (
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("max_exp_avg_sqs", max_exp_avg_sqs),
        ("param_copies", param_copies),
        ("remainders", remainders),
    ):
        if lst is not None and len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors but params has {n}")
    if remainders is not None and param_copies is not None:
        raise ValueError(
            "param_copies must be None when remainders are given: each bf16 param is "
            "already the model's copy (the master's high half, rounded); pass the bf16 "
            "model params as params and drop param_copies"
        )
    return params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders


def _checked_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders):
    """The seven lists (None where absent), every tensor checked: dtypes, one device, equal
    sizes per index, contiguity. Raises with the tensor's name and index."""
    lists = _seven_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders = lists
    n = len(params)
    if n == 0:
        return (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders)
    if not isinstance(params[0], torch.Tensor):
        raise TypeError(f"params[0] must be a tensor, got {type(params[0]).__name__}")
    device = params[0].device
    if remainders is None:
        param_dtypes, param_hint = (
            (torch.float32,),
            " (bf16 params need remainders=, their masters' low halves)",
        )
    else:
        param_dtypes, param_hint = (
            (torch.bfloat16,),
            " (with remainders, params hold the fp32 masters' high halves)",
        )
    for i in range(n):
        p, v = params[i], exp_avg_sqs[i]
        _check_tensor(p, "params", i, device, param_dtypes, None, param_hint)
        numel = p.numel()
        _check_tensor(grads[i], "grads", i, device, _GRAD_DTYPES, numel)
        _check_tensor(exp_avgs[i], "exp_avgs", i, device, _MOMENT_DTYPES, numel)
        _check_tensor(v, "exp_avg_sqs", i, device, _MOMENT_DTYPES, numel)
        if max_exp_avg_sqs is not None:
            _check_tensor(
                max_exp_avg_sqs[i],
                "max_exp_avg_sqs",
                i,
                device,
                (v.dtype,),
                numel,
                f" (exp_avg_sqs[{i}]'s dtype)",
            )
        if remainders is not None:
            _check_tensor(
                remainders[i], "remainders", i, device, (torch.int16,), numel, " (the masters' low 16 bits)"
            )
        if param_copies is not None and param_copies[i] is not None:
            _check_tensor(param_copies[i], "param_copies", i, device, _COPY_DTYPES, numel)
    return (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders)


def _groups(lists) -> dict:
    """{((grad, copy, exp_avg, exp_avg_sq codes), 16-byte aligned): [table row]}: a launch needs
    uniform pointer types and alignment facts, so rows are grouped by them (one group in the
    usual case); the updates are independent, so grouping changes no bits."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, remainders = lists
    groups = {}
    for i, p in enumerate(params):
        g, m, v = grads[i], exp_avgs[i], exp_avg_sqs[i]
        c = param_copies[i] if param_copies is not None else None
        ptrs = (
            p.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            max_exp_avg_sqs[i].data_ptr() if max_exp_avg_sqs is not None else 0,
            c.data_ptr() if c is not None else 0,
            remainders[i].data_ptr() if remainders is not None else 0,
        )
        codes = (
            _GRAD_DTYPES[g.dtype],
            _COPY_DTYPES[c.dtype] if c is not None else 0,
            _MOMENT_DTYPES[m.dtype],
            _MOMENT_DTYPES[v.dtype],
        )
        aligned = all(_runtime.is_aligned(ptr) for ptr in ptrs)
        groups.setdefault((codes, aligned), []).append((p.numel(), *ptrs))
    return groups


def _build_table(group, chunk):
    meta = torch.zeros((len(group), _META), dtype=torch.int64)
    meta[:, :8] = torch.tensor(group, dtype=torch.int64)
    chunks = _runtime.chunk_rows([r[0] for r in group], chunk)
    return torch.cat([meta.flatten(), chunks.flatten()])
