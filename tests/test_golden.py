"""The golden harness (tests/golden.py): every configuration's params, torch-format state,
last_grad_norm and step_was_skipped, step by step, bitwise those recorded on the code before
the layout changed (issue #21) — in one process at every placement, and at 2 gloo ranks under
FSDP2 and process_group."""

import os

import golden as G
import pytest
import torch
from dist_launch import DIST_MARKS

pytestmark = pytest.mark.skipif(
    __import__("cpu_kernels").simd_level() == "portable",
    reason="the goldens are the FMA levels' bits (AVX2 / AVX-512 agree bitwise); the portable "
    "level rounds a*b+c twice and differs in the last bits by design",
)


@pytest.mark.parametrize("name", list(G.CONFIGS))
def test_one_process_is_bitwise_the_golden(tmp_path, name):
    G.compare(G.run(name, str(tmp_path)), torch.load(G.path_of(name)), name)


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    for mark in DIST_MARKS:
        if mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    return G.run_dist(str(tmp_path_factory.mktemp("golden_dist")))


@pytest.mark.parametrize("name", G.DIST_CONFIGS)
def test_two_ranks_are_bitwise_the_golden(dist_run, name):
    for rank, res in enumerate(dist_run):
        G.compare(res[name], torch.load(G.path_of(f"{name}_rank{rank}")), f"{name} rank {rank}")


def test_every_golden_file_is_compared():
    names = set(G.CONFIGS) | {f"{n}_rank{r}" for n in G.DIST_CONFIGS for r in range(2)}
    on_disk = {f[:-3] for f in os.listdir(G.GOLDEN_DIR) if f.endswith(".pt")}
    assert on_disk == names, on_disk ^ names
