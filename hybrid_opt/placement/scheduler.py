"""`offload_fraction="auto"` / `nvme_fraction="auto"`: the placement the cost model predicts fastest
within the memory budgets, from calibrated rates and then measured steps; refitted every
`refit_every` steps.

Candidates are the optimizer's own subgroup boundaries in ready order, so a predicted plan is one
the optimizer can lay out. A refit moves state only when the predicted gain beats the move's cost
and `min_gain` of the step: noise never makes the plan flap. Design notes: docs/internals.md."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from hybrid_opt.distributed import node
from hybrid_opt.distributed.local_shards import is_dtensor
from hybrid_opt.placement import cost_model as cm
from hybrid_opt.placement.plan import DEFAULT_SPARE_BANKS
from hybrid_opt.state.layout import bank_padding
from hybrid_opt.state.state_format import StateFormat
from hybrid_opt.worker.client import DEFAULT_WORKER_SHARE

MAX_CANDIDATES = 48
HEADROOM = 0.1
MIN_GAIN = 0.05
SPARE_SHARE = 0.25  # default spare pool of fixed fractions: at most this share of free memory
MOVE_FIXED_S = 0.3  # a new worker process, its shared memory; replaced by the measured cost


def available_device_bytes(free: float, reserved: float, allocated: float) -> float:
    """Device memory a new allocation can get: what the driver has free (cudaMemGetInfo) plus
    the blocks torch's caching allocator holds but no tensor uses (reserved - allocated) —
    torch reuses those before it asks the driver, so the driver's figure alone undercounts."""
    return float(free) + max(0.0, float(reserved) - float(allocated))


def cuda_memory(device) -> dict:
    """The CUDA memory figures of `device` the budgets are computed from (bytes): the driver's
    free and total, and torch's reserved, allocated and peak allocated."""
    free, total = torch.cuda.mem_get_info(device)
    return {
        "free": float(free),
        "total": float(total),
        "reserved": float(torch.cuda.memory_reserved(device)),
        "allocated": float(torch.cuda.memory_allocated(device)),
        "peak": float(torch.cuda.max_memory_allocated(device)),
    }


def measured_device_budget(
    free: float, reserved: float, allocated: float, peak: float, counted: float, floor: float
) -> float:
    """The device budget of "auto" on CUDA once an iteration ran: what the cost model may plan
    with (it counts the model copy, grads and device-tier state itself) beside everything else
    that iteration needed at its peak — activations, temporaries, other tensors.

    free + reserved - peak is what could still have been allocated at the peak (the driver's
    free memory plus torch's cached blocks no tensor used even then); `counted` (the model
    copy, grads and device state now, as the cost model counts them) is already inside the
    peak and is planned again; HEADROOM of the memory the placement could use is kept free
    for iterations that peak higher and for fragmentation. Never below `floor` (the model copy
    and grads alone, every state off the device): the plan that just ran stays choosable."""
    usable = available_device_bytes(free, reserved, allocated) + counted
    room = float(free) + float(reserved) - float(peak)
    return max(float(floor), room + counted - HEADROOM * usable)


def _free_host_bytes() -> float:
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except Exception:  # pragma: no cover - psutil is a dependency; /proc is the fallback
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    return 0.0


def _free_host_share() -> float:
    """This rank's share of the node's free host memory: ranks on one node split it evenly
    (node.py; all of it for a single rank)."""
    return node.share(_free_host_bytes())


@dataclass
class Sample:
    """One step's measured times (seconds) and what was stepped where."""

    backward_s: float | None
    step_s: float
    device_s: float
    host_wait_s: float
    device_elements: int
    host_worker_s: float  # worker time on host-tier (not nvme) subgroups
    host_elements: int
    hidden_s: float
    # the trainer's own (host) time in the device step; on CUDA device_s is GPU time from
    # events, and step_s - device_s would subtract GPU time from host time
    device_host_s: float | None = None


@dataclass
class Decision:
    offload_fraction: float
    nvme_fraction: float
    prediction: cm.Prediction
    reason: str
    current: cm.Prediction | None = None


