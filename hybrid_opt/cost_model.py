"""Cost model: predicted step time and memory per tier of a placement, and the best placement.

Deterministic and closed-form, so it answers for machines we do not have (`hybrid-opt
plan`). Rates are inputs; nothing here measures. All figures are per GPU (per trainer
process where there is no GPU): the optimizer state, grads and model copy are partitioned
over the GPUs (ZeRO-3 style), and the host-side rates and capacities in `Machine` are
whole-machine figures shared evenly by the GPUs.

Time of one iteration = forward + backward + step, where the step is what is left after
backward ends:

- device tier, after backward: `Ed * (read + written) / device_adam_gbps`, with
  read = state + grad bytes and written = state + model-copy bytes per element
  (fp32 master+m+v = 12, bf16 grad 2, bf16 copy 2: 28 B/element);
- host tiers, per offloaded element: `w = max(1 / host rate, nvme I/O per element)
  + grad bytes / d2h + model bytes / h2d`. The nvme read and write of a subgroup pipeline
  with the CPU step of its neighbours (max, not sum); the PCIe/C2C copies are counted in
  series with the step (conservative: our worker copies a subgroup's grads in and its
  params out around its step). Host work in all: `H = Eo * w`;
- hiding under backward: grads become ready uniformly over backward (`T_b`), in reverse
  parameter order, and host tiers take the earliest-ready share `f` of the elements. That
  share arrives over `[0, f*T_b]`; a queue fed at that rate and served at `1/w` per element
  finishes at `max(f*T_b + s*w, s*T_b/E + H)` (s = one subgroup: the last one cannot start
  before its grads are ready, the first one not before it is whole). Host time exposed after
  backward = `max(0, finish - T_b)`: the whole of backward is the window when the host is
  the bottleneck, because it is busy from the first subgroup on;
- device and host tiers run on different hardware after backward: step = max(device step,
  exposed host time);
- contention (CPU-only hosts, DESIGN "Facts"): backward itself runs on the same memory
  system, and is `backward_slowdown_with_host_adam` times slower while host Adam runs, so
  each second of host work hidden under backward lengthens backward by `(1 - 1/c)` s.

Memory per GPU: device = state of the device share + model copy + grads (activations are
not counted: budgets keep `headroom`); host = state of the host share + spare banks +
staging slots (+ nvme I/O buffers); nvme = two slots x state of the nvme share.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hybrid_opt.plan import DEFAULT_SPARE_BANKS

GB = 1e9
DEFAULT_SUBGROUP_NUMEL = 4 * 2 ** 20     # HybridAdamW's default unit of placement
STAGING_SLOTS = 4                        # grad-in / param-out slots in flight per worker
IO_BANKS = 4                             # nvme reads in flight (two buffers each)
BACKWARD_SHARE = 2.0 / 3.0               # backward ~ 2x forward FLOPs


@dataclass
class Machine:
    """Rates and capacities. `gpus=0` means no accelerator: every element is stepped on the
    host and the model copy and grads live in host memory. Host-side figures (memory, Adam
    rate, nvme rates and capacity) are for the whole machine; GPU and link figures per GPU."""
    name: str = "custom"
    gpus: int = 1
    gpu_mem_bytes: float = 80 * GB
    host_mem_bytes: float = 512 * GB
    device_adam_gbps: float = 1600.0         # achieved memory bandwidth of a device Adam step
    host_adam_gelems_per_s: float = 2.0      # CPU Adam, G elements/s, the worker's cores
    h2d_gbps: float = 50.0
    d2h_gbps: float = 50.0
    nvme_read_gbps: float = 0.0              # aggregate; 0 = no nvme tier
    nvme_write_gbps: float = 0.0
    nvme_bytes: float | None = None          # aggregate capacity; None = not limiting
    gpu_tflops: float = 300.0                # achieved fwd+bwd rate per GPU (or the CPU's)
    backward_slowdown_with_host_adam: float = 1.0


@dataclass
class Workload:
    """The model: `params` in all; dtype sizes in bytes per element. fwd+bwd time is
    `backward_seconds * 1.5` when given, else `model_flops` (per iteration, all GPUs;
    default 6 x params x tokens_per_iteration) over the GPUs' achieved rate."""
    params: float
    model_bytes: int = 2                     # bf16 model copy
    state_bytes: int = 12                    # fp32 master + m + v (16 with amsgrad)
    grad_bytes: int = 2
    backward_seconds: float | None = None
    model_flops: float | None = None
    tokens_per_iteration: float = 8192
    subgroup_numel: int = DEFAULT_SUBGROUP_NUMEL

    @property
    def master_is_model(self) -> bool:
        # fp32 parameters are their own master: the device keeps no separate copy
        return self.model_bytes == 4


