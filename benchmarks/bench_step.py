"""End to end: full training iterations (forward + backward + step).

Two studies, one script:

    python benchmarks/bench_step.py [--layers 8] [--width 2048] [--batch 16] [--iters 10]
                                    [--offload 1.0] [--json out.json] [--png out.png]

  Speculation (issue 7): HybridAdamW at one placement with speculation on and off, next to
  torch's fused AdamW in process. The default model, 8 x Linear(2048, 2048) at batch 16
  (33.6M parameters), is one where backward takes about as long as the host step here.

    python benchmarks/bench_step.py --peers [--layers 12] [--width 4096] [--batch 16] ...

  Peers and the scheduler (issue 8), default model 12 x Linear(4096, 4096) (201M parameters):
  device-only (torch AdamW(fused=True) in process), HybridAdamW "auto", HybridAdamW at fixed
  offload fractions (a sweep, speculation on; the ends also with it off), DeepSpeed's CPU Adam
  (DeepSpeedCPUAdam stepping in process after backward, ZeRO-Offload's optimizer) when
  importable, torchao's CPUOffloadOptimizer when CUDA is present. For each hybrid row the
  cost model's prediction (calibrated rates + the forward/backward measured here without an
  optimizer) stands next to the measured times.

Both print a markdown table (median, p20, p80 over --iters iterations after warm-up) and
write `--json` records and a `--png` bar chart when asked. With CUDA (or `--fresh-rows`) each
peer row runs in a fresh process, so its peak device memory is its own: in one process a
torchao row's model stayed alive (its optimizer's hooks hold it) into every later row's peak.

torch's CPU allocator is run with transparent huge pages (THP_MEM_ALLOC_ENABLE=1 unless set
otherwise): each iteration's fresh grads (800 MB at 201M parameters) otherwise cost ~200k
page faults, whose cost in a VM swings by 2-3x from moment to moment and drowns every
optimizer's step in noise; with 2 MB pages it is ~6.5k.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read once, when torch is imported
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, write_json  # noqa: E402

from hybrid_opt import HybridAdamW  # noqa: E402
from hybrid_opt.testing import debug_view


def make_model(layers: int, width: int, device):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)


def _quantiles(xs: list) -> dict:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]  # noqa: E731
    return {"median_ms": pick(0.5), "p20_ms": pick(0.2), "p80_ms": pick(0.8)}


def summarize(samples: dict) -> dict:
    out = _quantiles(samples["it"])
    out["fwd_bwd_ms"] = _quantiles(samples["fb"])["median_ms"]
    out["step_ms"] = _quantiles(samples["st"])["median_ms"]
    return out


class Runner:
    """Times iterations split into forward+backward and step."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.x = torch.randn(args.batch, args.width, device=device)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, model, opt, warmup: int, on_step=None) -> dict:
        return summarize(self.samples(model, opt, warmup, on_step))

    def iteration(self, model, opt) -> tuple[float, float]:
        """One training iteration: (forward+backward ms, step ms), adding up to its wall time.
        On CUDA nothing waits between backward and step(), as in a training loop: a device-wide
        sync there would also wait for the D2H copies speculation's hooks queued on their side
        stream, and so run them before step() instead of beside it (the H200's speculative row,
        fwd+bwd 2.7 -> 14.4 ms, held about the D2H of every grad). forward+backward is the
        current stream's time between two events; the step is the rest of the iteration."""
        self._sync()
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            start, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        opt.zero_grad(set_to_none=True)
        model(self.x).square().mean().backward()
        if cuda:
            after.record()
        t1 = time.perf_counter()
        opt.step()
        self._sync()
        total = (time.perf_counter() - t0) * 1e3
        fb = start.elapsed_time(after) if cuda else (t1 - t0) * 1e3
        return fb, total - fb

    def samples(self, model, opt, warmup: int, on_step=None) -> dict:
        fb, st, it = [], [], []
        for k in range(warmup + self.args.iters):
            f, s = self.iteration(model, opt)
            if k >= warmup:
                fb.append(f)
                st.append(s)
                it.append(f + s)
                if on_step:
                    on_step()
        return {"it": it, "fb": fb, "st": st}

    def call_samples(self, fn, warmup: int = 2) -> list:
        """ms of each of `--iters` calls of `fn` after `warmup`."""
        ts = []
        for k in range(warmup + self.args.iters):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            if k >= warmup:
                ts.append((time.perf_counter() - t0) * 1e3)
        return ts

    def fwd_bwd(self, model):
        """One forward+backward of `model` without an optimizer, as a callable."""

        def run():
            model.zero_grad(set_to_none=True)
            model(self.x).square().mean().backward()

        return run

    def fwd_bwd_alone(self, model) -> dict:
        return _quantiles(self.call_samples(self.fwd_bwd(model)))


