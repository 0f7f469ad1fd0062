"""Calibration: the rates the cost model needs, measured on the running machine and cached.

`rates()` measures host and device Adam, the D2H / H2D copies, the CPU-only slowdowns and nvme
I/O, each the best of a few repetitions, and caches them under `$HYBRID_OPT_CACHE_DIR`, keyed by
what makes them stale (host, CPU, SIMD level, torch, GPU; nvme by device). `format_factor_cached()`
adds how much slower than its bytes say a state format steps on this CPU (q8 moments are
compute-bound), cached per format. Invariant: a cache that
cannot be read or written is re-measured with a warning, never an error. Design notes:
docs/internals.md."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import threading
import time
import warnings

import torch

from hybrid_opt.distributed import node

CACHE_VERSION = 3  # 3: a split worker's waited steps run on every core (speculated_host_share)
MEASURE_NUMEL = 4 << 20  # Adam rates: 4Mi elements (16 MB per fp32 tensor)
COPY_BYTES = 64 << 20  # copy rates
NVME_BYTES = 128 << 20  # nvme scratch file
NVME_CHUNK = 16 << 20
REPS = 5
# CUDA: Adam over four fp32 tensors of CUDA_ADAM_NUMEL (1 GiB) and copies of CUDA_COPY_NUMEL
# fp32 (256 MiB; the device buffer of the copies is allocated after the Adam tensors are
# freed) — at most these, and within the device memory the caller allows
CUDA_ADAM_NUMEL = 16 * MEASURE_NUMEL
CUDA_COPY_NUMEL = 64 << 20  # fp32 elements: 256 MiB
CALIBRATION_BUDGET_SHARE = 0.1


def cache_path() -> str:
    root = os.environ.get("HYBRID_OPT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hybrid_opt"
    )
    return os.path.join(root, "calibration.json")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(device: torch.device) -> str:
    import cpu_kernels

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [os.cpu_count()]
    parts = [
        str(CACHE_VERSION),
        platform.node(),
        _cpu_model(),
        ",".join(map(str, cpus)),
        cpu_kernels.simd_level(),
        torch.__version__,
        device.type,
    ]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _nvme_key(nvme_path: str) -> str:
    st = os.stat(nvme_path)
    return f"nvme-{CACHE_VERSION}-{platform.node()}-{st.st_dev}"


def _load_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(
            f"hybrid_opt: calibration cache {path} is unreadable ({e}); measuring again", stacklevel=3
        )
        return {}


def _store_cache(path: str, key: str, entry: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _load_cache(path)
        data[key] = entry
        fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
    except OSError as e:
        warnings.warn(
            f"hybrid_opt: cannot write the calibration cache {path} ({e}); the next "
            f"run measures again (set HYBRID_OPT_CACHE_DIR to a writable directory)",
            stacklevel=3,
        )


def _best_time(fn, reps: int = REPS) -> float:
    """The fastest of `reps` timed calls after a warm-up: the least disturbed by whatever else
    runs on the machine (timeit's rule), so a cached figure does not record a busy moment."""
    fn()  # warm-up: page faults, first-touch, lazy init
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _adam_kwargs():
    return dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


class _Threads:
    """Sets cpu_kernels' and torch's thread counts (and optionally this thread's CPU mask) for
    a measurement and restores them."""

    def __init__(self, n: int, cpus=None):
        self.n, self.cpus = n, cpus
        self.saved = None  # (cpu_kernels', torch's thread counts, the CPU mask) while entered

    def __enter__(self):
        import cpu_kernels

        self.saved = (
            cpu_kernels.get_num_threads(),
            torch.get_num_threads(),
            os.sched_getaffinity(0) if self.cpus and hasattr(os, "sched_setaffinity") else None,
        )
        cpu_kernels.set_num_threads(self.n)
        torch.set_num_threads(self.n)
        if self.saved[2] is not None:
            os.sched_setaffinity(0, self.cpus)
        return self

    def __exit__(self, *exc):
        import cpu_kernels

        cpu_kernels.set_num_threads(self.saved[0])
        torch.set_num_threads(self.saved[1])
        if self.saved[2] is not None:
            os.sched_setaffinity(0, self.saved[2])


def _cpu_adam_gbps(threads: int, bank: bool) -> float:
    """CPU Adam at `threads`, GB/s at 28 B/element (fp32 param, grad, m, v)."""
    import cpu_kernels

    n = MEASURE_NUMEL
    p, g, m, v = (torch.rand(n) for _ in range(4))
    out = tuple(torch.empty(n) for _ in range(3)) if bank else None
    with _Threads(threads):
        t = _best_time(lambda: cpu_kernels.adam_step_(p, g, m, v, out=out, **_adam_kwargs()))
    return n * 28 / t / 1e9


def _format_tensors(fmt, param_dtype: torch.dtype, grad_dtype: torch.dtype, amsgrad: bool, n: int):
    """(kernel, args, kwargs) of one host Adam step of `fmt` over n elements, as a host tier steps
    it: the q8 kernel where a moment is q8, else adam_step_; the bf16 param and its remainders, or
    an fp32 master (with a copy for a 16-bit param)."""
    import cpu_kernels
    from cpu_kernels.q8_reference import Q8Blocks
    from hybrid_opt.state.state_format import Q8

    def moment(dt):
        if dt == Q8:
            return Q8Blocks(torch.zeros(n, dtype=torch.uint8), torch.zeros((n + 255) // 256))
        return torch.zeros(n, dtype=dt)

    kw = _adam_kwargs()
    if fmt.remainders_for(param_dtype):
        param = torch.rand(n).to(torch.bfloat16)
        kw["remainder"] = torch.zeros(n, dtype=torch.int16)
    else:
        param = torch.rand(n)
        if param_dtype != torch.float32:
            kw["param_copy"] = torch.empty(n, dtype=param_dtype)
    if amsgrad:
        kw["max_exp_avg_sq"] = moment(fmt.exp_avg_sq_dtype)
    args = (param, torch.rand(n).to(grad_dtype), moment(fmt.exp_avg_dtype), moment(fmt.exp_avg_sq_dtype))
    kernel = cpu_kernels.q8_adam_step_ if fmt.quantized_moments else cpu_kernels.adam_step_
    return kernel, args, kw


def format_factor(
    fmt, param_dtype: torch.dtype, grad_dtype: torch.dtype, threads: int, amsgrad: bool = False
) -> float:
    """How much longer than its bytes say a host Adam step of state format `fmt` takes on this CPU at
    `threads`: its time over the time its bytes take at fp32 state's rate (_cpu_adam_gbps, in place),
    both stepped in process over MEASURE_NUMEL elements, the best of REPS each, at least 1.0. The cost
    model scales fp32 state's rates by bytes (cost_model.Machine.state_format_factor), which a
    memory-bound step follows; q8 moments are compute-bound on many CPUs (docs/kernels.md), and so is
    AVX2's compressed loop at one thread."""
    from hybrid_opt.state.state_format import StateFormat

    if fmt == StateFormat() and param_dtype == torch.float32 and grad_dtype == torch.float32 and not amsgrad:
        return 1.0
    n = MEASURE_NUMEL
    kernel, args, kw = _format_tensors(fmt, param_dtype, grad_dtype, amsgrad, n)
    fp32_gbps = _cpu_adam_gbps(threads, bank=False)
    with _Threads(threads):
        t = _best_time(lambda: kernel(*args, **kw))
    own = fmt.adam_bytes(param_dtype, grad_dtype.itemsize, amsgrad)
    return max(1.0, t / (n * own / (fp32_gbps * 1e9)))


def format_factor_cached(
    fmt,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    threads: int,
    amsgrad: bool = False,
    *,
    refresh=False,
) -> float:
    """format_factor, from the calibration cache when it has it (keyed by the machine, the format
    and the threads)."""
    from hybrid_opt.state.state_format import DTYPE_NAMES

    names = {v: k for k, v in DTYPE_NAMES.items()}  # torch.float32: "fp32", ..., "q8": "q8"
    dt = lambda d: names.get(d, str(d))  # noqa: E731
    key = (
        f"{machine_key(torch.device('cpu'))}-format-{dt(fmt.exp_avg_dtype)}-{dt(fmt.exp_avg_sq_dtype)}"
        f"-r{int(fmt.store_param_remainders)}-p{dt(param_dtype)}-g{dt(grad_dtype)}-a{int(amsgrad)}-t{threads}"
    )
    path = cache_path()
    cache = {} if refresh else _load_cache(path)
    entry = cache.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("state_format_factor"), (int, float)):
        return float(entry["state_format_factor"])
    factor = format_factor(fmt, param_dtype, grad_dtype, threads, amsgrad)
    _store_cache(
        path, key, {"state_format_factor": factor, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    )
    return factor


def _host_tier_gelems(worker_share: float | None) -> float:
    """G elements/s of a real host tier's worker: two subgroups stepped a few times, as steps
    the trainer waits for (HostStepping.finish)."""
    from hybrid_opt.tiers.host import AdamInputs, HostTier

    n = MEASURE_NUMEL
    grads = [torch.rand(n), torch.rand(n)]
    tier = HostTier([n, n], worker_share=worker_share, spare_banks=2)
    try:
        for k in range(2):
            tier.load_state(k, torch.rand(n))
        rates = []
        for step in range(1, REPS + 2):
            before = sum(tier.io.worker_seconds.values())
            tier.stepping.finish(
                {k: (grads[k], AdamInputs(step, 1e-3, 0.9, 0.999, 1e-8, 0.01)) for k in range(2)}
            )
            rates.append(2 * n / max(1e-9, sum(tier.io.worker_seconds.values()) - before))
    finally:
        tier.close()
    return max(rates[1:]) / 1e9  # the first step touches fresh pages


def _copy_gbps(threads: int) -> float:
    src = torch.rand(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    with _Threads(threads):
        t = _best_time(lambda: dst.copy_(src))
    return COPY_BYTES / t / 1e9


def _fwd_bwd_probe():
    """A small memory-bound training step: 4 x Linear(2048) at batch 16, as an MLP block's
    fwd+bwd runs on a CPU."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(2048, 2048, generator=gen).mul_(0.02).requires_grad_() for _ in range(4)]
    x = torch.randn(16, 2048, generator=gen)

    def run():
        h = x
        for w in ws:
            h = torch.nn.functional.linear(h, w)
        h.square().mean().backward()
        for w in ws:
            w.grad = None

    return run


def trainer_times(trainer: list, worker: list, run=None, timer=None) -> dict:
    """`timer(run)` of one training iteration without an optimizer step (by default a small
    fwd+bwd probe) under the three conditions the cost model tells apart: {"all": on every
    core, "trainer": on the trainer's cores alone, "contended": there while Adam streams on
    the worker's cores}. `timer` defaults to the best of a few calls; a benchmark passes one
    that keeps every sample, to time its own model at the same moments as its rows."""
    import cpu_kernels

    run, timer = run or _fwd_bwd_probe(), timer or _best_time
    out = {}
    with _Threads(len(os.sched_getaffinity(0))):
        out["all"] = timer(run)
    with _Threads(len(trainer), trainer):
        out["trainer"] = timer(run)
    n = 4 * MEASURE_NUMEL
    p, g, m, v = (torch.rand(n) for _ in range(4))
    stop, failed = threading.Event(), []

    def adam_loop():
        # ctypes releases the GIL for the kernel: this streams on the worker's cores while
        # the main thread runs fwd+bwd on the trainer's
        try:
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, worker)
            while not stop.is_set():
                cpu_kernels.adam_step_(p, g, m, v, **_adam_kwargs())
        except BaseException as e:  # handed to the measuring thread below
            failed.append(e)

    with _Threads(len(trainer), trainer):
        # the Adam loop's kernel runs on one thread: cpu_kernels' count is per process, and
        # the trainer's setting (len(trainer)) would oversubscribe a one-core worker share
        cpu_kernels.set_num_threads(max(1, len(worker)))
        th = threading.Thread(target=adam_loop, daemon=True)
        th.start()
        try:
            time.sleep(0.02)
            torch.set_num_threads(len(trainer))
            out["contended"] = timer(run)
        finally:
            stop.set()
            th.join(timeout=30)
    if failed:  # the contended time would be an uncontended one: not a figure to keep
        raise RuntimeError(
            f"calibration: the Adam stream on cores {worker} failed: {type(failed[0]).__name__}: {failed[0]}"
        ) from failed[0]
    return out


def trainer_factors(trainer: list, worker: list, run=None) -> tuple[float, float]:
    """(fwd+bwd slowdown on the trainer's cores alone, further slowdown while Adam streams on
    the worker's cores), both >= 1, from the best times of `trainer_times`."""
    t = trainer_times(trainer, worker, run)
    return factors_of(t["all"], t["trainer"], t["contended"])


def factors_of(t_all: float, t_trainer: float, t_contended: float) -> tuple[float, float]:
    """The two slowdown factors from times of the three conditions."""
    return max(1.0, t_trainer / t_all), max(1.0, t_contended / t_trainer)


def device_bytes_allowed(device_budget: float, model_and_grads: float) -> int:
    """The device memory calibration may take while the optimizer is built: at most
    CALIBRATION_BUDGET_SHARE of the device budget, and never more than the budget leaves
    beside the model copy and its grads (the measurement runs before any state exists)."""
    return int(max(0.0, min(CALIBRATION_BUDGET_SHARE * device_budget, device_budget - model_and_grads)))


def cuda_measure_sizes(device_bytes=None) -> tuple[int, int]:
    """(elements of each of the four fp32 Adam tensors, elements of the fp32 copy buffer) of
    the CUDA measurements, within `device_bytes` (None: the full sizes). The two measurements
    never hold memory at once; at least one element each (a budget that leaves nothing has
    no room for device state, and its rate then decides nothing)."""
    if device_bytes is None:
        return CUDA_ADAM_NUMEL, CUDA_COPY_NUMEL
    b = max(0, int(device_bytes))
    return max(1, min(CUDA_ADAM_NUMEL, b // 16)), max(1, min(CUDA_COPY_NUMEL, b // 4))


def _cuda_adam_gbps(device: torch.device, n: int) -> float:
    """The Triton fused Adam over four fp32 tensors of `n` elements, GB/s at 28 B/element (its
    tensors are freed on return)."""
    import gpu_kernels

    p, g, m, v = (torch.rand(n, device=device) for _ in range(4))
    scale = torch.ones(1, device=device)

    def adam():
        gpu_kernels.fused_adam_([p], [g], [m], [v], grad_scale=scale, **_adam_kwargs())
        torch.cuda.synchronize(device)

    return n * 28 / _best_time(adam) / 1e9


def _cuda_rates(device: torch.device, device_bytes=None) -> dict:
    n, n_copy = cuda_measure_sizes(device_bytes)
    adam_gbps = _cuda_adam_gbps(device, n)  # its memory is freed before the copies allocate theirs
    host = torch.empty(n_copy, pin_memory=True)
    dev = torch.empty(host.numel(), device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)

    return {
        "device_adam_gbps": adam_gbps,
        "device_measure_numel": n,
        "h2d_gbps": host.numel() * 4 / _best_time(h2d) / 1e9,
        "d2h_gbps": host.numel() * 4 / _best_time(d2h) / 1e9,
        "trainer_slowdown_with_worker": 1.0,
        "backward_slowdown_with_host_adam": 1.0,
    }


def measure(device, worker_share: float | None = 0.5, device_bytes=None) -> dict:
    """Measures the machine's rates (no cache): see the module docstring. `worker_share`:
    the host tier's arrangement (None: trainer and worker share every core, a CPU-only
    host's default: the host rate is then a step the trainer waits for, on every core).
    `device_bytes`: the most device memory the CUDA measurements may take (None: their full
    sizes)."""
    from hybrid_opt.worker.client import CoreSplit

    device = torch.device(device)
    split = CoreSplit(worker_share)
    trainer, worker = split.trainer or [0], split.worker or [0]
    t0 = time.perf_counter()
    own = _cpu_adam_gbps(len(worker), bank=True) / 28
    out: dict[str, float | str] = {
        "host_adam_gelems_per_s": _host_tier_gelems(worker_share),
        "host_kernel_gelems_per_s": own,
        "worker_cores": len(worker),
        "trainer_cores": len(trainer),
        "shared_cores": split.shared,
        # split: a speculated step runs on the worker's own cores, one that step() waits for
        # (host_adam_gelems_per_s) on every core; the kernel's rate on each says how much slower
        "speculated_host_share": (
            min(1.0, own / (_cpu_adam_gbps(split.waited_threads, bank=True) / 28)) if split.widens else 1.0
        ),
    }
    if device.type == "cuda":
        out.update(_cuda_rates(device, device_bytes))
    else:
        all_cores = len(set(trainer) | set(worker))
        out["device_adam_gbps"] = _cpu_adam_gbps(all_cores, bank=False)
        out["device_adam_gbps_with_worker"] = _cpu_adam_gbps(len(trainer), bank=False)
        out["h2d_gbps"] = out["d2h_gbps"] = _copy_gbps(len(trainer))
        if split.separate:
            slow, contention = trainer_factors(trainer, worker)
        else:
            slow, contention = 1.0, 1.0
        out["trainer_slowdown_with_worker"] = slow
        out["backward_slowdown_with_host_adam"] = contention
    out["seconds"] = time.perf_counter() - t0
    out["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return out


def measure_nvme(nvme_path: str) -> dict:
    """O_DIRECT write then read of a scratch file in `nvme_path`, GB/s."""
    from cpu_kernels.aio import AioEngine, aligned_buffer

    fd_path = None
    eng = AioEngine(threads=4, queue_depth=32)
    buf = aligned_buffer(NVME_CHUNK)
    buf.write(os.urandom(4096) * (NVME_CHUNK // 4096))
    try:
        fd_h, fd_path = tempfile.mkstemp(prefix=".hybrid_opt-calibrate-", dir=nvme_path)
        os.close(fd_h)
        res = {}
        for op in ("write", "read"):
            fd = eng.open(fd_path, "w" if op == "write" else "r")
            t0 = time.perf_counter()
            ids = [
                (eng.submit_write if op == "write" else eng.submit_read)(fd, buf, NVME_CHUNK, off)
                for off in range(0, NVME_BYTES, NVME_CHUNK)
            ]
            if op == "write":
                ids.append(eng.submit_sync(fd))
            eng.wait(ids)
            res[f"nvme_{op}_gbps"] = NVME_BYTES / (time.perf_counter() - t0) / 1e9
            eng.close_fd(fd)
        return res
    finally:
        eng.close()
        if fd_path is not None:
            try:
                os.unlink(fd_path)
            except OSError:
                pass


def rates(
    device="cpu",
    nvme_path=None,
    worker_share: float | None = 0.5,
    *,
    refresh: bool = False,
    device_bytes=None,
) -> dict:
    """The machine's rates, from the cache when it has them (see the module docstring).
    `device_bytes`: the most device memory the CUDA measurements may take (None: their full
    sizes); a cached device Adam rate measured smaller than this allows (a tight budget
    before) is measured again at the larger size."""
    device = torch.device(device)
    path = cache_path()
    key = machine_key(device) + ("-wshared" if worker_share is None else f"-w{worker_share:g}")
    here = node.info()
    if here.local_world_size > 1:
        # the host rates are measured on this rank's slice of the node's cores (CoreSplit)
        key += f"-r{here.local_rank}of{here.local_world_size}"
    cache = {} if refresh else _load_cache(path)
    out = cache.get(key)
    if not isinstance(out, dict) or "host_adam_gelems_per_s" not in out:
        out = measure(device, worker_share, device_bytes)
        _store_cache(path, key, out)
    elif (
        device.type == "cuda"
        and out.get("device_measure_numel", CUDA_ADAM_NUMEL) < cuda_measure_sizes(device_bytes)[0]
    ):
        out = dict(out, **_cuda_rates(device, device_bytes))
        _store_cache(path, key, out)
    out = dict(out)
    if nvme_path is not None:
        nkey = _nvme_key(nvme_path)
        nv = cache.get(nkey)
        if not isinstance(nv, dict) or "nvme_read_gbps" not in nv:
            nv = measure_nvme(nvme_path)
            _store_cache(path, nkey, nv)
        out.update(nv)
    return out
