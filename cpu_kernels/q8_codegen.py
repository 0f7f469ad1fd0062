"""Writes the q8 codebook for the C kernels: `csrc/q8_tables.c`, the two dynamic maps and the fast
quantizer's bucket tables exactly as `q8_reference` builds them, as C constants.

The C library is loaded by the worker process, which imports no torch, and the maps are built in
exact rational arithmetic (see `q8_reference`), so the C side takes them as generated data rather
than building them again. `tests/test_q8_cpu.py` holds the committed file to `source()` and the
library's loaded tables to the reference. Regenerate with

    python -m cpu_kernels.q8_codegen
"""

from __future__ import annotations

import pathlib
from fractions import Fraction

from . import q8_reference as q8

PATH = pathlib.Path(__file__).resolve().parent / "csrc" / "q8_tables.c"
_PER_LINE = 8


def _rows(words):
    lines = []
    for k in range(0, len(words), _PER_LINE):
        lines.append("    " + ", ".join(f"0x{w & 0xFFFFFFFF:08x}u" for w in words[k : k + _PER_LINE]) + ",")
    return "\n".join(lines)


LINES = 4  # lines per octave: the rank's interpolant is their minimum
LINE_KEYS = 32  # octaves 2^-31 .. 2^0 (key = biased exponent - 96, clamped to 0..31)
NEAR = Fraction(1, 2**13)  # q8.h's Q8_NEAR: a t whose fraction is below 2·NEAR takes q8_code
# the top rank's line (see top_line): steeper than the last boundary's spacing (so it stays under the
# lines below the top boundary), flatter than the top bucket's width (so it stays under top + 1 up to
# 1.0), and flat enough that its near band spans more than Q8_SLACK patterns either side
TOP_SLOPE = {True: 160, False: 196}


def _f32(q) -> float:
    return q8._round32(Fraction(q))


def _bias(signed: bool) -> Fraction:
    """What every line adds to the rank: NEAR (so floor(t) is the rank and the near test one
    compare of t's fraction), and for the signed map the zero code 127 (so t is the positive
    code, 255 - t the negative one)."""
    return NEAR + (127 if signed else 0)


def line_tables(signed: bool):
    """[LINES][2][LINE_KEYS] fp32: per octave of |x|, LINES lines (slope A, offset B) whose minimum
    interpolates |x|'s rank (codes away from the zero code) through each code boundary, plus
    _bias: the rank steps from r to r + 1 at the boundary firsts[r], so the points (firsts[r], r +
    1) joined by segments, from (0, 1/2); consecutive segments of nearly one slope share a line.
    Away from an integer the floor of the minimum is the rank; a lane near one takes the exact
    scalar path (q8_code). tests/test_q8_cpu.py holds the vector path to q8_code for every |x|."""
    firsts = q8._first_of_each_rank(signed)[0]
    bias = _bias(signed)
    pts = [(Fraction(0), Fraction(1, 2))] + [
        (Fraction(q8._from_bits32(u)), Fraction(r + 1)) for r, u in enumerate(firsts)
    ]
    slopes = [(pts[i + 1][1] - pts[i][1]) / (pts[i + 1][0] - pts[i][0]) for i in range(len(pts) - 1)]
    groups, a = [], 0
    for i in range(1, len(slopes) + 1):
        if i == len(slopes) or abs(slopes[i] / slopes[a] - 1) > Fraction(1, 1000):
            groups.append((a, i))
            a = i
    top = len(firsts)
    # the last boundary (to +1.0, the map's lopsided top) is nearer than the grid's: that corner is
    # convex, so its segment is no line of the minimum; top_line's maximum sets the top rank
    (a0, _), (b0, b1) = groups[-2], groups[-1]
    assert b1 - b0 == 1 and slopes[b0] > slopes[a0]
    groups.pop()
    out = [[[0.0] * LINE_KEYS, [0.0] * LINE_KEYS] for _ in range(LINES)]
    for key in range(LINE_KEYS):
        lo, hi = Fraction(2) ** (key + 96 - 127), Fraction(2) ** (key + 96 - 126)
        lines = []
        for g0, g1 in groups:
            (x0, r0), (x1, r1) = pts[g0], pts[g1]
            if x1 >= lo and x0 < hi:
                slope = (r1 - r0) / (x1 - x0)
                lines.append((_f32(slope), _f32(r0 - slope * x0 + bias)))
        if pts[-2][0] < hi:
            lines.append((0.0, _f32(Fraction(2 * top + 1, 2) + bias)))
        assert 1 <= len(lines) <= LINES, (signed, key, len(lines))
        lines += [lines[-1]] * (LINES - len(lines))
        for k, (slope, offset) in enumerate(lines):
            out[k][0][key], out[k][1][key] = slope, offset
    return out