def _release(model) -> None:
    """Frees the params and grads of a row's model now, even where its optimizer still holds
    them: torchao's CPUOffloadOptimizer registers a post-accumulate-grad hook on each param
    whose closure holds the optimizer, which holds the param, a cycle through the autograd
    hook that the gc never collects. The rows after it then count that model's params and
    grads in their peak device memory: 8 B/param, the +1.5 GB by which "auto" (4,702 MB) and
    offload 0 (4,710 MB) exceeded torch fused AdamW's 3,139 MB on an H200 at 201M params, in a
    one-round study where they ran after torchao's row (3,163 and 3,170 MB in one without it)."""
    with torch.no_grad():
        for p in model.parameters():
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _peak_device_mb(device):
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def _reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _hybrid_samples(runner, args, device, n_params, warmup=3, **kw) -> tuple[dict, dict]:
    """Raw samples of one HybridAdamW configuration, and what describes it."""
    model = make_model(args.layers, args.width, device)
    _reset_peak(device)
    with HybridAdamW(model.parameters(), lr=1e-4, subgroup_numel=args.subgroup_numel, **kw) as opt:
        worker, hidden = [], []

        def record():
            worker.append(opt.stats.get("worker_s", 0.0) * 1e3)
            hidden.append(opt.stats.get("hidden_s", 0.0) * 1e3)

        samples = runner.samples(model, opt, warmup, record)
        samples.update(worker=worker, hidden=hidden)
        spec = opt.stats.get("speculation") or {}
        # as the OS reports them (the arena's allocated pages: dormant spare banks have none)
        held = opt.allocated_bytes
        host_bytes = held["host"] + (held["device"] if device.type != "cuda" else 0)
        info = {
            "committed": spec.get("committed", 0),
            "redone": spec.get("redone", 0),
            "host_bytes_per_param": host_bytes / n_params,
            "peak_device_mb": _peak_device_mb(device),
            "plan": repr(opt.plan),
            "fractions": list(debug_view(opt).fractions),
            "spare_banks": opt.plan.spare_banks,
            "spares_awake": debug_view(opt).host.spares_awake if debug_view(opt).host is not None else 0,
            "speculative": opt.speculative,
        }
        if debug_view(opt).planner is not None:
            info["refit_moves"] = debug_view(opt).planner.moves
    _release(model)
    del model
    return samples, info


def _row(label: str, samples: dict, info: dict) -> dict:
    row = {"impl": label, **summarize(samples), **info}
    if samples.get("worker"):
        w, h = _quantiles(samples["worker"])["median_ms"], _quantiles(samples["hidden"])["median_ms"]
        row.update(worker_ms=w, hidden_pct=100 * h / w if w else None)
    return row


def _hybrid_row(runner, args, device, n_params, label, warmup=3, **kw) -> dict:
    return _row(label, *_hybrid_samples(runner, args, device, n_params, warmup, **kw))


def speculation_study(args, device) -> list:
    runner = Runner(args, device)
    rows = []
    model = make_model(args.layers, args.width, device)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rows.append({"impl": "torch AdamW(fused=True), in process", **runner.run(model, ref, 2)})
    rows.append({"impl": "forward+backward alone, all cores", **runner.fwd_bwd_alone(model)})
    del model, ref
    n = args.layers * (args.width * args.width + args.width)
    for speculative in (False, True):
        rows.append(
            _hybrid_row(
                runner,
                args,
                device,
                n,
                f"HybridAdamW offload {args.offload}, speculative={speculative}",
                offload_fraction=args.offload,
                speculative=speculative,
                spare_banks=64,
            )
        )
    seq = next(r for r in rows if "speculative=False" in r["impl"])
    spec = next(r for r in rows if "speculative=True" in r["impl"])
    spec["vs_sequential"] = spec["median_ms"] / seq["median_ms"]
    return rows


