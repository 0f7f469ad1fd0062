"""Numeric tolerances, defined once and reused by every test (CONTRIBUTING.md, Tolerances)."""

import torch

# relative tolerance against torch / fp64 references, by the dtype the result is stored in
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# absolute floor, so values that pass through zero are not judged by relative error alone
ATOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def assert_close(actual, expected, dtype=None, msg=""):
    dtype = dtype or actual.dtype
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        rtol=RTOL[dtype],
        atol=ATOL[dtype],
        msg=lambda m: f"{msg}\n{m}" if msg else m,
    )


# a bf16 result computed from fp32 values that differ in their last bits may round to the
# neighbouring bf16 value: "within bf16 rounding" is one bf16 ulp, judged on the bits, with
# fp32's absolute floor for values that pass through zero (a result cancelled to ~1e-12 may
# come out with either sign, thousands of bf16 values apart)
BF16_ULPS = 1


def bf16_ulp_distance(actual, expected):
    """Per element, how many bf16 values lie between `actual` and `expected` (bf16 tensors;
    -0 and +0 are the same place)."""

    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(actual) - ordered(expected)).abs()


def assert_bf16_within_ulps(actual, expected, ulps=BF16_ULPS, atol=ATOL[torch.float32], msg=""):
    far = (bf16_ulp_distance(actual, expected) > ulps) & ((actual.double() - expected.double()).abs() > atol)
    if bool(far.any()):
        worst = int(bf16_ulp_distance(actual, expected)[far].max())
        raise AssertionError(
            f"{msg}: {int(far.sum())} of {far.numel()} bf16 values more than {ulps} ulp "
            f"and {atol} from the reference (worst {worst} ulp)"
        )


# distributed runs against single-process torch on the global batch: data-parallel averaging
# rounds differently (torch's own AdamW under FSDP2 lands at 3e-6)
DIST_RTOL = 1e-4

# q8 moments (issue 38) against torch.optim.AdamW's fp32 ones: a trajectory, not a rounding —
# each moment is requantized every step (about 1 % of its block's absmax near the top of the
# map), so params drift by a small share of how far they moved
Q8_TRAJECTORY_SHARE = 0.05  # of the largest move of a param since the start
