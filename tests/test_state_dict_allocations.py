"""What state_dict() allocates on the params' device (hybrid_opt/state/checkpoint.py iter_state),
counted on the CPU with a dispatch mode: nothing. Every tensor it returns is a view of the
memory that holds the state (a param spanning subgroups cut on page boundaries too: its pieces
mapped side by side), an nvme subgroup's included (its committed slot, mapped). On a CUDA
model a param spanning device subgroups is a copy (test_gpu_checkpoint.py measures it there),
as is, anywhere, a param over the device and host tiers. An fp32 device subgroup holding several
params makes no copy of them as a "master": an fp32 param's entry has no key for one.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_opt import HybridAdamW
from hybrid_opt.placement.plan import DEVICE
from hybrid_opt.testing import debug_view

SUBGROUP = 1 << 16  # test_gpu_checkpoint.py's layout: device subgroups of one and of two params
PLACEMENTS = {
    "device": dict(offload_fraction=0.0),
    "mixed_nvme": dict(offload_fraction=0.5, nvme_fraction=0.25),
}


class NewStorages(TorchDispatchMode):
    """(nbytes, data_ptr) of each storage of at least 1 KiB an op makes on `device`: an output
    sharing no storage with the op's inputs (views and in-place or out= results share theirs).
    Smaller ones are scalars (a view's placeholder, a flag): a subgroup's worth is what counts."""

    def __init__(self, device):
        super().__init__()
        self.device, self.made = torch.device(device), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
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
        subgroups, tiers = debug_view(opt).subgroups, opt.plan.tiers
        # what the bound is about: a device subgroup shared by params (whose fp32 master would
        # be a copy) and a param spanning device subgroups
        assert any(tiers[sg.index] == DEVICE and len(sg.slices) > 1 for sg in subgroups)
        with NewStorages(params[0].device) as mode:
            sd = opt.state_dict()
        # the one copy: a param over the device and host tiers (which keep views differently)
        tiers_of = {}
        for sg in subgroups:
            for sl in sg.slices:
                tiers_of.setdefault(sl.param_index, set()).add(tiers[sg.index] == DEVICE)
        across = sum(
            t.untyped_storage().nbytes()
            for i, st in sd["state"].items()
            if len(tiers_of[i]) == 2
            for k, t in st.items()
            if k != "step"
        )
        made = sum(n for n, _ in mode.made)
        assert made == across, f"state_dict() made {made} B on {params[0].device}: {sorted(mode.made)}"
        for st in sd["state"].values():
            for t in st.values():  # each a storage of its own: torch.save writes just its bytes
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