def _plain_samples(runner, args, device, make_opt, warmup=2) -> tuple[dict, dict]:
    model = make_model(args.layers, args.width, device)
    _reset_peak(device)
    opt = make_opt(model.parameters())
    samples = runner.samples(model, opt, warmup)
    info = {"peak_device_mb": _peak_device_mb(device)}
    _release(model)
    del model, opt
    return samples, info


def _peer_configs(args, device) -> tuple[list, list]:
    """[(label, make_opt or None, info, hybrid kwargs)] of the peers that can run here, and
    notes on those that cannot."""
    configs, notes = [], []
    configs.append(
        (
            "device only: torch AdamW(fused=True)",
            lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
            {"host_bytes_per_param": 8.0 if device.type != "cuda" else 0.0},
            None,
        )
    )
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if device.type == "cuda":
            notes.append(
                "DeepSpeedCPUAdam skipped on a GPU host: it needs ZeRO-Offload's engine "
                "around it to move grads and params"
            )
        else:
            configs.append(
                (
                    "DeepSpeedCPUAdam (ZeRO-Offload's CPU Adam), in process",
                    lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, adamw_mode=True),
                    {"host_bytes_per_param": 8.0},
                    None,
                )
            )
    except Exception as e:  # not installed, or its extension cannot build here
        notes.append(f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {e}")
    if device.type != "cuda":
        notes.append("torchao CPUOffloadOptimizer skipped: it needs CUDA")
    else:
        try:
            try:
                from torchao.optim import CPUOffloadOptimizer
            except ImportError:  # older torchao keeps it in its prototype namespace
                from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
            configs.append(
                (
                    "torchao CPUOffloadOptimizer(AdamW fused)",
                    lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, lr=1e-4, fused=True),
                    {"host_bytes_per_param": 16.0},
                    None,
                )
            )
        except Exception as e:
            notes.append(f"torchao CPUOffloadOptimizer skipped: {type(e).__name__}: {e}")
    # "auto" first refits after 5 steps: warm up past it so the rows time the refitted plan
    configs.append(('HybridAdamW "auto"', None, {}, dict(offload_fraction="auto", warmup=7)))
    for off in args.sweep:
        configs.append((f"HybridAdamW offload {off:g}", None, {}, dict(offload_fraction=off)))
    for off in sorted({min(args.sweep, key=lambda f: abs(f - 0.5)), max(args.sweep)}):
        if off > 0:
            configs.append(
                (
                    f"HybridAdamW offload {off:g}, no speculation",
                    None,
                    {},
                    dict(offload_fraction=off, speculative=False),
                )
            )
    for share in args.worker_shares:
        # the worker's share of the cores: on a GPU host the trainer needs few (the H200 host's
        # worker stepped 2.75 Gelem/s on 8 of 16 cores, the in-process kernel 4.96 on 16)
        configs.append(
            (
                f"HybridAdamW offload {max(args.sweep):g}, worker_share {share:g}",
                None,
                {},
                dict(offload_fraction=max(args.sweep), worker_share=share),
            )
        )
    return configs, notes


def _predictions(rows, args, device, n_params, fwd_bwd_ms, rates, suffix=""):
    """The cost model's figures for each hybrid row's laid-out placement, from rates
    calibrated in this run and the forward+backward measured without an optimizer."""
    from hybrid_opt.placement import cost_model as cm
    from hybrid_opt.placement.scheduler import machine_from_rates

    machine = machine_from_rates(rates, device)
    wl = cm.Workload(
        params=float(n_params),
        model_bytes=4,
        grad_bytes=4,
        backward_seconds=fwd_bwd_ms / 1e3 * cm.BACKWARD_SHARE,
        subgroup_numel=args.subgroup_numel,
    )
    for r in rows:
        if "fractions" not in r:
            continue
        wl.speculative = r.get("speculative", True)
        p = cm.predict(machine, wl, *r["fractions"], r.get("spare_banks"))
        r["pred_iteration_ms" + suffix] = p.iteration_seconds * 1e3
        r["pred_vs_measured" + suffix] = p.iteration_seconds * 1e3 / r["median_ms"]
        if not suffix:
            r["pred_step_ms"] = p.step_seconds * 1e3
            r["pred_step_vs_measured"] = p.step_seconds * 1e3 / r["step_ms"] if r["step_ms"] else None


