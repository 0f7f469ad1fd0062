"""Triton kernels for the device tier: fused multi-tensor Adam/AdamW and gradient statistics.

Importing this package needs neither triton nor a GPU; a kernel call that cannot run raises
RuntimeError saying why (`unavailable_reason(device)` tells beforehand). Without a CUDA
device the kernels run on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1.
Each kernel sits beside its launcher and a pure-torch reference.
"""

from ._runtime import unavailable_reason
from .adam import FusedAdam, fused_adam_, fused_adam_reference_
from .grad_stats import clip_coef, grad_stats, grad_stats_reference
from .remainders import decode_remainder, encode_remainder

__all__ = [
    "FusedAdam",
    "fused_adam_",
    "fused_adam_reference_",
    "grad_stats",
    "grad_stats_reference",
    "clip_coef",
    "unavailable_reason",
    "encode_remainder",
    "decode_remainder",
]
