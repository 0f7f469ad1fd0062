"""`hybrid-opt plan`: the cost model's best placement for a model on a machine we may not have.

Presets are real machines; their figures are from vendor datasheets where one exists and
otherwise stated as assumptions (see `PRESETS` and `--help`). Every figure can be
overridden by an option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import torch

from hybrid_opt.placement.cost_model import GB, SHARDINGS, Machine, Workload, arrangement, best_plan
from hybrid_opt.state import state_format

GiB = 2**30
_DTYPES = state_format.DTYPE_NAMES
_NAMES = {v: k for k, v in _DTYPES.items()}

# nvme figures are per drive; the machine's aggregate is drives x per-drive rate.
PRESETS: dict[str, dict] = {
    "h100-pcie5": dict(
        about="one H100 PCIe 80GB on PCIe 5.0 x16, 32-core Xeon host",
        sources="datasheet: 80 GB HBM2e at 2.0 TB/s, 756 bf16 dense TFLOPS. Assumed: 50 GB/s "
        "practical H2D/D2H (64 GB/s theoretical per direction); device Adam at 80%% of "
        "HBM bandwidth; 40%% MFU (300 TFLOPS); 512 GB host memory; CPU Adam 2e9 "
        "elem/s (conservative: the DRAM-bound rate of our 2-core dev machine; 8 DDR5 "
        "channels may allow several times more); one PCIe 4 NVMe drive at 7 GB/s read / "
        "5 GB/s write, 3.84 TB. "
        "With --gpus > 1 (collectives): NVLink bridge 600 GB/s (datasheet, both ways: "
        "300 GB/s each way; it pairs two GPUs, more talk over PCIe: pass --nvlink-gbps "
        "50); across nodes one 400 Gb/s NIC per GPU (assumed)",
        machine=dict(
            gpus=1,
            gpu_mem_bytes=80 * GB,
            host_mem_bytes=512 * GB,
            device_adam_gbps=1600,
            host_adam_gelems_per_s=2.0,
            h2d_gbps=50,
            d2h_gbps=50,
            gpu_tflops=300,
            nvlink_gbps=300.0,
            ib_gbps=50.0,
        ),
        nvme=dict(drives=1, read=7.0, write=5.0, drive_bytes=3.84e12),
    ),
    "gh200": dict(
        about="one GH200 superchip: H100 with 96 GB HBM3, 72-core Grace (Neoverse V2, 128-bit "
        "SVE2), 480 GB LPDDR5X, NVLink-C2C",
        sources="datasheet: 96 GB HBM3 at 4 TB/s, 480 GB LPDDR5X up to 500 GB/s, NVLink-C2C "
        "900 GB/s total (450 GB/s each way, used as is: practical rates are lower), "
        "989 bf16 dense TFLOPS. Assumed: device Adam at 80%% of HBM and 40%% MFU (400 "
        "TFLOPS), as 8xh100-node's H100 figures; Grace CPU Adam 1e10 elem/s on 72 cores "
        "(~280 GB/s, ~55%% of LPDDR5X peak; cpu_kernels' sve/neon levels are tested under "
        "emulation only, their speed on Grace unmeasured); one NVMe drive at 7 / 5 GB/s, "
        "3.84 TB. With --gpus > 1: NVLink 4 between superchips 900 GB/s (datasheet; 450 "
        "GB/s each way), one 400 Gb/s NIC per superchip (assumed)",
        machine=dict(
            gpus=1,
            gpu_mem_bytes=96 * GB,
            host_mem_bytes=480 * GB,
            device_adam_gbps=3200,
            host_adam_gelems_per_s=10.0,
            h2d_gbps=450,
            d2h_gbps=450,
            gpu_tflops=400,
            nvlink_gbps=450.0,
            ib_gbps=50.0,
        ),
        nvme=dict(drives=1, read=7.0, write=5.0, drive_bytes=3.84e12),
    ),
    "8xh100-node": dict(
        about="a DGX H100-class node: 8 H100 SXM 80GB, 2 Xeon 8480C (112 cores), 2 TB, 8 NVMe",
        sources="datasheet (DGX H100): 8x H100 SXM5 80 GB (HBM3 3.35 TB/s, 989 bf16 dense "
        "TFLOPS), 2 TB system memory, 8x 3.84 TB NVMe U.2. Assumed: 50 GB/s practical "
        "PCIe 5 per GPU; device Adam at 80%% of HBM; 40%% MFU; CPU Adam 8e9 elem/s for "
        "the node (~224 GB/s of 16 DDR5 channels); per drive 7 GB/s read / 4 GB/s "
        "write. Host memory, CPU and NVMe are shared evenly by the 8 GPUs. Collectives "
        "(datasheet): NVLink 4 through NVSwitch, 900 GB/s per GPU (450 GB/s each "
        "way); across nodes 8x 400 Gb/s ConnectX-7 InfiniBand, 8x 50 = 400 GB/s per "
        "node each way",
        machine=dict(
            gpus=8,
            gpu_mem_bytes=80 * GB,
            host_mem_bytes=2048 * GB,
            device_adam_gbps=2700,
            host_adam_gelems_per_s=8.0,
            h2d_gbps=50,
            d2h_gbps=50,
            gpu_tflops=400,
            nvlink_gbps=450.0,
            ib_gbps=400.0,
        ),
        nvme=dict(drives=8, read=7.0, write=4.0, drive_bytes=3.84e12),
    ),
    "this-machine": dict(
        about="the machine this command runs on, calibrated (cached; hybrid_opt/placement/calibrate.py)",
        sources="measured here: CPU Adam (bank mode, the worker's cores), device Adam (the GPU's "
        "fused kernel, or in-process CPU Adam on a CPU-only host), H2D/D2H (pinned "
        "copies, or the trainer's copies into shared memory), the trainer's slowdown "
        "when a worker takes cores and under its memory traffic, nvme O_DIRECT rates in "
        "--nvme-path (default: the system temp dir); memory as the machine reports it; "
        "collectives' links assumed as 8xh100-node's (450 GB/s NVLink each way, 400 GB/s "
        "IB per node): pass --nvlink-gbps / --ib-gbps",
        machine=None,
        nvme=None,
    ),
}
DEFAULT_PRESET = "h100-pcie5"

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'70e9', '7B', '1.3e9', '350M' -> a positive number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count: use e.g. 70e9, 7B, 1.3e9, 350M")
    value = float(m.group(1)) * _SUFFIX.get(m.group(2).lower(), 1.0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"parameter count must be at least 1, got {text!r}")
    return value


_SIZE_UNITS = {
    "": GB,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": GB,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": GiB,
    "tib": 2**40,
}


def parse_size(text: str) -> float:
    """'80GB', '80GiB', '2TB', '512MiB', '80' (a bare number is GB, 1e9 bytes) -> bytes > 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = _SIZE_UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use e.g. 80GB, 80GiB, 2TB "
            "(decimal GB/TB, binary GiB/TiB; a bare number is GB)"
        )
    value = float(m.group(1)) * unit  # type: ignore[union-attr]  # unit is None where m is
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _positive(kind):
    def conv(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return v

    return conv


def _parser() -> argparse.ArgumentParser:
    presets = "\n".join(
        f"  {name}: {p['about']}.\n    {p['sources'].replace('%%', '%')}." for name, p in PRESETS.items()
    )
    ap = argparse.ArgumentParser(
        prog="hybrid-opt plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Predict the best device/host/nvme placement of AdamW state, its memory per "
        "tier and its step time, from the cost model (hybrid_opt/placement/cost_model.py).",
        epilog="presets (figures from vendor datasheets where stated, otherwise assumptions; "
        "override any of them with the options above):\n" + presets,
    )
    pos = _positive(float)
    ap.add_argument("--params", type=parse_count, required=True, help="parameter count, e.g. 70e9, 7B, 1.3e9")
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        help=f"machine to start from (default {DEFAULT_PRESET})",
    )
    ap.add_argument(
        "--gpus", type=int, help="GPUs in all (0 = CPU only); over several nodes with --gpus-per-node"
    )
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="N",
        help="GPUs per node (default: all --gpus on one node); the host figures "
        "(--host-mem, --host-adam, nvme) are per node, each GPU's rank gets "
        "1/N of them",
    )
    ap.add_argument(
        "--gpu-mem",
        type=parse_size,
        metavar="SIZE",
        help="memory per GPU: 80GB, 80GiB, 0.5TB (a bare number is GB)",
    )
    ap.add_argument(
        "--host-mem",
        type=parse_size,
        metavar="SIZE",
        help="host memory of a node: 2TB, 2TiB, 512GB (a bare number is GB)",
    )
    ap.add_argument(
        "--host-adam", type=pos, metavar="GELEM/S", help="CPU Adam rate of a node (its cores), G elements/s"
    )
    ap.add_argument(
        "--device-adam",
        type=pos,
        metavar="GB/S",
        help="achieved memory bandwidth of the device Adam step, GB/s",
    )
    ap.add_argument("--pcie", type=pos, metavar="GB/S", help="H2D and D2H rate per GPU, each way")
    ap.add_argument("--nvme-read", type=pos, metavar="GB/S", help="read rate per drive")
    ap.add_argument("--nvme-write", type=pos, metavar="GB/S", help="write rate per drive")
    ap.add_argument("--nvme-drives", type=int, help="drives per node (0 = no nvme tier)")
    ap.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default=None,
        help="how the GPUs divide the work, and the collectives' time: "
        "fsdp = FSDP2/ZeRO-3: optimizer state, grads and params sharded over "
        "the GPUs (device memory for each divided by --gpus); params "
        "all-gathered in forward and again in backward, grads reduce-scattered. "
        "zero = ZeRO-2, HybridAdamW(process_group=): optimizer state sharded, "
        "every GPU holds the whole model copy and grads; grads reduce-scattered "
        "in backward, updated params all-gathered after the step (exposed). "
        "none = replicated (DDP): every GPU holds and steps all state (N x host "
        "memory and host Adam work per node), grads all-reduced; DDP's hooks "
        "fire before its all-reduce, so no host step hides under backward. "
        "Not given: the model before this option (fsdp's memory, no "
        "collectives counted). Collectives: ring, bandwidth only, (N-1)/N of "
        "the bytes per GPU over NVLink within a node, over the node's IB "
        "share per GPU across nodes; forward/backward ones overlap compute",
    )
    ap.add_argument(
        "--nvlink-gbps",
        type=pos,
        metavar="GB/S",
        help="NVLink rate per GPU, each way, within a node (preset default: see "
        "below; H100 SXM: 450 = 900 GB/s both ways, datasheet)",
    )
    ap.add_argument(
        "--ib-gbps",
        type=pos,
        metavar="GB/S",
        help="inter-node rate per node, each way: the sum of its NICs (preset "
        "default: see below; DGX H100: 8x 400 Gb/s = 400)",
    )
    ap.add_argument(
        "--nvme-path",
        help="with --preset this-machine: the directory whose disk to "
        "calibrate (default: the system temp dir)",
    )
    ap.add_argument("--backward-seconds", type=pos, help="measured backward time per iteration")
    ap.add_argument(
        "--model-flops", type=pos, help="FLOPs per iteration, all GPUs (default 6 x params x --tokens)"
    )
    ap.add_argument(
        "--tokens",
        type=pos,
        default=8192,
        help="tokens per iteration, all GPUs, for the default FLOPs (default 8192)",
    )
    ap.add_argument("--gpu-tflops", type=pos, help="achieved fwd+bwd TFLOPS per GPU")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="model dtype")
    ap.add_argument(
        "--amsgrad",
        action="store_true",
        help="one more moment, the running max of exp_avg_sq (its dtype: 4 B/param, "
        "2 with --exp-avg-sq-dtype bf16)",
    )
    state_format.add_arguments(
        ap,
        "; the nvme tier reads the high half from the model's param, "
        "a D2H copy of 2 B/param per step; no effect with --dtype fp32",
    )
    ap.add_argument(
        "--no-speculation",
        action="store_true",
        help="host steps start after backward (HybridAdamW(speculative=False)): none hide; "
        'with --gpus 0 they do so anyway (speculative="auto" on shared cores)',
    )
    ap.add_argument(
        "--spare-banks",
        type=int,
        default=None,
        help="spare state banks of exact rollback (default: one per offloaded "
        "subgroup if host memory allows, else the most that fit)",
    )
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="share of GPU and host memory kept free for activations, buffers, the OS (default 0.1)",
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="prefer less offload among plans within this relative share of the fastest (default 0.02)",
    )
    ap.add_argument(
        "--grid-step", type=float, default=0.05, help="fraction grid of the search (default 0.05)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _this_machine(nvme_path: str | None, fmt, dtype, amsgrad: bool) -> tuple[dict, dict]:
    """(Machine kwargs, nvme figures) of the running machine, from calibration (cached); the state
    format `fmt` of `dtype` params and grads as fast as this CPU steps it (calibrate.format_factor)."""
    import tempfile

    import psutil
    import torch

    from hybrid_opt.placement import calibrate
    from hybrid_opt.placement.scheduler import machine_from_rates

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    # the host tier's arrangement there: split on a GPU host, shared on a CPU-only one
    r = calibrate.rates(device, nvme_path or tempfile.gettempdir(), 0.5 if cuda else None)
    kw = _fields(
        machine_from_rates(
            r,
            device,
            torch.cuda.get_device_properties(device).total_memory if cuda else 0.0,
            psutil.virtual_memory().total,
            nvme=False,
        )
    )
    kw.pop("name")
    kw["state_format_factor"] = calibrate.format_factor_cached(
        fmt, dtype, dtype, int(r.get("worker_cores") or 1), amsgrad
    )
    kw["gpu_tflops"] = 300.0 if cuda else 0.033  # override with --gpu-tflops or --backward-seconds
    return kw, dict(drives=1, read=r["nvme_read_gbps"], write=r["nvme_write_gbps"], drive_bytes=None)


def build(args) -> tuple[Machine, Workload]:
    preset = PRESETS[args.preset]
    fp32 = args.dtype == "fp32"
    fmt = state_format.from_arguments(args)
    if preset["machine"] is None:
        base, nvme = _this_machine(
            args.nvme_path, fmt, torch.float32 if fp32 else torch.bfloat16, args.amsgrad
        )
    else:
        base, nvme = preset["machine"], preset["nvme"]
    kw = dict(base, name=args.preset)
    nv = dict(nvme)
    for opt, key in (
        ("gpus", "gpus"),
        ("host_adam", "host_adam_gelems_per_s"),
        ("device_adam", "device_adam_gbps"),
        ("gpu_tflops", "gpu_tflops"),
        ("gpus_per_node", "gpus_per_node"),
        ("nvlink_gbps", "nvlink_gbps"),
        ("ib_gbps", "ib_gbps"),
    ):
        if getattr(args, opt) is not None:
            kw[key] = getattr(args, opt)
    if args.gpu_mem is not None:
        kw["gpu_mem_bytes"] = args.gpu_mem
    if args.host_mem is not None:
        kw["host_mem_bytes"] = args.host_mem
    if args.pcie is not None:
        kw["h2d_gbps"] = kw["d2h_gbps"] = args.pcie
    for opt, key in (("nvme_read", "read"), ("nvme_write", "write"), ("nvme_drives", "drives")):
        if getattr(args, opt) is not None:
            nv[key] = getattr(args, opt)
    kw["nvme_read_gbps"] = nv["read"] * nv["drives"]
    kw["nvme_write_gbps"] = nv["write"] * nv["drives"]
    kw["nvme_bytes"] = None if nv["drive_bytes"] is None else nv["drive_bytes"] * nv["drives"]
    # the optimizer's default arrangement: a CPU-only trainer shares its cores with the worker
    kw["shared_cores"] = kw.get("gpus", 1) == 0
    machine = Machine(**kw)
    workload = Workload(
        params=args.params,
        model_bytes=4 if fp32 else 2,
        grad_bytes=4 if fp32 else 2,
        amsgrad=args.amsgrad,
        state_format=fmt,
        backward_seconds=args.backward_seconds,
        model_flops=args.model_flops,
        tokens_per_iteration=args.tokens,
        # speculative="auto" (speculation.speculates): not where the worker shares the cores
        speculative=not args.no_speculation and not machine.shared_cores,
        sharding=args.sharding,
    )
    return machine, workload


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB"


def model_tflops_per_gpu(machine: Machine, workload: Workload, p) -> float | None:
    """Model FLOPs (6 x params x tokens unless --model-flops) per GPU per second of the
    predicted iteration: the figure papers publish."""
    if workload.backward_seconds is not None and workload.model_flops is None:
        return None  # the iteration's FLOPs are not known
    flops = workload.model_flops or 6.0 * workload.params * workload.tokens_per_iteration
    return flops / max(1, machine.gpus) / p.iteration_seconds / 1e12


_SHARDING_ABOUT = {
    "fsdp": "state, grads and params sharded over the GPUs (FSDP2 / ZeRO-3)",
    "zero": "state sharded over the GPUs, whole model copy and grads on each (ZeRO-2, process_group=)",
    "none": "replicated: every GPU holds and steps all state (DDP)",
}


def _fields(record) -> dict:
    """A dataclass record's fields by name (a new dict: the record is left as it is)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def workload_json(workload: Workload) -> dict:
    """The workload's fields as JSON values: dtypes by name, the state format as its options."""
    out = {k: v for k, v in _fields(workload).items() if k not in ("state_format", "model_dtype")}
    fmt = workload.state_format
    out.update(
        model_dtype=_NAMES.get(workload.param_dtype, str(workload.param_dtype)),
        exp_avg_dtype=_NAMES[fmt.exp_avg_dtype],
        exp_avg_sq_dtype=_NAMES[fmt.exp_avg_sq_dtype],
        store_param_remainders=fmt.store_param_remainders,
    )
    return out


def _state_lines(workload: Workload, machine: Machine) -> list:
    """What the optimizer state is made of, its bytes per param on each tier, and how fast the CPU
    steps it against its bytes where that was measured."""
    fmt, b = workload.state_format, workload.tier_bytes()
    master = (
        "fp32 params: their own master"
        if workload.param_dtype == torch.float32
        else "master = bf16 param + int16 remainder"
        if b["high_half"]
        else "fp32 master"
    )
    extra = "; nvme reads the 2 B high half from the model param (D2H) each step" if b["high_half"] else ""
    return (
        [
            f"state: exp_avg {_NAMES[fmt.exp_avg_dtype]}, exp_avg_sq {_NAMES[fmt.exp_avg_sq_dtype]}"
            f"{' (+ max, amsgrad)' if workload.amsgrad else ''}, {master}",
            f"  bytes per param: device {b['device']}, host bank {b['host']} (spares alike), nvme "
            f"file {b['nvme']} (x2 slots); Adam moves {b['host_adam']} B/param a step",
        ]
        + ([f"  {extra[2:]}"] if extra else [])
        + (
            [
                f"  this CPU steps it {machine.state_format_factor:.2f}x as long as its bytes say (measured: "
                "compute-bound, not memory-bound); the host step's time counts that"
            ]
            if machine.state_format_factor > 1.0
            else []
        )
    )


def _summary(machine: Machine, workload: Workload, p, headroom: float) -> str:
    ranks = max(1, min(machine.gpus_per_node or machine.gpus, max(1, machine.gpus)))
    per = "per GPU" if machine.gpus else "(no GPU: one trainer)"
    d = p.to_dict()
    b = p.breakdown
    off, nv = p.offload_fraction, p.nvme_fraction
    lines = (
        [
            f"hybrid-opt plan: {workload.params:.3g} parameters on {machine.name} "
            f"({machine.gpus} GPU{'s' if machine.gpus != 1 else ''})",
            f"plan: offload_fraction={off:.2f}, nvme_fraction={nv:.2f} "
            f"(device {1 - off:.0%}, host {off - nv:.0%}, nvme {nv:.0%} of the elements)",
            f"spare banks: {p.spare_banks} (each holds one speculated subgroup step until step() "
            f"validates it)",
            *([f"cores: {arrangement(machine)}"] if off > 0 else []),
            *_state_lines(workload, machine),
            f"memory {per}:",
            (
                f"  device {_gb(d['memory_bytes']['device'])} of {_gb(machine.gpu_mem_bytes)}"
                if machine.gpus
                else "  (no GPU: the 'device' share is stepped by the trainer's own cores; "
                "all in host memory)"
            ),
            f"  host   {_gb(d['memory_bytes']['host'])} of {_gb(machine.host_mem_bytes / ranks)}",
            f"  nvme   {_gb(d['memory_bytes']['nvme'])}",
        ]
        + (
            []
            if machine.gpus_per_node is None
            else [
                f"  (host memory, CPU and drives per node, each shared by its {ranks} GPUs)",
            ]
        )
        + [
            f"  ({headroom:.0%} of GPU and host memory kept as headroom)",
            f"predicted: forward+backward {b['forward_backward']:.3f} s, step after backward "
            f"{p.step_seconds:.3f} s, iteration {p.iteration_seconds:.3f} s"
            + (
                ""
                if model_tflops_per_gpu(machine, workload, p) is None
                else f" ({model_tflops_per_gpu(machine, workload, p):.0f} model TFLOPS per GPU)"
            ),
            "where the time goes (seconds):",
            f"  {'device Adam step (after backward)':44s}{b['device_step']:8.3f}",
            f"  {'host Adam compute':44s}{b['host_compute']:8.3f}",
            f"  {'nvme read + write (pipelined with compute)':44s}{b['nvme_io']:8.3f}",
            f"  {'D2H grads + H2D params':44s}{b['d2h'] + b['h2d']:8.3f}",
            f"  {'host work hidden under backward':44s}{b['host_hidden']:8.3f}",
            f"  {'host work exposed after backward':44s}{b['host_exposed']:8.3f}",
        ]
    )
    if workload.sharding is not None:
        lines.insert(1, f"sharding: {workload.sharding}: {_SHARDING_ABOUT[workload.sharding]}")
        lines.append(
            f"  {'collectives (exposed / total)':44s}{b['collectives_exposed']:8.3f} / {b['collectives']:.3f}"
        )
    if b["backward_contention"] > 0:
        lines.append(f"  {'backward slowed by host Adam (shared DRAM)':44s}{b['backward_contention']:8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else list(argv))
    if not 0 <= args.headroom < 1:
        ap.error(f"--headroom must be in [0, 1), got {args.headroom}")
    if args.tolerance < 0:
        ap.error(f"--tolerance must be >= 0, got {args.tolerance}")
    if not 0 < args.grid_step <= 1:
        ap.error(f"--grid-step must be in (0, 1], got {args.grid_step}")
    for name in ("gpus", "nvme_drives", "spare_banks"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        ap.error(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    machine, workload = build(args)
    if machine.gpus == 0 and (args.sharding is not None or args.gpus_per_node is not None):
        ap.error(
            "--sharding and --gpus-per-node describe GPU ranks; with --gpus 0 the planner "
            "models one CPU trainer: give --gpus"
        )
    if machine.gpus_per_node is not None and (
        machine.gpus_per_node > machine.gpus or machine.gpus % machine.gpus_per_node
    ):
        ap.error(
            f"--gpus ({machine.gpus}) must be a multiple of --gpus-per-node "
            f"({machine.gpus_per_node}): every node holds as many GPUs"
        )
    try:
        p = best_plan(
            machine,
            workload,
            spare_banks=args.spare_banks,
            step=args.grid_step,
            headroom=args.headroom,
            tolerance=args.tolerance,
        )
    except ValueError as e:
        print(f"hybrid-opt plan: no placement fits: {e}", file=sys.stderr)
        return 1
    if args.json:
        out = p.to_dict()
        out["machine"] = _fields(machine)
        out["workload"] = workload_json(workload)
        out["bytes_per_param"] = workload.tier_bytes()
        out["model_tflops_per_gpu"] = model_tflops_per_gpu(machine, workload, p)
        out["cores"] = arrangement(machine)
        print(json.dumps(out, indent=2))
    else:
        print(_summary(machine, workload, p, args.headroom))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
