"""The golden harness: what HybridAdamW computes, step by step, recorded once and compared
bitwise afterwards — the promise a change of layout (packed subgroups, params with their own
memory: issue #21) must keep.

Each configuration trains a small model of several params and two param groups for STEPS
steps and records per step the params, the torch-format optimizer state (`step`, the moments,
`master_param`: a remainder one decoded, see _fp32_masters) and `last_grad_norm` /
`step_was_skipped`. Nothing here depends on the CPU the goldens were recorded on: the grads
are exact by construction — the loss is sum(p * G) with G small integers over a power of two,
so backward writes G itself (times a GradScaler's power-of-two scale) into p.grad, with no
matmul whose rounding could differ between CPUs — and every tier steps with the same FMA
arithmetic at every x86 SIMD level (cpu_kernels' promise), the global norm summed per param in
param order. Layout is free to change: Adam is elementwise.

    python tests/golden.py --write        # records tests/data/golden/*.pt on today's code
    python -m pytest tests/test_golden.py # compares

2-rank configurations (FSDP2, process_group) run in tests/dist_scripts/golden_train.py on the
same model and grads (each rank its own G; the reduction averages them exactly).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(HERE, "data", "golden")
STEPS = 5
OVERFLOW_STEP = 2  # the GradScaler configurations see an inf at this step: skipped
SHAPES = [(13, 12), (13,), (6, 13), (6,), (3, 6), (3,), (40, 3)]  # 400 elements; odd rows shard unevenly

# name: (optimizer, hybrid kwargs, model dtype, clip, GradScaler)
CONFIGS = {
    "device_clip": ("AdamW", dict(offload_fraction=0.0), torch.float32, 0.05, False),
    "host_clip": ("AdamW", dict(offload_fraction=1.0), torch.float32, 0.05, False),
    "nvme_clip": ("AdamW", dict(offload_fraction=1.0, nvme_fraction=0.5), torch.float32, 0.05, False),
    "mixed_clip": ("AdamW", dict(offload_fraction=0.5, nvme_fraction=0.25), torch.float32, 0.05, False),
    "mixed_noclip_adam": (
        "Adam",
        dict(offload_fraction=0.5, nvme_fraction=0.25, weight_decay=0.01),
        torch.float32,
        None,
        False,
    ),
    "mixed_scaler_overflow": (
        "AdamW",
        dict(offload_fraction=0.5, nvme_fraction=0.25),
        torch.float32,
        0.05,
        True,
    ),
    "host_amsgrad": ("AdamW", dict(offload_fraction=1.0, amsgrad=True), torch.float32, None, False),
    "host_inverse": ("AdamW", dict(offload_fraction=1.0, rollback="inverse"), torch.float32, None, False),
    "bf16_mixed": ("AdamW", dict(offload_fraction=0.5, nvme_fraction=0.25), torch.bfloat16, 0.05, False),
    "bf16_compressed_mixed": (
        "AdamW",
        dict(
            offload_fraction=0.5,
            nvme_fraction=0.25,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
            store_param_remainders=True,
        ),
        torch.bfloat16,
        0.05,
        True,
    ),
}
SUBGROUP_NUMEL = 48  # several subgroups per param and params sharing subgroups


def build_params(dtype=torch.float32) -> list:
    """The model's params: values k / 64 for small integers k (exact in bf16 too)."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter((torch.randint(-64, 65, s, generator=gen).float() / 64).to(dtype)) for s in SHAPES
    ]


def param_groups(params: list) -> list:
    """Weights decayed at one lr, biases (1-d) not decayed at another: two param groups."""
    return [
        dict(params=[p for p in params if p.dim() > 1], lr=1e-2),
        dict(params=[p for p in params if p.dim() == 1], lr=3e-2, weight_decay=0.0),
    ]


def grads(step: int, rank: int = 0, dtype=torch.float32, overflow: bool = False) -> list:
    """p.grad of each param at `step` on `rank`: integers in [-16, 16] over 8 (exact in bf16),
    one inf in the first param's at OVERFLOW_STEP when `overflow`."""
    gen = torch.Generator().manual_seed(1000 * rank + step + 1)
    out = [(torch.randint(-16, 17, s, generator=gen).float() / 8).to(dtype) for s in SHAPES]
    if overflow and step == OVERFLOW_STEP:
        out[0].view(-1)[0] = float("inf")
    return out


