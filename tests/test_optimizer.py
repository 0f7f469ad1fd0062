"""HybridAdamW / HybridAdam against torch.optim.AdamW / Adam (foreach=False), at every placement.

One table drives the numerics (CONTRIBUTING.md, Tests; torch/optim's OptimizerInfo style):
placements × optimizer class × model dtype × clipping × optimizer inputs, each run for 30 steps
beside torch (+ `clip_grad_norm_` before torch's step). fp32 models run their own forward and
backward beside torch's and must stay within fp32 rounding (tests/tolerances.py). A bf16 model
is compared with torch stepping fp32 copies initialised from the same bf16 values and fed the
same grads: torch then keeps an fp32 master exactly as we do, so our fp32 master
(`state_dict()['state'][i]['master_param']`) is held to the fp32 tolerance and our bf16 params
to the bf16 one.

What is promised bitwise (a checkpoint round trip, a param that gets no grad) is asserted with
`torch.equal`, never with a tolerance. Error inputs are a second table, with torch's message
regex where torch has one (and torch is checked to raise it too).

Every optimizer with offload_fraction > 0 starts a worker process: each test closes its
optimizers (`with` / ExitStack), and the models are tiny with small subgroups so that layouts
still span several subgroups (a parameter larger than a subgroup, many tiny ones sharing one).
"""

import copy
import inspect
import io
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field

import psutil
import pytest
import torch
from helpers import needs_named_params, needs_torch_adam_decoupled
from tolerances import ATOL, RTOL, assert_close
from torch import nn

from hybrid_opt import HybridAdam, HybridAdamW

FP32, BF16 = torch.float32, torch.bfloat16
STEPS = 30
SUBGROUP = 64  # Net has 724 elements: 12 subgroups, fc1.weight spans 8, the tiny params share


# ============================================================================= tables
@dataclass(frozen=True)
class Placement:
    """Where the state lives: shares of all elements off the device (host + nvme) and on nvme."""

    name: str
    offload: float
    nvme: float = 0.0

    def kwargs(self) -> dict:
        kw = dict(offload_fraction=self.offload)
        if self.nvme:
            kw.update(nvme_fraction=self.nvme, nvme_path=_NVME_DIR["path"])
        return kw


_NVME_DIR = {}


@pytest.fixture(autouse=True, scope="module")
def _nvme_dir(tmp_path_factory):
    """One directory for every nvme placement of this module (a real disk, not /dev/shm)."""
    _NVME_DIR["path"] = str(tmp_path_factory.mktemp("nvme"))


PLACEMENTS = [
    Placement("device", offload=0.0),
    Placement("mixed", offload=0.5),
    Placement("host", offload=1.0),
    Placement("nvme", offload=1.0, nvme=0.25),
]
MIXED = PLACEMENTS[1]


@dataclass(frozen=True)
class OptimizerInfo:
    """Our class, torch's class it must match, and its decay semantics."""

    cls: type
    reference: type
    decoupled: bool

    @property
    def name(self) -> str:
        return self.cls.__name__


OPTIMIZERS = [
    OptimizerInfo(HybridAdamW, torch.optim.AdamW, True),
    OptimizerInfo(HybridAdam, torch.optim.Adam, False),
]
ADAMW, ADAM = OPTIMIZERS


@dataclass(frozen=True)
class OptimInput:
    """Hyperparameters shared by ours and torch's (weight decay > 0 everywhere: Adam's default
    is 0, and decay on a param that got no grad is what several tests look for)."""

    name: str
    kwargs: dict = field(default_factory=dict)


OPTIM_INPUTS = [
    OptimInput("plain", dict(lr=1e-2, weight_decay=0.1)),
    OptimInput("amsgrad", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.99))),
    OptimInput("maximize", dict(lr=5e-3, weight_decay=0.05, maximize=True, eps=1e-6, amsgrad=True)),
]


def _table():
    for pl in PLACEMENTS:
        for info in OPTIMIZERS:
            for dtype in (FP32, BF16):
                for clip in (None, 0.5):
                    for oi in OPTIM_INPUTS:
                        yield pytest.param(
                            pl,
                            info,
                            dtype,
                            clip,
                            oi,
                            id="-".join(
                                [
                                    pl.name,
                                    info.name,
                                    str(dtype).split(".")[-1],
                                    "clip" if clip else "noclip",
                                    oi.name,
                                ]
                            ),
                        )


# ============================================================================= models and loops
class Net(nn.Module):
    """Linear(16,32)-ReLU-Linear(32,4) plus many tiny params: fc1.weight (512) is larger than a
    subgroup, the tiny ones (1 or 4 elements) share one."""

    def __init__(self, n_tiny=12):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.tiny = nn.ParameterList(
            nn.Parameter(0.1 * torch.randn(4 if k % 2 else 1)) for k in range(n_tiny)
        )

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x)))
        for k, t in enumerate(self.tiny):
            out = out + t * ((k + 1) / len(self.tiny))
        return out