@dataclass
class AutoPlanner:
    numels: list  # per subgroup
    ready_ranks: list
    device: torch.device
    model_bytes: int
    state_bytes: int  # 12, or 16 with amsgrad (which moments exist; their bytes: state_format)
    subgroup_numel: int
    fixed_offload: float | None = None  # a number when only nvme_fraction is "auto"
    fixed_nvme: float | None = None  # a number when only offload_fraction is "auto"
    nvme_path: str | os.PathLike | None = None
    worker_share: float | None = None  # None: HostTier's default arrangement
    spare_banks: int | None = None  # None: sized from the host budget (cost_model.best_plan)
    exact_rollback: bool = True
    speculative: bool = True
    device_budget: float | None = None
    host_budget: float | None = None
    refit_every: int = 50
    calibration: dict | None = None
    samples: list = field(default_factory=list)
    move_cost_s: float | None = None
    backward_s: float | None = None  # measured, normalised to "all cores, no host work"
    overhead_s: float = 0.0  # measured step time outside the tiers' work
    refits: int = 0
    moves: int = 0
    # CUDA without an explicit device budget: state stays off the device until the peak of
    # the iterations (activations included) is measured; observe_device_memory() then sets
    # the budget, at every refit
    device_from_peak: bool = False
    state_format: StateFormat = field(default_factory=StateFormat)
    model_dtype: torch.dtype | None = None  # None: fp32 for 4-byte params, else bf16

    def __post_init__(self):
        self.device_peak_pending = self.device_from_peak
        if self.calibration is None:
            from hybrid_opt.placement import calibrate

            device_bytes = None
            if torch.device(self.device).type == "cuda" and self.device_budget is not None:
                # the measurement's buffers within the budget, beside the model and its grads
                device_bytes = calibrate.device_bytes_allowed(
                    self.device_budget, sum(self.numels) * 2 * self.model_bytes
                )
            # the arrangement the host tier will have (HostTier: None splits a GPU host's
            # cores, and shares a CPU-only host's between the trainer and the worker)
            share = self.worker_share
            if share is None and torch.device(self.device).type == "cuda":
                share = DEFAULT_WORKER_SHARE
            rates = calibrate.rates(
                self.device,
                self.nvme_path if self._nvme_allowed() else None,
                share,
                device_bytes=device_bytes,
            )
            # the state format's own speed on this CPU, at the worker's cores (cost_model.Machine)
            dt = self.model_dtype or (torch.float32 if self.model_bytes == 4 else torch.bfloat16)
            factor = calibrate.format_factor_cached(
                self.state_format, dt, dt, int(rates.get("worker_cores") or 1), self.state_bytes == 16
            )
            self.calibration = dict(rates, state_format_factor=factor)
        self.rates = dict(self.calibration)
        self.total = sum(self.numels)

    def regrow(self, numels: list, ready_ranks: list) -> None:
        """The model's subgroups changed (add_param_group): their sizes and readiness now. The
        refitted rates still hold; the backward measured before is scaled by the growth (more
        trainable params, proportionally more backward) until the next refit measures it."""
        if self.backward_s is not None and self.total:
            self.backward_s *= sum(numels) / self.total
        self.numels, self.ready_ranks, self.total = list(numels), list(ready_ranks), sum(numels)
        self.samples = []

    # ------------------------------------------------------------------ the model's inputs
    def _nvme_allowed(self) -> bool:
        return self.nvme_path is not None and self.fixed_nvme != 0.0

    def machine(self) -> cm.Machine:
        return machine_from_rates(
            self.rates, self.device, self.device_budget, self.host_budget, nvme=self._nvme_allowed()
        )

    def workload(self) -> cm.Workload:
        wl = cm.Workload(
            params=float(self.total),
            model_bytes=self.model_bytes,
            grad_bytes=self.model_bytes,
            state_bytes=self.state_bytes,
            state_format=self.state_format,
            model_dtype=self.model_dtype,
            subgroup_numel=min(self.subgroup_numel, max(self.numels or [1])),
            bank_padding=bank_padding(self.numels),
            step_overhead_seconds=self.overhead_s,
            exact_rollback=self.exact_rollback,
            speculative=self.speculative,
        )
        backward = self.backward_s
        if backward is None:
            # nothing measured yet: assume backward takes as long as a device-only Adam step
            # (the case hybrid placement is for); the first refit replaces it with the measure
            backward = self.total * cm.device_bytes_per_element(wl) / (self.rates["device_adam_gbps"] * 1e9)
        return dataclasses.replace(wl, backward_seconds=backward)

    def _boundaries(self) -> list:
        """Offloaded shares at subgroup boundaries, earliest-ready first (at most
        MAX_CANDIDATES + 1 of them, evenly spread)."""
        order = sorted(range(len(self.numels)), key=lambda i: self.ready_ranks[i])
        cum, acc = [0.0], 0
        for i in order:
            acc += self.numels[i]
            cum.append(acc / self.total if self.total else 0.0)
        if len(cum) > MAX_CANDIDATES + 1:
            step = (len(cum) - 1) / MAX_CANDIDATES
            cum = [cum[round(k * step)] for k in range(MAX_CANDIDATES + 1)]
        cum[-1] = 1.0
        return cum

    def _snap(self, value: float) -> float:
        return min(self._boundaries(), key=lambda b: abs(b - value))

    # ------------------------------------------------------------------ decisions
    def observe_device_memory(self, mem: dict, counted: float, floor: float) -> None:
        """The device budget from memory measured after iterations ran (`mem`: cuda_memory()
        figures; `counted`, `floor`: see measured_device_budget); the next choice may put
        state on the device within it."""
        self.device_budget = measured_device_budget(
            mem["free"], mem["reserved"], mem["allocated"], mem["peak"], counted, floor
        )
        self.device_peak_pending = False

    def choose(self) -> Decision:
        bounds = self._boundaries()
        offs = [self._snap(self.fixed_offload)] if self.fixed_offload is not None else bounds
        if self.device_peak_pending:
            offs = [1.0]  # nothing on the device before the activations are measured
        nvs = [self._snap(self.fixed_nvme)] if self.fixed_nvme is not None else bounds
        machine = self.machine()
        try:
            p = cm.best_plan(
                machine,
                self.workload(),
                spare_banks=self.spare_banks,
                headroom=HEADROOM,
                offload_choices=offs,
                nvme_choices=nvs,
                device_budget=self.device_budget,
                host_budget=self.host_budget,
            )
        except ValueError as e:
            hint = (
                ""
                if self.nvme_path is not None
                else ('; or give nvme_path (with nvme_fraction="auto") so state can go to disk')
            )
            raise ValueError(
                f'offload_fraction="auto": no placement fits the memory budgets: {e}. '
                f"Pass device_memory_budget= / host_memory_budget= (bytes) if more "
                f"is free than was measured{hint}"
            ) from None
        why = (
            "from calibrated rates, backward assumed as long as a device-only step"
            if self.backward_s is None
            else f"from rates and backward ({self.backward_s * 1e3:.1f} ms) measured over "
            f"{len(self.samples)} steps"
        )
        if self.device_peak_pending:
            why = (
                "all state off the device until the first iterations' peak device memory "
                "(activations included) is measured; " + why
            )
        if p.offload_fraction > 0:
            why += "; cores " + cm.arrangement(machine)
        if machine.state_format_factor > 1.0:
            why += (
                f"; this CPU steps the state format {machine.state_format_factor:.2f}x as long as its bytes "
                "say (calibrate.format_factor)"
            )
        return Decision(p.offload_fraction, p.nvme_fraction, p, why)

    def predict(self, offload_fraction: float, nvme_fraction: float, spare_banks=None) -> cm.Prediction:
        spares = spare_banks if spare_banks is not None else self.spare_banks
        return cm.predict(self.machine(), self.workload(), offload_fraction, nvme_fraction, spares)

    def observe(self, sample: Sample) -> None:
        self.samples.append(sample)

    def moved(self, seconds: float) -> None:
        """A move between tiers took `seconds`: the next refit weighs a move by that cost."""
        self.move_cost_s = seconds
        self.moves += 1

    def due(self, steps_taken: int) -> bool:
        """First refit after 4 measured steps (the first step's page faults excluded), then
        every `refit_every`."""
        if self.refit_every <= 0:
            return False
        first = min(5, self.refit_every)
        return steps_taken == first or (steps_taken > first and (steps_taken - first) % self.refit_every == 0)

    def refit(self, current_off: float, current_nv: float, current_spares=None) -> Decision | None:
        """Updates the rates from the samples since the last refit; returns the plan to move
        to, or None to stay."""
        samples = self.samples[1:] if self.refits == 0 else self.samples
        self.samples = []
        self.refits += 1
        if not samples:
            return None
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        r = self.rates
        cpu_only = self.device.type != "cuda"
        bwd = [s.backward_s for s in samples if s.backward_s]
        if bwd:
            hidden = med([s.hidden_s for s in samples])
            c = r.get("backward_slowdown_with_host_adam", 1.0)
            b = med(bwd) - (hidden * (1 - 1 / c) if c > 1 else 0.0)
            if cpu_only and current_off > 0:
                b /= r.get("trainer_slowdown_with_worker", 1.0)
            self.backward_s = max(0.0, b)
        # the device tier's own time: perf_counter on a CPU host, CUDA events (GPU time) on a GPU
        dev = [s for s in samples if s.device_elements and s.device_s > 0]
        if dev:
            gbps = med(
                [
                    s.device_elements * cm.device_bytes_per_element(self.workload()) / s.device_s / 1e9
                    for s in dev
                ]
            )
            if not cpu_only:  # the worker shares no memory system with the GPU's kernels
                r["device_adam_gbps"] = r["device_adam_gbps_with_worker"] = gbps
            else:
                # at fp32 state's speed: the cost model scales the CPU's by state_format_factor
                gbps *= r.get("state_format_factor", 1.0)
                alone = r["device_adam_gbps"]
                shared = r.get("device_adam_gbps_with_worker") or r["device_adam_gbps"]
                if current_off > 0:
                    r["device_adam_gbps_with_worker"], r["device_adam_gbps"] = gbps, gbps * alone / shared
                else:
                    r["device_adam_gbps"], r["device_adam_gbps_with_worker"] = gbps, gbps * shared / alone
        self.overhead_s = max(
            0.0,
            med(
                [
                    s.step_s - (s.device_s if s.device_host_s is None else s.device_host_s) - s.host_wait_s
                    for s in samples
                ]
            ),
        )
        host = [s for s in samples if s.host_elements and s.host_worker_s > 0]
        if host:
            # measured at this format's bytes and speed; kept at the reference bytes the cost model
            # divides by, and fp32 state's speed its state_format_factor scales
            scale = self.workload().tier_bytes()["host_adam"] / cm.HOST_ADAM_REFERENCE_BYTES
            scale *= r.get("state_format_factor", 1.0)
            r["host_adam_gelems_per_s"] = med([s.host_elements / s.host_worker_s / 1e9 for s in host]) * scale
        best = self.choose()
        now = self.predict(current_off, current_nv, current_spares)
        best.current = now
        if (best.offload_fraction, best.nvme_fraction) == (current_off, current_nv) and (
            current_spares is None or best.prediction.spare_banks <= current_spares
        ):
            return None
        gain = now.iteration_seconds - best.prediction.iteration_seconds
        moved = abs(best.offload_fraction - current_off) + abs(best.nvme_fraction - current_nv)
        copy_gbps = r.get("d2h_gbps") or 1.0
        cost = (
            self.move_cost_s if self.move_cost_s is not None else MOVE_FIXED_S
        ) + moved * self.total * self.workload().tier_bytes()["host"] / (copy_gbps * 1e9)
        if gain < MIN_GAIN * now.iteration_seconds or gain * self.refit_every < cost:
            return None
        best.reason = (
            f"refit: predicted {now.iteration_seconds * 1e3:.1f} -> "
            f"{best.prediction.iteration_seconds * 1e3:.1f} ms per iteration, move "
            f"~{cost:.2f} s"
        )
        return best


