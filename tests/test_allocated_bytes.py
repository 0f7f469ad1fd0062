"""`opt.allocated_bytes` against what the OS reports (hybrid_opt/state/allocated.py): the host
arena's size from the memfd behind it (`/proc/self/fd`) and its mapping (`/proc/self/smaps`),
the nvme files' apparent sizes on disk, process_group's buffers, the device tier's state
(8 B per fp32 element: its two moments), and nothing once closed."""

import os

import pytest
import torch
from helpers import arena_rss, child_pids, needs_public_dtensor

from hybrid_opt import HybridAdamW
from hybrid_opt.testing import debug_view


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40)).to(dtype)


def _step(model, opt):
    model(torch.randn(4, 128, dtype=next(model.parameters()).dtype)).float().square().mean().backward()
    opt.step()


def _memfd_sizes(field="st_blocks") -> int:
    """Allocated bytes (st_blocks) or sizes (st_size) of the hybrid_opt arenas this process holds
    a descriptor of (each memfd once, by inode: one may be open twice), as the OS reports them."""
    sizes = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:hybrid_opt-host" in os.readlink(f"/proc/self/fd/{fd}"):
                st = os.stat(f"/proc/self/fd/{fd}")
                sizes[(st.st_dev, st.st_ino)] = st.st_blocks * 512 if field == "st_blocks" else st.st_size
        except OSError:
            pass
    return sum(sizes.values())


def _apparent(path) -> int:
    return sum(os.stat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)


# the kernel's shared-memory huge pages (shmem_enabled): the host's own setting, and "always", whose
# path (the arena populated through mappings that ask for 4 KiB pages, not reserved by fallocate:
# populate.shmem_takes_huge_pages) then runs on any host; only a host set so can show that its pages
# stay 4 KiB (measured: docs/benchmarks.md, huge pages)
SHMEM_ENABLED = [None, "[always] within_size advise never deny force"]


@pytest.mark.parametrize("shmem_enabled", SHMEM_ENABLED, ids=["host's", "always"])
def test_host_and_nvme_bytes_are_what_the_os_reports(tmp_path, monkeypatch, shmem_enabled):
    if shmem_enabled is not None:
        monkeypatch.setenv("HYBRID_OPT_SHMEM_ENABLED", shmem_enabled)
    model = _model()
    with HybridAdamW(
        model.parameters(),
        subgroup_numel=2048,
        offload_fraction=0.75,
        nvme_fraction=0.25,
        nvme_path=str(tmp_path),
    ) as opt:
        _step(model, opt)
        debug_view(opt).host.arena.wait_populated(timeout_s=60)
        got = opt.allocated_bytes
        assert got["host"] == _memfd_sizes() == arena_rss() == _memfd_sizes("st_size") > 0
        assert got["nvme"] == _apparent(tmp_path) > 0
        assert got["comm"] == 0
        device = sum(opt.plan.numels[i] for i in opt.plan.subgroups("device"))
        assert device > 0 and got["device"] == 8 * device  # fp32: its own master, two fp32 moments
    assert opt.allocated_bytes == {"device": 0, "host": 0, "nvme": 0, "comm": 0}


def test_dormant_spare_banks_are_not_counted_until_they_wake():
    """Speculating at a fixed fraction lays out a spare per host subgroup, two awake
    (tests/test_spare_growth.py): the host bytes are the pages the OS allocated, which the
    trainer's mapping holds, less than the arena's size by the dormant banks."""
    model = _model()
    kw = dict(subgroup_numel=2048, offload_fraction=1.0, speculative=True, worker_share=0.5)
    with HybridAdamW(model.parameters(), **kw) as opt:
        host = debug_view(opt).host
        for stepped in (False, True):  # before the first step; after it (some may have woken)
            if stepped:
                _step(model, opt)
            host.arena.wait_populated(timeout_s=60)
            got = opt.allocated_bytes["host"]
            dormant = len(host.pool.dormant)
            assert dormant > 0 or stepped, "no dormant spare bank at construction"
            assert got == _memfd_sizes() == arena_rss()
            assert got == _memfd_sizes("st_size") - dormant * host.banks.bank_stride


