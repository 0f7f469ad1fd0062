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

Then the tier rows (`tier_rows`): the same bytes as subgroup state swapped out and in
through hybrid_opt's NVMe tier (target >= 90% of the raw engine), and a pipelined step
over N subgroups against max(I/O time, compute time) (target <= 1.15x).

Then the compressed-state rows (`compressed_rows`, #16): a bf16 model's N nvme subgroups
stepped with fp32 state (fp32 master + m + v: 12 B/param in each file slot) and with bf16
moments + remainders (remainder + m + v: 6 B/param; the high half is read from the model's
param), the same elements and grads, interleaved step by step (time_ms_interleaved); the
ratio of the medians (target <= 0.6x) and each file's bytes per param. `--compressed-only`
runs just these rows.
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
from _common import (
    fs_type,
    host_description,
    markdown_table,
    parse_size,
    time_ms,  # noqa: E402
    time_ms_interleaved,
    write_json,
)

from cpu_kernels.aio import AioEngine, aligned_buffer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
DD_BLOCK = 8 * MiB


def record(impl: str, nbytes: int, threads: int | None, op: str, t_ms: dict) -> dict:
    median_s = t_ms["median_ms"] / 1e3
    return {
        "impl": impl,
        "bytes": nbytes,
        "threads": threads,
        "op": op,
        "median_s": median_s,
        "p20_s": t_ms["p20_ms"] / 1e3,
        "p80_s": t_ms["p80_ms"] / 1e3,
        "gb_per_s": nbytes / median_s / 1e9,
    }


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


def tier_rows(args, workdir: str, nbytes: int, raw: list) -> list[dict]:
    """The same bytes as subgroup state (fp32 master, m, v) through hybrid_opt's NVMe tier:
    - "tier swap_out" / "tier swap_in": every subgroup's state block written to / read from
      its file slot by the worker (CRC32C computed on write, verified on read);
    - "tier pipelined step": one step over the N subgroups (the worker reads each committed
      slot as its task arrives, steps it, writes the other slot), with --io-banks read
      buffers in flight; "host step (no I/O)": the same step on the resident host tier;
      "io (swap_in + swap_out)": the I/O alone, all subgroups at once. The pipelined step
      should take about max(I/O, compute), I/O being the raw sequential O_DIRECT read and
      write of the same bytes (the best engine rows of this run); the ratio to the tier's
      all-at-once swaps is printed too (they run 8 requests deep, the pipeline fewer)."""
    import torch

    from hybrid_opt.tiers.host import AdamInputs, HostTier
    from hybrid_opt.worker import protocol as proto

    n_sub = args.subgroups
    numel = max(4096, nbytes // (12 * n_sub) // 4096 * 4096)
    sizes = [numel] * n_sub
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=gen) for _ in range(n_sub)]
    rows: list = []
    tier = HostTier(
        sizes,
        nvme=[True] * n_sub,
        nvme_path=workdir,
        io_banks=max(args.io_banks, n_sub),
        slot_numel=1 << 20,
        staging_slots=4,
        nvme_threads=4,
    )
    try:
        io_bytes = tier.io_bytes * n_sub
        banks = tier.pool.acquire(n_sub)
        for b in banks:  # incompressible state, every page touched before timing
            tier.banks.view(b, "p", tier.io_bytes // 4, torch.float32).normal_(generator=gen)
        crcs = {}

        def run(op):
            ids = []
            for sg, b in enumerate(banks):
                ids.append(
                    tier.client.send(proto.Task(op, 0, sg, in_bank=b, file_slot=1, crc=crcs.get(sg, 0)))
                )
            for r in tier.client.wait(ids):
                if op == proto.OP_SWAP_OUT:
                    crcs[r.subgroup] = r.crc

        t_out = time_ms(lambda: run(proto.OP_SWAP_OUT), reps=args.reps, warmup=1)
        t_in = time_ms(lambda: run(proto.OP_SWAP_IN), reps=args.reps, warmup=1)
        rows += [
            record("tier swap_out", io_bytes, 4, "write", t_out),
            record("tier swap_in", io_bytes, 4, "read", t_in),
        ]
        for b in banks:
            tier.pool.release(b)
        tier.close()
        # the pipelined step, with --io-banks reads in flight
        tier = HostTier(
            sizes,
            nvme=[True] * n_sub,
            nvme_path=workdir,
            io_banks=args.io_banks,
            slot_numel=1 << 20,
            staging_slots=4,
            nvme_threads=4,
        )
        step = [0]

        def one_step(t):
            step[0] += 1
            t.stepping.finish(
                {sg: (grads[sg], AdamInputs(step[0], 1e-3, 0.9, 0.999, 1e-8, 0.01)) for sg in range(n_sub)}
            )

        t_pipe = time_ms(lambda: one_step(tier), reps=args.reps, warmup=1)
        tier.close()
        resident = HostTier(sizes, spare_banks=2, slot_numel=1 << 20, staging_slots=4)
        try:
            t_comp = time_ms(lambda: one_step(resident), reps=args.reps, warmup=1)
        finally:
            resident.close()
        t_io = {k: t_in[k] + t_out[k] for k in t_in}
        rows += [
            record("tier pipelined step", 2 * io_bytes, 4, "step", t_pipe),
            record("host step (no I/O)", 2 * io_bytes, None, "step", t_comp),
            record("io (swap_in + swap_out)", 2 * io_bytes, 4, "step", t_io),
        ]
        best = {
            op: max(
                (r["gb_per_s"] for r in raw if r["op"] == op and r["impl"].startswith("aio")), default=None
            )
            for op in ("read", "write")
        }
        if best["read"] and best["write"]:
            raw_io_ms = io_bytes / best["read"] / 1e6 + io_bytes / best["write"] / 1e6
            bound = max(raw_io_ms, t_comp["median_ms"])
            print(
                f"pipelined step over {n_sub} subgroups of {numel} elements ({args.io_banks} read "
                f"buffers): {t_pipe['median_ms']:.0f} ms = {t_pipe['median_ms'] / bound:.2f}x "
                f"max(raw sequential I/O of the same bytes {raw_io_ms:.0f} ms, compute "
                f"{t_comp['median_ms']:.0f} ms)"
            )
        tier_bound = max(t_io["median_ms"], t_comp["median_ms"])
        print(
            f"  = {t_pipe['median_ms'] / tier_bound:.2f}x max(the tier's all-at-once swap-in + "
            f"swap-out {t_io['median_ms']:.0f} ms, compute {t_comp['median_ms']:.0f} ms)"
        )
    finally:
        tier.close()
    return rows


def compressed_rows(args, workdir: str, nbytes: int) -> list[dict]:
    """A bf16 model's nvme step with fp32 state vs bf16 moments + remainders (module
    docstring), interleaved; each tier's param copies land in the model as the optimizer's
    commit does (the remainder tier reads its next high half from them)."""
    import torch

    from hybrid_opt.tiers.host import AdamInputs, HostTier

    n_sub = args.subgroups
    numel = max(4096, nbytes // (12 * n_sub) // 4096 * 4096)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(n_sub)]
    configs = {
        "fp32 state": dict(),
        "bf16 moments + remainders": dict(
            exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, remainders=True
        ),
    }
    tiers, params, step = {}, {}, {}
    try:
        for name, kw in configs.items():
            params[name] = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(n_sub)]
            if kw:
                kw = dict(kw, params=params[name])
            tiers[name] = HostTier(
                [numel] * n_sub,
                nvme=[True] * n_sub,
                nvme_path=workdir,
                io_banks=args.io_banks,
                slot_numel=1 << 20,
                staging_slots=4,
                nvme_threads=4,
                grad_dtype=torch.bfloat16,
                copy_dtype=torch.bfloat16,
                **kw,
            )
            for sg in range(n_sub):
                tiers[name].load_state(sg, params[name][sg].float())
            step[name] = 0

        def stepper(name):
            tier, model = tiers[name], params[name]

            def land(sg, views):
                model[sg].copy_(views["param_copy"])

            def one():
                step[name] += 1
                tier.stepping.finish(
                    {
                        sg: (grads[sg], AdamInputs(step[name], 1e-3, 0.9, 0.999, 1e-8, 0.01))
                        for sg in range(n_sub)
                    },
                    on_commit=land,
                )

            return one

        times = time_ms_interleaved({name: stepper(name) for name in configs}, reps=args.reps, warmup=1)
        rows = []
        for name in configs:
            r = record(
                f"nvme step, bf16 model, {name}", 2 * tiers[name].io_bytes * n_sub, 4, "step", times[name]
            )
            r["file_bytes_per_param"] = tiers[name].io_bytes / numel
            rows.append(r)
    finally:
        for t in tiers.values():
            t.close()
    base, comp = rows
    ratio = comp["median_s"] / base["median_s"]
    print(
        f"nvme step over {n_sub} subgroups of {numel} bf16 params, interleaved x{args.reps}: "
        f"bf16 moments + remainders {comp['median_s'] * 1e3:.0f} ms vs fp32 state "
        f"{base['median_s'] * 1e3:.0f} ms = {ratio:.2f}x (target <= 0.6x); file bytes per "
        f"param {comp['file_bytes_per_param']:.2f} vs {base['file_bytes_per_param']:.2f}"
    )
    for r in rows:
        r["ratio_to_fp32_state"] = r["median_s"] / base["median_s"]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="1Gi", help="bytes per transfer (default 1Gi)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--dir",
        default=os.path.join(REPO, "bench_out", "nvme"),
        help="directory on the disk to measure (not tmpfs)",
    )
    ap.add_argument("--no-dd", action="store_true", help="skip the dd baseline")
    ap.add_argument("--subgroups", type=int, default=8, help="nvme subgroups for the tier rows")
    ap.add_argument("--io-banks", type=int, default=4, help="read buffers in flight (pipelined row)")
    ap.add_argument(
        "--compressed-only",
        action="store_true",
        help="only the compressed-state rows (fp32 state vs bf16 moments + remainders)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    nbytes = parse_size(args.bytes)
    if nbytes <= 0 or nbytes % 4096:
        sys.exit(f"--bytes must be a positive multiple of 4096 (O_DIRECT), got {nbytes}")
    os.makedirs(args.dir, exist_ok=True)
    kind = fs_type(args.dir)
    if kind in ("tmpfs", "ramfs"):
        sys.exit(
            f"--dir {args.dir} is on {kind}: that measures memory, not a disk; "
            f"pass a directory on the disk (see `df`)"
        )
    free = shutil.disk_usage(args.dir).free
    if free < 4 * nbytes:
        sys.exit(
            f"--dir {args.dir} has {free / 2**30:.1f} GiB free; this run needs {4 * nbytes / 2**30:.1f} GiB"
        )

    workdir = tempfile.mkdtemp(prefix="bench_nvme_", dir=args.dir)
    path = os.path.join(workdir, "raw.bin")
    print(
        f"# NVMe raw I/O: {nbytes / 2**30:.2f} GiB sequential, {args.reps} reps, "
        f"{workdir} ({kind}), {host_description()}"
    )
    rows = []
    try:
        if args.compressed_only:
            rows += compressed_rows(args, workdir, nbytes)
            return _report(rows, args)
        buf = aligned_buffer(nbytes)
        block = os.urandom(MiB)  # incompressible, and every page touched before timing
        for off in range(0, nbytes, MiB):
            buf[off : off + MiB] = block[: min(MiB, nbytes - off)]
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
        rows += tier_rows(args, workdir, nbytes, rows)
        buf.close()
        rows += compressed_rows(args, workdir, nbytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _report(rows, args)


def _report(rows: list, args) -> None:
    for op in ("write", "read"):
        dd = next((r["gb_per_s"] for r in rows if r["impl"].startswith("dd") and r["op"] == op), None)
        for r in rows:
            if r["op"] == op and dd:
                r["_vs_dd"] = r["gb_per_s"] / dd
    table = sorted(rows, key=lambda r: (r["op"] != "write", r["impl"], r["threads"] or 0))
    print(
        markdown_table(
            table,
            [
                ("impl", "impl", "s"),
                ("op", "op", "s"),
                ("threads", "threads", "d"),
                ("median_s", "median s", ".3f"),
                ("p20_s", "p20 s", ".3f"),
                ("p80_s", "p80 s", ".3f"),
                ("gb_per_s", "GB/s", ".2f"),
                ("_vs_dd", "vs dd", ".2f"),
                ("file_bytes_per_param", "file B/param", ".2f"),
                ("ratio_to_fp32_state", "vs fp32 state", ".2f"),
            ],
        )
    )
    for r in rows:
        r.pop("_vs_dd", None)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
