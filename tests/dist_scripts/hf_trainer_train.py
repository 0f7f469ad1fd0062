"""Rank script: HF Trainer on 2 gloo ranks (torchrun; Trainer wraps the model in DDP itself),
for each configuration named on the command line, with hf_common's Tiny model:

- ddp_torch: torch.optim.AdamW(foreach=False), Trainer's default max_grad_norm=1.0 (the reference);
- ddp_hybrid: HybridAdamW replicated on every rank (process_group=None), the same clipping;
- zero_trainer_clip: HybridAdamW(process_group=WORLD) under Trainer's default max_grad_norm=1.0,
  whose clip_grad_norm_ after backward cannot reach grads reduce-scattered during backward:
  step() must refuse it (GradsEditedError) — the error is caught and saved;
- zero_recipe: TrainingArguments(max_grad_norm=0) and HybridAdamW(process_group=WORLD,
  max_grad_norm=1.0), clipping inside the optimizer;
- zero_recipe_no_norm: zero_recipe in a Trainer whose _get_grad_norm is overridden (hf_common
  NormFreeTrainer): with max_grad_norm=0 transformers still calls clip_grad_norm_(params, inf)
  each step for its log, an in-place multiply by 1;
- zero_resume: zero_recipe_no_norm saving checkpoint-3 (save_strategy="steps"), then a fresh
  model and Trainer resumed from it: the resumed params beside the uninterrupted ones;
- fsdp_cpu: TrainingArguments(fsdp=True) with torch.optim.AdamW on CPU ranks — what Trainer
  and accelerate make of it (they run DDP: accelerate enables FSDP only on accelerator devices).

Saves per configuration the params after training, the grad norms Trainer logged, the error
(type, is-RuntimeError, message) if train() raised, the optimizer's step count and
last_grad_norm, the model's wrapper and accelerate's distributed type, and the warnings given.
"""

import os
import warnings

import common as C
import hf_common as H
import torch
import torch.distributed as dist

CONFIGS = {
    # name: (optimizer, HybridAdamW kwargs, TrainingArguments kwargs)
    "ddp_torch": ("torch", {}, {}),
    "ddp_hybrid": ("hybrid", {}, {}),
    "zero_trainer_clip": ("hybrid", {"process_group": "WORLD"}, {}),
    "zero_recipe": ("hybrid", {"process_group": "WORLD", "max_grad_norm": H.CLIP}, {"max_grad_norm": 0}),
    "zero_recipe_no_norm": (
        "hybrid",
        {"process_group": "WORLD", "max_grad_norm": H.CLIP},
        {"max_grad_norm": 0},
    ),
    "zero_resume": ("hybrid", {"process_group": "WORLD", "max_grad_norm": H.CLIP}, {"max_grad_norm": 0}),
    "fsdp_cpu": ("torch", {}, {"fsdp": True}),
}


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    import transformers

    from hybrid_opt import HybridAdamW

    transformers.logging.set_verbosity_error()
    kind, hybrid, args_kw = CONFIGS[name]
    if hybrid.get("process_group") == "WORLD":
        hybrid = dict(hybrid, process_group=dist.group.WORLD)
    model = H.Tiny()
    init = H.params_of(model)
    opt_cls_kw = (
        (HybridAdamW, H.hybrid_kwargs(**hybrid))
        if kind == "hybrid"
        else (torch.optim.AdamW, H.torch_kwargs())
    )
    cls = H.norm_free_trainer() if name in ("zero_recipe_no_norm", "zero_resume") else transformers.Trainer
    # checkpoints in the launch's directory: rank 0 writes them, every rank resumes from them
    out_dir = os.path.join(os.environ["DIST_OUT"] if name == "zero_resume" else tmp, name)
    if name == "zero_resume":
        args_kw = dict(args_kw, save_strategy="steps", save_steps=3)
    trainer = cls(
        model=model,
        args=H.training_args(out_dir, **args_kw),
        train_dataset=H.dataset(),
        optimizer_cls_and_kwargs=opt_cls_kw,
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 - the test judges the type and message
            error = (type(e).__name__, isinstance(e, RuntimeError), str(e))
    opt = H.unwrap_optimizer(trainer.optimizer)
    out = dict(
        params=H.params_of(model),
        init=init,
        norms=H.grad_norms(trainer),
        error=error,
        steps=H.step_count(opt),
        global_step=trainer.state.global_step,
        wrapped=type(trainer.model_wrapped).__name__,
        fsdp_enabled=trainer.is_fsdp_enabled,
        distributed_type=str(trainer.accelerator.distributed_type),
        last_grad_norm=getattr(opt, "last_grad_norm", None),
        warnings=[str(w.message) for w in caught],
    )
    H.close(opt)
    if name == "zero_resume":
        model = H.Tiny()
        resumed = cls(
            model=model,
            args=H.training_args(out_dir, max_grad_norm=0),
            train_dataset=H.dataset(),
            optimizer_cls_and_kwargs=opt_cls_kw,
        )
        try:  # rank 0's optimizer.pt on every rank: refused on all of them
            resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-3"))
            out["resume_error"] = None
        except ValueError as e:
            out["resume_error"] = str(e)
        out["resumed"] = H.params_of(model)
        H.close(resumed.optimizer)
    return out


if __name__ == "__main__":
    C.rank_main(run)
