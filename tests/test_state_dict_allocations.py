"""What state_dict() allocates on the params' device (hybrid_opt/state/checkpoint.py iter_state),
counted on the CPU with a dispatch mode: the state copies it returns (a param spanning
subgroups gets its own; one in a single device subgroup gets views) and, on a CPU model, each
nvme subgroup's state read once from its file, only the keys its params' entries have —
nothing else. On a CUDA model every byte past the returned copies is GPU memory
(test_gpu_checkpoint.py measures it there); an fp32 device subgroup holding several params
once made a copy of them all as its "master", which an fp32 param's entry has no key for.
"""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import DEVICE, NVME

SUBGROUP = 1 << 16  # test_gpu_checkpoint.py's layout: device subgroups of one and of two params
PLACEMENTS = {"device": dict(offload_fraction=0.0),
              "mixed_nvme": dict(offload_fraction=0.5, nvme_fraction=0.25)}


class NewStorages(TorchDispatchMode):
    """(nbytes, data_ptr) of each storage of at least 1 KiB an op makes on `device`: an output
    sharing no storage with the op's inputs (views and in-place or out= results share theirs).
    Smaller ones are scalars (a view's placeholder, a flag): a subgroup's worth is what counts."""

    def __init__(self, device):
        super().__init__()
        self.device, self.made = torch.device(device), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device == self.device:
                storage = t.untyped_storage()
                if storage.nbytes() >= 1024 and storage.data_ptr() not in inputs:
                    self.made.append((storage.nbytes(), storage.data_ptr()))
        return out


def make_params(dtype):
    """test_gpu_checkpoint.py's params, on the CPU: one spanning two subgroups' worth, six of
    one subgroup's worth, a small one."""
    g = torch.Generator().manual_seed(0)
    sizes = [2 * SUBGROUP] + [SUBGROUP] * 6 + [1000]
    return [nn.Parameter((torch.randn(n, generator=g) * 0.1).to(dtype)) for n in sizes]


@pytest.mark.filterwarnings("ignore:offload_fraction=0.5")  # whole subgroups miss the fractions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_state_dict_allocates_only_the_state_it_returns(placement, dtype, tmp_path):
    params = make_params(dtype)
    kw = dict(PLACEMENTS[placement], nvme_path=str(tmp_path) if placement == "mixed_nvme" else None)
    with HybridAdamW(params, lr=1e-2, weight_decay=0.1, subgroup_numel=SUBGROUP, **kw) as opt:
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            sum(((p.float() - torch.randn(p.shape, generator=g)) ** 2).mean() for p in params).backward()
            opt.step()
        subgroups, tiers = opt.parts.layout.subgroups, opt.plan.tiers
        # what the bound is about: a device subgroup shared by params (whose fp32 master would
        # be a copy) and a param spanning device subgroups (a returned copy, not views)
        assert any(tiers[sg.index] == DEVICE and len(sg.slices) > 1 for sg in subgroups)
        with NewStorages(params[0].device) as mode:
            sd = opt.state_dict()
        returned = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for st in sd["state"].values() for t in st.values()}
        made = sum(n for n, _ in mode.made)
        copies = sum(n for ptr, n in returned.items() if ptr in {p for _, p in mode.made})
        n_keys = 2 + (dtype != torch.float32)  # exp_avg, exp_avg_sq [, master_param]: fp32 each
        nvme_reads = sum(sg.numel * 4 * n_keys for sg in subgroups if tiers[sg.index] == NVME)
        one_param = max(p.numel() for p in params) * 4 * n_keys
        assert copies >= one_param  # the spanning param's copy is among what it made
        assert made - copies <= nvme_reads, (
            f"state_dict() made {made - copies} B on {params[0].device} past the {copies} B of state "
            f"copies it returns; only the nvme subgroups' reads ({nvme_reads} B) may be: "
            f"{sorted(n for n, p in mode.made if p not in returned)}")