def _trainer_split(device):
    """The worker's CoreSplit where a worker takes cores from the trainer (CPU-only, two or
    more cores), else None."""
    from hybrid_opt.worker.client import CoreSplit

    split = CoreSplit(0.5)
    return split if device.type != "cuda" and split.separate else None


def _time_alone(runner, args, device, split, alone: dict) -> None:
    """This model's forward+backward without an optimizer, at this moment of the run, appended
    to `alone`: on every core, and where a worker takes cores (`split`) also on the trainer's
    alone and there while Adam streams on the worker's — the cost model's inputs measured
    with the same statistic and at the same moments as the rows they predict (the
    calibration's best-of-a-few times of a small probe, against medians that a noisy VM
    inflates most on all cores, overpredicted the rows without speculation by 1.3-1.5x)."""
    from hybrid_opt.placement import calibrate

    model = make_model(args.layers, args.width, device)
    run = runner.fwd_bwd(model)
    if split is None:
        alone["all"] += runner.call_samples(run)
    else:
        for k, ts in calibrate.trainer_times(split.trainer, split.worker, run, runner.call_samples).items():
            alone[k] += ts
    _release(model)
    del model


def _model_rates(rates: dict, alone: dict, notes: list) -> dict:
    """The rates with the trainer's slowdown factors of this model's own forward+backward
    (medians over the rounds) in place of the calibration's probe."""
    from hybrid_opt.placement import calibrate

    if not alone.get("trainer"):
        return rates
    med = {k: _quantiles(v)["median_ms"] for k, v in alone.items()}
    slow, contention = calibrate.factors_of(med["all"], med["trainer"], med["contended"])
    notes.append(
        f"this model's fwd+bwd without an optimizer (medians over the rounds): all cores "
        f"{med['all']:.1f} ms, the trainer's {med['trainer']:.1f} ms ({slow:.2f}x), there while Adam "
        f"streams on the worker's {med['contended']:.1f} ms ({contention:.2f}x more); the "
        f"calibration's probe (best times): {rates['trainer_slowdown_with_worker']:.2f}x, "
        f"{rates['backward_slowdown_with_host_adam']:.2f}x. Predictions use this model's, "
        f'"pred/meas (probe)" the probe\'s'
    )
    return dict(rates, trainer_slowdown_with_worker=slow, backward_slowdown_with_host_adam=contention)


