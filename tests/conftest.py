"""Test set-up shared by every module.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it must be set before
gpu_kernels is first imported: without a CUDA device the Triton kernels run on CPU tensors
through the interpreter.
"""
import os
import tempfile

import pytest


def _cuda_available():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the scheduler's calibration cache: one fresh measurement per test session, never the user's
os.environ.setdefault("HYBRID_OPT_CACHE_DIR", tempfile.mkdtemp(prefix="hybrid_opt-test-cache-"))


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
