"""Numeric tolerances, defined once and reused by every test (STYLE.md rule 3)."""
import torch

# relative tolerance against torch / fp64 references, by the dtype the result is stored in
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# absolute floor, so values that pass through zero are not judged by relative error alone
ATOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def assert_close(actual, expected, dtype=None, msg=""):
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.double(), expected.double(), rtol=RTOL[dtype],
                               atol=ATOL[dtype], msg=lambda m: f"{msg}\n{m}" if msg else m)
