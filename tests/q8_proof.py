"""The q8 quantizers' proof over every fp32 pattern, for one SIMD level and one map: the level's
test hook (q8_check_quant_<level>) runs its vector quantizer on all 2^32 patterns, and the
bounded form's (the fused pass's) on the patterns it can see, against q8_code. Run by
tests/background_jobs.py as a background job (about 24 s of both cores a map at AVX2, 10 at
AVX-512); test_q8_cpu.py's test asserts what it prints. Also the helpers the narrower checks of
test_q8_cpu.py share.

    python tests/q8_proof.py --level avx2 [--signed]

prints one JSON line: {"level", "signed", "checks": [{"first", "bounded", "bad", "near"}]}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from concurrent.futures import ThreadPoolExecutor

# The bounded form (x·(1/absmax), |x| <= absmax, both normal) sees finite |x| <= 1 + 2^-23 only.
BOUNDED_LAST = 0x3F800001


def check_quant(level, signed, first, count, bounded=False):
    """The level's test hook (q8_check_quant_<level>): its vector quantizer on the fp32 patterns
    [first, first + count) against q8_code -> (mismatches, lanes that took q8_code). A long range
    is cut into spans checked on every core at once (ctypes lets go of the GIL for the call)."""
    from cpu_kernels import _q8_lib

    fn = getattr(_q8_lib.lib, f"q8_check_quant_{level}")
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64)]
    mode = (0 if signed else 1) + (2 if bounded else 0)

    def check(span):
        near = ctypes.c_int64()
        return fn(mode, span[0], span[1], ctypes.byref(near)), near.value

    piece = 1 << 26  # a multiple of the hook's 8 (or 16) lanes a round
    spans = [(first + at, min(piece, count - at)) for at in range(0, count, piece)]
    if len(spans) == 1:
        return check(spans[0])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(check, spans))
    return sum(bad for bad, _ in results), sum(near for _, near in results)


def every_pattern(level: str, signed: bool) -> list[dict]:
    """Both signs' 2^31 patterns, whole and in the bounded form."""
    out = []
    for first in (0, 1 << 31):
        for bounded, count in ((False, 1 << 31), (True, BOUNDED_LAST + 1)):
            bad, near = check_quant(level, signed, first, count, bounded)
            out.append(dict(first=first, bounded=bounded, bad=bad, near=near))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--level", required=True, choices=["avx512", "avx2"])
    ap.add_argument("--signed", action="store_true")
    a = ap.parse_args()
    print(json.dumps(dict(level=a.level, signed=a.signed, checks=every_pattern(a.level, a.signed))))


if __name__ == "__main__":
    main()
