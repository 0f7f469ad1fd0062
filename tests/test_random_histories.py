"""Random training histories: at every placement, a history of events trains bitwise as the
all-device run does.

Each feature has its own tests beside it; this module looks for their interactions. A case
draws from its seed:
- a model: one to five params (an empty one, one-element ones, non-contiguous ones, up to 9,000
  elements) in one or two groups, fp32, or bf16 where the master is kept as remainders;
- a state format (fp32, bf16 moments, q8 moments, remainders, remainders with q8), Adam or
  AdamW, amsgrad, maximize, betas, clipping (`max_grad_norm`), a GradScaler, and whether the grads
  are assigned or made by a backward pass (whose hooks start speculated steps), run inside
  `step(closure)` or before it; every group's lr a float or a 0-dim tensor;
- a history of two to eight steps, each with some of: grads missing or zero for some params, a
  grad holding an infinity, micro-batches accumulated before the last backward (annotated by
  `set_gradient_accumulation_boundary` or not), `zero_grad(set_to_none=False)`, one grad or every grad
  edited in place after backward, lr / weight_decay / betas changed in a group (a tensor lr in place), a
  param written in place, a group added (`add_param_group`), the optimizer's state loaded into a
  new one (at its own placement or another) from `state_dict()`, from `save_state_dict`'s file or
  from its fp32 file (the one torch.optim.AdamW loads; q8 moments are quantized again), each file
  read by `torch.load(weights_only=True)`, `replan()` to another placement, the worker killed
  (SIGKILL) before `step()`, a `step()` refused first (a sparse grad, an lr of -1 or a beta2 of
  1.5: it must raise and change nothing; the input is then mended and the step taken); and, for
  the whole history, a fault injected into the first worker's K-th step task
  (HYBRID_OPT_WORKER_FAULT). The kills and faults go with exact rollback only: with inverse
  rollback a worker killed mid-step may tear subgroups, which the error names.

The history runs twice: at `offload_fraction=0` (the in-process kernel) and at a placement drawn
from the same seed (host, nvme or mixed; speculative or not; small subgroups; inverse rollback
with fp32 state). Params and every state tensor must be equal bit for bit (NaNs where the
infinity went, at the same places); within fp32 rounding where inverse rollback may have undone a
speculated step, as documented. With fp32 state the history also runs through
torch.optim.AdamW / Adam (foreach=False, torch's `clip_grad_norm_` after `unscale_`), which the
all-device run must follow within fp32 rounding, step counts and moments included. The state compared is
`state_dict()`'s, torch's format: moments, masters or remainders, q8 codes and absmaxes.

HYBRID_OPT_RANDOM_HISTORIES=N runs seeds 0..N-1 instead of the first 32 (1,000 passed with every
event above, in about 5 minutes on 2 cores). Sabotage: a worker's eps changed after step 3 fails
47 of the first 200 seeds (3 of the first 32); speculation blind to a grad's `_version` (a grad
edited in place after backward then commits a stale speculated step) fails 10 of the first 300
(1 of the first 32).
"""

import contextlib
import os
import random
import signal
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from helpers import backward_with, draw_grads, grads_pattern, reloaded_state
from tolerances import ATOL, RTOL

from hybrid_opt import HybridAdam, HybridAdamW

SEEDS = range(int(os.environ.get("HYBRID_OPT_RANDOM_HISTORIES", "32")))
FORMATS = {
    "fp32": {},
    "bf16 moments": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "bf16 exp_avg": {"exp_avg_dtype": torch.bfloat16},
    "q8": {"exp_avg_dtype": "q8", "exp_avg_sq_dtype": "q8"},
    "q8 exp_avg": {"exp_avg_dtype": "q8"},
    "remainders": {"store_param_remainders": True},
    "remainders + q8": {"store_param_remainders": True, "exp_avg_dtype": "q8", "exp_avg_sq_dtype": "q8"},
}
OTHER_PLACEMENTS = (
    {"offload_fraction": 0.0},
    {"offload_fraction": 1.0},
    {"offload_fraction": 1.0, "nvme_fraction": 1.0},
    {"offload_fraction": 0.5, "subgroup_numel": 512},
)