@dataclass
class Prediction:
    offload_fraction: float
    nvme_fraction: float
    step_seconds: float
    iteration_seconds: float
    forward_backward_seconds: float
    memory_bytes: dict
    breakdown: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {"predicted_step_seconds": d.pop("step_seconds"),
                "predicted_iteration_seconds": d.pop("iteration_seconds"),
                "forward_backward_seconds": d.pop("forward_backward_seconds"),
                "plan": {"offload_fraction": d.pop("offload_fraction"),
                         "nvme_fraction": d.pop("nvme_fraction")},
                **d}


def _ranks(machine: Machine) -> int:
    return max(1, machine.gpus)


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


def memory_bytes(machine: Machine, workload: Workload, offload_fraction: float,
                 nvme_fraction: float, spare_banks: int = DEFAULT_SPARE_BANKS) -> dict:
    """Bytes per GPU on each tier for this placement."""
    e = workload.params / _ranks(machine)
    off, nv = offload_fraction, nvme_fraction
    s = min(workload.subgroup_numel, e)
    device_state = workload.state_bytes - (4 if workload.master_is_model else 0)
    model_and_grads = e * (workload.model_bytes + workload.grad_bytes)
    device = (1 - off) * e * device_state + model_and_grads
    host = (off - nv) * e * workload.state_bytes
    if off > 0:
        n_off = max(1, round(off * e / s))
        host += min(spare_banks, n_off) * s * workload.state_bytes
        host += STAGING_SLOTS * s * (workload.grad_bytes + workload.model_bytes)
    if nv > 0:
        host += IO_BANKS * 2 * s * workload.state_bytes
    if machine.gpus == 0:
        host += device
        device = 0.0
    return {"device": float(device), "host": float(host),
            "nvme": float(2 * nv * e * workload.state_bytes)}


def predict(machine: Machine, workload: Workload, offload_fraction: float,
            nvme_fraction: float = 0.0, spare_banks: int = DEFAULT_SPARE_BANKS) -> Prediction:
    """Predicted times and memory of one placement (see the module docstring for the model)."""
    off, nv = float(offload_fraction), float(nvme_fraction)
    if not (0.0 <= nv <= off <= 1.0):
        raise ValueError(f"need 0 <= nvme_fraction <= offload_fraction <= 1, got "
                         f"offload_fraction={off}, nvme_fraction={nv}")
    if machine.gpus == 0 and off < 1.0:
        raise ValueError("a machine without GPUs steps every element on the host: "
                         "offload_fraction must be 1")
    if nv > 0 and (machine.nvme_read_gbps <= 0 or machine.nvme_write_gbps <= 0):
        raise ValueError(f"machine {machine.name!r} has no nvme rates: nvme_fraction must be 0")
    ranks = _ranks(machine)
    wl = workload
    e = wl.params / ranks
    s = min(wl.subgroup_numel, e)
    t_fb, t_b = forward_backward_seconds(machine, wl)

    # device tier
    e_dev = (1 - off) * e
    written = wl.state_bytes + (0 if wl.master_is_model else wl.model_bytes)
    device_step = e_dev * (wl.state_bytes + wl.grad_bytes + written) / (machine.device_adam_gbps * GB)

    # host tiers, per offloaded element (host rate and nvme bandwidth are shared by the GPUs)
    e_off = off * e
    host_rate = machine.host_adam_gelems_per_s * 1e9 / ranks
    compute_per_elem = 1.0 / host_rate
    if nv > 0:
        nvme_io = (nv * e * wl.state_bytes / (machine.nvme_read_gbps * GB / ranks)
                   + nv * e * wl.state_bytes / (machine.nvme_write_gbps * GB / ranks))
    else:
        nvme_io = 0.0
    host_compute = e_off * compute_per_elem
    if machine.gpus == 0:
        d2h = h2d = 0.0
    else:
        d2h = e_off * wl.grad_bytes / (machine.d2h_gbps * GB)
        h2d = e_off * wl.model_bytes / (machine.h2d_gbps * GB)
    host_work = max(host_compute, nvme_io) + d2h + h2d
    w = host_work / e_off if e_off > 0 else 0.0
    if e_off > 0:
        finish = max(off * t_b + s * w, s * t_b / e + host_work)
        exposed_host = max(0.0, finish - t_b)
    else:
        exposed_host = 0.0
    hidden_host = host_work - exposed_host
    c = machine.backward_slowdown_with_host_adam
    contention = hidden_host * (1.0 - 1.0 / c) if c > 1.0 else 0.0

    step = max(device_step, exposed_host)
    iteration = t_fb + contention + step
    breakdown = {
        "forward_backward": t_fb, "backward": t_b,
        "device_step": device_step,
        "host_compute": host_compute, "nvme_io": nvme_io, "d2h": d2h, "h2d": h2d,
        "host_work": host_work, "host_hidden": hidden_host, "host_exposed": exposed_host,
        "backward_contention": contention,
    }
    return Prediction(off, nv, step, iteration, t_fb,
                      memory_bytes(machine, wl, off, nv, spare_banks), breakdown)