def make_net(dtype=FP32, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def make_batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def loss_fn(model, batch):
    x, y = batch
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def train(model, opt, batches, clip=None):
    """Plain loop; `clip` is for torch's optimizers (ours clip through max_grad_norm)."""
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def lockstep(ours_model, ours, ref_model, ref, batches, *, clip=None, share_grads=False, after_step=None):
    """Steps ours and torch's side by side. share_grads: torch gets our grads (as fp32)
    instead of running its own backward (bf16 models). Returns torch's pre-clip norms."""
    norms = []
    for i, batch in enumerate(batches):
        ours.zero_grad()
        ref.zero_grad()
        loss_fn(ours_model, batch).backward()
        if share_grads:
            for a, b in zip(ours_model.parameters(), ref_model.parameters()):
                b.grad = None if a.grad is None else a.grad.float()
        else:
            loss_fn(ref_model, batch).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)))
        ref.step()
        ours.step()
        if after_step is not None:
            after_step(i)
    return norms


def assert_params_close(ours_model, ref_model, dtype=FP32):
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        assert_close(a.float(), b.to(dtype).float(), dtype=dtype, msg=name)


def assert_state_close(ours_sd, ref_sd, *, exact=False):
    """Our state_dict against torch's: same params stepped, same keys (plus master_param for a
    low-precision param), same step counts, moments within fp32 rounding (or bitwise)."""
    assert set(ours_sd["state"]) == set(ref_sd["state"])
    for i, ref_st in ref_sd["state"].items():
        st = ours_sd["state"][i]
        assert set(st) - {"master_param"} == set(ref_st) - {"master_param"}, i
        assert float(st["step"]) == float(ref_st["step"]), i
        for k, v in ref_st.items():
            if k == "step":
                continue
            if exact:
                assert torch.equal(st[k], v), (i, k)
            else:
                assert_close(st[k], v.float(), dtype=FP32, msg=f"state[{i}][{k}]")


