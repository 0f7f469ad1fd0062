"""hybrid_opt: a drop-in PyTorch Adam/AdamW whose optimizer state is divided by subgroup
between the device, host and NVMe tiers.

    from hybrid_opt import HybridAdamW
    opt = HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=0.5)

The public classes import torch on first use, so the worker process (which runs
`hybrid_opt.worker.main` and needs only the C kernels) starts without it.
"""

__version__ = "0.1.0"
__all__ = [
    "HybridAdamW",
    "HybridAdam",
    "GradsEditedError",
    "UnclosedOptimizerWarning",
    "fp32_master",
    "__version__",
]


def __getattr__(name):
    if name in ("HybridAdamW", "HybridAdam"):
        from hybrid_opt import optimizer

        return getattr(optimizer, name)
    if name == "GradsEditedError":
        from hybrid_opt.distributed.zero_edits import GradsEditedError

        return GradsEditedError
    if name == "fp32_master":
        from hybrid_opt.state.checkpoint import fp32_master

        return fp32_master
    if name == "UnclosedOptimizerWarning":
        from hybrid_opt.lifetime import UnclosedOptimizerWarning

        return UnclosedOptimizerWarning
    raise AttributeError(f"module 'hybrid_opt' has no attribute {name!r}")