def test_compressed_device_state_is_six_bytes_a_param():
    model = _model(torch.bfloat16)
    with HybridAdamW(
        model.parameters(),
        offload_fraction=0.0,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        store_param_remainders=True,
    ) as opt:
        n = sum(p.numel() for p in model.parameters())
        # bf16 moments (2 + 2) and the int16 remainder (2); the bf16 param is the master's high half
        assert opt.allocated_bytes == {"device": 6 * n, "host": 0, "nvme": 0, "comm": 0}


@needs_public_dtensor  # process_group= (torch >= 2.5)
def test_process_group_buffers_are_counted_as_comm(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = _model()
        with HybridAdamW(
            model.parameters(), subgroup_numel=2048, offload_fraction=1.0, process_group=dist.group.WORLD
        ) as opt:
            before = opt.allocated_bytes["comm"]
            _step(model, opt)
            got = opt.allocated_bytes["comm"]
            buffers = debug_view(opt).sharding.comm_tensors()  # the comm window's slots, chunks, counts
            assert got == sum(t.untyped_storage().nbytes() for t in buffers if t is not None)
            # the averaged chunks (one fp32 grad copy of this rank's share) exist from
            # construction; the comm window's slots are allocated on first use
            n = sum(p.numel() for p in model.parameters())
            assert before >= 4 * n and got > before
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the budgets count these bytes
def _wide(dtype=torch.float32):
    """~1.2M params: the default subgroup_numel cuts it into 8 subgroups of ~150K (whole pages
    matter little at that size: the cost model's element counts come within a few %)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(384, 384) for _ in range(8)] + [torch.nn.LayerNorm(384)]
    return torch.nn.Sequential(*layers).to(dtype)


PLACEMENTS = {
    "host": dict(offload_fraction=1.0),
    "mixed": dict(offload_fraction=0.5),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=0.5),
    "all-nvme": dict(offload_fraction=1.0, nvme_fraction=1.0),
    "inverse": dict(offload_fraction=1.0, rollback="inverse"),
    "amsgrad": dict(offload_fraction=0.75, amsgrad=True),
    "bf16-remainders": dict(
        offload_fraction=1.0,
        dtype=torch.bfloat16,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    ),
    "bf16-fp32-norm": dict(offload_fraction=1.0, dtype=torch.bfloat16, fp32_norm=True),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_a_placement_is_counted_as_the_os_reports_it_before_it_is_allocated(tmp_path, name):
    """What the budgets are checked against (footprint.py: the plan's arena and device tensors,
    counted before the tiers exist) is what allocated_bytes then reads from the OS, to the byte;
    the cost model's estimate (what "auto" plans with) is not below it."""
    kw = dict(PLACEMENTS[name])
    model = _wide(kw.pop("dtype", torch.float32))
    if kw.pop("fp32_norm", False):
        model[-1].float()
    if kw.get("nvme_fraction"):
        kw["nvme_path"] = str(tmp_path)
    with HybridAdamW(model.parameters(), **kw) as opt:
        counted = debug_view(opt).placement.bytes_of(opt.plan)
        got = opt.allocated_bytes
        assert got["host"] == _memfd_sizes() > 0
        assert counted["host"] == got["host"] + got["device"]  # one memory on a CPU-only host
        assert counted["device"] == got["device"]
        estimate = debug_view(opt).placement.modelled_bytes(*debug_view(opt).fractions, opt.plan.spare_banks)[
            "host"
        ]
        model_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + grads
        assert estimate - model_bytes >= 0.97 * counted["host"], (estimate - model_bytes, counted)


def test_a_fixed_placement_over_its_host_budget_raises_before_allocating_anything():
    """The budget one byte short of the arena the placement would map: refused at construction,
    saying how much it needs, and no arena was made (no memfd, no worker process)."""
    model = _wide()
    with HybridAdamW(model.parameters(), offload_fraction=1.0, spare_banks=1) as probe:
        need = probe.allocated_bytes["host"]
    children = child_pids()
    arenas = _memfd_sizes()
    with pytest.raises(ValueError, match="this placement needs .* of host memory and host_memory_budget"):
        HybridAdamW(model.parameters(), offload_fraction=1.0, host_memory_budget=need - 1)
    assert _memfd_sizes() == arenas and child_pids() == children
    with HybridAdamW(model.parameters(), offload_fraction=1.0, host_memory_budget=need) as opt:
        assert opt.allocated_bytes["host"] == need and opt.plan.spare_banks == 1