def save_load(sd):
    """Through a file as a user would: torch.save, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def hybrid(info, params, placement=MIXED, subgroup_numel=SUBGROUP, **kw):
    return info.cls(params, subgroup_numel=subgroup_numel, **placement.kwargs(), **kw)


# ============================================================================= 1. the table
@pytest.mark.parametrize("placement,info,dtype,clip,oi", list(_table()))
def test_matches_torch_over_30_steps(placement, info, dtype, clip, oi):
    ours_model = make_net(dtype)
    ref_model = copy.deepcopy(ours_model).float()  # fp32 copy of the same (bf16) values
    ref = info.reference(ref_model.parameters(), foreach=False, **oi.kwargs)
    clip_coefs, our_norms = [], []
    with hybrid(info, ours_model.parameters(), placement, max_grad_norm=clip, **oi.kwargs) as ours:

        def record(_):
            clip_coefs.append(ours.stats["clip_coef"])
            our_norms.append(ours.last_grad_norm)

        ref_norms = lockstep(
            ours_model,
            ours,
            ref_model,
            ref,
            make_batches(),
            clip=clip,
            share_grads=dtype != FP32,
            after_step=record,
        )
        sd = ours.state_dict()
        assert_state_close(sd, ref.state_dict())
    if clip is not None:
        assert min(clip_coefs) < 1.0, "clipping never triggered: the test proves nothing"
        torch.testing.assert_close(
            torch.tensor(our_norms), torch.tensor(ref_norms), rtol=RTOL[FP32], atol=ATOL[FP32]
        )
    else:
        assert set(clip_coefs) == {1.0}
    if dtype == FP32:
        assert_params_close(ours_model, ref_model)
        return
    assert_params_close(ours_model, ref_model, dtype)
    for i, (a, b) in enumerate(zip(ours_model.parameters(), ref_model.parameters())):
        master = sd["state"][i]["master_param"]
        assert master.dtype == FP32 and master.shape == a.shape
        assert_close(master, b, dtype=FP32, msg=f"master {i}")
        assert torch.equal(master.to(dtype), a), "the model param is its master rounded as torch casts"


# ============================================================================= 2. GradScaler
INF_STEPS = {2, 5, 6, 11}


@pytest.mark.parametrize("clip_mode", ["noclip", "fused_clip", "unscale_then_clip"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_grad_scaler_skips_and_scales_like_torch(placement, clip_mode):
    """Injected infs (in fc1.weight, held on the device tier at mixed placement, and in the
    last tiny param, ready first and so on the host tier) skip exactly torch's steps; the scale
    sequence is torch's. fused_clip: ours clips through max_grad_norm on still-scaled grads;
    unscale_then_clip: the user unscales and clips, ours then gets grad_scale=None."""
    batches = make_batches(15)
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours_model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **kw)
    ours_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    max_norm = None if clip_mode == "noclip" else 0.5
    fused = max_norm if clip_mode == "fused_clip" else None
    ours_scales, ref_scales, ours_skipped, ref_skipped = [], [], [], []
    with hybrid(ADAMW, ours_model.parameters(), placement, max_grad_norm=fused, **kw) as ours:
        for i, batch in enumerate(batches):
            for model, opt, scaler, scales in (
                (ours_model, ours, ours_scaler, ours_scales),
                (ref_model, ref, ref_scaler, ref_scales),
            ):
                opt.zero_grad()
                scaler.scale(loss_fn(model, batch)).backward()
                if i in INF_STEPS:
                    target = model.fc1.weight if i % 2 else model.tiny[-1]
                    target.grad.view(-1)[0] = float("inf")
                if max_norm is not None and (opt is ref or clip_mode == "unscale_then_clip"):
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                before = [p.detach().clone() for p in model.parameters()]
                scale_before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
                if opt is ours:
                    ours_skipped.append(ours.step_was_skipped)
                    if ours.step_was_skipped:
                        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
                else:
                    ref_skipped.append(scaler.get_scale() < scale_before)
    assert [i for i, s in enumerate(ref_skipped) if s] == sorted(INF_STEPS)
    assert ours_skipped == ref_skipped
    assert ours_scales == ref_scales
    assert_params_close(ours_model, ref_model)


# ============================================================================= 3. checkpoints
def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _resume(dtype, weights, make_opt, sd):
    model = make_net(dtype, seed=123)  # different init: everything must come from the checkpoint
    model.load_state_dict(weights)
    opt = make_opt(model)
    opt.load_state_dict(save_load(sd))
    return model, opt


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_checkpoint_round_trip_continues_bitwise(placement, dtype):
    batches = make_batches(15)
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, max_grad_norm=0.5, subgroup_numel=200)

    def make_opt(model):
        return hybrid(ADAMW, model.parameters(), placement, **kw)

    model = make_net(dtype)
    with ExitStack() as stack:
        opt = stack.enter_context(make_opt(model))
        train(model, opt, batches[:5])
        # a snapshot, as with torch: device-tier state comes as references to the live state
        sd, weights = save_load(opt.state_dict()), _snapshot(model)
        train(model, opt, batches[5:])
        end_sd = opt.state_dict()

        model2, opt2 = _resume(dtype, weights, make_opt, sd)
        stack.enter_context(opt2)
        train(model2, opt2, batches[5:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        assert_state_close(opt2.state_dict(), end_sd, exact=True)
        if dtype != FP32:
            for st, st2 in zip(end_sd["state"].values(), opt2.state_dict()["state"].values()):
                assert torch.equal(st["master_param"], st2["master_param"])


@pytest.mark.parametrize(
    "saved_at,loaded_at",
    [(PLACEMENTS[0], PLACEMENTS[2]), (PLACEMENTS[2], PLACEMENTS[1])],
    ids=["device_to_host", "host_to_mixed"],
)
def test_checkpoint_across_placements_continues_bitwise(saved_at, loaded_at):
    """The same CPU kernel steps every tier on a CPU-only host, so moving a checkpoint to
    another placement does not change a bit of the continuation."""
    batches = make_batches(15)
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    model = make_net()
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(ADAMW, model.parameters(), saved_at, **kw))
        train(model, opt, batches[:5])
        sd, weights = save_load(opt.state_dict()), _snapshot(model)  # a snapshot (see above)
        train(model, opt, batches[5:])
        model2, opt2 = _resume(FP32, weights, lambda m: hybrid(ADAMW, m.parameters(), loaded_at, **kw), sd)
        stack.enter_context(opt2)
        train(model2, opt2, batches[5:])
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        assert_state_close(opt2.state_dict(), opt.state_dict(), exact=True)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_our_state_dict_loads_into_torch(placement, info):
    batches = make_batches(15)
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    model = make_net()
    with hybrid(info, model.parameters(), placement, **kw) as ours:
        train(model, ours, batches[:5])
        ref_model = copy.deepcopy(model)
        ref = info.reference(ref_model.parameters(), foreach=False, **kw)
        ref.load_state_dict(save_load(ours.state_dict()))
        assert ref.param_groups[0]["decoupled_weight_decay"] is info.decoupled
        lockstep(model, ours, ref_model, ref, batches[5:])
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(model, ref_model)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_torch_state_dict_loads_into_ours(placement, info):
    batches = make_batches(15)
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    ref_model = make_net()
    ref = info.reference(ref_model.parameters(), foreach=False, **kw)
    train(ref_model, ref, batches[:5])
    model = copy.deepcopy(ref_model)
    with hybrid(info, model.parameters(), placement, **kw) as ours:
        ours.load_state_dict(save_load(ref.state_dict()))
        assert_state_close(ours.state_dict(), ref.state_dict(), exact=True)
        lockstep(model, ours, ref_model, ref, batches[5:])
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(model, ref_model)


@needs_torch_adam_decoupled
@pytest.mark.parametrize("src,dst", [(ADAMW, ADAM), (ADAM, ADAMW)], ids=["AdamW_to_Adam", "Adam_to_AdamW"])
def test_checkpoint_loads_across_classes(src, dst):
    """As torch.optim: the checkpoint's hyperparameters (lr, betas, weight_decay, ...) are taken;
    torch.optim.Adam loading an AdamW checkpoint takes the saved `decoupled_weight_decay=True`
    and decays as AdamW from then on, while AdamW stays decoupled (its __setstate__)."""
    batches = make_batches(15)
    model = make_net()
    with ExitStack() as stack:
        opt = stack.enter_context(hybrid(src, model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True))
        train(model, opt, batches[:5])
        sd = save_load(opt.state_dict())
        model2 = copy.deepcopy(model)
        # built with amsgrad=True: see test_amsgrad_checkpoint_loads_into_optimizer_built_without
        opt2 = stack.enter_context(hybrid(dst, model2.parameters(), lr=1e-3, weight_decay=0.0, amsgrad=True))
        opt2.load_state_dict(sd)
        group = opt2.param_groups[0]
        assert group["decoupled_weight_decay"] is (src.decoupled or dst.decoupled)
        assert (group["lr"], group["weight_decay"], group["amsgrad"]) == (1e-2, 0.1, True)
        # reference: torch's class of the loading kind, same checkpoint
        ref_model = copy.deepcopy(model)
        ref = dst.reference(ref_model.parameters(), foreach=False)
        ref.load_state_dict(sd)
        assert ref.param_groups[0]["decoupled_weight_decay"] is group["decoupled_weight_decay"]
        lockstep(model2, opt2, ref_model, ref, batches[5:])
        assert_state_close(opt2.state_dict(), ref.state_dict())
    assert_params_close(model2, ref_model)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_amsgrad_checkpoint_loads_into_optimizer_built_without(placement):
    """torch takes amsgrad (and max_exp_avg_sq) from the checkpoint, whatever the constructor said."""
    batches = make_batches(15)
    ref_model = make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, amsgrad=True, foreach=False)
    train(ref_model, ref, batches[:5])
    model = copy.deepcopy(ref_model)
    with hybrid(ADAMW, model.parameters(), placement, lr=1e-2) as ours:
        ours.load_state_dict(save_load(ref.state_dict()))
        lockstep(model, ours, ref_model, ref, batches[5:])
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(model, ref_model)


def test_bf16_checkpoint_through_torch_and_back_keeps_torch_progress():
    """ours (bf16) -> torch.optim.AdamW -> 5 more steps in torch -> ours: torch's load never
    touches params, so after loading the params must still be what torch trained."""
    batches = make_batches(10)
    model = make_net(BF16)
    with hybrid(ADAMW, model.parameters(), lr=1e-2) as ours:
        train(model, ours, batches[:5])
        sd = save_load(ours.state_dict())
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ref.load_state_dict(sd)
    train(model, ref, batches[5:])
    trained = _snapshot(model)
    with hybrid(ADAMW, model.parameters(), lr=1e-2) as ours:
        ours.load_state_dict(save_load(ref.state_dict()))
        for k, v in model.state_dict().items():
            assert torch.equal(v, trained[k]), k


def test_state_dict_without_master_takes_it_from_the_param():
    """A bf16 checkpoint from torch (no master_param key) loads: the master is the param."""
    model = make_net(BF16)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    train(model, ref, make_batches(3))
    with hybrid(ADAMW, model.parameters(), lr=1e-2) as ours:
        ours.load_state_dict(save_load(ref.state_dict()))
        sd = ours.state_dict()
        for i, p in enumerate(model.parameters()):
            assert torch.equal(sd["state"][i]["master_param"], p.float())
            assert float(sd["state"][i]["step"]) == 3


# ============================================================================= 4. lr and param groups
def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _one_cycle(opt):  # also cycles betas[0] every step
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS)


@pytest.mark.parametrize("make_sched", [_step_lr, _one_cycle], ids=["StepLR", "OneCycleLR"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_lr_scheduler_matches_torch(placement, make_sched):
    ours_model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    with hybrid(ADAMW, ours_model.parameters(), placement, lr=1e-2) as ours:
        ours_sched, ref_sched = make_sched(ours), make_sched(ref)
        hypers = []

        def advance(_):
            ours_sched.step()
            ref_sched.step()
            hypers.append((ours.param_groups[0]["lr"], ours.param_groups[0]["betas"]))
            assert hypers[-1] == (ref.param_groups[0]["lr"], ref.param_groups[0]["betas"])

        lockstep(ours_model, ours, ref_model, ref, make_batches(), after_step=advance)
        assert len({h for h in hypers}) > 3
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(ours_model, ref_model)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_tensor_lr_matches_torch(placement):
    ours_model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=torch.tensor(1e-2), foreach=False)
    with hybrid(ADAMW, ours_model.parameters(), placement, lr=torch.tensor(1e-2)) as ours:
        scheds = [_step_lr(ours), _step_lr(ref)]
        lockstep(
            ours_model, ours, ref_model, ref, make_batches(), after_step=lambda _: [s.step() for s in scheds]
        )
        assert isinstance(ours.param_groups[0]["lr"], torch.Tensor)
        assert torch.equal(ours.param_groups[0]["lr"], ref.param_groups[0]["lr"])
    assert_params_close(ours_model, ref_model)


def _groups(model):
    return [
        dict(params=list(model.fc1.parameters()), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99)),
        dict(
            params=list(model.fc2.parameters()) + list(model.tiny),
            lr=3e-3,
            weight_decay=0.0,
            betas=(0.8, 0.999),
            eps=1e-6,
            amsgrad=True,
        ),
    ]


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_param_groups_with_own_hyperparameters(placement, info):
    ours_model, ref_model = make_net(), make_net()
    ref = info.reference(_groups(ref_model), foreach=False, weight_decay=0.05)
    with hybrid(info, _groups(ours_model), placement, weight_decay=0.05) as ours:
        lockstep(ours_model, ours, ref_model, ref, make_batches())
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(ours_model, ref_model)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_add_param_group_after_construction(placement):
    batches = make_batches(12)
    ours_model, ref_model = make_net(), make_net()
    groups = [lambda m: list(m.fc1.parameters()) + list(m.fc2.parameters()), lambda m: list(m.tiny)]
    ref = torch.optim.AdamW(groups[0](ref_model), lr=1e-2, foreach=False)
    with hybrid(ADAMW, groups[0](ours_model), placement, lr=1e-2) as ours:
        lockstep(ours_model, ours, ref_model, ref, batches[:4])
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.add_param_group(dict(params=groups[1](model), lr=5e-3, weight_decay=0.2))
            model.zero_grad()  # the new params' grads accumulated while no optimizer owned them
        # the grown model is laid out as an optimizer built with both groups would be: the new
        # group's state does not all land on the device tier
        twin = copy.deepcopy(ours_model)
        with hybrid(ADAMW, [dict(params=g(twin)) for g in groups], placement) as fresh:
            assert ours.plan.tiers == fresh.plan.tiers, (ours.plan, fresh.plan)
        lockstep(ours_model, ours, ref_model, ref, batches[4:])
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(ours_model, ref_model)


@needs_torch_adam_decoupled
@pytest.mark.parametrize("placement", [PLACEMENTS[0], PLACEMENTS[2]], ids=lambda p: p.name)
def test_adams_decoupled_weight_decay_per_group_and_through_a_checkpoint_as_torch(placement):
    """torch.optim.Adam's decoupled_weight_decay (torch >= 2.6): the argument, a group's own
    value, and an AdamW checkpoint (its groups say True) loaded into Adam, as torch does."""
    ours_model, ref_model = make_net(), make_net()
    ps, rs = list(ours_model.parameters()), list(ref_model.parameters())

    def groups(params):
        return [{"params": params[:2]}, {"params": params[2:], "decoupled_weight_decay": False}]

    ours = hybrid(ADAM, groups(ps), placement, weight_decay=0.1, decoupled_weight_decay=True)
    ref = torch.optim.Adam(groups(rs), weight_decay=0.1, decoupled_weight_decay=True, foreach=False)
    try:
        assert [g["decoupled_weight_decay"] for g in ours.param_groups] == [True, False]
        batches = make_batches(12)
        lockstep(ours_model, ours, ref_model, ref, batches[:6])
        assert_params_close(ours_model, ref_model)
        # an AdamW checkpoint into Adam: every group decoupled from here on, in both
        adamw = torch.optim.AdamW(rs, weight_decay=0.1, foreach=False)
        adamw.load_state_dict({**adamw.state_dict(), "state": ref.state_dict()["state"]})
        sd = adamw.state_dict()
        ref = torch.optim.Adam(rs, weight_decay=0.1, foreach=False)
        ref.load_state_dict(sd)
        ours.close()
        ours = hybrid(ADAM, ps, placement, weight_decay=0.1)
        ours.load_state_dict(sd)
        assert (
            ours.param_groups[0]["decoupled_weight_decay"]
            is ref.param_groups[0]["decoupled_weight_decay"]
            is True
        )
        lockstep(ours_model, ours, ref_model, ref, batches[6:])
        assert_params_close(ours_model, ref_model)
    finally:
        ours.close()


# ============================================================================= 5. frozen and grad-less
class Branchy(nn.Module):
    """A frozen param and a branch used only on even steps, both in the middle of the layout
    so they share subgroups with params that do get grads."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.frozen = nn.Parameter(0.1 * torch.randn(32), requires_grad=False)
        self.branch = nn.Linear(32, 4)
        self.fc2 = nn.Linear(32, 4)
        self.use_branch = True

    def forward(self, x):
        h = torch.relu(self.fc1(x) + self.frozen)
        out = self.fc2(h)
        return out + self.branch(h) if self.use_branch else out


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_params_without_grad_are_untouched_and_keep_their_step(placement, info):
    torch.manual_seed(0)
    ours_model = Branchy()
    ref_model = copy.deepcopy(ours_model)
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref = info.reference(ref_model.parameters(), foreach=False, **kw)
    frozen0 = ours_model.frozen.detach().clone()
    batches = make_batches(12)
    with hybrid(info, ours_model.parameters(), placement, **kw) as ours:
        for i, batch in enumerate(batches):
            ours_model.use_branch = ref_model.use_branch = i % 2 == 0
            before = [p.detach().clone() for p in ours_model.branch.parameters()]
            lockstep(ours_model, ours, ref_model, ref, [batch])
            if i % 2:
                assert all(p.grad is None for p in ours_model.branch.parameters())
                for b, p in zip(before, ours_model.branch.parameters()):
                    assert torch.equal(b, p), f"step {i}: a param without grad was touched"
            assert torch.equal(ours_model.frozen, frozen0)
        sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert_state_close(sd, ref_sd)
        frozen_index = [n for n, _ in ours_model.named_parameters()].index("frozen")
        assert frozen_index not in sd["state"]
        branch_w = [n for n, _ in ours_model.named_parameters()].index("branch.weight")
        assert float(sd["state"][branch_w]["step"]) == len(batches) // 2
    assert_params_close(ours_model, ref_model)