def peer_study(args, device) -> tuple[list, list]:
    """Every configuration once per round, `--rounds` rounds (drift on a noisy machine hits them
    all alike); each row pools its samples over the rounds."""
    from hybrid_opt.placement import calibrate

    runner = Runner(args, device)
    n = args.layers * (args.width * args.width + args.width)
    configs, notes = _peer_configs(args, device)
    # the machine's rates now, not a cached calibration from another moment of a noisy host
    rates = calibrate.measure(device)
    notes.append(
        "calibrated in this run: "
        + ", ".join(f"{k} {v:.3g}" for k, v in rates.items() if isinstance(v, float) and k != "seconds")
    )
    split = _trainer_split(device)
    pooled = {label: {} for label, *_ in configs}
    per_round = []  # {label: median iteration ms} of each round: ratios paired within a round
    infos = {label: dict(info) for label, _, info, _ in configs}
    alone = {"all": [], "trainer": [], "contended": []}
    for r in range(args.rounds):
        # every round: the predictions compare with rows measured under the same drift
        _time_alone(runner, args, device, split, alone)
        # each round starts one configuration later, every other one in reverse order, so no
        # configuration always follows the same one (in a fixed order "auto" ran 11-17 %
        # slower than the same placement one row later)
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for label, make_opt, _, hybrid in order[::-1] if r % 2 else order:
            if args.fresh_rows:
                samples, info = _row_in_a_fresh_process(args, label)
            else:
                samples, info = _one_row(runner, args, device, n, make_opt, hybrid)
            infos[label].update(info)
            if r == len(per_round):
                per_round.append({})
            per_round[r][label] = summarize(samples)["median_ms"]
            for k, xs in samples.items():
                pooled[label].setdefault(k, []).extend(xs)
            print(
                f"  round {r + 1}/{args.rounds}: {label}: {summarize(samples)['median_ms']:.1f} ms",
                file=sys.stderr,
            )
    rows = [_row(label, pooled[label], infos[label]) for label, *_ in configs]
    paired = _paired(runner, args, device, configs, n)
    for r in rows:
        if r["impl"] in paired:
            r["paired_ms"], r["paired_step_ms"] = paired[r["impl"]]
    if 'HybridAdamW "auto"' in paired:
        base = paired['HybridAdamW "auto"']
        short = {k: k.split(" (")[0].split(":")[0] for k in paired}
        notes.append(
            "in-process configurations interleaved iteration by iteration, iteration (step) ms: "
            + ", ".join(f"{k} {it:.1f} ({st:.1f})" for k, (it, st) in paired.items())
            + "; auto / "
            + ", auto / ".join(
                f"{short[k]} {base[0] / it:.3f} (step {base[1] / st:.3f})"
                for k, (it, st) in paired.items()
                if "auto" not in k
            )
        )
    fwd_bwd = _quantiles(alone["all"])
    model_rates = _model_rates(rates, alone, notes)
    _predictions(rows, args, device, n, fwd_bwd["median_ms"], model_rates)
    if model_rates is not rates:
        _predictions(rows, args, device, n, fwd_bwd["median_ms"], rates, suffix="_probe")
    auto = next(r for r in rows if '"auto"' in r["impl"])
    # the fixed fractions at auto's own settings (speculation on, the default worker_share)
    sweep = [r for r in rows if r["impl"].startswith("HybridAdamW offload") and "," not in r["impl"]]
    best = min(sweep, key=lambda r: r["median_ms"])
    auto["vs_best_fixed"] = auto["median_ms"] / best["median_ms"]
    ds = next((r for r in rows if r["impl"].startswith("DeepSpeed")), None)
    if ds:
        auto["vs_deepspeed"] = auto["median_ms"] / ds["median_ms"]
    # the same ratio within each round (drift between rounds cancels), median over rounds; the
    # best fraction is picked once, from the pooled medians (a per-round minimum over the sweep
    # would pick whichever configuration the noise favoured in that round)
    paired = sorted(m[auto["impl"]] / m[best["impl"]] for m in per_round)
    auto["vs_best_fixed_paired"] = paired[len(paired) // 2]
    notes.append(f"auto / {best['impl']}, per round: " + ", ".join(f"{x:.3f}" for x in paired))
    if ds:
        pds = sorted(m[auto["impl"]] / m[ds["impl"]] for m in per_round)
        auto["vs_deepspeed_paired"] = pds[len(pds) // 2]
        notes.append("auto / DeepSpeedCPUAdam, per round: " + ", ".join(f"{x:.3f}" for x in pds))
    notes.append(
        f"forward+backward alone (all cores, no optimizer): {fwd_bwd['median_ms']:.1f} ms "
        f"(p20 {fwd_bwd['p20_ms']:.1f}, p80 {fwd_bwd['p80_ms']:.1f})"
    )
    notes.append(
        f'"auto" chose {auto["plan"]}; best fixed fraction of the sweep: {best["impl"]} '
        f"({best['median_ms']:.1f} ms); auto / best = {auto['vs_best_fixed']:.3f}"
        + (f"; auto / DeepSpeedCPUAdam = {auto['vs_deepspeed']:.3f}" if ds else "")
    )
    return rows, notes


def _one_row(runner, args, device, n, make_opt, hybrid) -> tuple[dict, dict]:
    """One configuration's raw samples and info, in this process."""
    if make_opt is not None:
        return _plain_samples(runner, args, device, make_opt)
    kw = dict(hybrid)
    return _hybrid_samples(runner, args, device, n, kw.pop("warmup", 3), **kw)


ROW_DEADLINE_S = 600


def _row_in_a_fresh_process(args, label: str) -> tuple[dict, dict]:
    """`_one_row` of `label` in a fresh interpreter (--one-row): nothing of an earlier row — a
    peer's leaked model, the allocator's cached blocks, a worker — is alive in it, so its peak
    device memory is its own. The samples come back as JSON."""
    import json
    import subprocess
    import tempfile

    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--peers",
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--batch",
        str(args.batch),
        "--iters",
        str(args.iters),
        "--subgroup-numel",
        str(args.subgroup_numel),
        "--device",
        args.device,
        "--sweep",
        *(f"{f:g}" for f in args.sweep),
        "--worker-shares",
        *(f"{f:g}" for f in args.worker_shares),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        res = subprocess.run(
            argv + ["--one-row", label, "--row-out", out],
            capture_output=True,
            text=True,
            timeout=ROW_DEADLINE_S,
            start_new_session=True,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"the row {label!r} failed in its own process (exit {res.returncode}):\n"
                f"{res.stdout[-2000:]}{res.stderr[-4000:]}"
            )
        with open(out) as f:
            got = json.load(f)
    return got["samples"], got["info"]


def run_one_row(args, device) -> int:
    """--one-row: the peer study's row `args.one_row`, once, written to --row-out as JSON."""
    import json

    configs, _ = _peer_configs(args, device)
    match = [c for c in configs if c[0] == args.one_row]
    if not match:
        print(f"no peer row {args.one_row!r} here; the rows: {[c[0] for c in configs]}", file=sys.stderr)
        return 2
    label, make_opt, _, hybrid = match[0]
    n = args.layers * (args.width * args.width + args.width)
    samples, info = _one_row(Runner(args, device), args, device, n, make_opt, hybrid)
    with open(args.row_out, "w") as f:
        json.dump({"samples": samples, "info": info}, f)
    return 0


def _paired(runner, args, device, configs, n) -> dict:
    """The in-process configurations (no worker: torch, DeepSpeed, "auto" when it keeps
    everything on the device, offload 0) alive at once, one iteration each in turn, so
    they share every moment of a noisy machine: {label: (median iteration ms, median step
    ms)}. A worker would take a core from all of them, so configurations with one are not
    paired."""
    live = []
    try:
        for label, make_opt, _, hybrid in configs:
            if make_opt is None and hybrid.get("offload_fraction") not in ("auto", 0.0):
                continue
            model = make_model(args.layers, args.width, device)
            if make_opt is not None:
                opt = make_opt(model.parameters())
            else:
                kw = {k: v for k, v in hybrid.items() if k != "warmup"}
                opt = HybridAdamW(model.parameters(), lr=1e-4, subgroup_numel=args.subgroup_numel, **kw)
                if debug_view(opt).host is not None:  # "auto" chose a worker here: not an in-process row
                    opt.close()
                    continue
            live.append((label, model, opt))
        times = {label: ([], []) for label, *_ in live}
        for _ in range(6):  # warm-up rounds ("auto" refits after 5 steps)
            for label, model, opt in live:
                runner.iteration(model, opt)
        for k in range(args.iters * args.rounds):
            order = live[k % len(live) :] + live[: k % len(live)]
            for label, model, opt in order:
                fb, st = runner.iteration(model, opt)
                times[label][0].append(fb + st)
                times[label][1].append(st)
        return {
            label: (_quantiles(it)["median_ms"], _quantiles(st)["median_ms"])
            for label, (it, st) in times.items()
        }
    finally:
        for _, _, opt in live:
            if hasattr(opt, "close"):
                opt.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", action="store_true", help="the peer/scheduler study (issue 8)")
    ap.add_argument("--layers", type=int, default=None, help="default 8, or 12 with --peers")
    ap.add_argument("--width", type=int, default=None, help="default 2048, or 4096 with --peers")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="peer study: rounds over every configuration")
    ap.add_argument("--offload", type=float, default=1.0, help="placement of the speculation study")
    ap.add_argument(
        "--sweep",
        type=float,
        nargs="+",
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="fixed offload fractions of the peer study",
    )
    ap.add_argument(
        "--worker-shares",
        type=float,
        nargs="*",
        default=[],
        help="peer study: also the largest offload fraction at these worker_share values",
    )
    ap.add_argument("--subgroup-numel", type=int, default=None, help="default 2Mi, or 4Mi with --peers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument(
        "--fresh-rows",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="peer study: each row in a fresh process, so no row's memory counts in "
        "another's peak (default: on with CUDA)",
    )
    ap.add_argument("--one-row", default=None, help=argparse.SUPPRESS)  # a fresh process's row
    ap.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.layers = args.layers or (12 if args.peers else 8)
    args.width = args.width or (4096 if args.peers else 2048)
    args.subgroup_numel = args.subgroup_numel or (1 << 22 if args.peers else 1 << 21)
    device = torch.device(args.device)
    if args.fresh_rows is None:
        args.fresh_rows = device.type == "cuda"
    if args.one_row is not None:
        return run_one_row(args, device)
    n = args.layers * (args.width * args.width + args.width)
    print(
        f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch}: {n / 1e6:.1f}M "
        f"parameters; torch {torch.__version__}; {device}; {os.cpu_count()} cpus"
    )
    if args.peers:
        rows, notes = peer_study(args, device)
        cols = [
            ("impl", "impl", "s"),
            ("median_ms", "iteration ms", ".1f"),
            ("p20_ms", "p20", ".1f"),
            ("p80_ms", "p80", ".1f"),
            ("paired_ms", "interleaved ms", ".1f"),
            ("paired_step_ms", "interleaved step ms", ".1f"),
            ("fwd_bwd_ms", "fwd+bwd ms", ".1f"),
            ("step_ms", "step ms", ".1f"),
            ("pred_iteration_ms", "predicted it. ms", ".1f"),
            ("pred_step_ms", "predicted step ms", ".1f"),
            ("pred_vs_measured", "pred/meas it.", ".2f"),
            ("pred_vs_measured_probe", "pred/meas (probe)", ".2f"),
            ("hidden_pct", "% hidden", ".0f"),
            ("host_bytes_per_param", "host B/param", ".1f"),
            ("peak_device_mb", "peak device MB", ".0f"),
        ]
    else:
        rows, notes = speculation_study(args, device), []
        cols = [
            ("impl", "impl", "s"),
            ("median_ms", "iteration ms", ".1f"),
            ("p20_ms", "p20", ".1f"),
            ("p80_ms", "p80", ".1f"),
            ("step_ms", "step ms", ".1f"),
            ("worker_ms", "worker ms", ".1f"),
            ("hidden_pct", "% hidden", ".0f"),
            ("committed", "committed", "d"),
            ("redone", "redone", "d"),
            ("vs_sequential", "vs sequential", ".3f"),
        ]
    print(markdown_table(rows, cols))
    for note in notes:
        print(f"- {note}")
    write_json(
        args.json, [dict(r, numel=n, layers=args.layers, width=args.width, batch=args.batch) for r in rows]
    )
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.2))
        names = [r["impl"] for r in rows]
        ax.barh(
            names,
            [r["median_ms"] for r in rows],
            xerr=[[r["median_ms"] - r["p20_ms"] for r in rows], [r["p80_ms"] - r["median_ms"] for r in rows]],
        )
        if args.peers:
            ys = [k for k, r in enumerate(rows) if "pred_iteration_ms" in r]
            ax.scatter(
                [rows[k]["pred_iteration_ms"] for k in ys],
                ys,
                marker="x",
                color="k",
                zorder=3,
                label="cost model's prediction",
            )
            ax.legend(loc="lower right")
        ax.invert_yaxis()
        ax.set_xlabel("ms per iteration (median, p20-p80)")
        ax.set_title(
            f"{args.layers} x Linear({args.width}), batch {args.batch}, {n / 1e6:.0f}M params, {device}",
            fontsize=10,
        )
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
