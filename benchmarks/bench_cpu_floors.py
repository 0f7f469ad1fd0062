"""The arithmetic floors of the CPU steps on an AVX2 host: the time a step cannot go under, however
fast the memory, for the operations an exact kernel must do (benchmarks/cpu_floors.c).

    python benchmarks/bench_cpu_floors.py [--threads 1 2] [--size 16Mi] [--json out.json]

Each probe runs alone on an L1-resident block, on every thread at once (each its own copy), and
reports ns per element per core (the median thread's best of 9 rounds):
- sqrt_div: one IEEE square root and one IEEE division per element. Every Adam step does both,
  correctly rounded; the bitwise contract (every level equal to the reference) rules out the
  rsqrt / rcp estimates that would be cheaper.
- lookup: a 256-entry fp32 table read per element, by scalar loads inserted into a vector: q8's
  dequantize, twice an element, and the shape of its quantizer's bucket reads, twice more.
- gather: the same table read by vpgatherdd.

The floors at --size elements and each thread count (ms, the per-core time over the threads):
- adam: sqrt_div. The fp32 and 16-bit rows of bench_cpu_adam.py pay it beside their memory traffic.
- q8: 4 x min(lookup, gather) + sqrt_div: bench_q8.py's row, whose quantizer takes no table read
  per comparison but one per element (issue 38), and whose moments come back through the map.
Set them beside bench_cpu_adam.py's and bench_q8.py's times: a row near its floor is bound by its
arithmetic on this CPU, not by its bytes. The C file builds with the compiler that built
cpu_kernels (gcc, -O2 -fopenmp); a CPU without AVX2 reports that and exits 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_description, markdown_table, parse_size, write_json  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_floors.c")
PROBES = ("sqrt_div", "lookup", "gather")
Q8_LOOKUPS = 4  # an element: exp_avg and exp_avg_sq dequantized, then each quantized


def build(out_dir: str) -> str:
    exe = os.path.join(out_dir, "cpu_floors")
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-O2", "-fopenmp", "-o", exe, SOURCE], check=True, capture_output=True, text=True)
    return exe


def measure(exe: str, threads: int) -> dict:
    """ns per element per core of each probe at this thread count."""
    res = subprocess.run([exe, str(threads)], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"cpu_floors {threads}: exit {res.returncode}: {res.stdout}{res.stderr}")
    got = {}
    for line in res.stdout.splitlines():
        name, th, ns = line.split()
        assert int(th) == threads
        got[name] = float(ns)
    missing = set(PROBES) - set(got)
    if missing:
        raise SystemExit(f"cpu_floors {threads}: no figure for {sorted(missing)}: {res.stdout}")
    return got


def floors(ns: dict, size: int, threads: int) -> dict:
    """The step floors, ms at `size` elements split over `threads` cores."""
    per_elem = {"adam": ns["sqrt_div"], "q8": Q8_LOOKUPS * min(ns["lookup"], ns["gather"]) + ns["sqrt_div"]}
    return {k: v * size / threads / 1e6 for k, v in per_elem.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--size", default="16Mi", help="elements of the step whose floor is printed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        records = []
        for th in sorted(set(args.threads)):
            ns = measure(exe, th)
            fl = floors(ns, size, th)
            records.append(
                {
                    "threads": th,
                    "numel": size,
                    **{f"{k}_ns_per_elem_core": v for k, v in ns.items()},
                    "adam_floor_ms": fl["adam"],
                    "q8_floor_ms": fl["q8"],
                }
            )
    print(
        f"{host_description()}; probes on an L1-resident block, every thread its own copy; {args.size} elements"
    )
    print()
    print(
        markdown_table(
            records,
            [
                ("threads", "threads", "d"),
                ("sqrt_div_ns_per_elem_core", "sqrt+div ns/elem/core", ".3f"),
                ("lookup_ns_per_elem_core", "lookup ns/elem/core", ".3f"),
                ("gather_ns_per_elem_core", "gather ns/elem/core", ".3f"),
                ("adam_floor_ms", f"Adam floor ms @{args.size}", ".2f"),
                ("q8_floor_ms", f"q8 floor ms @{args.size}", ".2f"),
            ],
        )
    )
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