@dataclass
class Step:
    grads: list  # per param of the whole model: a tensor, "zero" or None (no grad)
    infinite_grad: int | None = None  # this param's grad gets an infinity in its first element
    lr: tuple | None = None  # (group, value)
    weight_decay: tuple | None = None
    betas: tuple | None = None
    write: tuple | None = None  # (param, factor): p.mul_(factor) under no_grad before the step
    # after the step: state_dict() into a new optimizer with these placement args ({}: the same)
    reload_into: dict | None = None
    replan: tuple | None = None  # after the step: opt.replan(offload_fraction, nvme_fraction)
    kill_worker: bool = False  # SIGKILL to the worker once the grads are in, speculated steps maybe in flight
    # backward mode: micro-batches before this step's grads, each a list as `grads`; their grads
    # accumulate in p.grad (autograd's order, the same in every run)
    micro: list = field(default_factory=list)
    annotate: bool = False  # set_gradient_accumulation_boundary(False) on the micro-batches, True on the last
    set_to_none: bool = True  # backward mode: zero_grad(set_to_none=False) keeps the grad tensors, zeroed
    # (param or None, factor): p.grad.mul_(factor) after the grads are in, before step(); None:
    # every grad (as a loop that unscales or clips by hand does)
    edit_grad: tuple | None = None
    # before the step, ours: a refused step() first, then the input mended and step() again:
    # ("sparse", param) a sparse grad, ("lr", group) an lr of -1, ("betas", group) beta2 of 1.5
    refused: tuple | None = None
    reload_via: str = (
        "memory"  # "memory" (a deep copy), "file" (save_state_dict, torch.load weights_only), "fp32"
    )


@dataclass
class History:
    params: list  # initial values; the last `added` of them join by add_param_group
    added: int
    add_at: int
    format: str
    adamw: bool
    hyper: dict
    clip: float | None
    scaler: bool
    backward: bool  # grads made by a backward pass (their hooks fire), not assigned
    worker_fault: str | None  # HYBRID_OPT_WORKER_FAULT for the placed run's first worker ("STAGE:K")
    lr_tensor: bool  # every group's lr a 0-dim tensor, changed in place (fill_)
    closure: bool  # backward mode, ours: the backward passes run in step(closure)
    steps: list = field(default_factory=list)


def _draw_params(rng: random.Random, dtype) -> list:
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    shapes = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.random()
        if kind < 0.1:
            shapes.append((0,))
        elif kind < 0.25:
            shapes.append((rng.randint(1, 5),))
        elif kind < 0.7:
            shapes.append((rng.randint(1, 70), rng.randint(1, 90)))
        else:
            shapes.append((rng.randint(1000, 9000),))
    values = [(torch.randn(s, generator=gen) * 0.5).to(dtype) for s in shapes]
    return [v.t() if v.dim() == 2 and rng.random() < 0.3 else v for v in values]  # some non-contiguous


def _draw_grads(rng: random.Random, params: list) -> list:
    """A grad per param: a tensor, "zero" or None (no grad)."""
    return draw_grads(rng, params, none=0.15, zero=0.05)


def draw_history(seed: int) -> History:
    rng = random.Random(seed)
    fmt = rng.choice(sorted(FORMATS))
    dtype = torch.bfloat16 if "remainders" in fmt else torch.float32
    params = _draw_params(rng, dtype)
    added = 0
    if rng.random() < 0.25:
        extra = _draw_params(rng, dtype)
        params, added = params + extra, len(extra)
    history = History(
        params=params,
        added=added,
        add_at=0,
        format=fmt,
        adamw=rng.random() < 0.8,
        hyper=dict(
            lr=rng.choice([1e-3, 1e-2, 3e-4]),
            weight_decay=rng.choice([0.0, 0.01, 0.1]),
            amsgrad=rng.random() < 0.25,
            betas=rng.choice([(0.9, 0.999), (0.8, 0.99), (0.0, 0.999)]),
            maximize=rng.random() < 0.15,
        ),
        clip=rng.choice([None, None, 0.3, 100.0]),
        scaler=rng.random() < 0.35,
        backward=rng.random() < 0.5,
        worker_fault=(
            f"{rng.choice(['before_step', 'mid_step', 'after_step'])}:{rng.randint(1, 4)}"
            if rng.random() < 0.15
            else None
        ),
        lr_tensor=rng.random() < 0.2,
        closure=False,
    )
    # GradScaler.step takes no closure (torch's rule)
    history.closure = history.backward and not history.scaler and rng.random() < 0.25
    for _ in range(rng.randint(2, 8)):
        grads = _draw_grads(rng, params)
        if all(g is None for g in grads[: len(params) - added]):
            grads[0] = torch.randn(
                params[0].shape
            )  # a GradScaler refuses a step with no grads (torch's fused AdamW too)
        step = Step(grads=grads)
        if rng.random() < 0.15:
            step.infinite_grad = rng.randrange(len(params))
        if rng.random() < 0.2:
            step.lr = (rng.randint(0, 1), rng.choice([1e-4, 2e-3]))
        if rng.random() < 0.1:
            step.weight_decay = (rng.randint(0, 1), rng.choice([0.0, 0.2]))
        if rng.random() < 0.1:
            step.betas = (rng.randint(0, 1), rng.choice([(0.95, 0.999), (0.9, 0.99)]))
        if rng.random() < 0.1:
            step.write = (rng.randrange(len(params)), rng.choice([0.5, -1.0]))
        if rng.random() < 0.2:
            step.reload_into = rng.choice((None, *OTHER_PLACEMENTS)) or {}
        if rng.random() < 0.08:
            step.kill_worker = True
        elif rng.random() < 0.1:
            step.replan = rng.choice(((0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 0.25)))
        if step.reload_into is not None:
            step.reload_via = rng.choice(("memory", "file", "fp32"))
        if history.backward:
            if rng.random() < 0.25:
                step.micro = [_draw_grads(rng, params) for _ in range(rng.randint(1, 2))]
                step.annotate = rng.random() < 0.5
            step.set_to_none = rng.random() < 0.7
        if not history.scaler and rng.random() < 0.12:  # (GradScaler.step cannot be retried)
            step.refused = (rng.choice(["sparse", "lr", "betas"]), rng.randrange(len(params)))
        if rng.random() < 0.25:
            step.edit_grad = (rng.choice([None, rng.randrange(len(params))]), rng.choice([0.5, -2.0, 3.0]))
        history.steps.append(step)
    history.add_at = rng.randrange(len(history.steps))
    return history


