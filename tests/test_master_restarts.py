"""The optimizer's own writes into the params never look like a user's (storage.py): training
with no user write never restarts a master from its param, at every placement, through
zero_grad(), state_dict(), load_state_dict(), replan() and add_param_group(). A false restart
is silent and, with store_param_remainders, loses the master's low 16 bits — so each run is
also checked bit for bit against an fp32-master run of the same grads (remainders step the
same master as an fp32 master would).

Also: a load_state_dict() that fails leaves the committed state as it was (nothing half
loaded), and the re-adoption of a param given new memory with the values it had keeps its
master.
"""

import pytest
import torch
from helpers import FSDP2_ON_GLOO, FSDP2_ON_GLOO_REASON, TORCH_VERSION
from torch import nn

from hybrid_opt import HybridAdam, HybridAdamW, fp32_master
from hybrid_opt.state.storage import ParamGuard
from hybrid_opt.testing import debug_view

BF16, FP32 = torch.bfloat16, torch.float32
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
PLACED = {
    "device": dict(offload_fraction=0.0),
    "host": dict(offload_fraction=1.0),
    "mixed": dict(offload_fraction=0.5),
    "nvme": dict(offload_fraction=1.0, nvme_fraction=0.5),
}
# a bf16 model with one fp32 param (a norm), in one param group
SHAPES = ((40, 9), (23,), (6, 7))
DTYPES = (BF16, FP32, BF16)


def _params(seed=0, shapes=SHAPES, dtypes=DTYPES):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dt)) for s, dt in zip(shapes, dtypes)]


def _backward(params, k):
    """A fixed grad stream through autograd ((p * g).sum() leaves p.grad == g): the grad hooks
    fire, so host subgroups are speculated during backward."""
    g = torch.Generator().manual_seed(500 + k)
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
    sum((p * gr).sum() for p, gr in zip(params, grads)).float().backward()


@pytest.fixture
def restarts(monkeypatch):
    calls = []
    real = ParamGuard.restart_masters

    def spied(self, sg, slices, only_changed):
        calls.append((sg.index, [sl.param_index for sl in slices]))
        return real(self, sg, slices, only_changed)

    monkeypatch.setattr(ParamGuard, "restart_masters", spied)
    return calls


