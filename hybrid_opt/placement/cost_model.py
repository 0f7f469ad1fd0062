"""Cost model: predicted step time and memory per tier of a placement, and the best placement.

Deterministic and closed-form, so it answers for machines we do not have (`hybrid-opt plan`).
Rates are inputs; nothing here measures. All figures are per GPU (per trainer process without a
GPU); host-side rates in `Machine` are per node, shared evenly by its GPUs. The formulas (sharding
modes, collectives, hiding under backward, contention, bytes per element): docs/internals.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from hybrid_opt.state.state_format import StateFormat

GB = 1e9
DEFAULT_SUBGROUP_NUMEL = 4 * 2**20  # HybridAdamW's default unit of placement (its one definition)
STAGING_SLOTS = 4  # grad-in / param-out slots in flight per worker
IO_BANKS = 4  # nvme reads in flight (two buffers each)
BACKWARD_SHARE = 2.0 / 3.0  # backward ~ 2x forward FLOPs
# spare banks of exact rollback without speculation: one holds the step being written (the
# committed bank is never torn), a second lets the next subgroup stage meanwhile (measured on a
# 33.5M bf16 model here: one spare, 80-98 ms a step; two, 58-75; one per subgroup, 69-73)
NON_SPECULATIVE_SPARE_BANKS = 2
# the spare pool best_plan picks: the fewest spares (halving from one per offloaded subgroup) whose
# iteration is within this of the largest pool's. A spare holds a speculated step until step():
# where backward is short next to the host step (the H200's 201M bench: 2.7 against ~40 ms), one
# per subgroup doubles the host state for nothing (24.7 B/param against torchao's 16)
SPARE_TOLERANCE = 0.005
# bytes per element at which host_adam_gelems_per_s is measured (calibrate.py: fp32 param,
# grad, m, v) and quoted (presets): a step moving other bytes takes time in proportion
HOST_ADAM_REFERENCE_BYTES = 28


@dataclass
class Machine:
    """Rates and capacities. `gpus=0` means no accelerator: the model, its grads and every
    tier live in host memory, and the "device" tier is the trainer's own cores. Host-side
    figures (memory, Adam rate, nvme rates and capacity) are for the whole machine; GPU and
    link figures per GPU."""

    name: str = "custom"
    gpus: int = 1
    gpu_mem_bytes: float = 80 * GB
    host_mem_bytes: float = 512 * GB
    device_adam_gbps: float = 1600.0  # achieved memory bandwidth of a device Adam step
    host_adam_gelems_per_s: float = 2.0  # CPU Adam, G elements/s, the worker's cores
    h2d_gbps: float = 50.0
    d2h_gbps: float = 50.0
    nvme_read_gbps: float = 0.0  # aggregate; 0 = no nvme tier
    nvme_write_gbps: float = 0.0
    nvme_bytes: float | None = None  # aggregate capacity; None = not limiting
    gpu_tflops: float = 300.0  # achieved fwd+bwd rate per GPU (or the CPU's)
    backward_slowdown_with_host_adam: float = 1.0
    # CPU-only hosts: the worker beside the trainer on every core (the default there), or on
    # cores taken from it; what the trainer loses to a worker process (the module docstring)
    shared_cores: bool = False
    trainer_slowdown_with_worker: float = 1.0
    # split cores: a host step speculated during backward runs on the worker's own cores, one
    # that step() waits for on every core (host_adam_gelems_per_s); the first's rate over that
    speculated_host_share: float = 1.0
    device_adam_gbps_with_worker: float | None = None
    # how much longer than its bytes say the workload's state format steps on this CPU: the Adam
    # rates above are fp32 state's (28 B an element), scaled by bytes for other formats, which a
    # memory-bound step follows; q8 moments (and AVX2's compressed loop on some CPUs) are
    # compute-bound and take longer (calibrate.format_factor measures it; 1.0 for a preset). It
    # applies to the host tiers and, on a host without a GPU, to the device tier (the CPU's cores).
    state_format_factor: float = 1.0
    # several nodes: host-side figures above are per node, shared by its GPUs; None = all on one
    gpus_per_node: int | None = None
    nvlink_gbps: float = 450.0  # per GPU, each way, within a node (H100 NVLink 4)
    ib_gbps: float = 400.0  # per node, each way, across nodes (8 x 400 Gb/s)


def arrangement(machine: Machine) -> str:
    """How the trainer and the worker use the CPU's cores, and why (a plan says it)."""
    if machine.gpus and not machine.shared_cores:
        return (
            "split: the worker steps on cores of its own (worker_share of them) during backward, "
            "the trainer keeps the rest to drive the GPU; host work hides under backward, and what "
            "is left when step() waits runs on every core"
        )
    if machine.shared_cores:
        return (
            "shared: the params live on the CPU, so the trainer keeps every core for forward "
            "and backward; host work during backward would take the backward's cores and hide "
            'nothing, so speculative="auto" (the default) steps the host tiers in step(), on every '
            "core, by the trainer itself (no grad copied); the worker reads and writes the nvme "
            "tier's state around them"
        )
    return (
        "split: the worker on cores taken from the trainer (worker_share=); forward and "
        "backward run on the rest, and a step that step() waits for on every core"
    )


