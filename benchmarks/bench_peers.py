"""HybridAdamW next to its peers: the side-by-side a user asks for before switching (issue 21, 7).

One GPT-shaped model (`peers_model.py`: the same module, model, init and batch stream in every
row and in both interpreters), the same global batch stream (8 x 64 tokens by default, split
among the ranks) and hyperparameters (AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
decay 0.01, global-norm clipping at 1.0, the whole optimizer state off the device where the
row offloads: offload 1.0) at 1 and 2 ranks (gloo on CPU, NCCL where CUDA exists), each row
configured as its own documentation says:

- HybridAdamW: plain params (at 2 ranks under DDP: replicated state), FSDP2 (`fully_shard` per
  block) and `process_group=WORLD`, each with fp32 state and with bf16 moments
  (`exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16`; `store_param_remainders=True` too where
  the params are bf16 — these are fp32, so it is not set); `process_group` with
  `rollback="inverse"`, and with `rollback="inverse", release_grads=True` (skipped, saying
  so, where HybridAdamW has no `release_grads`); nvme_fraction 0.5 and 1.0 for each mode;
- DeepSpeed (in an interpreter of its own, `--peer-python`): ZeRO-2 + CPU optimizer offload,
  ZeRO-3 + CPU optimizer offload, ZeRO-3 + nvme optimizer offload (`peers_rows.ds_config()`; the rows and each launch's body are in `peers_rows.py`);
- torch: DDP + `AdamW(fused=True)`, FSDP2 + `AdamW` (clipping by `clip_grad_norm_`).

Every row is a launch of its own (`torch.distributed.run --standalone`, one process tree, so
its memory is its own), bounded by `--timeout`: past it the whole tree is killed (the ranks'
workers too) and the row is reported failed. Rounds alternate between the configurations:
each round launches every row once, in an order rotated (and reversed every other round)
from the round before. The first `--warmup` of the `--steps` iterations are not timed.

Columns (JSON keys in brackets; one record per row and rank count):
- iteration (forward + backward + clip + step, after a barrier) of the slowest rank, per
  iteration, pooled over the rounds: median, p20, p80 [median, p20, p80: ms];
- PSS per rank: `psutil`'s `memory_full_info().pss` of the rank's process plus its children
  (the HybridAdamW worker), after the last step [pss: bytes per rank, max over rounds];
- `opt.allocated_bytes` where the optimizer has it (`{"device","host","nvme","comm"}`, else
  None, "—" in the table) [allocated: per rank];
- nvme bytes on disk: the apparent sizes of the files under the rank's own nvme_path after
  the last step, before close [nvme_bytes: per rank];
- the params' max relative deviation from the DDP run's at the same rank count, same round:
  the max over the param tensors of ||p - p_ddp||_2 / ||p_ddp||_2 [max_dev] (per tensor, not per
  element: Adam's first steps turn a rounding-level grad of either sign into a +-lr step, so
  an element of a rarely-seen embedding row can differ by ~lr in any two correct runs);
- and [impl, config, ranks, device, versions, timestamp, skipped] (skipped: None, or why the
  row has no figures: a missing peer, a missing keyword, a failed or overrun launch).

Writes `--json` (a list of those records), `--md` (the table, with what was skipped and the
command) and `--png` (iteration and PSS per rank, per row).

    python benchmarks/bench_peers.py [--peer-python /work/ds-venv/bin/python] [--ranks 1,2]
        [--rows all|no-peers|KEY,...] [--rounds 3] [--steps 16] [--warmup 2]
        [--d-model 512 --layers 6 --vocab 4096 --heads 8 --seq 64 --batch 8]
        [--json F] [--md F] [--png F] [--nvme-dir DIR] [--timeout 900]

DeepSpeed never enters the project's environment: make its venv with
`python3 -m venv /work/ds-venv && /work/ds-venv/bin/pip install torch==2.13.0 deepspeed==0.19.8
ninja psutil numpy` (and `apt-get install libaio-dev` for the nvme row). On CPU it runs with
`DS_ACCELERATOR=cpu` and `deepspeed.init_distributed("gloo")`; its ops (cpu_adam, async_io)
are JIT-built once, before the rounds, outside every timing (`--build-timeout`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import peers_model as M  # noqa: E402  (no hybrid_opt inside: the peer interpreter imports it too)
from peers_rows import BY_KEY, CLIP, GROUPS, HYPER, OFFLOAD, REFERENCE, has_release_grads, rank_main  # noqa: E402


def _q(xs: list, k: int) -> float:
    xs = sorted(xs)
    return statistics.quantiles(xs, n=10, method="inclusive")[k] if len(xs) > 1 else xs[0]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _run_bounded(
    cmd: list, env: dict, log: str, timeout: float, cwd: str | None = None
) -> tuple[int | None, float]:
    """(exit status or None past the deadline, seconds): the command in a session of its own,
    output to `log`; past `timeout` its whole tree is killed (tests/dist_launch.py's pattern)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from dist_launch import _kill_tree

    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.wait()
            return None, time.monotonic() - t0
    return proc.returncode, time.monotonic() - t0


def _env(args, row: dict, ranks: int, out: str, nvme_root: str) -> dict:
    env = dict(
        os.environ,
        BENCH_OUT=out,
        OMP_NUM_THREADS=str(max(1, _cores() // ranks)),
        TORCHELASTIC_ERROR_FILE=os.path.join(out, "error.json"),
    )
    if row["mode"] == "ds":
        # only this directory: the peer interpreter must not find hybrid_opt
        env["PYTHONPATH"] = os.pathsep.join(
            [HERE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
        if args.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
    else:
        env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])
    return env


def probe_peer(args) -> tuple[dict | None, str | None]:
    """(the peer's versions, None) or (None, why the DeepSpeed rows are skipped)."""
    if not args.peer_python:
        return None, (
            "no --peer-python given (DeepSpeed lives in a venv of its own: python3 -m venv "
            "/work/ds-venv && /work/ds-venv/bin/pip install torch==2.13.0 deepspeed==0.19.8 ninja "
            "psutil numpy; then --peer-python /work/ds-venv/bin/python)"
        )
    if not (os.path.isfile(args.peer_python) and os.access(args.peer_python, os.X_OK)):
        return None, f"--peer-python {args.peer_python}: no such interpreter"
    code = (
        "import json, sys, torch, deepspeed, psutil; print('PEER ' + json.dumps(dict(python=sys.version.split()[0], "
        "torch=torch.__version__, deepspeed=deepspeed.__version__, cuda=torch.cuda.is_available())))"
    )
    env = dict(os.environ, PYTHONPATH=HERE)
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    try:
        res = subprocess.run(
            [args.peer_python, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
    except subprocess.TimeoutExpired:
        return None, f"{args.peer_python} did not import deepspeed within 300 s"
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("PEER ")]
    if res.returncode != 0 or not lines:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{args.peer_python} cannot import torch + deepspeed + psutil: {last}"
    info = json.loads(lines[-1][5:])
    if args.device == "cuda" and not info["cuda"]:
        return None, f"the peer's torch {info['torch']} has no CUDA, the other rows run on CUDA"
    return info, None


def build_peer_ops(args, want_aio: bool, logdir: str) -> dict:
    """JIT-builds DeepSpeed's ops once, outside every timing: {op name: None or why it failed}."""
    ops = {"CPUAdamBuilder": None}
    if want_aio:
        ops["AsyncIOBuilder"] = None
    if args.device == "cpu":  # init_distributed builds it on the CPU accelerator (optional there)
        ops["ShareMemCommBuilder"] = None
    env = dict(os.environ, PYTHONPATH=HERE)
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    for op in ops:
        code = (
            "from deepspeed.accelerator import get_accelerator; "
            f"b = get_accelerator().create_op_builder({op!r}); "
            "assert b is not None and b.is_compatible(verbose=True), 'not compatible here'; b.load(); print('BUILT')"
        )
        log = os.path.join(logdir, f"build-{op}.log")
        t0 = time.monotonic()
        rc, _ = _run_bounded([args.peer_python, "-c", code], env, log, args.build_timeout)
        if rc != 0 or "BUILT" not in _tail(log, 10**6):
            why = (
                "no result within the build timeout"
                if rc is None
                else (_tail(log, 600).strip().splitlines() or ["?"])[-1]
            )
            ops[op] = f"DeepSpeed's {op} did not build: {why} (log {log})"
        print(
            f"peer op {op}: {'built' if ops[op] is None else ops[op]} ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
    return ops


def launch(args, row: dict, ranks: int, workdir: str, tag: str) -> dict:
    """One launch of one row: its ranks' records and rank 0's params, or {"error": why}."""
    out = os.path.join(workdir, tag)
    os.makedirs(out, exist_ok=True)
    nvme_root = os.path.join(args.nvme_dir, f"bench_peers-{os.getpid()}-{tag}")
    python = args.peer_python if row["mode"] == "ds" else sys.executable
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        f"--log-dir={os.path.join(out, 'torchelastic')}",  # not a /tmp/torchelastic_* per launch
        "--standalone",
        os.path.abspath(__file__),
        "--rank-main",
        f"--row={row['key']}",
        f"--out={out}",
        f"--nvme-root={nvme_root}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--device={args.device}",
        *M.config_from_args(args).as_args(),
    ]
    log = os.path.join(out, "log.txt")
    try:
        rc, secs = _run_bounded(cmd, _env(args, row, ranks, out, nvme_root), log, args.timeout, cwd=out)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    if rc is None:
        return dict(
            error=f"no result within {args.timeout:.0f} s (every rank and worker killed); log {log}",
            seconds=secs,
        )
    recs = []
    for r in range(ranks):
        path = os.path.join(out, f"rank{r}.json")
        if rc != 0 or not os.path.exists(path):
            lines = [ln for ln in _tail(log, 20000).splitlines() if ln.strip()]
            cause = next(
                (ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "?"
            )
            return dict(error=f"launch failed (exit {rc}): {cause.strip()[:300]}; log {log}", seconds=secs)
        with open(path) as f:
            recs.append(json.load(f))
    return dict(recs=recs, params=os.path.join(out, "params.pt"), seconds=secs)


def max_rel_dev(path: str, ref_path: str) -> float:
    import torch

    a, b = torch.load(path), torch.load(ref_path)
    if set(a) != set(b):
        raise ValueError(f"different params: {sorted(set(a) ^ set(b))[:4]}")
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in b)


def _commit() -> str | None:
    """The project's commit (+dirty where tracked files changed): what the row measured."""
    try:
        head = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def _versions(recs: list, row: dict, peer: dict | None) -> dict:
    """The interpreter's, torch's and the optimizer's versions of a row (a DeepSpeed row's are
    the peer venv's; a HybridAdamW or torch row's carry the project's commit)."""
    if recs:
        v = {k: recs[0][k] for k in ("python", "torch", "hybrid_opt", "deepspeed") if k in recs[0]}
    elif row["mode"] == "ds":
        v = dict(peer or {})
        v.pop("cuda", None)
    else:
        import torch

        v = dict(python=sys.version.split()[0], torch=torch.__version__)
    if row["mode"] != "ds":
        v["hybrid_opt_commit"] = _commit()
    return v


def _device_name(args) -> str:
    if args.device == "cuda":
        import torch

        return f"cuda ({torch.cuda.get_device_name(0)}), nccl"
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {_cores()} cores), gloo"


def select_rows(spec: str) -> list:
    keys = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if part in GROUPS:
            keys += GROUPS[part]
        elif part in BY_KEY:
            keys.append(part)
        else:
            raise SystemExit(
                f"bench_peers: unknown row {part!r}; rows: {', '.join(BY_KEY)}; groups: {', '.join(GROUPS)}"
            )
    return [BY_KEY[k] for k in dict.fromkeys(keys)]


MIB = 2**20


def _fmt_alloc(allocs: list) -> str:
    if not allocs or any(a is None for a in allocs):
        return "—"
    worst = {k: max(a.get(k, 0) for a in allocs) for k in ("device", "host", "nvme", "comm")}
    return " / ".join(f"{worst[k] / MIB:,.0f}" for k in ("device", "host", "nvme", "comm"))


def _fmt_overlap(r: dict) -> str:
    """'subgroups per rank · % of host steps committed from speculation' (HybridAdamW rows)."""
    if not r.get("subgroups") or r["subgroups"][0] is None:
        return "—"
    spec = [s for s in r.get("speculation") or [] if s]
    total = sum(s.get(k, 0) for s in spec for k in ("committed", "redone", "stepped"))
    share = f" · {100 * sum(s.get('committed', 0) for s in spec) / total:.0f} %" if total else ""
    return f"{max(r['subgroups'])}{share}"


def markdown(records: list, meta: dict) -> str:
    head = (
        "| run | ranks | iteration ms (median) | p20 | p80 | PSS / rank, MiB | allocated_bytes / rank, MiB "
        "(device / host / nvme / comm) | nvme on disk, MiB (all ranks) | max rel. dev. from DDP "
        "| subgroups / rank · speculated |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in records:
        if r["skipped"]:
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['impl']} {r['config']}",
                    str(r["ranks"]),
                    f"{r['median']:,.0f}",
                    f"{r['p20']:,.0f}",
                    f"{r['p80']:,.0f}",
                    f"{max(r['pss']) / MIB:,.0f}",
                    _fmt_alloc(r["allocated"]),
                    f"{sum(r['nvme_bytes']) / MIB:,.0f}" if sum(r["nvme_bytes"]) else "—",
                    "—" if r["max_dev"] is None else f"{r['max_dev']:.1e}",
                    _fmt_overlap(r),
                ]
            )
            + " |"
        )
    skipped = [r for r in records if r["skipped"]]
    text = "\n".join(lines)
    text += (
        f"\n\n{meta['model']}; global batch {meta['batch']} x {meta['seq']} tokens, AdamW lr {HYPER['lr']}, "
        f"weight decay {HYPER['weight_decay']}, clip {CLIP}, offload {OFFLOAD}; {meta['steps']} steps per launch, "
        f"the first {meta['warmup']} not timed; {meta['rounds']} round(s), rows alternating; the slowest rank per "
        f"iteration; {meta['device']}; PSS: trainer + worker after the last step, max over ranks; "
        f"deviation: max over the param tensors of ||p - p_DDP|| / ||p_DDP|| at the same ranks; "
        f"{meta['versions']}; {meta['timestamp']}."
    )
    if not meta["default_model"]:
        text += "\n**Not the issue's model: a smoke run, not a figure.**"
    if skipped:
        text += "\n\nNot measured (skipped, or every launch failed):\n" + "\n".join(
            f"- {r['impl']} {r['config']} at {r['ranks']} rank(s): {r['skipped']}" for r in skipped
        )
    if meta["partial"]:
        text += "\n\nFrom fewer launches than rounds:\n" + "\n".join(f"- {p}" for p in meta["partial"])
    text += f"\n\nCommand: `{meta['command']}`\n"
    return text