def machine_from_rates(
    rates: dict, device, device_budget=None, host_budget=None, nvme: bool = True
) -> cm.Machine:
    """The cost model's Machine for the running machine, from calibrate.rates() (or rates
    refitted from measured steps). Memory figures are the budgets (0 when not given). The
    node's nvme bandwidth is shared by its ranks: each plans with its share (node.py)."""
    r = rates
    kw = dict(
        name="this machine",
        gpus=1 if torch.device(device).type == "cuda" else 0,
        gpu_mem_bytes=float(device_budget or 0.0),
        host_mem_bytes=float(host_budget or 0.0),
        device_adam_gbps=r["device_adam_gbps"],
        host_adam_gelems_per_s=r["host_adam_gelems_per_s"],
        h2d_gbps=r.get("h2d_gbps", 0.0),
        d2h_gbps=r.get("d2h_gbps", 0.0),
        backward_slowdown_with_host_adam=r.get("backward_slowdown_with_host_adam", 1.0),
        trainer_slowdown_with_worker=r.get("trainer_slowdown_with_worker", 1.0),
        device_adam_gbps_with_worker=r.get("device_adam_gbps_with_worker"),
        shared_cores=bool(r.get("shared_cores", False)),
        speculated_host_share=float(r.get("speculated_host_share", 1.0)),
        state_format_factor=float(r.get("state_format_factor", 1.0)),
    )
    if nvme and r.get("nvme_read_gbps") and r.get("nvme_write_gbps"):
        kw.update(
            nvme_read_gbps=node.share(r["nvme_read_gbps"]), nvme_write_gbps=node.share(r["nvme_write_gbps"])
        )
    return cm.Machine(**kw)


