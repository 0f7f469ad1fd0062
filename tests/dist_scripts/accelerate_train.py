"""Rank script: accelerate on 2 gloo ranks (torchrun), hf_common's Tiny model and loop
(accelerate_train), for each configuration named on the command line:

- acc_ddp_torch: accelerator.prepare(model, opt, loader) — which wraps the model in DDP in a
  multi-process launch — with torch.optim.AdamW(foreach=False) and accelerator.clip_grad_norm_
  (the reference);
- acc_zero_clip: the model only moved, not prepared (no DDP), HybridAdamW(process_group=WORLD)
  and accelerator.clip_grad_norm_ after backward: step() must refuse it (GradsEditedError);
- acc_zero_ddp_clip: the same with the model prepared (DDP-wrapped, then clipped): refused;
- acc_zero_recipe: the model only moved, HybridAdamW(process_group=WORLD, max_grad_norm=1.0),
  no clip_grad_norm_ call;
- acc_zero_recipe_eval_mode: the recipe with accelerator.prepare_model(model,
  evaluation_mode=True) (no DDP either, the model registered for save_state);
- acc_zero_ddp_noclip: the recipe with the model prepared (DDP-wrapped): DDP's write of the
  averaged grads is accepted (correct, twice the traffic) and warned about.

Saves per configuration the params, the clip norms, the error (type, is-RuntimeError,
message) if training raised, the optimizer's step count, the model's wrapper and the warnings.
"""

import warnings

import common as C
import hf_common as H
import torch.distributed as dist

CONFIGS = {
    # name: (optimizer, HybridAdamW kwargs, how the model is prepared, accelerator.clip_grad_norm_)
    "acc_ddp_torch": ("torch", {}, "prepare", H.CLIP),
    "acc_zero_clip": ("hybrid", {"process_group": "WORLD"}, "move", H.CLIP),
    "acc_zero_ddp_clip": ("hybrid", {"process_group": "WORLD"}, "prepare", H.CLIP),
    "acc_zero_recipe": ("hybrid", {"process_group": "WORLD", "max_grad_norm": H.CLIP}, "move", None),
    "acc_zero_recipe_eval_mode": (
        "hybrid",
        {"process_group": "WORLD", "max_grad_norm": H.CLIP},
        "evaluation_mode",
        None,
    ),
    "acc_zero_ddp_noclip": ("hybrid", {"process_group": "WORLD", "max_grad_norm": H.CLIP}, "prepare", None),
}


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    from accelerate import Accelerator

    kind, hybrid, model_by, clip = CONFIGS[name]
    if hybrid.get("process_group") == "WORLD":
        hybrid = dict(hybrid, process_group=dist.group.WORLD)
    accelerator = Accelerator(cpu=True)
    model = H.Tiny()
    init = H.params_of(model)
    error, norms = None, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = H.make_optimizer(kind, model.parameters(), **hybrid)
        wrapped, accelerated, loader = H.accelerate_prepare(accelerator, model, opt, model_by=model_by)
        try:
            norms = H.accelerate_train(accelerator, wrapped, accelerated, loader, clip=clip)
        except Exception as e:  # noqa: BLE001 - the test judges the type and message
            error = (type(e).__name__, isinstance(e, RuntimeError), str(e))
    out = dict(
        params=H.params_of(model),
        init=init,
        norms=norms,
        error=error,
        steps=H.step_count(opt),
        wrapped=type(wrapped).__name__,
        last_grad_norm=getattr(opt, "last_grad_norm", None),
        registered=len(accelerator._models),
        warnings=[str(w.message) for w in caught],
    )
    H.close(opt)
    accelerator.free_memory()
    return out


if __name__ == "__main__":
    C.rank_main(run)