SHARDINGS = ("fsdp", "zero", "none")


@dataclass
class Workload:
    """The model: `params` in all; dtype sizes in bytes per element. fwd+bwd time is
    `backward_seconds * 1.5` when given, else `model_flops` (per iteration, all GPUs;
    default 6 x params x tokens_per_iteration) over the GPUs' achieved rate."""

    params: float
    model_bytes: int = 2  # bf16 model copy
    state_bytes: int | None = None  # deprecated: 12, or 16 = amsgrad (use amsgrad=)
    grad_bytes: int = 2
    backward_seconds: float | None = None
    model_flops: float | None = None
    tokens_per_iteration: float = 8192
    subgroup_numel: int = DEFAULT_SUBGROUP_NUMEL
    step_overhead_seconds: float = 0.0  # fixed per step: norms, launches, bookkeeping
    exact_rollback: bool = True  # spare banks hold speculated steps until validated
    speculative: bool = True  # host steps start during backward; False: after it
    sharding: str | None = None  # None, "fsdp", "zero" or "none" (module docstring)
    state_format: StateFormat = field(default_factory=StateFormat)  # moments' dtypes, remainders
    amsgrad: bool = False  # one more moment (exp_avg_sq's dtype)
    model_dtype: torch.dtype | None = None  # None: fp32 for a 4-byte model, else bf16
    # host banks and nvme files per state element: every bank has the largest subgroup's
    # capacity, so n subgroups of capacity c over E elements hold n*c/E (layout.py: >= 1)
    bank_padding: float = 1.0

    def __post_init__(self):
        if self.state_bytes is not None:  # the plain fp32 state's count, from before state_format
            if self.state_bytes not in (12, 16):
                raise ValueError(
                    f"state_bytes must be 12 or 16 (fp32 state, 16 with amsgrad), got "
                    f"{self.state_bytes}: give state_format= and amsgrad= instead"
                )
            self.amsgrad = self.amsgrad or self.state_bytes == 16
        if not isinstance(self.state_format, StateFormat):
            raise TypeError(
                f"state_format must be a hybrid_opt.state.state_format.StateFormat, got "
                f"{type(self.state_format).__name__}"
            )

    @property
    def master_is_model(self) -> bool:
        # fp32 parameters are their own master: the device keeps no separate copy
        return self.model_bytes == 4

    @property
    def param_dtype(self) -> torch.dtype:
        if self.model_dtype is not None:
            return self.model_dtype
        return torch.float32 if self.model_bytes == 4 else torch.bfloat16

    def tier_bytes(self) -> dict:
        """Bytes per element by tier (module docstring): "device" state, "host" bank (also each
        spare and nvme I/O bank), "nvme" file (one slot), "host_adam" / "device_adam" bytes a
        step moves, "high_half" read from the model per nvme element per step (remainders)."""
        fmt, dt, ams = self.state_format, self.param_dtype, self.amsgrad
        adam = fmt.adam_bytes(dt, self.grad_bytes, ams)
        return {
            "device": fmt.state_bytes(dt, ams, own_master=True),
            "host": fmt.bank_bytes(dt, ams),
            "nvme": fmt.state_bytes(dt, ams),
            "host_adam": adam,
            "device_adam": adam,
            "high_half": 2 if fmt.remainders_for(dt) else 0,
        }


@dataclass
class Prediction:
    offload_fraction: float
    nvme_fraction: float
    step_seconds: float
    iteration_seconds: float
    forward_backward_seconds: float
    memory_bytes: dict
    breakdown: dict = field(default_factory=dict)
    spare_banks: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        return {
            "predicted_step_seconds": d.pop("step_seconds"),
            "predicted_iteration_seconds": d.pop("iteration_seconds"),
            "forward_backward_seconds": d.pop("forward_backward_seconds"),
            "plan": {"offload_fraction": d.pop("offload_fraction"), "nvme_fraction": d.pop("nvme_fraction")},
            **d,
        }