def default_spare_banks(n_host: int, subgroup_state_bytes: int, leftover=None) -> int:
    """Fixed fractions without `spare_banks=`: a spare bank for every host subgroup (every host
    step can then hide under backward) if they fit in SPARE_SHARE of the free memory, else as
    many as fit, never fewer than DEFAULT_SPARE_BANKS. With an explicit host budget, `leftover`
    is what the placement leaves of it: as many as fit there (at least one)."""
    size = max(1, subgroup_state_bytes)
    if leftover is not None:
        return max(1, min(n_host, int(leftover // size)))
    fit = int(_free_host_share() * SPARE_SHARE // size)
    return max(1, min(n_host, max(DEFAULT_SPARE_BANKS, fit)))


def _held(t: torch.Tensor) -> torch.Tensor:
    """The memory `t` holds on this rank: a DTensor's local shard, else `t` (a process_group
    param is whole on every rank)."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def default_budgets(params: list, device: torch.device, device_budget, host_budget) -> tuple:
    """(device, host) budgets in bytes for the cost model, which counts the model copy and
    grads itself: what is free now (on CUDA: available_device_bytes, torch's cached blocks
    included; host memory: this rank's share of the node's, _free_host_share) plus what the
    model's parameters already hold, less HEADROOM (the user's explicit budgets are taken as
    they are). A DTensor param (FSDP2) holds its local shard only: its global size would count
    every rank's."""
    param_bytes = sum(_held(p).numel() * p.element_size() for p in params)
    grad_bytes = sum(_held(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    if host_budget is None:
        host_budget = (_free_host_share() + (param_bytes + grad_bytes if device.type != "cuda" else 0)) * (
            1 - HEADROOM
        )
    if device.type == "cuda":
        if device_budget is None:
            m = cuda_memory(device)
            free = available_device_bytes(m["free"], m["reserved"], m["allocated"])
            device_budget = (free + param_bytes + grad_bytes) * (1 - HEADROOM)
    else:
        # CPU only: one memory holds every tier; the host budget governs
        device_budget = device_budget if device_budget is not None else host_budget
        if device_budget is not None and host_budget is not None:
            host_budget = min(host_budget, device_budget)
    return float(device_budget), float(host_budget)


def check_fixed_plan(machine_budgets: tuple, mem: dict, cuda: bool) -> None:
    """Fixed fractions with explicit budgets: a clear error when the plan needs more."""
    device_budget, host_budget = machine_budgets
    if cuda and device_budget is not None and mem["device"] > device_budget:
        raise ValueError(
            f"this placement needs {mem['device'] / 1e9:.2f} GB of device memory and "
            f"device_memory_budget is {device_budget / 1e9:.2f} GB: raise "
            f'offload_fraction or use offload_fraction="auto"'
        )
    if host_budget is not None and mem["host"] > host_budget:
        raise ValueError(
            f"this placement needs {mem['host'] / 1e9:.2f} GB of host memory and "
            f"host_memory_budget is {host_budget / 1e9:.2f} GB: raise nvme_fraction "
            f'(with nvme_path) or use nvme_fraction="auto"'
        )