def _masters(opt):
    """Each stepped param's fp32 master: its `master_param`, or decoded from its
    `master_remainder` with the param (its high half); None for an fp32 param. A new tensor
    where decoded, so it keeps the value it had when taken."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {i: fp32_master(st, params[i]) for i, st in opt.state_dict()["state"].items()}


@pytest.mark.parametrize(
    "cls,amsgrad", [(HybridAdamW, False), (HybridAdam, True)], ids=["adamw", "adam-amsgrad"]
)
@pytest.mark.parametrize("placement", list(PLACED))
def test_training_without_user_writes_never_restarts_a_master(placement, cls, amsgrad, restarts, tmp_path):
    kw = dict(PLACED[placement])
    if "nvme_fraction" in kw:
        kw["nvme_path"] = str(tmp_path)
    runs = {}
    for name, rem in (("remainders", True), ("fp32 master", False)):
        params = _params()
        hyper = dict(HYPER, weight_decay=0.01) if cls is HybridAdam else HYPER
        opt = cls(
            params,
            amsgrad=amsgrad,
            subgroup_numel=128,
            max_grad_norm=5.0,
            exp_avg_dtype=BF16,
            exp_avg_sq_dtype=BF16,
            store_param_remainders=rem,
            **hyper,
            **kw,
        )
        runs[name] = (params, opt)
    try:
        for k in range(8):
            for params, opt in runs.values():
                opt.zero_grad()
                _backward(params, k)
                if k == 3:  # between backward and step(): a checkpoint of the committed state
                    opt.state_dict()
                opt.step()
                if k == 4:  # resume from its own checkpoint
                    opt.load_state_dict(opt.state_dict())
                if k == 5:  # a move there and back
                    opt.replan(0.5 if placement != "mixed" else 1.0)
                    opt.replan(**{a: b for a, b in kw.items() if a != "nvme_path"})
            ma, mb = _masters(runs["remainders"][1]), _masters(runs["fp32 master"][1])
            for i, m in ma.items():
                if m is not None:
                    assert torch.equal(m, mb[i]), f"step {k}: param {i}'s master left the fp32-master run's"
        assert not restarts, f"masters restarted with no user write: {restarts}"
        # a param group added afterwards: laying the tiers out again is not a user write either
        for params, opt in runs.values():
            extra = nn.Parameter(torch.ones(5, 3, dtype=BF16))
            opt.add_param_group({"params": [extra]})
            params.append(extra)
            opt.zero_grad()
            _backward(params, 9)
            opt.step()
        assert not restarts, f"masters restarted with no user write: {restarts}"
        ma, mb = _masters(runs["remainders"][1]), _masters(runs["fp32 master"][1])
        for i, m in ma.items():
            if m is not None:
                assert torch.equal(m, mb[i]), f"after add_param_group: param {i}'s master"
    finally:
        for _, opt in runs.values():
            opt.close()


# ---------------------------------------------------------------------------- replaced memory
def _swap_load(model, sd):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(sd, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32 master", "remainders"])
@pytest.mark.parametrize("placement", list(PLACED))
def test_new_memory_with_the_values_it_had_keeps_the_masters(placement, remainders, tmp_path):
    """A module's load_state_dict(assign=True) under swap_module_params_on_conversion gives the
    params new memory: re-adopted (storage.py), the elements whose values did not change keep
    their masters, as an in-place rewrite with the same values does — the resume order model
    last (optimizer checkpoint first) then loses no master bits. Compared bitwise with a run
    that never reloaded; an element given a new value restarts from it."""
    kw = dict(PLACED[placement])
    if "nvme_fraction" in kw:
        kw["nvme_path"] = str(tmp_path)
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 3)).to(BF16)
        models.append(model)
        opts.append(
            HybridAdamW(
                model.parameters(),
                subgroup_numel=64,
                exp_avg_dtype=BF16,
                store_param_remainders=remainders,
                **HYPER,
                **kw,
            )
        )
    try:
        for k in range(6):
            for model, opt in zip(models, opts):
                if k == 3 and model is models[1]:
                    sd = {n: t.clone() for n, t in model.state_dict().items()}
                    _swap_load(model, sd)
                opt.zero_grad()
                _backward(list(model.parameters()), k)
                opt.step()
            ma, mb = _masters(opts[0]), _masters(opts[1])
            for i in ma:
                assert torch.equal(ma[i], mb[i]), f"step {k}: param {i}'s master"
            for pa, pb in zip(models[0].parameters(), models[1].parameters()):
                assert torch.equal(pa.detach(), pb.detach())
        # new values do restart: the master of a changed element is the value written
        model, opt = models[1], opts[1]
        sd = {n: t.clone() for n, t in model.state_dict().items()}
        sd["0.weight"][0, :4] = torch.tensor([0.5, -0.25, 2.0, 1.0], dtype=BF16)
        _swap_load(model, sd)
        opt.zero_grad()
        opt.step()  # no grads: nothing stepped, the new memory re-adopted
        master = fp32_master(opt.state_dict()["state"][0], model[0].weight)
        assert torch.equal(master[0, :4], sd["0.weight"][0, :4].float())
        assert torch.equal(master[1:], ma[0][1:])  # the rest kept its master bits
    finally:
        for opt in opts:
            opt.close()


# ---------------------------------------------------------------------------- a failed load
@pytest.mark.parametrize("placement", ["device", "host", "nvme"])
def test_a_load_that_fails_leaves_the_committed_state_as_it_was(placement, tmp_path):
    """A checkpoint whose last param's exp_avg has the wrong number of elements (another
    model's): refused before anything is written, naming the param and the key — the
    hyperparameters, step counts, moments, masters and params are the optimizer's own still."""
    kw = dict(PLACED[placement])
    if "nvme_fraction" in kw:
        kw["nvme_path"] = str(tmp_path)
    params = _params()
    opt = HybridAdamW(
        params, subgroup_numel=128, exp_avg_dtype=BF16, store_param_remainders=True, **HYPER, **kw
    )
    with opt:
        for k in range(3):
            opt.zero_grad()
            _backward(params, k)
            opt.step()
        before = opt.state_dict()
        before = {
            "state": {i: {k: v.clone() for k, v in st.items()} for i, st in before["state"].items()},
            "lr": before["param_groups"][0]["lr"],
        }
        bad = opt.state_dict()
        bad = {
            "param_groups": [dict(g, lr=0.5) for g in bad["param_groups"]],
            "state": {
                i: {k: (v * 0 + 1 if k != "step" else v * 0 + 9) for k, v in st.items()}
                for i, st in bad["state"].items()
            },
        }
        bad["state"][2]["exp_avg"] = torch.zeros(5)
        values = [p.detach().clone() for p in params]
        out_of_step = RuntimeError(
            "a peer's step failed"
        )  # rank_faults.py: only a load that completes clears it
        debug_view(opt).ledger.rank_failure = out_of_step
        with pytest.raises(ValueError, match=r"parameter 2.*exp_avg.*5 elements.*42"):
            opt.load_state_dict(bad)
        assert debug_view(opt).rank_failure is out_of_step
        debug_view(opt).ledger.rank_failure = None
        after = opt.state_dict()
        assert after["param_groups"][0]["lr"] == before["lr"]
        for i, st in before["state"].items():
            for k, v in st.items():
                assert torch.equal(after["state"][i][k], v), (i, k)
        for p, v in zip(params, values):
            assert torch.equal(p.detach(), v)
        opt.zero_grad()
        _backward(params, 3)
        opt.step()  # and it still trains


