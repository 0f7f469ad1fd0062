"""The model, data and set-ups shared by tests/test_frameworks_hf.py and its rank scripts
(hf_trainer_train.py, accelerate_train.py): HF Trainer and accelerate runs of one tiny model,
with HybridAdamW or torch.optim.AdamW(foreach=False) as the reference.

Tiny is a plain nn.Module whose forward returns {"loss": ...}, as HF Trainer takes it. A tiny
GPT-2 is not used for the numeric comparisons: its attention's key bias gets a grad that is
rounding noise (softmax ignores it; |grad| ~ 1e-11), which Adam turns into full lr-sized steps
of either sign, so even torch's own fused and foreach=False AdamW end 5e-4 apart there.
"""

from __future__ import annotations

import torch

IN, HID, OUT = 8, 16, 4  # 212 elements
SUBGROUP = 64  # 4 subgroups, each on the host tier (offload_fraction's default 1.0)
ROWS = 48
BATCH = 4  # per device
STEPS = 6
LR, WD = 1e-2, 0.01
CLIP = 1.0  # HF Trainer's default max_grad_norm; the grads' norm is 3-6 here


class Tiny(torch.nn.Module):
    """Linear-Tanh-Linear regressing random targets (grad norms > CLIP: clipping bites)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))

    def forward(self, x, labels=None):
        return {"loss": (self.net(x) - labels).square().mean()}


def dataset() -> list:
    gen = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(IN, generator=gen), "labels": 3 * torch.randn(OUT, generator=gen)}
        for _ in range(ROWS)
    ]


def batches(n: int = STEPS, batch: int = BATCH) -> list:
    """`n` collated batches of the dataset in order (repeating it), for hand-written loops."""
    data = dataset()
    out = []
    for i in range(n):
        rows = [data[(i * batch + k) % ROWS] for k in range(batch)]
        out.append({key: torch.stack([r[key] for r in rows]) for key in rows[0]})
    return out


def hybrid_kwargs(**kw) -> dict:
    # speculative=True: on these CPU-only hosts "auto" steps the host tier in step(); the recipes
    # must hold with host steps speculated during the frameworks' backward, as on a GPU host
    return dict(dict(lr=LR, weight_decay=WD, subgroup_numel=SUBGROUP, speculative=True), **kw)


def torch_kwargs() -> dict:
    return dict(lr=LR, weight_decay=WD, foreach=False)


def make_optimizer(kind: str, params, **hybrid):
    if kind == "torch":
        return torch.optim.AdamW(params, **torch_kwargs())
    from hybrid_opt import HybridAdamW

    return HybridAdamW(params, **hybrid_kwargs(**hybrid))


def training_args(out_dir: str, **kw):
    """HF TrainingArguments for these runs: CPU, no reporting, no progress bar, no checkpoints
    unless asked, the grad norm logged every step."""
    from transformers import TrainingArguments

    args = dict(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        weight_decay=WD,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        seed=0,
    )
    args.update(kw)
    return TrainingArguments(**args)


def norm_free_trainer():
    """A transformers.Trainer that computes no grad norm of its own when max_grad_norm=0.

    transformers 5.x (Trainer._get_grad_norm) logs a grad norm every step: with max_grad_norm=0
    it gets one from accelerator.clip_grad_norm_(model.parameters(), inf), which multiplies
    every grad by 1 in place — an edit HybridAdamW(process_group=) refuses like any other. The
    norm that matters is the optimizer's own last_grad_norm (its max_grad_norm clipping)."""
    import transformers

    class NormFreeTrainer(transformers.Trainer):
        def _get_grad_norm(self, model, grad_norm=None):
            return grad_norm

    return NormFreeTrainer


def grad_norms(trainer) -> list:
    """The grad norm HF Trainer logged at each step (its clip_grad_norm_'s pre-clip norm)."""
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def unwrap_optimizer(opt):
    """The optimizer inside accelerate's AcceleratedOptimizer (HF Trainer's trainer.optimizer),
    which forwards step/zero_grad/state_dict but not HybridAdamW's own close()."""
    while hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def close(opt) -> None:
    opt = unwrap_optimizer(opt)
    if hasattr(opt, "close"):
        opt.close()


def params_of(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def step_count(opt) -> float:
    """The largest per-param step count in the optimizer's state (0 where nothing stepped)."""
    steps = [float(s["step"]) for s in unwrap_optimizer(opt).state.values() if "step" in s]
    return max(steps, default=0.0)


def accelerate_prepare(accelerator, model, opt, *, model_by: str = "prepare") -> tuple:
    """(model, opt, loader) prepared by accelerate: the optimizer, a DataLoader over the dataset
    (split over the ranks) and the model `model_by`: "prepare" (in a multi-process launch
    prepare() wraps it in DistributedDataParallel), "evaluation_mode"
    (accelerator.prepare_model(model, evaluation_mode=True): placed, autocast/compile applied,
    registered for save_state, never wrapped) or "move" (only moved to the device)."""
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    if model_by == "prepare":
        return accelerator.prepare(model, opt, loader)
    if model_by == "evaluation_mode":
        model = accelerator.prepare_model(model, evaluation_mode=True)
    elif model_by == "move":
        model = model.to(accelerator.device)
    else:
        raise ValueError(f"model_by={model_by!r}: prepare, evaluation_mode or move")
    opt, loader = accelerator.prepare(opt, loader)
    return model, opt, loader


def accelerate_train(accelerator, model, opt, loader, *, clip=None) -> list:
    """STEPS steps of the accelerate loop, `accelerator.clip_grad_norm_(..., clip)` after
    backward when asked. Returns the norms clip_grad_norm_ returned."""
    norms = []
    for i, batch in enumerate(loader):
        if i == STEPS:
            break
        opt.zero_grad()
        accelerator.backward(model(**batch)["loss"])
        if clip is not None:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return norms