def top_line(signed: bool):
    """(slope, offsets[LINE_KEYS]) fp32: the line through (first |x| of the top rank, top rank +
    _bias) in the octaves that hold the top rank's step (up to 1.0), far below every rank in the
    others; the kernel raises line_tables' minimum to it, which makes the top rank's step, near
    band included (that corner is convex: no line of a minimum)."""
    firsts = q8._first_of_each_rank(signed)[0]
    first, below = Fraction(q8._from_bits32(firsts[-1])), Fraction(q8._from_bits32(firsts[-2]))
    slope = TOP_SLOPE[signed]
    # steeper than the last step, flatter than the top bucket, and under the rank where it starts
    assert slope * (first - below) > 1 + 4 * NEAR and slope * (1 - first) < 1 - 4 * NEAR
    offset = len(firsts) + _bias(signed) - slope * first
    start = LINE_KEYS - 2  # the octave [1/2, 1) and 1.0's
    lo = Fraction(2) ** (start + 96 - 127)
    rank_lo = sum(1 for u in firsts if Fraction(q8._from_bits32(u)) <= lo)
    assert slope * lo + offset < rank_lo + _bias(signed) - 4 * NEAR
    offsets = [_f32(offset) if key >= start else -1024.0 for key in range(LINE_KEYS)]
    return _f32(slope), offsets


def source() -> str:
    """The text of csrc/q8_tables.c."""
    maps = {signed: [q8._bits32(x) for x in q8._dynamic_map_values(signed)] for signed in (True, False)}
    tables = {signed: [w for row in q8._bucket_table_values(signed) for w in row] for signed in (True, False)}
    parts = [
        "/* GENERATED by `python -m cpu_kernels.q8_codegen` from cpu_kernels/q8_reference.py: do not edit.",
        " * The q8 codebook (issue 38): bitsandbytes' dynamic maps as fp32 bits, ascending, [0] signed",
        " * (exp_avg) and [1] unsigned (exp_avg_sq); the fast quantizer's bucket tables, per map a row",
        " * for x >= +0 then a row for x <= -0, each entry rank << 17 | the low 16 bits of |x| where the",
        " * rank steps once in the bucket (65536: it does not). tests/test_q8_cpu.py checks both. */",
        '#include "q8.h"',
        "",
        f"#if Q8_KEY_FIRST != 0x{q8.KEY_FIRST:x} || Q8_KEYS != {q8.KEYS}",
        '#error "q8.h disagrees with q8_reference: regenerate this file"',
        "#endif",
        "",
        "const uint32_t q8_maps[2][256] __attribute__((aligned(64))) = {",
    ]
    for signed in (True, False):
        parts += ["  {", _rows(maps[signed]), "  },"]
    parts += ["};", "", "const uint32_t q8_buckets[2][2 * Q8_KEYS] __attribute__((aligned(64))) = {"]
    for signed in (True, False):
        parts += ["  {", _rows(tables[signed]), "  },"]
    parts += [
        "};",
        "",
        "/* the vector quantizer's top line (q8_codegen.top_line): [map] slope; [map][octave] offset,"
        " fp32 bits */",
        "const uint32_t q8_top_slope[2] = {"
        + ", ".join(f"0x{q8._bits32(top_line(signed)[0]):08x}u" for signed in (True, False))
        + "};",
        "const uint32_t q8_top_offset[2][32] __attribute__((aligned(64))) = {",
    ]
    for signed in (True, False):
        parts += ["  {", _rows([q8._bits32(v) for v in top_line(signed)[1]]), "  },"]
    parts += [
        "};",
        "",
        "/* the vector quantizer's lines (q8_codegen.line_tables): [map][line][slope, offset]"
        "[octave], fp32 bits */",
        f"const uint32_t q8_lines[2][{LINES}][2][{LINE_KEYS}] __attribute__((aligned(64))) = {{",
    ]
    for signed in (True, False):
        parts.append("  {")
        for line in line_tables(signed):
            parts.append("    {")
            for row in line:
                parts += ["     {", _rows([q8._bits32(v) for v in row]).replace("u,", "u,"), "     },"]
            parts.append("    },")
        parts.append("  },")
    parts += ["};", ""]
    return "\n".join(parts)


def main() -> None:
    PATH.write_text(source())
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