# ---------------------------------------------------------------------------- FSDP2 shards
@pytest.fixture
def one_rank(tmp_path):
    """torch.distributed with one gloo rank in this process (FSDP2 on a "cpu" mesh)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp2_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 13), nn.Tanh(), nn.Linear(13, 6)).to(BF16)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2_iteration(model, opt, k):
    opt.zero_grad()
    g = torch.Generator().manual_seed(k)
    model(torch.randn(8, 12, generator=g).to(BF16)).float().square().mean().backward()
    opt.step()


@pytest.mark.parametrize("placement", list(PLACED))
def test_fsdp2_shard_given_new_memory_keeps_remainders_consistent(placement, one_rank, tmp_path):
    """An FSDP2 model (bf16 DTensor params) reloaded with assign=True under swap_tensors: the
    optimizer re-points its subgroups at the new local shards (storage.py) — the host tier's
    remainders too, whose high half is the model's param (on nvme it is read from it each
    step): the param stays its master's high half and the masters those of a run that never
    reloaded, bit for bit."""
    if TORCH_VERSION < FSDP2_ON_GLOO:
        pytest.skip(FSDP2_ON_GLOO_REASON)
    from cpu_kernels.reference import encode_remainder_reference

    kw = dict(PLACED[placement])
    if "nvme_fraction" in kw:
        kw["nvme_path"] = str(tmp_path)
    runs = []
    for _ in range(2):
        model = _fsdp2_model()
        runs.append(
            (
                model,
                HybridAdamW(
                    model.parameters(),
                    lr=1e-2,
                    subgroup_numel=32,
                    store_param_remainders=True,
                    exp_avg_dtype=BF16,
                    **kw,
                ),
            )
        )
    try:
        for k in range(7):
            for model, opt in runs:
                if k == 3 and model is runs[1][0]:
                    before = [p.to_local().data_ptr() for p in model.parameters()]
                    _swap_load(model, {n: t.clone() for n, t in model.state_dict().items()})
                    assert before != [p.to_local().data_ptr() for p in model.parameters()]
                _fsdp2_iteration(model, opt, k)
        (ma, oa), (mb, ob) = runs
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        for i, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
            # the entry holds the master's low half (a DTensor like the param), the param its
            # high half: both the never-reloaded run's, so the decoded masters are its too
            ra, rb = sa[i]["master_remainder"], sb[i]["master_remainder"]
            assert rb.dtype == torch.int16 and rb.placements == pb.placements, i
            assert torch.equal(ra.to_local(), rb.to_local()), i
            assert torch.equal(pa.to_local(), pb.to_local()), i
            master = fp32_master(sb[i], pb).reshape(-1)  # the local shard's
            high, low = encode_remainder_reference(master.contiguous())
            assert torch.equal(high, pb.to_local().detach().reshape(-1)), (
                f"param {i} is not its master's high half"
            )
            assert torch.equal(low, rb.to_local().reshape(-1)), i
            assert torch.equal(fp32_master(sa[i], pa), fp32_master(sb[i], pb)), i
    finally:
        for _, opt in runs:
            opt.close()