def _ranks(machine: Machine) -> int:
    return max(1, machine.gpus)


def _node_ranks(machine: Machine) -> int:
    """GPUs sharing one node's host memory, CPU and drives."""
    return max(1, min(machine.gpus_per_node or machine.gpus, _ranks(machine)))


def _nodes(machine: Machine) -> int:
    return -(-_ranks(machine) // _node_ranks(machine))


def check(machine: Machine, workload: Workload) -> None:
    """ValueError naming a sharding, node size or link rate the model cannot take."""
    if workload.sharding not in (None,) + SHARDINGS:
        raise ValueError(
            f"sharding must be one of {', '.join(SHARDINGS)} (or None), got {workload.sharding!r}"
        )
    if machine.gpus_per_node is not None and not 1 <= machine.gpus_per_node <= _ranks(machine):
        raise ValueError(
            f"gpus_per_node must be between 1 and gpus ({machine.gpus}), got {machine.gpus_per_node}"
        )
    if machine.gpus_per_node is not None and _ranks(machine) % machine.gpus_per_node:
        raise ValueError(
            f"gpus ({machine.gpus}) must be a multiple of gpus_per_node "
            f"({machine.gpus_per_node}): every node holds as many GPUs"
        )
    if workload.sharding is not None and _ranks(machine) > 1:
        for name in ("nvlink_gbps", "ib_gbps"):
            if not getattr(machine, name) > 0:
                raise ValueError(f"{name} must be > 0 to time the collectives, got {getattr(machine, name)}")


def state_elements(machine: Machine, workload: Workload) -> float:
    """Elements whose optimizer state one GPU holds and steps."""
    return workload.params if workload.sharding == "none" else workload.params / _ranks(machine)


def model_elements(machine: Machine, workload: Workload) -> float:
    """Elements of the model copy and of the grads one GPU holds."""
    sharded = workload.sharding in (None, "fsdp")
    return workload.params / _ranks(machine) if sharded else workload.params


def link_gbps(machine: Machine) -> float:
    """Per-GPU rate of a ring collective: NVLink within a node, the node's IB share across."""
    if _nodes(machine) == 1:
        return machine.nvlink_gbps
    return min(machine.nvlink_gbps, machine.ib_gbps / _node_ranks(machine))


def collective_seconds(machine: Machine, workload: Workload) -> dict:
    """Seconds of the collectives per iteration, by when they run: "forward", "backward"
    (beside that compute) and "after_step" (exposed whole); zeros without sharding or GPUs
    to share with (module docstring)."""
    n = _ranks(machine)
    out = {"forward": 0.0, "backward": 0.0, "after_step": 0.0}
    if workload.sharding is None or n <= 1:
        return out
    per_byte = (n - 1) / n / (link_gbps(machine) * GB)
    params = workload.params * workload.model_bytes * per_byte  # one all-gather of the params
    grads = workload.params * workload.grad_bytes * per_byte  # one reduce-scatter of the grads
    if workload.sharding == "fsdp":
        out.update(forward=params, backward=params + grads)
    elif workload.sharding == "zero":
        out.update(backward=grads, after_step=params)
    else:
        out.update(backward=2 * grads)  # all-reduce
    return out


def forward_backward_seconds(machine: Machine, workload: Workload) -> tuple[float, float]:
    """(forward + backward, backward) seconds of one iteration, before any contention."""
    if workload.backward_seconds is not None:
        t_b = float(workload.backward_seconds)
        return t_b / BACKWARD_SHARE, t_b
    flops = workload.model_flops
    if flops is None:
        flops = 6.0 * workload.params * workload.tokens_per_iteration
    t_fb = flops / _ranks(machine) / (machine.gpu_tflops * 1e12)
    return t_fb, t_fb * BACKWARD_SHARE


def device_bytes_per_element(workload: Workload) -> int:
    """Bytes a device Adam step reads and writes per element: state and grad in, state and
    (unless the fp32 param is its own master) the model copy out (StateFormat.adam_bytes)."""
    return workload.tier_bytes()["device_adam"]


def offloaded_subgroups(machine: Machine, workload: Workload, offload_fraction: float) -> int:
    e = state_elements(machine, workload)
    s = min(workload.subgroup_numel, e)
    return max(1, round(offload_fraction * e / s)) if offload_fraction > 0 else 0


def _spares(machine, workload, offload_fraction, spare_banks) -> int:
    """Spare banks in use: one per offloaded subgroup at most; None = that many (without
    speculation, NON_SPECULATIVE_SPARE_BANKS); none without exact rollback."""
    n_off = offloaded_subgroups(machine, workload, offload_fraction)
    if not workload.exact_rollback:
        return 0
    if spare_banks is None and not workload.speculative:
        return min(NON_SPECULATIVE_SPARE_BANKS, n_off)
    return n_off if spare_banks is None else min(spare_banks, n_off)


def memory_bytes(
    machine: Machine,
    workload: Workload,
    offload_fraction: float,
    nvme_fraction: float,
    spare_banks: int | None = None,
) -> dict:
    """Bytes per GPU on each tier for this placement (`spare_banks=None`: one per offloaded
    subgroup). An estimate from element counts: a fixed placement's budgets are checked
    against the bytes its tiers will allocate (footprint.py), which this does not undercount
    beyond whole pages."""
    e = state_elements(machine, workload)
    off, nv = offload_fraction, nvme_fraction
    s = min(workload.subgroup_numel, e)
    b = workload.tier_bytes()
    model_and_grads = model_elements(machine, workload) * (workload.model_bytes + workload.grad_bytes)
    device = (1 - off) * e * b["device"] + model_and_grads
    host = (off - nv) * e * b["host"] * workload.bank_padding
    if off > 0:
        host += _spares(machine, workload, off, spare_banks) * s * b["host"]
        host += STAGING_SLOTS * s * (workload.grad_bytes + workload.model_bytes)
    if nv > 0:
        host += IO_BANKS * 2 * s * b["host"]
    if machine.gpus == 0:
        host += device
        device = 0.0
    return {
        "device": float(device),
        "host": float(host),
        "nvme": float(2 * nv * e * b["nvme"] * workload.bank_padding),
    }


def predict(
    machine: Machine,
    workload: Workload,
    offload_fraction: float,
    nvme_fraction: float = 0.0,
    spare_banks: int | None = None,
) -> Prediction:
    """Predicted times and memory of one placement (see the module docstring for the model)."""
    off, nv = float(offload_fraction), float(nvme_fraction)
    if not (0.0 <= nv <= off <= 1.0):
        raise ValueError(
            f"need 0 <= nvme_fraction <= offload_fraction <= 1, got "
            f"offload_fraction={off}, nvme_fraction={nv}"
        )
    if nv > 0 and (machine.nvme_read_gbps <= 0 or machine.nvme_write_gbps <= 0):
        raise ValueError(f"machine {machine.name!r} has no nvme rates: nvme_fraction must be 0")
    check(machine, workload)
    ranks = _node_ranks(machine)  # the node's host rates are shared by its GPUs
    wl = workload
    e = state_elements(machine, wl)
    s = min(wl.subgroup_numel, e)
    t_fb, t_b = forward_backward_seconds(machine, wl)
    device_gbps = machine.device_adam_gbps
    if machine.gpus == 0 and off > 0:
        # a worker process takes cores from the trainer
        t_fb, t_b = t_fb * machine.trainer_slowdown_with_worker, t_b * machine.trainer_slowdown_with_worker
        device_gbps = machine.device_adam_gbps_with_worker or device_gbps

    # device tier
    e_dev = (1 - off) * e
    device_step = e_dev * device_bytes_per_element(wl) / (device_gbps * GB)
    if machine.gpus == 0:
        device_step *= machine.state_format_factor

    # collectives beside forward and backward: what exceeds them lengthens them, and the
    # grads' readiness (the window host work hides in) spreads over the longer of the two
    comm = collective_seconds(machine, wl)
    t_f = t_fb - t_b
    comm_forward = max(0.0, comm["forward"] - t_f)
    t_window = max(t_b, comm["backward"])
    comm_backward = t_window - t_b

    # host tiers, per offloaded element (host rate and nvme bandwidth are shared by the GPUs)
    e_off = off * e
    tb = wl.tier_bytes()
    host_rate = machine.host_adam_gelems_per_s * 1e9 / ranks
    compute_per_elem = tb["host_adam"] / HOST_ADAM_REFERENCE_BYTES / host_rate * machine.state_format_factor
    if nv > 0:
        nvme_io = nv * e * tb["nvme"] / (machine.nvme_read_gbps * GB / ranks) + nv * e * tb["nvme"] / (
            machine.nvme_write_gbps * GB / ranks
        )
    else:
        nvme_io = 0.0
    host_compute = e_off * compute_per_elem
    # a CPU-only host sharing its cores: the trainer runs the host and nvme steps itself, reading
    # the grads where backward left them (tiers/inline_steps.py): none is copied
    staged = 0.0 if machine.shared_cores and not machine.gpus else e_off
    d2h_bytes = staged * wl.grad_bytes + nv * e * tb["high_half"]
    d2h = d2h_bytes / (machine.d2h_gbps * GB) if machine.d2h_gbps > 0 else 0.0
    h2d = e_off * wl.model_bytes / (machine.h2d_gbps * GB) if machine.h2d_gbps > 0 else 0.0
    # what can run during backward: the step and the grads' way in; the new params go out
    # only once step() has validated the step (h2d below is always exposed)
    host_work = max(host_compute, nvme_io) + d2h
    w = host_work / e_off if e_off > 0 else 0.0
    if e_off > 0 and (not wl.speculative or wl.sharding == "none"):
        # every host step waits for step(): nothing hides (under DDP the grad hooks fire
        # before the all-reduce, so a speculated step is redone)
        exposed_host = host_work
    elif e_off > 0:
        # during backward the host work runs at the speculated rate; what is left when the
        # window ends runs at step()'s (every core), in proportion
        share = min(1.0, max(1e-3, machine.speculated_host_share))
        spec_work = max(host_compute / share, nvme_io) + d2h
        w_s = spec_work / e_off
        finish = max(off * t_window + s * w_s, s * t_window / e + spec_work)
        exposed_host = max(0.0, finish - t_window) * host_work / spec_work
        spares = _spares(machine, wl, off, spare_banks)
        if wl.exact_rollback and spares < offloaded_subgroups(machine, wl, off):
            # each speculated step holds a spare bank until step() validates it: at most
            # `spares` subgroups' work can be done under backward
            exposed_host = max(exposed_host, host_work - spares * s * w)
    else:
        exposed_host = 0.0
    hidden_host = host_work - exposed_host
    c = machine.backward_slowdown_with_host_adam
    if machine.shared_cores:
        # on the backward's own cores: the bench GPT at 2 cores ran 380-405 ms an iteration
        # with its host steps speculated during backward, 372-388 ms with them after it
        contention = hidden_host
    else:
        contention = hidden_host * (1.0 - 1.0 / c) if c > 1.0 else 0.0

    # step(): the host tiers' remaining work and the params' copy back, then the device tier
    step = exposed_host + h2d + device_step + wl.step_overhead_seconds + comm["after_step"]
    iteration = t_fb + comm_forward + comm_backward + contention + step
    breakdown = {
        "forward_backward": t_fb,
        "backward": t_b,
        "device_step": device_step,
        "host_compute": host_compute,
        "nvme_io": nvme_io,
        "d2h": d2h,
        "h2d": h2d,
        "host_work": host_work + h2d,
        "host_hidden": hidden_host,
        "host_exposed": exposed_host + h2d,
        "backward_contention": contention,
        "step_overhead": wl.step_overhead_seconds,
    }
    if wl.sharding is not None:
        breakdown["collectives"] = comm["forward"] + comm["backward"] + comm["after_step"]
        breakdown["collectives_exposed"] = comm_forward + comm_backward + comm["after_step"]
    return Prediction(
        off,
        nv,
        step,
        iteration,
        t_fb,
        memory_bytes(machine, wl, off, nv, spare_banks),
        breakdown,
        _spares(machine, wl, off, spare_banks),
    )


def _grid(step: float) -> list:
    n = max(1, round(1.0 / step))
    return [i / n for i in range(n + 1)]


def best_plan(
    machine: Machine,
    workload: Workload,
    spare_banks: int | None = None,
    step: float = 0.05,
    headroom: float = 0.1,
    tolerance: float = 0.02,
    offload_choices=None,
    nvme_choices=None,
    device_budget: float | None = None,
    host_budget: float | None = None,
) -> Prediction:
    """The placement with the least predicted iteration time whose memory fits `(1 - headroom)`
    of the GPU's and of the host's per-GPU share (and the nvme capacity).

    Candidates: `offload_choices` x `nvme_choices` (fractions; e.g. a model's subgroup
    boundaries), by default a grid of `step`; `spare_banks=None` also picks the spare-bank
    pool: the fewest (one per offloaded subgroup, halving) whose iteration is within
    SPARE_TOLERANCE of the largest pool's that fits (a spare is worth its memory only where
    backward is long enough to hide the step it holds). `device_budget` / `host_budget` (bytes, per
    GPU) replace the headroom-reduced machine figures when given. Among plans within
    `tolerance` (relative) of the fastest, the one with the least offloaded, then least nvme,
    share wins: moving state off the device costs host memory, link bandwidth and a worker,
    for a gain below what this model can resolve. Raises ValueError saying how much memory
    is needed when no plan fits."""
    check(machine, workload)
    ranks = _node_ranks(machine)  # GPUs sharing a node's host memory and drives
    if device_budget is None:
        device_budget = machine.gpu_mem_bytes * (1 - headroom) if machine.gpus else 0.0
    if host_budget is None:
        host_budget = machine.host_mem_bytes / ranks * (1 - headroom)
    nvme_budget = None if machine.nvme_bytes is None else machine.nvme_bytes / ranks
    has_nvme = machine.nvme_read_gbps > 0 and machine.nvme_write_gbps > 0
    offs = sorted(set(offload_choices)) if offload_choices is not None else _grid(step)
    nvs = sorted(set(nvme_choices)) if nvme_choices is not None else _grid(step)
    if not has_nvme:
        nvs = [0.0]
    fits, need_device, need_host = [], None, None
    for off in offs:
        for nv in nvs:
            if nv > off:
                continue
            n_off = offloaded_subgroups(machine, workload, off)
            pools: list[int | None]
            if spare_banks is not None:
                pools = [spare_banks]
            elif not workload.speculative:
                pools = [None, 1]  # NON_SPECULATIVE_SPARE_BANKS, or one where they do not fit
            else:
                pools, k = [None], n_off // 2
                while k >= 1:
                    pools.append(k)
                    k //= 2
            largest = chosen = None
            for pool in pools:
                mem = memory_bytes(machine, workload, off, nv, pool)
                need_device = mem["device"] if need_device is None else min(need_device, mem["device"])
                if machine.gpus and mem["device"] > device_budget:
                    break
                if nvme_budget is not None and mem["nvme"] > nvme_budget:
                    break
                need_host = mem["host"] if need_host is None else min(need_host, mem["host"])
                if mem["host"] > host_budget:
                    continue  # fewer spares may fit
                p = predict(machine, workload, off, nv, pool)
                if largest is None:
                    largest = p  # more spares never cost time: the fastest pool that fits
                elif not workload.speculative or p.iteration_seconds > largest.iteration_seconds * (
                    1 + SPARE_TOLERANCE
                ):
                    break  # fewer spares would expose host work backward could hide
                chosen = p
            if chosen is not None:
                fits.append(chosen)
    if fits:
        fastest = min(p.iteration_seconds for p in fits)
        return min(
            (p for p in fits if p.iteration_seconds <= fastest * (1 + tolerance)),
            key=lambda p: (p.offload_fraction, p.nvme_fraction, p.iteration_seconds),
        )
    per = "per GPU " if machine.gpus > 1 else ""
    if need_host is None:
        whole = workload.sharding in ("zero", "none")
        raise ValueError(
            # need_device is None only where no plan was tried (empty choices): a TypeError, as ever
            f"needs at least {need_device / GB / (1 - headroom):.1f} GB of GPU memory {per}for "  # type: ignore[operator]
            f"the model copy and grads of {workload.params:.3g} parameters (incl. "
            f"{headroom:.0%} headroom); have {device_budget / (1 - headroom) / GB:.1f} GB: "
            + (
                f"with sharding {workload.sharding!r} every GPU holds the whole model copy and "
                f"grads: shard them (fsdp), raise the device memory budget, or use a smaller "
                f"model"
                if whole
                else "add GPUs, raise the device memory budget, or use a smaller model"
            )
        )
    where = (
        "model copy, grads and optimizer state" if machine.gpus == 0 else "offloaded optimizer state"
    ) + ("" if has_nvme else " (no nvme tier given)")
    raise ValueError(
        f"needs at least {need_host / GB / (1 - headroom):.1f} GB of host memory {per}for the "
        f"{where} of {workload.params:.3g} parameters (incl. {headroom:.0%} headroom); have "
        f"{host_budget / (1 - headroom) / GB:.1f} GB{' per GPU' if ranks > 1 else ''}"
        + ("" if has_nvme else "; an nvme tier (nvme_path, or --nvme-read/--nvme-write) would need less")
    )
