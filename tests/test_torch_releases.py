"""What differs between the torch releases the GPU CI matrix installs (2.4 on; pyproject: torch >= 2.4).

DTensor parameters (FSDP2) and process_group= need torch.distributed.tensor's public DTensor (2.5 on;
tested from 2.6, where fully_shard is public too). An older torch keeps DTensor under
torch.distributed._tensor, which the optimizer does not read: it refuses both with the release
that has them, rather than step a local shard as a whole param. The other features a later torch
added (named parameters, Adam's decoupled_weight_decay) follow the installed torch, as
torch.optim's classes do; the tests that compare with them are skipped on an older torch
(tests/helpers.py says which).
"""

import pytest
import torch
from helpers import skip_unless

from hybrid_opt import HybridAdamW
from hybrid_opt.distributed.local_shards import has_public_dtensor, is_pre_public_dtensor


def test_the_version_rule_matches_what_torch_has():
    import torch.distributed.tensor

    assert has_public_dtensor() == hasattr(torch.distributed.tensor, "DTensor")
    assert not is_pre_public_dtensor(torch.zeros(2))


@skip_unless(
    not has_public_dtensor(), f"torch {torch.__version__} has a public DTensor (the FSDP2 tests use it)"
)
def test_an_older_torch_s_dtensor_and_process_group_are_refused_naming_the_release(tmp_path):
    import torch.distributed as dist
    from torch.distributed._tensor import DTensor, Shard
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        p = torch.nn.Parameter(DTensor.from_local(torch.zeros(8), mesh, [Shard(0)]))
        assert is_pre_public_dtensor(p)
        with pytest.raises(ValueError, match=r"DTensor parameters \(FSDP2\) from torch 2\.6.*Upgrade torch"):
            HybridAdamW([p], offload_fraction=0.0)
        with pytest.raises(RuntimeError, match=r"process_group= needs torch >= 2\.5.*Upgrade torch"):
            HybridAdamW([torch.nn.Parameter(torch.zeros(8))], process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
