"""Writes the q8 codebook for the C kernels: `csrc/q8_tables.c`, the two dynamic maps and the fast
quantizer's bucket tables exactly as `q8_reference` builds them, as C constants.

The C library is loaded by the worker process, which imports no torch, and the maps are built in
exact rational arithmetic (see `q8_reference`), so the C side takes them as generated data rather
than building them again. `tests/test_q8_cpu.py` holds the committed file to `source()` and the
library's loaded tables to the reference. Regenerate with

    python -m cpu_kernels.q8_codegen
"""

from __future__ import annotations

import itertools
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


LINES = 3  # table rows per octave, the most either map needs (q8.h's Q8_LINES)
USED = {True: 2, False: 3}  # the rows each map's buckets need (q8.h's Q8_LINES_SIGNED / _UNSIGNED)
LINE_KEYS = 32  # octaves 2^-31 .. 2^0 (key = biased exponent - 96, clamped to 0..31)
# added to |x|'s bits before the key is taken (q8.h's Q8_LINE_SHIFT_*): the signed map's buckets
# run from 1.75 · 2^e, which keeps its 0.01 edge and the boundary at 2^-6 in different buckets
LINE_SHIFT = {True: 0x200000, False: 0}
TOP_BUCKET = LINE_KEYS - 2  # the top line's first bucket (q8.h's Q8_TOP_BUCKET): below 1.0's, and 1.0's
SLACK = 16  # boundaries this many patterns outside a bucket count as in it (q8.h's Q8_SLACK, doubled)
NEAR = Fraction(1, 2**13)  # q8.h's Q8_NEAR: a t whose fraction is below 2·NEAR takes q8_code
# the top rank's line (see top_line): steeper than the last boundary's spacing (so it stays under the
# lines below the top boundary), flatter than the top bucket's width (so it stays under top + 1 up to
# 1.0), and flat enough that its near band spans more than Q8_SLACK patterns either side
TOP_SLOPE = {True: 160, False: 196}


def _f32(q) -> float:
    return q8._round32(Fraction(q))


def _bias(signed: bool) -> Fraction:
    """What every line adds to the rank: NEAR (so floor(t) is the rank and the near test one
    compare of t's fraction), 256 (so t lies in [256, 512), where its fraction is its low 15 bits),
    and for the signed map the zero code 127 (so t is 256 + the positive code, 511 - t the negative
    one)."""
    return NEAR + 256 + (127 if signed else 0)


def _bucket(signed: bool, key: int):
    """The bit patterns [lo, hi) of |x| that take the key (the line tables' column)."""
    return ((key + 96) << 23) - LINE_SHIFT[signed], ((key + 97) << 23) - LINE_SHIFT[signed]


def _fewest_through(pts, bits, groups, lo_bits, hi_bits):
    """The fewest of the groups near the bucket (index ranges into the boundary points pts, whose
    magnitudes' patterns are bits) whose lines pass through every boundary point of the bucket
    [lo_bits, hi_bits) or within SLACK patterns of it, and stay below the next point's rank up to
    the bucket's end. That is
    all the minimum needs: each line lies on or above the interpolant (which is concave: every
    segment's line lies above it) and the lines rise, so a minimum through every boundary point of a
    bucket floors to the rank across it; a segment whose line is left out is crossed by its
    neighbours' lines within its own rank."""
    inside = [j for j in range(1, len(pts) - 1) if lo_bits - SLACK <= bits[j] < hi_bits + SLACK]
    after = [j for j in range(1, len(pts) - 1) if bits[j] >= hi_bits + SLACK]
    hi = Fraction(q8._from_bits32(hi_bits))
    lo = Fraction(q8._from_bits32(lo_bits))
    groups = [
        g
        for g in groups
        if pts[g[1]][0] >= lo and pts[g[0]][0] < hi or any(g[0] <= j <= g[1] for j in inside)
    ]
    if not groups:  # past the last boundary: the flat line alone
        return []

    def line_at(g, x):
        (x0, r0), (x1, r1) = pts[g[0]], pts[g[1]]
        return r0 + (r1 - r0) / (x1 - x0) * (x - x0)

    def enough(subset):
        if not all(any(g0 <= j <= g1 for g0, g1 in subset) for j in inside):
            return False
        j = after[0] if after else None
        return (
            j is None
            or any(g0 <= j <= g1 for g0, g1 in subset)
            or min(line_at(g, hi) for g in subset) < pts[j][1] - 8 * NEAR
        )

    for size in range(1, len(groups) + 1):
        for subset in itertools.combinations(groups, size):
            if enough(subset):
                return list(subset)
    raise AssertionError("no groups through every boundary point")