# ============================================================================= 6. torch's calling conventions
@needs_named_params
def test_named_parameters_accepted_like_torch():
    ours_model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2, foreach=False)
    with hybrid(ADAMW, ours_model.named_parameters(), lr=1e-2) as ours:
        lockstep(ours_model, ours, ref_model, ref, make_batches(10))
        sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert sd["param_groups"][0]["param_names"] == ref_sd["param_groups"][0]["param_names"]
        assert sd["param_groups"][0]["params"] == ref_sd["param_groups"][0]["params"]
        assert_state_close(sd, ref_sd)
    assert_params_close(ours_model, ref_model)


def test_duplicate_params_warned_and_deduplicated():
    ours_model, ref_model = make_net(), make_net()
    dup = list(ours_model.parameters())
    dup = dup[:3] + [dup[0]] + dup[3:] + [dup[-1]]
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ours = hybrid(ADAMW, dup, lr=1e-2)
    with ours:
        assert len(ours.param_groups[0]["params"]) == len(list(ours_model.parameters()))
        lockstep(ours_model, ours, ref_model, ref, make_batches(10))
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(ours_model, ref_model)


def test_step_with_closure_returns_the_loss():
    ours_model, ref_model = make_net(), make_net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    with hybrid(ADAMW, ours_model.parameters(), lr=1e-2) as ours:
        for batch in make_batches(8):
            seen = []

            def closure(model=ours_model, opt=ours):
                opt.zero_grad()
                loss = loss_fn(model, batch)
                loss.backward()
                seen.append(loss)
                return loss

            def ref_closure():
                ref.zero_grad()
                loss = loss_fn(ref_model, batch)
                loss.backward()
                return loss

            returned = ours.step(closure)
            ref_loss = ref.step(ref_closure)
            assert returned is seen[0]
            assert_close(returned.detach(), ref_loss.detach(), dtype=FP32)
    assert_params_close(ours_model, ref_model)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_zero_grad(placement):
    model = make_net()
    with hybrid(ADAMW, model.parameters(), placement) as opt:
        loss_fn(model, make_batches(1)[0]).backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        loss_fn(model, make_batches(1)[0]).backward()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()  # no grads at all: nothing moves, no state appears
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert opt.state_dict()["state"] == {}


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16).t())  # (16, 32), not contiguous
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(x @ self.w))


