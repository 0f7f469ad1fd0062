"""The built C library keeps the software prefetches of its Adam loops (docs/kernels.md, "Software
prefetch of the fp32 streams"). gcc 12.2 deleted every call of a prefetch-only helper that it had
not inlined early (pure-const: no side effects), silently: the bits stay the same, only the speed
falls (the fp32-stream rows 10-20 % slower on an Intel Xeon). So the prefetches are counted in the
disassembly of the x86 entry points. Skipped, saying why, off x86-64 or without objdump (binutils)."""

import platform
import shutil
import subprocess

import pytest

import cpu_kernels._lib

OBJDUMP = shutil.which("objdump")

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86 levels' loops"),
    pytest.mark.skipif(OBJDUMP is None, reason="objdump is not installed (binutils)"),
]


def _library() -> str:
    return cpu_kernels._lib.lib._name  # the path _lib loaded


def _disassembly(symbol: str) -> str:
    return subprocess.run(
        [OBJDUMP, "-d", "--no-show-raw-insn", f"--disassemble={symbol}", _library()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def _prefetches(symbol: str) -> int:
    """prefetch instructions in `symbol`'s disassembly (its inlined helpers included)."""
    out = _disassembly(symbol)
    assert f"<{symbol}>:" in out, f"{symbol} is not in the library"
    return sum("prefetch" in line for line in out.splitlines())


# In-place blocks (adam_body.h's prefetch_block): the grad, the param and both moments a block each.
# Without it adam_range_avx2 holds none and adam_range_avx512 only its bank loop's 8.
@pytest.mark.parametrize("symbol, at_least", [("adam_range_avx2", 16), ("adam_range_avx512", 24)])
def test_the_in_place_blocks_prefetch(symbol, at_least):
    assert _prefetches(symbol) >= at_least


def test_the_avx512_register_loop_prefetches_both_lines_of_an_fp32_stream():
    """adam_c16_insn (kernels_avx512.c, the AVX-512 BF16 instances of the register loop): its
    prefetch32 helper lost every prefetch when it was not always_inline, and before it fetched one
    line of an fp32 stream per 32 elements the four instances held 24 prefetches; with both, 46."""
    if "<adam_c16_insn>:" not in _disassembly("adam_c16_insn"):
        pytest.skip("this compiler built no AVX-512 BF16 instances (HAVE_BF16_INSN)")
    assert _prefetches("adam_c16_insn") >= 36