def loss_of(params: list, gs: list):
    """sum(p * G): backward writes G into p.grad exactly."""
    return sum((p * g).sum() for p, g in zip(params, gs))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's part (a DTensor's local shard), on the CPU."""
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).to("cpu", copy=True)


def _fp32_masters(entry: dict, param) -> dict:
    """`entry` with a remainder master recorded as before issue #36: state_dict() now gives a
    bf16 param kept as remainders its int16 `master_remainder` (the tier's own) where it gave
    the decoded fp32 `master_param`; the goldens (bf16_compressed_mixed, zero_compressed_host)
    were recorded with the latter and are not rewritten, so the remainder is decoded here with
    the param (its high half) into exactly that `master_param` (this rank's part), and dropped."""
    if "master_remainder" not in entry:
        return entry
    from hybrid_opt import fp32_master

    out = {n: v for n, v in entry.items() if n != "master_remainder"}
    out["master_param"] = fp32_master(entry, param)
    return out


def snapshot(opt, params: list) -> dict:
    """One step's record: params, torch-format state (cloned: state_dict may return views of
    the live state; a remainder master decoded to its fp32 `master_param`: _fp32_masters),
    last_grad_norm and step_was_skipped."""
    sd = opt.state_dict()
    ordered = [p for g in opt.param_groups for p in g["params"]]  # the state's indices
    state = {
        k: {
            n: (_local(v) if isinstance(v, torch.Tensor) else v)
            for n, v in _fp32_masters(st, ordered[k]).items()
        }
        for k, st in sd["state"].items()
    }
    return dict(
        params=[_local(p) for p in params],
        state=state,
        last_grad_norm=opt.last_grad_norm,
        step_was_skipped=opt.step_was_skipped,
    )


def run(name: str, nvme_dir: str) -> list:
    """The per-step records of configuration `name` in one process."""
    from hybrid_opt import HybridAdam, HybridAdamW

    kind, hybrid, dtype, clip, use_scaler = CONFIGS[name]
    hybrid = dict(hybrid)
    if hybrid.get("nvme_fraction"):
        hybrid["nvme_path"] = nvme_dir
    cls = HybridAdamW if kind == "AdamW" else HybridAdam
    params = build_params(dtype)
    records = []
    with cls(param_groups(params), max_grad_norm=clip, subgroup_numel=SUBGROUP_NUMEL, **hybrid) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if use_scaler else None
        if scaler is not None:
            opt.attach_grad_scaler(scaler)
        for step in range(STEPS):
            opt.zero_grad()
            loss = loss_of(params, grads(step, dtype=dtype, overflow=use_scaler))
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            records.append(snapshot(opt, params))
    return records


def path_of(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.pt")


def compare(actual: list, golden: list, what: str) -> None:
    """Bitwise: every tensor torch.equal (NaN where NaN), every float equal."""
    assert len(actual) == len(golden), f"{what}: {len(actual)} steps recorded, golden has {len(golden)}"
    for step, (a, g) in enumerate(zip(actual, golden)):
        where = f"{what} step {step}"
        assert a["step_was_skipped"] == g["step_was_skipped"], where
        assert (
            a["last_grad_norm"] == g["last_grad_norm"]
            or a["last_grad_norm"] != a["last_grad_norm"]
            and g["last_grad_norm"] != g["last_grad_norm"]
        ), f"{where}: last_grad_norm {a['last_grad_norm']!r} != golden {g['last_grad_norm']!r}"
        for k, (x, y) in enumerate(zip(a["params"], g["params"])):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{where}: param {k} differs"
        assert a["state"].keys() == g["state"].keys(), f"{where}: state keys {a['state'].keys()}"
        for k in g["state"]:
            assert a["state"][k].keys() == g["state"][k].keys(), f"{where}: param {k}'s state keys"
            for n, y in g["state"][k].items():
                x = a["state"][k][n]
                if isinstance(y, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y), f"{where}: param {k}'s {n} differs"
                else:
                    assert x == y, f"{where}: param {k}'s {n}: {x!r} != {y!r}"


DIST_CONFIGS = ("fsdp2_mixed", "zero_mixed", "zero_compressed_host")  # dist_scripts/golden_train.py


def run_dist(out_dir: str) -> list:
    """Every 2-rank configuration in one launch: [rank 0's {name: records}, rank 1's]."""
    from dist_launch import launch

    return launch("golden_train.py", out_dir, *DIST_CONFIGS, timeout_s=170)


def write_all() -> None:
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    for name in CONFIGS:
        with tempfile.TemporaryDirectory() as d:
            torch.save(run(name, d), path_of(name))
        print(f"wrote {path_of(name)}")
    with tempfile.TemporaryDirectory() as d:
        for rank, res in enumerate(run_dist(d)):
            for name in DIST_CONFIGS:
                torch.save(res[name], path_of(f"{name}_rank{rank}"))
                print(f"wrote {path_of(f'{name}_rank{rank}')}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/golden.py --write   (records the goldens on this checkout's code)")
    sys.path[:0] = [os.path.dirname(HERE), HERE]
    write_all()