def draw_placement(seed: int, history: History) -> dict:
    rng = random.Random(seed + 10**6)
    args = {
        "offload_fraction": rng.choice([0.0, 0.5, 1.0, 1.0]),
        "speculative": rng.choice([True, False, "auto"]),
    }
    if rng.random() < 0.4:
        args.update(offload_fraction=1.0, nvme_fraction=rng.choice([0.5, 1.0]))
    if rng.random() < 0.5:
        args["subgroup_numel"] = rng.choice([256, 512, 1024, 4096, 65536])
    if history.format == "fp32" and not history.hyper["amsgrad"] and rng.random() < 0.3:
        args["rollback"] = "inverse"
    return args


def _lr(history: History, value: float):
    """A group's lr: a float, or a 0-dim tensor of its own (changed in place by the history)."""
    return torch.tensor(value) if history.lr_tensor else value


def _edit_grad(step: Step, live: list) -> None:
    """The step's grad edit, once the grads are in: in place, so a speculated step from the grad
    before it is stale."""
    if step.edit_grad is None:
        return
    which, factor = step.edit_grad
    for p in live if which is None else [live[which % len(live)]]:
        if p.grad is not None:
            p.grad.mul_(factor)


def _refused_step(opt, refused: tuple, live: list) -> None:
    """A step() with one bad input, which must raise and change nothing; then the input as it
    was (the grad the same tensor, the group's value put back) for the step that follows."""
    kind, k = refused
    if kind == "sparse":
        p = live[k % len(live)]
        if p.grad is None or p.grad.dim() == 0:
            return  # (a 0-dim tensor has no sparse form)
        good, p.grad = p.grad, p.grad.to_sparse()
        with pytest.raises(RuntimeError, match="sparse gradients"):
            opt.step()
        p.grad = good
        return
    group = opt.param_groups[k % len(opt.param_groups)]
    if not any(p.grad is not None and p.numel() for p in group["params"]):
        return  # a group with nothing to step is not read this step (torch reads none at a step)
    good = group[kind]
    bad = -1.0 if kind == "lr" else (good[0], 1.5)
    if torch.is_tensor(good):
        good = good.clone()
        group[kind].fill_(bad)
    else:
        group[kind] = bad
    with pytest.raises(ValueError, match="Nothing was stepped"):
        opt.step()
    if torch.is_tensor(good):
        group[kind].copy_(good)
    else:
        group[kind] = good


def _build(cls, groups, history, placement, nvme_dir):
    kw = dict(history.hyper, lr=_lr(history, history.hyper["lr"]))
    if cls in (torch.optim.AdamW, torch.optim.Adam):
        return cls(groups, foreach=False, **kw)
    args = dict(placement, nvme_path=nvme_dir)  # every placement may be replanned onto nvme
    return cls(groups, max_grad_norm=history.clip, **FORMATS[history.format], **kw, **args)


