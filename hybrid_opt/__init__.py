"""hybrid_opt: a drop-in PyTorch Adam/AdamW whose optimizer state is divided by subgroup
between the device, host and NVMe tiers.

This package will hold the public optimizer classes (HybridAdamW, HybridAdam), the subgroup
layout, the scheduler, the tiers and the worker. Its kernels live in the sibling packages
`cpu_kernels` (AVX CPU Adam, grad statistics) and `gpu_kernels` (Triton fused Adam).
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