def test_non_contiguous_param():
    torch.manual_seed(0)
    ours_model = Transposed()
    ref_model = copy.deepcopy(ours_model)
    assert not ours_model.w.is_contiguous() and not ref_model.w.is_contiguous()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    with hybrid(ADAMW, ours_model.parameters(), lr=1e-2) as ours:
        lockstep(ours_model, ours, ref_model, ref, make_batches(10))
        assert_state_close(ours.state_dict(), ref.state_dict())
    assert_params_close(ours_model, ref_model)


# ============================================================================= 7. error inputs
@dataclass(frozen=True)
class ErrorInput:
    """A bad argument and the error it must raise; torch_raises: torch's class raises the
    same type and message (so the regex is torch's own)."""

    name: str
    kwargs: dict = field(default_factory=dict)
    error: type = ValueError
    match: str = ""
    params: object = None  # callable -> params; default: one small Linear's
    at_step: object = None  # callable(params) run before step(); the error comes from step()
    torch_raises: bool = False
    # an older torch refuses it too, with another error: the type and message are held to torch's
    # only where its Adam.__init__ has this check
    torch_check: str = ""


def _linear_params():
    return list(nn.Linear(4, 3).parameters())


def _sparse_grad(params):
    params[0].grad = torch.zeros_like(params[0]).to_sparse()