def _moved(placement: dict, tiers: dict) -> dict:
    """`placement` with its tiers' args replaced by `tiers` ({}: the same placement)."""
    if not tiers:
        return placement
    kept = {
        k: v for k, v in placement.items() if k not in ("offload_fraction", "nvme_fraction", "subgroup_numel")
    }
    return {**kept, **tiers}


def _inverse(placement: dict) -> bool:
    """Inverse rollback: a worker killed mid-step may leave torn subgroups, which the error names
    (docs/internals.md); the kills here are for exact rollback, which redoes everything."""
    return placement.get("rollback") == "inverse"


def _grads_of(grads: list, infinite_grad: int | None, live: list, scaler) -> list:
    """The grad of each live param, in its dtype (None: no grad), times the scaler's scale."""
    out = []
    for i, p in enumerate(live):
        g = grads[i]
        if g is not None:
            g = torch.zeros(p.shape) if isinstance(g, str) else g * (scaler.get_scale() if scaler else 1.0)
            if infinite_grad == i and g.numel():
                g.view(-1)[0] = float("inf")
            g = g.to(p.dtype)
        out.append(g)
    return out


def run_history(history: History, cls, placement: dict, nvme_dir: str):
    """Trains `history` with `cls` at `placement` (ignored for torch's); returns the params and
    each one's state entry."""
    params = [
        torch.nn.Parameter(v.clone() if v.is_contiguous() else v.t().clone().t()) for v in history.params
    ]
    base = params[: len(params) - history.added]
    half = max(1, len(base) // 2)
    groups = [{"params": base[:half]}]
    if len(base) > half:
        groups.append({"params": base[half:], "lr": _lr(history, 5e-3), "weight_decay": 0.05})
    opt = _build(cls, groups, history, placement, nvme_dir)
    hybrid = not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if history.scaler else None
    if scaler is not None:
        scaler.scale(torch.ones(()))  # the scale starts here, as a loss's scale() starts it
    live = base
    try:
        for n, step in enumerate(history.steps):
            if history.added and n == history.add_at:
                opt.add_param_group(
                    {"params": params[len(base) :], "lr": _lr(history, 3e-3), "weight_decay": 0.02}
                )
                live = params
            if step.write is not None:
                with torch.no_grad():
                    live[step.write[0] % len(live)].mul_(step.write[1])
            passes = [_grads_of(m, None, live, scaler) for m in step.micro]
            passes.append(_grads_of(step.grads, step.infinite_grad, live, scaler))

            def backward(passes=passes, step=step, opt=opt):
                # the grads' hooks fire: speculation starts from them
                opt.zero_grad(set_to_none=step.set_to_none)
                for k, grads in enumerate(passes):
                    if step.annotate and hybrid:
                        opt.set_gradient_accumulation_boundary(k == len(passes) - 1)
                    backward_with(live, grads)
                _edit_grad(step, live)

            closure = history.backward and history.closure and hybrid
            if history.backward and not closure:
                backward()
            elif not history.backward:
                for p, g in zip(live, passes[-1]):
                    p.grad = g
                _edit_grad(step, live)
            if step.kill_worker and hybrid and opt.worker_pid is not None and not _inverse(placement):
                os.kill(opt.worker_pid, signal.SIGKILL)  # replaced, its work redone bitwise (exact rollback)
            for what in ("lr", "weight_decay", "betas"):
                change = getattr(step, what)
                if change is not None:
                    group = opt.param_groups[change[0] % len(opt.param_groups)]
                    if torch.is_tensor(group[what]):
                        group[what].fill_(change[1])  # in place: the optimizer holds this tensor
                    else:
                        group[what] = change[1]
            if step.refused is not None and hybrid:
                _refused_step(opt, step.refused, live)
            if history.clip is not None and not hybrid:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(
                    [p for p in live if p.grad is not None], history.clip, foreach=False
                )
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif closure:
                opt.step(backward)
            else:
                opt.step()
            if step.replan is not None and hybrid:
                opt.replan(*step.replan)
            if step.reload_into is not None and hybrid:
                groups = [{"params": list(g["params"])} for g in opt.param_groups]
                saved = reloaded_state(opt, step.reload_via)
                opt.close()
                opt = _build(cls, groups, history, _moved(placement, step.reload_into), nvme_dir)
                opt.load_state_dict(saved)
        # the torch-format state (`opt.state` holds only step counts here: the moments are in the tiers)
        saved = opt.state_dict()["state"]
        states = [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in saved.get(i, {}).items()}
            for i in range(len(live))
        ]
        return [p.detach().clone() for p in live], states
    finally:
        if hybrid:
            opt.close()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, element for element (-0.0 is not 0.0), but NaNs: equal where both have one
    (an infinite grad's NaNs carry no promised payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a[~na].view(bits), b[~nb].view(bits))


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _agree(ref: torch.Tensor, got: torch.Tensor, rounding: bool) -> bool:
    if not rounding or not ref.is_floating_point():
        return bitwise_equal(ref, got)
    return ref.dtype == got.dtype and bool(
        torch.isclose(got, ref, rtol=RTOL[torch.float32], atol=ATOL[torch.float32], equal_nan=True).all()
    )


def _describe(history: History, placement: dict) -> str:
    events = []
    plain = Step(grads=[])
    for step in history.steps:
        held = {k: v for k, v in vars(step).items() if k not in ("grads", "micro") and v != getattr(plain, k)}
        held["grads"] = "+".join(grads_pattern(g) for g in [*step.micro, step.grads])
        events.append(held)
    return (
        f"format {history.format}, {'AdamW' if history.adamw else 'Adam'} {history.hyper}, "
        f"clip {history.clip}, scaler {history.scaler}, "
        f"backward {history.backward} (closure {history.closure}), "
        f"lr tensor {history.lr_tensor}, worker fault {history.worker_fault}, "
        f"shapes {[tuple(v.shape) for v in history.params]} (last {history.added} "
        f"added at step {history.add_at}), placement {placement}, steps {events}"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_history_trains_bitwise_at_every_placement(seed, tmp_path):
    history = draw_history(seed)
    placement = draw_placement(seed, history)
    cls = HybridAdamW if history.adamw else HybridAdam
    what = _describe(history, placement)
    with warnings.catch_warnings():
        # the placements are small on purpose: "the plan has N % off the device" is not checked here
        warnings.simplefilter("ignore", UserWarning)
        ref_params, ref_states = run_history(history, cls, {"offload_fraction": 0.0}, str(tmp_path))
        fault = history.worker_fault if not _inverse(placement) else None
        with _env("HYBRID_OPT_WORKER_FAULT", fault):
            params, states = run_history(history, cls, placement, str(tmp_path))
    # rollback="inverse" undoes a wrong speculation algebraically: within fp32 rounding, not bitwise
    undone = placement.get("rollback") == "inverse" and placement["speculative"] is True and history.backward
    for i, (r, p) in enumerate(zip(ref_params, params)):
        assert _agree(r, p, undone), f"param {i} differs from the all-device run's: {what}"
    for i, (r, s) in enumerate(zip(ref_states, states)):
        assert sorted(r) == sorted(s), f"param {i}'s state keys differ: {what}"
        for key in r:
            same = _agree(r[key], s[key], undone) if torch.is_tensor(r[key]) else r[key] == s[key]
            assert same, f"param {i}'s {key} differs from the all-device run's: {what}"
    if history.format != "fp32":
        return
    torch_params, torch_states = run_history(
        history, torch.optim.AdamW if history.adamw else torch.optim.Adam, {}, ""
    )
    for t, r in zip(torch_params, ref_params):
        torch.testing.assert_close(
            r,
            t,
            rtol=RTOL[torch.float32],
            atol=ATOL[torch.float32],
            equal_nan=True,
            msg=lambda m: f"{m}\n{what}",
        )
    for i, (t, r) in enumerate(zip(torch_states, ref_states)):
        assert ("step" in t) == ("step" in r), (
            f"param {i}: torch has a state where ours has none or back: {what}"
        )
        if "step" in t:
            assert float(t["step"]) == float(r["step"]), f"param {i}'s step count: {what}"
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in t:
                # an infinite grad (no GradScaler) with beta1 = 0: torch's lerp makes exp_avg
                # end - (end - m)·0 = NaN, ours m + 1·(g - m) = inf; non-finite either way
                lost = ~t[key].isfinite()
                assert not r[key][lost].isfinite().any(), (
                    f"param {i}'s {key}: finite where torch's is not: {what}"
                )
                torch.testing.assert_close(
                    r[key].masked_fill(lost, 0.0),
                    t[key].masked_fill(lost, 0.0),
                    rtol=RTOL[torch.float32],
                    atol=ATOL[torch.float32],
                    equal_nan=True,
                    msg=lambda m, key=key: f"param {i}'s {key}: {m}\n{what}",
                )
