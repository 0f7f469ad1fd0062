"""The model of tests/test_sharded_memory.py, shared by its one-process run and its ranks."""

import torch

from hybrid_opt.testing import debug_view

WIDTH = 256


def model() -> torch.nn.Sequential:
    """~1.6M params: 3 blocks of Linear(256, 1024) + Linear(1024, 256) with biases, and norms."""
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [
            torch.nn.Linear(WIDTH, 4 * WIDTH),
            torch.nn.Linear(4 * WIDTH, WIDTH),
            torch.nn.LayerNorm(WIDTH),
        ]
    return torch.nn.Sequential(*layers)


def loss(model, x):
    return model(x).square().mean()


def figures(opt) -> dict:
    """The tiers' bytes as the OS reports them (opt.allocated_bytes), the arena's fixed parts
    (staging slots; io banks: two per nvme read in flight) and the state's own bytes."""
    host = debug_view(opt).host
    return dict(
        allocated=opt.allocated_bytes,
        staging=host.staging_bytes,
        io_banks=2 * host.io_banks * host.banks.bank_stride,
        state=sum(s.numel for s in debug_view(opt).subgroups) * 12,
        subgroups=len(debug_view(opt).subgroups),
    )