def _two_groups_sharing():
    p = nn.Parameter(torch.randn(3))
    return [dict(params=[p]), dict(params=[p, nn.Parameter(torch.randn(2))])]


ERROR_INPUTS = [
    ErrorInput("negative_lr", dict(lr=-1), ValueError, "Invalid learning rate", torch_raises=True),
    ErrorInput("negative_eps", dict(eps=-1), ValueError, "Invalid epsilon value", torch_raises=True),
    ErrorInput(
        "beta1_is_1",
        dict(betas=(1.0, 0.9)),
        ValueError,
        "Invalid beta parameter at index 0",
        torch_raises=True,
    ),
    ErrorInput(
        "beta2_is_1",
        dict(betas=(0.9, 1.0)),
        ValueError,
        "Invalid beta parameter at index 1",
        torch_raises=True,
    ),
    ErrorInput(
        "negative_weight_decay",
        dict(weight_decay=-1),
        ValueError,
        "Invalid weight_decay value",
        torch_raises=True,
    ),
    ErrorInput(
        "tensor_lr_2_elements",
        dict(lr=torch.tensor([1e-2, 1e-2])),
        ValueError,
        "Tensor lr must be 1-element",
        torch_raises=True,
        torch_check="Tensor lr must be 1-element",
    ),
    ErrorInput(
        "empty_params", error=ValueError, match="empty parameter list", params=list, torch_raises=True
    ),
    ErrorInput(
        "group_params_as_set",
        error=TypeError,
        match="ordered collections",
        params=lambda: [dict(params=set(_linear_params()))],
        torch_raises=True,
    ),
    ErrorInput(
        "param_in_two_groups",
        error=ValueError,
        match="more than one parameter group",
        params=_two_groups_sharing,
        torch_raises=True,
    ),
    ErrorInput(
        "sparse_grad",
        error=RuntimeError,
        match="does not support sparse gradients",
        at_step=_sparse_grad,
        torch_raises=True,
    ),
    ErrorInput(
        "lazy_module_param",
        error=ValueError,
        match=r"uninitialized \(a torch.nn.Lazy\* module\).*forward",
        params=lambda: list(nn.LazyLinear(3).parameters()),
    ),
    ErrorInput(
        "complex_param",
        error=ValueError,
        match="complex parameters",
        params=lambda: [nn.Parameter(torch.randn(3, dtype=torch.complex64))],
    ),
    ErrorInput(
        "float64_param",
        error=TypeError,
        match="float32, bfloat16 and float16.*float64",
        params=lambda: [nn.Parameter(torch.randn(3, dtype=torch.float64))],
    ),
    ErrorInput("capturable", dict(capturable=True), ValueError, "capturable"),
    ErrorInput("differentiable", dict(differentiable=True), ValueError, "differentiable"),
    ErrorInput(
        "process_group_without_dist",
        dict(process_group=object()),
        RuntimeError,
        r"process_group= needs torch.distributed initialised",
    ),
    ErrorInput("rollback_bogus", dict(rollback="bogus"), ValueError, "rollback must be 'exact' or 'inverse'"),
    ErrorInput("rollback_inverse_amsgrad", dict(rollback="inverse", amsgrad=True), ValueError, "amsgrad"),
    ErrorInput("offload_fraction_1.5", dict(offload_fraction=1.5), ValueError, "offload_fraction"),
    ErrorInput("offload_fraction_negative", dict(offload_fraction=-0.1), ValueError, "offload_fraction"),
    ErrorInput(
        "nvme_above_offload_without_path",
        dict(offload_fraction=0.2, nvme_fraction=0.5),
        ValueError,
        r"nvme_fraction.*must not exceed offload_fraction",
    ),
    ErrorInput(
        "nvme_above_offload",
        dict(offload_fraction=0.2, nvme_fraction=0.5, nvme_path=tempfile.gettempdir()),
        ValueError,
        r"nvme_fraction.*must not exceed offload_fraction",
    ),
    ErrorInput("nvme_without_path", dict(offload_fraction=1.0, nvme_fraction=0.25), ValueError, "nvme_path"),
    ErrorInput("max_grad_norm_negative", dict(max_grad_norm=-1), ValueError, "max_grad_norm"),
    ErrorInput("max_grad_norm_inf", dict(max_grad_norm=float("inf")), ValueError, "max_grad_norm"),
    ErrorInput("subgroup_numel_0", dict(subgroup_numel=0), ValueError, "subgroup_numel"),
]


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("case", ERROR_INPUTS, ids=lambda c: c.name)
def test_error_inputs(case, info):
    make_params = case.params or _linear_params
    kw = dict(dict(offload_fraction=0.0, subgroup_numel=SUBGROUP), **case.kwargs)
    if case.at_step is None:
        with pytest.raises(case.error, match=case.match):
            with info.cls(make_params(), **kw):
                pass
    else:
        params = make_params()
        with info.cls(params, **kw) as opt:
            case.at_step(params)
            with pytest.raises(case.error, match=case.match):
                opt.step()
    if case.torch_raises:
        torch_kw = {k: v for k, v in case.kwargs.items() if k not in ("offload_fraction", "subgroup_numel")}
        params = make_params()
        error, match = case.error, case.match
        if case.torch_check and case.torch_check not in inspect.getsource(torch.optim.Adam.__init__):
            error, match = Exception, ""
        with pytest.raises(error, match=match):
            ref = info.reference(params, foreach=False, **torch_kw)
            if case.at_step is not None:
                case.at_step(params)
                ref.step()


