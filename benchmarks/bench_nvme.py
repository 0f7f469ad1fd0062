"""NVMe tier I/O: raw sequential O_DIRECT write then read of the same bytes through the
cpu_kernels.aio engine at several thread counts and chunk sizes, against `dd` with
oflag/iflag=direct on the same file in the same run.

    python benchmarks/bench_nvme.py [--bytes 1Gi] [--threads 1 4 8] [--chunk-mib 1 8]
                                    [--reps 3] [--dir DIR] [--json out.json]

Each engine row moves --bytes as one request (the engine splits it into chunks over its
threads) from one page-aligned buffer into one file under --dir, overwriting the file the
warm-up wrote (as a swap slot is overwritten), then reads it back. The files are deleted
afterwards. --dir must be on the disk being measured, not tmpfs (default: bench_out/nvme
in the repository, which is git-ignored). GB/s are 1e9 bytes per second of the median.

JSON records: {"impl", "bytes", "threads", "op", "median_s", "p20_s", "p80_s", "gb_per_s"}.

The tier rows (swap-in/out through hybrid_opt's NVMe tier, and the pipelined run) are
not here yet: see `tier_rows`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cpu_kernels.aio import AioEngine, aligned_buffer  # noqa: E402
from _common import host_description, markdown_table, time_ms, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
DD_BLOCK = 8 * MiB


def parse_size(s: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * units[u])
    return int(s)


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding path (longest mount-point prefix)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mnt, typ = fields[1], fields[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind


def record(impl: str, nbytes: int, threads: int | None, op: str, t_ms: dict) -> dict:
    median_s = t_ms["median_ms"] / 1e3
    return {"impl": impl, "bytes": nbytes, "threads": threads, "op": op, "median_s": median_s,
            "p20_s": t_ms["p20_ms"] / 1e3, "p80_s": t_ms["p80_ms"] / 1e3,
            "gb_per_s": nbytes / median_s / 1e9}


def engine_rows(path: str, buf, nbytes: int, threads: int, chunk: int, reps: int) -> list[dict]:
    """Sequential write then read of `nbytes` as one request each."""
    impl = f"aio chunk={chunk // MiB}MiB"
    with AioEngine(threads=threads, queue_depth=4, chunk_bytes=chunk) as eng:
        fd = eng.open(path, "r+" if os.path.exists(path) else "w+")
        try:
            if not eng.is_direct(fd):
                print(f"warning: {path} is not open with O_DIRECT; these are buffered figures")
            tw = time_ms(lambda: eng.write(fd, buf, nbytes, 0), reps=reps, warmup=1)
            tr = time_ms(lambda: eng.read(fd, buf, nbytes, 0), reps=reps, warmup=1)
        finally:
            eng.close_fd(fd)
    return [record(impl, nbytes, threads, "write", tw), record(impl, nbytes, threads, "read", tr)]


def dd_rows(path: str, nbytes: int, reps: int) -> list[dict]:
    """dd's own O_DIRECT sequential write (overwriting, like the engine rows) and read."""
    count = nbytes // DD_BLOCK
    common = ["bs=8M", f"count={count}", "status=none"]
    write = ["dd", "if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"] + common
    read = ["dd", f"if={path}", "of=/dev/null", "iflag=direct"] + common

    def run(cmd):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    tw = time_ms(lambda: run(write), reps=reps, warmup=1)
    tr = time_ms(lambda: run(read), reps=reps, warmup=1)
    return [record("dd bs=8M", nbytes, 1, "write", tw), record("dd bs=8M", nbytes, 1, "read", tr)]


def tier_rows(args, workdir: str) -> list[dict]:
    """TODO(issue 5, swapper/tier part): add here, with the same record schema,
      - "tier swap_out" / "tier swap_in": the same bytes as subgroup state (master, m, v)
        written to and read from their slots through hybrid_opt's NVMe tier (checksums
        included); target >= 90% of the best raw engine row of the same op in this run;
      - "pipelined": a step over N subgroups (prefetch next, step current, write back
        previous) vs max(I/O time, compute time); target <= 1.15x.
    Returns no rows until the tier exists."""
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="1Gi", help="bytes per transfer (default 1Gi)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(REPO, "bench_out", "nvme"),
                    help="directory on the disk to measure (not tmpfs)")
    ap.add_argument("--no-dd", action="store_true", help="skip the dd baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    nbytes = parse_size(args.bytes)
    if nbytes <= 0 or nbytes % 4096:
        sys.exit(f"--bytes must be a positive multiple of 4096 (O_DIRECT), got {nbytes}")
    os.makedirs(args.dir, exist_ok=True)
    kind = fs_type(args.dir)
    if kind in ("tmpfs", "ramfs"):
        sys.exit(f"--dir {args.dir} is on {kind}: that measures memory, not a disk; "
                 f"pass a directory on the disk (see `df`)")
    free = shutil.disk_usage(args.dir).free
    if free < 2 * nbytes:
        sys.exit(f"--dir {args.dir} has {free / 2**30:.1f} GiB free; this run needs "
                 f"{2 * nbytes / 2**30:.1f} GiB")

    workdir = tempfile.mkdtemp(prefix="bench_nvme_", dir=args.dir)
    path = os.path.join(workdir, "raw.bin")
    print(f"# NVMe raw I/O: {nbytes / 2**30:.2f} GiB sequential, {args.reps} reps, "
          f"{workdir} ({kind}), {host_description()}")
    rows = []
    try:
        buf = aligned_buffer(nbytes)
        block = os.urandom(MiB)  # incompressible, and every page touched before timing
        for off in range(0, nbytes, MiB):
            buf[off:off + MiB] = block[: min(MiB, nbytes - off)]
        for threads in args.threads:
            for chunk_mib in args.chunk_mib:
                rows += engine_rows(path, buf, nbytes, threads, chunk_mib * MiB, args.reps)
        if args.no_dd:
            pass
        elif shutil.which("dd") is None:
            print("dd not found: no dd rows")
        elif nbytes % DD_BLOCK:
            print("--bytes is not a multiple of 8 MiB: no dd rows")
        else:
            rows += dd_rows(path, nbytes, args.reps)
        rows += tier_rows(args, workdir)
        buf.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for op in ("write", "read"):
        dd = next((r["gb_per_s"] for r in rows if r["impl"].startswith("dd") and r["op"] == op), None)
        for r in rows:
            if r["op"] == op and dd:
                r["_vs_dd"] = r["gb_per_s"] / dd
    table = sorted(rows, key=lambda r: (r["op"] != "write", r["impl"], r["threads"] or 0))
    print(markdown_table(table, [("impl", "impl", "s"), ("op", "op", "s"), ("threads", "threads", "d"),
                                 ("median_s", "median s", ".3f"), ("p20_s", "p20 s", ".3f"),
                                 ("p80_s", "p80 s", ".3f"), ("gb_per_s", "GB/s", ".2f"),
                                 ("_vs_dd", "vs dd", ".2f")]))
    for r in rows:
        r.pop("_vs_dd", None)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