def plot(records: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if not r["skipped"]]
    if not rows:
        return
    labels = [f"{r['impl']} {r['config']} @{r['ranks']}" for r in rows]
    colors = {"HybridAdamW": "tab:blue", "DeepSpeed": "tab:orange", "torch": "tab:gray"}
    c = [colors.get(r["impl"], "tab:green") for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 0.35 * len(rows) + 1.5), sharey=True)
    y = list(range(len(rows)))
    med = [r["median"] for r in rows]
    err = [[r["median"] - r["p20"] for r in rows], [r["p80"] - r["median"] for r in rows]]
    a1.barh(y, med, xerr=err, color=c, capsize=2)
    a1.set_xlabel("iteration, ms (median; p20-p80), slowest rank")
    a2.barh(y, [max(r["pss"]) / MIB for r in rows], color=c)
    a2.set_xlabel("PSS per rank (trainer + worker), MiB")
    from matplotlib.patches import Patch

    a2.legend(
        handles=[Patch(color=v, label=k) for k, v in colors.items() if any(r["impl"] == k for r in rows)],
        loc="lower right",
        fontsize=8,
    )
    a1.set_yticks(y)
    a1.set_yticklabels(labels, fontsize=7)
    a1.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    M.add_model_args(ap)
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    ap.add_argument(
        "--rows",
        default="all",
        help=f"comma-separated row keys or groups ({', '.join(GROUPS)}); rows: {', '.join(BY_KEY)}",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="iterations per launch, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations of each launch not timed")
    ap.add_argument("--peer-python", default=None, help="the interpreter of DeepSpeed's own venv")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument(
        "--nvme-dir",
        default=os.path.join(REPO, "bench_out"),
        help="where each launch's nvme directories go (on the disk to measure; tmpfs is not)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch before its tree is killed")
    ap.add_argument(
        "--build-timeout", type=float, default=900, help="seconds for each DeepSpeed op's JIT build"
    )
    ap.add_argument("--json", default="bench_out/peers.json")
    ap.add_argument("--md", default="bench_out/peers.md")
    ap.add_argument("--png", default="bench_out/peers.png")
    ap.add_argument("--keep", action="store_true", help="keep the launches' logs and results (printed path)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--nvme-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)

    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.warmup >= args.steps:
        raise SystemExit("bench_peers: --warmup must be below --steps (no iteration would be timed)")
    cfg = M.config_from_args(args)
    rank_counts = [int(x) for x in args.ranks.split(",") if x]
    for w in rank_counts:
        if cfg.batch % w:
            raise SystemExit(f"bench_peers: global batch {cfg.batch} does not divide among {w} ranks")
    rows = select_rows(args.rows)
    os.makedirs(args.nvme_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_peers-")
    t_start = time.monotonic()
    print(
        f"bench_peers: {M.n_params(cfg):,} params, {len(rows)} rows x ranks {rank_counts} x {args.rounds} "
        f"round(s) on {args.device}; logs in {workdir}",
        flush=True,
    )

    skip = {}
    peer, why_no_peer = (None, None)
    if any(r["mode"] == "ds" for r in rows):
        peer, why_no_peer = probe_peer(args)
        if why_no_peer:
            skip.update({r["key"]: why_no_peer for r in rows if r["mode"] == "ds"})
        else:
            built = build_peer_ops(
                args, any(r["mode"] == "ds" and r["offload"] == "nvme" for r in rows), workdir
            )
            for r in rows:
                if r["mode"] != "ds":
                    continue
                bad = built["CPUAdamBuilder"] or (
                    built.get("AsyncIOBuilder") if r["offload"] == "nvme" else None
                )
                if bad:
                    skip[r["key"]] = bad
    if any(r.get("release_grads") for r in rows):
        from hybrid_opt import HybridAdamW  # noqa: F401

        if not has_release_grads():
            skip.update(
                {
                    r["key"]: "HybridAdamW has no release_grads keyword yet (issue 21, item 4)"
                    for r in rows
                    if r.get("release_grads")
                }
            )

    skip_ranks = {}
    if args.device == "cuda":  # NCCL: one device per rank
        skip_ranks = {
            w: f"{w} ranks need {w} GPUs, this machine has {torch.cuda.device_count()}"
            for w in rank_counts
            if w > torch.cuda.device_count()
        }
    todo = [(r, w) for w in rank_counts for r in rows if r["key"] not in skip and w not in skip_ranks]
    results = {(r["key"], w): [] for r in rows for w in rank_counts}
    errors = {}
    n = 0
    for rnd in range(args.rounds):
        k = (rnd * len(todo)) // max(1, args.rounds)
        order = todo[k:] + todo[:k]
        if rnd % 2:
            order = order[::-1]
        for row, w in order:
            n += 1
            res = launch(args, row, w, workdir, f"r{rnd}-{row['key']}-w{w}")
            status = (
                f"{statistics.median([max(v) for v in zip(*(x['times_ms'] for x in res['recs']))]):.0f} ms"
                if "recs" in res
                else res["error"]
            )
            print(
                f"[{n}/{len(todo) * args.rounds}] round {rnd} {row['key']} @{w}: {status} "
                f"(launch {res['seconds']:.0f} s)",
                flush=True,
            )
            if "recs" in res:
                results[(row["key"], w)].append(dict(res, round=rnd))
            else:
                errors.setdefault((row["key"], w), res["error"])

    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    records, partial = [], []
    for w in rank_counts:
        for row in rows:
            runs = results[(row["key"], w)]
            rec = dict(
                impl=row["impl"],
                config=row["config"],
                ranks=w,
                median=None,
                p20=None,
                p80=None,
                pss=None,
                allocated=None,
                nvme_bytes=None,
                max_dev=None,
                subgroups=None,
                speculation=None,
                device=_device_name(args),
                versions=None,
                timestamp=stamp,
                skipped=None,
            )
            if not runs:
                rec["skipped"] = (
                    skip.get(row["key"]) or skip_ranks.get(w) or errors.get((row["key"], w)) or "not run"
                )
                rec["versions"] = _versions([], row, peer)
                records.append(rec)
                continue
            its = [max(v) for run in runs for v in zip(*(x["times_ms"] for x in run["recs"]))]
            rec.update(
                median=statistics.median(its),
                p20=_q(its, 1),
                p80=_q(its, 7),
                pss=[max(run["recs"][r]["pss"] for run in runs) for r in range(w)],
                allocated=[runs[-1]["recs"][r]["allocated"] for r in range(w)],
                subgroups=[runs[-1]["recs"][r].get("subgroups") for r in range(w)],
                speculation=[run["recs"][r].get("speculation") for run in runs for r in range(w)],
                nvme_bytes=[max(run["recs"][r]["nvme_bytes"] for run in runs) for r in range(w)],
                versions=_versions(runs[0]["recs"], row, peer),
            )
            refs = {run["round"]: run["params"] for run in results.get((REFERENCE, w), [])}
            if refs:
                devs = [
                    max_rel_dev(run["params"], refs.get(run["round"], next(iter(refs.values()))))
                    for run in runs
                ]
                rec["max_dev"] = max(devs)
            if errors.get((row["key"], w)):
                partial.append(
                    f"{row['impl']} {row['config']} at {w} rank(s): {len(runs)} of {args.rounds} "
                    f"launches; a failed one: {errors[(row['key'], w)]}"
                )
            records.append(rec)

    default = cfg == M.ModelConfig()
    meta = dict(
        model=f"GPT-shaped model of {M.n_params(cfg):,} params (d_model {cfg.d_model}, {cfg.layers} "
        f"blocks, vocab {cfg.vocab})",
        batch=cfg.batch,
        seq=cfg.seq,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        device=_device_name(args),
        timestamp=stamp,
        versions=", ".join(f"{k} {v}" for k, v in _versions([], BY_KEY[REFERENCE], None).items())
        + (f", deepspeed {peer['deepspeed']} (torch {peer['torch']}, its own venv)" if peer else ""),
        default_model=default,
        partial=partial,
        command="python " + " ".join([os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:]),
    )
    text = markdown(records, meta)
    print(text)
    for path in (args.json, args.md, args.png):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.png:
        plot(records, args.png)
    print(f"wrote {args.json}, {args.md}, {args.png} in {time.monotonic() - t_start:.0f} s", flush=True)
    if args.keep or errors:
        print(f"logs and results kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