def line_tables(signed: bool):
    """[LINES][2][LINE_KEYS] fp32: per bucket of |x| (an octave, from 1.75 · 2^e in the signed
    map: _bucket), up to USED lines (slope A, offset B; unused rows repeat the last) whose minimum
    crosses |x|'s rank (codes away from the zero code), plus _bias, at each code boundary: the rank
    steps from r to r + 1 at the boundary firsts[r], so the points (firsts[r], r + 1) joined by
    segments, from (0, 1/2); consecutive segments of nearly one slope share a line, and a bucket
    takes the fewest lines through its points (_fewest_through). Away from an integer the floor of
    the minimum is the rank; a lane near one takes the exact scalar path (q8_code).
    tests/test_q8_cpu.py holds the vector path to q8_code for every |x|."""
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
    bits = [0, *firsts]
    for key in range(LINE_KEYS):
        lo_bits, hi_bits = _bucket(signed, key)
        hi = Fraction(q8._from_bits32(hi_bits))
        lines = []
        for g0, g1 in _fewest_through(pts, bits, groups, lo_bits, hi_bits):
            (x0, r0), (x1, r1) = pts[g0], pts[g1]
            slope = (r1 - r0) / (x1 - x0)
            lines.append((_f32(slope), _f32(r0 - slope * x0 + bias)))
        if pts[-2][0] < hi:
            lines.append((0.0, _f32(Fraction(2 * top + 1, 2) + bias)))
        assert 1 <= len(lines) <= USED[signed] <= LINES, (signed, key, len(lines))
        lines += [lines[-1]] * (LINES - len(lines))
        for k, (slope, offset) in enumerate(lines):
            out[k][0][key], out[k][1][key] = slope, offset
    return out


def top_line(signed: bool):
    """(slope, offset) fp32: the line through (first |x| of the top rank, top rank + _bias), which
    the kernel raises line_tables' minimum to in the buckets from TOP_BUCKET on (up to 1.0's):
    that makes the top rank's step, near band included (the corner is convex: no line of a
    minimum). From that bucket's first |x| on it lies below every rank but the top one."""
    firsts = q8._first_of_each_rank(signed)[0]
    first, below = Fraction(q8._from_bits32(firsts[-1])), Fraction(q8._from_bits32(firsts[-2]))
    slope = TOP_SLOPE[signed]
    # steeper than the last step, flatter than the top bucket, and under the rank where it starts
    assert slope * (first - below) > 1 + 4 * NEAR and slope * (1 - first) < 1 - 4 * NEAR
    offset = len(firsts) + _bias(signed) - slope * first
    lo = Fraction(q8._from_bits32(_bucket(signed, TOP_BUCKET)[0]))
    rank_lo = sum(1 for u in firsts if Fraction(q8._from_bits32(u)) <= lo)
    assert slope * lo + offset < rank_lo + _bias(signed) - 4 * NEAR
    return _f32(slope), _f32(offset)


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
        f"#if Q8_KEY_FIRST != 0x{q8.KEY_FIRST:x} || Q8_KEYS != {q8.KEYS} || Q8_LINES != {LINES} || "
        f"Q8_LINES_SIGNED != {USED[True]} || Q8_LINES_UNSIGNED != {USED[False]} || "
        f"Q8_LINE_SHIFT_SIGNED != 0x{LINE_SHIFT[True]:x} || "
        f"Q8_LINE_SHIFT_UNSIGNED != 0x{LINE_SHIFT[False]:x} || Q8_TOP_BUCKET != {TOP_BUCKET}",
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
        "/* the vector quantizer's top line (q8_codegen.top_line): [map][slope, offset], fp32 bits */",
        "const uint32_t q8_top_line[2][2] = {"
        + ", ".join(
            "{" + ", ".join(f"0x{q8._bits32(v):08x}u" for v in top_line(signed)) + "}"
            for signed in (True, False)
        )
        + "};",
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