def _grid(step: float) -> list:
    n = max(1, round(1.0 / step))
    return [i / n for i in range(n + 1)]


def best_plan(machine: Machine, workload: Workload, spare_banks: int = DEFAULT_SPARE_BANKS,
              step: float = 0.05, headroom: float = 0.1, tolerance: float = 0.02) -> Prediction:
    """The placement on a grid of `step` with the least predicted iteration time whose memory
    fits `(1 - headroom)` of the GPU's and of the host's per-GPU share (and the nvme capacity).

    Among plans within `tolerance` (relative) of the fastest, the one with the least
    offloaded, then least nvme, share wins: moving state off the device costs host memory,
    link bandwidth and a worker, for a gain below what this model can resolve. Raises
    ValueError saying how much memory is needed when no plan fits."""
    ranks = _ranks(machine)
    device_budget = machine.gpu_mem_bytes * (1 - headroom) if machine.gpus else 0.0
    host_budget = machine.host_mem_bytes / ranks * (1 - headroom)
    nvme_budget = None if machine.nvme_bytes is None else machine.nvme_bytes / ranks
    has_nvme = machine.nvme_read_gbps > 0 and machine.nvme_write_gbps > 0
    offs = [1.0] if machine.gpus == 0 else _grid(step)
    fits, need_device, need_host = [], None, None
    for off in offs:
        for nv in (_grid(step) if has_nvme else [0.0]):
            if nv > off:
                continue
            mem = memory_bytes(machine, workload, off, nv, spare_banks)
            need_device = mem["device"] if need_device is None else min(need_device, mem["device"])
            if mem["device"] > device_budget:
                continue
            if nvme_budget is not None and mem["nvme"] > nvme_budget:
                continue
            need_host = mem["host"] if need_host is None else min(need_host, mem["host"])
            if mem["host"] > host_budget:
                continue
            fits.append(predict(machine, workload, off, nv, spare_banks))
    if fits:
        fastest = min(p.iteration_seconds for p in fits)
        return min((p for p in fits if p.iteration_seconds <= fastest * (1 + tolerance)),
                   key=lambda p: (p.offload_fraction, p.nvme_fraction, p.iteration_seconds))
    per = "per GPU " if machine.gpus > 1 else ""
    if need_host is None:
        raise ValueError(
            f"needs at least {need_device / GB / (1 - headroom):.1f} GB of GPU memory {per}for "
            f"the model copy and grads of {workload.params:.3g} parameters (incl. "
            f"{headroom:.0%} headroom); have {machine.gpu_mem_bytes / GB:.1f} GB: add GPUs or "
            f"use a smaller model")
    where = ("model copy, grads and optimizer state" if machine.gpus == 0
             else "offloaded optimizer state") + ("" if has_nvme else " (no nvme tier given)")
    raise ValueError(
        f"needs at least {need_host / GB / (1 - headroom):.1f} GB of host memory {per}for the "
        f"{where} of {workload.params:.3g} parameters (incl. {headroom:.0%} headroom); have "
        f"{machine.host_mem_bytes / ranks / GB:.1f} GB{' per GPU' if ranks > 1 else ''}"
        + ("" if has_nvme else "; an nvme tier (--nvme-read/--nvme-write) would need less"))