def test_error_inputs_in_add_param_group():
    with hybrid(ADAMW, _linear_params(), PLACEMENTS[0]) as opt:
        for group, match in (
            (dict(lr=-1), "Invalid learning rate"),
            (dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
            (dict(lr=torch.tensor([1.0, 2.0])), "Tensor lr must be 1-element"),
        ):
            with pytest.raises(ValueError, match=match):
                opt.add_param_group(dict(params=[nn.Parameter(torch.randn(3))], **group))
        with pytest.raises(ValueError, match="amsgrad"):
            opt.add_param_group(dict(params=[nn.Parameter(torch.randn(3))], amsgrad=True))
        n_groups = len(opt.param_groups)
    with pytest.raises(RuntimeError, match="was closed .* cannot step again: build a new one"):
        opt.add_param_group(dict(params=[nn.Parameter(torch.randn(3))]))
    assert len(opt.param_groups) == n_groups


@pytest.mark.parametrize("offload", [0.0, 1.0])
def test_a_sparse_grad_from_backward_is_refused_in_torchs_words_with_nothing_stepped(offload):
    """nn.Embedding(sparse=True): its grad hook does not speculate a sparse grad (the worker
    cannot read one), so step() refuses it as torch does, not as a failed speculation."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    with HybridAdamW(emb.parameters(), offload_fraction=offload) as opt:
        before = opt.state_dict()
        emb(torch.tensor([1, 2, 3])).sum().backward()
        with pytest.raises(RuntimeError, match="does not support sparse gradients") as info:
            opt.step()
        assert "speculative" not in str(info.value)
        after = opt.state_dict()
        assert after["state"] == before["state"] == {}


def test_step_after_close_raises_and_close_is_idempotent():
    model = make_net()
    opt = hybrid(ADAMW, model.parameters(), PLACEMENTS[2])
    pid = opt.worker_pid
    loss_fn(model, make_batches(1)[0]).backward()
    opt.step()
    opt.close()
    opt.close()
    assert opt.worker_pid is None
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    for take in (opt.state_dict, lambda: opt.save_state_dict(io.BytesIO())):
        with pytest.raises(RuntimeError, match=r"closed .* cannot give its state.*before it closes"):
            take()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # the parameters outlive the optimizer with their values
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, make_batches(1)[0]).backward()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_context_manager_closes():
    model = make_net()
    with hybrid(ADAMW, model.parameters(), PLACEMENTS[2]) as opt:
        pid = opt.worker_pid
        assert isinstance(pid, int) and psutil.pid_exists(pid)
    assert opt.worker_pid is None
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    # and on the way out of an exception
    with pytest.raises(KeyError):
        with hybrid(ADAMW, model.parameters(), PLACEMENTS[2]) as opt2:
            raise KeyError("boom")
    assert opt2.worker_pid is None


# ============================================================================= 8. misc attributes
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.name)
def test_attributes(placement):
    model = make_net()
    with hybrid(ADAMW, model.parameters(), placement, max_grad_norm=1.0) as opt:
        assert opt._step_supports_amp_scaling is True
        if placement.offload > 0:
            assert isinstance(opt.worker_pid, int)
        else:
            assert opt.worker_pid is None
        summary = opt.plan.summary()
        assert sum(v["elements"] for v in summary.values()) == sum(p.numel() for p in model.parameters())
        assert summary["host"]["share"] + summary["nvme"]["share"] == pytest.approx(
            placement.offload, abs=0.1
        )
        assert summary["nvme"]["share"] == pytest.approx(placement.nvme, abs=0.1)
        assert sum(v["subgroups"] for v in summary.values()) > 1
        assert "Plan(" in repr(opt)
        assert opt.step_was_skipped is False and opt.last_grad_norm is None
        loss_fn(model, make_batches(1)[0]).backward()
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        opt.step()
        assert isinstance(opt.stats, dict) and opt.stats
        assert opt.last_grad_norm == pytest.approx(float(ref_norm), rel=RTOL[FP32])
        assert opt.step_was_skipped is False


def test_add_param_group_on_another_device_is_refused_and_changes_nothing():
    model = nn.Linear(8, 8)
    with HybridAdamW(model.parameters(), offload_fraction=0.0) as opt:
        other = nn.Parameter(torch.empty(4, device="meta"))
        with pytest.raises(ValueError, match=r"one device.*\['cpu'\].*\['meta'\]"):
            opt.add_param_group({"params": [other]})
        assert len(opt.param_groups) == 1
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # still trains
