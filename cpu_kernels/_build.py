"""How cpu_kernels' C library is compiled: its sources and flags, shared by setup.py (the
installed library) and the aarch64 emulation test (the same sources and flags, cross-built).

The arithmetic is stated, not left to the compiler: `-ffp-contract=off` forbids contracting
`a * b + c` into a fused multiply-add where the source does not ask for one. GNU C's default
(`-ffp-contract=fast`) contracts wherever the target has FMA, which AArch64 always has: there
the portable level differed from x86's portable level in 9 of 10 kernel cases, and on the
amsgrad/L2 path even from the FMA levels. Levels that want fused multiply-adds say so in the
source (`__builtin_fmaf`, `_mm512_fmadd_ps`, `vfmaq_f32`, `svmla_x`), so the flag changes no
SIMD level's bits, and the portable level gives the same bits on every architecture.
"""

from __future__ import annotations

CSRC = "cpu_kernels/csrc"
SOURCES = [
    f"{CSRC}/{name}"
    for name in (
        "module.c",
        "dispatch.c",
        "kernels_avx512.c",
        "kernels_avx2.c",
        "kernels_neon.c",
        "kernels_sve.c",
        "kernels_portable.c",
        "aio.c",
        "q8_dispatch.c",
        "q8_tables.c",
        "q8_portable.c",
        "q8_avx2.c",
        "q8_avx512.c",
        "q8_neon.c",
        "q8_sve.c",
    )
]
HEADERS = [
    f"{CSRC}/{name}" for name in ("kernels.h", "adam_body.h", "aio.h", "q8.h", "q8_body.h", "q8_fused.h")
]
COMPILE_ARGS = [
    "-O3",
    "-std=gnu11",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp",
    "-Wall",
    "-Wno-unknown-pragmas",
]
LINK_ARGS = ["-fopenmp"]
# the library without its Python module (module.c needs Python.h): what a native test driver links
LIBRARY_SOURCES = [s for s in SOURCES if not s.endswith("/module.c")]
