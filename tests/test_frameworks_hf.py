"""HybridAdamW under Hugging Face's frameworks and torch.compile, each real (no mocks): HF
Trainer (both ways of handing it an optimizer, its default max_grad_norm=1.0 clipping, its
checkpoint resume, DDP and process_group= under torchrun), accelerate (the prepare() loop with
clip_grad_norm_, process_group= under torchrun, save_state / load_state), and a
torch.compile'd model. References: the same run with torch.optim.AdamW(foreach=False).

The distributed cases run in two torchrun launches (tests/dist_scripts/hf_trainer_train.py and
accelerate_train.py, 2 gloo ranks, about 10 s each here); each is bounded and kills every
rank and worker when it overruns. Model, data and loops: tests/dist_scripts/hf_common.py.
"""

import logging
import os
import re
import sys
import time

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch
from helpers import transformers_or_skip
from tolerances import DIST_RTOL, assert_close

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402
import hf_common as H  # noqa: E402

transformers = transformers_or_skip()
accelerate = pytest.importorskip("accelerate")
transformers.logging.set_verbosity_error()

from hybrid_opt import HybridAdamW  # noqa: E402

# what GradsEditedError's message must tell a user of each framework (hybrid_opt/distributed/zero_edits.py)
RECIPE_PARTS = (
    "attach_grad_scaler",
    "TrainingArguments(max_grad_norm=0)",
    "gradient_clip_val=None",
    "accelerator.clip_grad_norm_",
)


def distributed(test):
    for mark in DIST_MARKS:
        test = mark(test)
    return test


def _assert_params_close(ours, ref, what=""):
    for k, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert_close(a, b, msg=f"{what} param {k}")


def _assert_params_within_dist_rtol(ours, ref, what):
    for k, (a, b) in enumerate(zip(ours, ref, strict=True)):
        err = C.rel_err(a, b)
        assert err <= DIST_RTOL, f"{what}: param {k}: relative error {err:.2e}"


def _assert_refused(results, name):
    """Both ranks raised GradsEditedError at the first step, nothing stepped, the message naming
    the optimizer's clipping and every framework's switch."""
    for rank, res in enumerate(results):
        r = res[name]
        assert r["error"] is not None, f"{name} rank {rank}: training was not refused"
        kind, is_runtime_error, message = r["error"]
        assert kind == "GradsEditedError" and is_runtime_error, (rank, r["error"])
        assert r["steps"] == 0.0
        for a, b in zip(r["params"], r["init"]):
            assert torch.equal(a, b)
        assert re.search(r"HybridAdamW\([^)]*max_grad_norm=", message), message
        for part in RECIPE_PARTS:
            assert part in message, f"{name} rank {rank}: {part!r} not in {message!r}"


# ---------------------------------------------------------------- HF Trainer, one process


def _trainer_run(kind, how, out_dir, **args_kw):
    """(params, logged grad norms, the HybridAdamW or None) after STEPS steps of HF Trainer."""
    model = H.Tiny()
    if how == "optimizers":  # built by the user on model.parameters(), with a scheduler of theirs
        opt = H.make_optimizer(kind, model.parameters())
        sched = transformers.get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=2, num_training_steps=H.STEPS
        )
        handed = dict(optimizers=(opt, sched))
    else:  # built by Trainer: its decay / no-decay param groups, its linear schedule
        cls_kw = (
            (HybridAdamW, H.hybrid_kwargs()) if kind == "hybrid" else (torch.optim.AdamW, H.torch_kwargs())
        )
        handed = dict(optimizer_cls_and_kwargs=cls_kw)
    trainer = transformers.Trainer(
        model=model, args=H.training_args(out_dir, **args_kw), train_dataset=H.dataset(), **handed
    )
    trainer.train()
    opt = H.unwrap_optimizer(trainer.optimizer)
    return H.params_of(model), H.grad_norms(trainer), opt


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_with_hybrid_adamw_matches_torch_adamw_under_its_default_clipping(tmp_path, how):
    """HF Trainer's default max_grad_norm=1.0 clips the grads after backward (clipping bites: the
    logged norms are 3-6), so the host subgroups speculated during backward are redone with the
    clipped grads; the params end within fp32 tolerance of torch.optim.AdamW's."""
    ref, ref_norms, _ = _trainer_run("torch", how, str(tmp_path / "torch"))
    ours, norms, opt = _trainer_run("hybrid", how, str(tmp_path / "hybrid"))
    try:
        assert opt.plan.summary()["host"]["subgroups"] >= 2
        assert len(opt.param_groups) == (1 if how == "optimizers" else 2)
        assert opt.stats["speculation"]["redone"] >= 1
        assert min(ref_norms) > H.CLIP
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        _assert_params_close(ours, ref, how)
    finally:
        opt.close()


def test_trainers_built_in_a_loop_and_dropped_leave_no_worker(tmp_path):
    """optimizer_cls_and_kwargs: Trainer builds the optimizer and the user never holds it to
    close it. Three Trainers built in a loop and dropped: each optimizer is collected and its
    worker reaped (hooks hold it weakly: hybrid_opt/lifetime.py), with one UnclosedOptimizerWarning."""
    import gc
    import warnings

    import psutil

    from hybrid_opt import UnclosedOptimizerWarning

    pids = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for k in range(3):
            trainer = transformers.Trainer(
                model=H.Tiny(),
                args=H.training_args(str(tmp_path / str(k)), max_steps=2),
                train_dataset=H.dataset(),
                optimizer_cls_and_kwargs=(HybridAdamW, H.hybrid_kwargs()),
            )
            trainer.train()
            pids.append(H.unwrap_optimizer(trainer.optimizer).worker_pid)
            del trainer
            gc.collect()
            assert not psutil.pid_exists(pids[-1]), f"Trainer {k}'s worker outlived it"
    assert all(pids) and len(set(pids)) == 3
    # Python's default filters show it once per place: said once, not once per Trainer
    assert sum(issubclass(w.category, UnclosedOptimizerWarning) for w in caught) == 1


@pytest.mark.parametrize("trainer_cls", ["Trainer", "norm_free_trainer"])
def test_trainer_grad_norm_log_redoes_speculation_unless_the_trainer_computes_none(tmp_path, trainer_cls):
    """With max_grad_norm=0 HF Trainer still logs a grad norm from accelerate's
    clip_grad_norm_(params, inf). Where that multiplies the grads by 1 in place (accelerate
    before 1.16: torch's clip_grad_norm_) every speculated host step is redone (correct, the
    overlap lost); where it only reads them (accelerate 1.16: get_total_norm, no clip at inf)
    they are committed. A Trainer whose _get_grad_norm computes none (hf_common.norm_free_trainer)
    leaves the grads alone and the speculated steps are committed (and logs no grad norm)."""
    model = H.Tiny()
    opt = H.make_optimizer("hybrid", model.parameters())
    cls = transformers.Trainer if trainer_cls == "Trainer" else H.norm_free_trainer()
    trainer = cls(
        model=model,
        args=H.training_args(str(tmp_path), max_grad_norm=0),
        train_dataset=H.dataset(),
        optimizers=(opt, None),
    )
    try:
        trainer.train()
        spec = opt.stats["speculation"]  # the last step's
        if trainer_cls == "Trainer":
            if _norm_at_inf_writes_the_grads(trainer):
                assert spec["redone"] > 0 and spec["committed"] == 0
            else:
                assert spec["committed"] > 0 and spec["redone"] == 0
            assert len(H.grad_norms(trainer)) == H.STEPS
        else:
            assert spec["committed"] > 0 and spec["redone"] == 0
            assert H.grad_norms(trainer) == []
    finally:
        opt.close()


def _norm_at_inf_writes_the_grads(trainer) -> bool:
    """Whether this accelerate's clip_grad_norm_(params, inf) writes the grads (bumps their
    version) or only reads them."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    before = p.grad._version
    trainer.accelerator.clip_grad_norm_([p], float("inf"))
    return p.grad._version != before


def _tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _gpt2_dataset():
    ids = torch.randint(0, 64, (H.ROWS, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


class _StepsTaken(transformers.TrainerCallback):
    """The optimizer steps a train() call takes, and the global step number of its first."""

    def __init__(self):
        self.first, self.count = None, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.first = state.global_step if self.first is None else self.first
        self.count += 1


@pytest.mark.parametrize("model_kind", ["gpt2", "plain"])
def test_trainer_resume_from_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path, model_kind):
    """save_strategy="steps" writes checkpoint-3 during an uninterrupted 6-step run; a fresh
    model and Trainer resumed from it (weights: save_pretrained's safetensors for the tiny
    GPT-2 — tied embeddings — and a plain safetensors file for the nn.Module; optimizer.pt from
    HybridAdamW.state_dict()) take the last 3 steps bit for bit as the uninterrupted run did."""
    build, data = (_tiny_gpt2, _gpt2_dataset()) if model_kind == "gpt2" else (H.Tiny, H.dataset())
    out = str(tmp_path / "run")

    def trainer_for(model, **args_kw):
        return transformers.Trainer(
            model=model,
            args=H.training_args(out, **args_kw),
            train_dataset=data,
            optimizer_cls_and_kwargs=(HybridAdamW, H.hybrid_kwargs()),
        )

    model = build()
    first = trainer_for(model, save_strategy="steps", save_steps=3)
    first.train()
    uninterrupted = H.params_of(model)
    H.close(first.optimizer)
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6"]

    model = build()
    resumed, taken = trainer_for(model), _StepsTaken()
    resumed.add_callback(taken)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    H.close(resumed.optimizer)
    assert (taken.first, taken.count, resumed.state.global_step) == (4, H.STEPS - 3, H.STEPS)
    for a, b in zip(H.params_of(model), uninterrupted, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- HF Trainer, 2 ranks

HF_CONFIGS = [
    "ddp_torch",
    "ddp_hybrid",
    "zero_trainer_clip",
    "zero_recipe",
    "zero_recipe_no_norm",
    "zero_resume",
    "fsdp_cpu",
]


@pytest.fixture(scope="module")
def hf_ranks(tmp_path_factory):
    return launch(
        "hf_trainer_train.py", str(tmp_path_factory.mktemp("hf_trainer")), *HF_CONFIGS, timeout_s=180
    )


@distributed
def test_trainer_ddp_with_replicated_hybrid_adamw_matches_torch_adamw_ddp(hf_ranks):
    """HF Trainer under torchrun wraps the model in DDP itself; HybridAdamW with plain params
    and no process_group keeps a replica of the state on each rank (and warns so, naming
    process_group), and with Trainer's clipping follows torch.optim.AdamW under the same DDP."""
    for rank, res in enumerate(hf_ranks):
        assert res["ddp_hybrid"]["wrapped"] == "DistributedDataParallel"
        assert min(res["ddp_torch"]["norms"]) > H.CLIP
        _assert_params_within_dist_rtol(
            res["ddp_hybrid"]["params"], res["ddp_torch"]["params"], f"rank {rank}"
        )
        assert any("process_group" in w and "replicated" in w for w in res["ddp_hybrid"]["warnings"])


@distributed
def test_trainer_clipping_under_process_group_is_refused_on_every_rank_before_any_step(hf_ranks):
    """process_group= reduce-scatters the grads during backward, so Trainer's default
    clip_grad_norm_ after backward could not reach the step: the first step() raises
    GradsEditedError on both ranks, nothing stepped, the message giving each framework's recipe."""
    _assert_refused(hf_ranks, "zero_trainer_clip")


@distributed
def test_trainer_process_group_recipe_matches_ddp_torch_adamw_with_clipping(hf_ranks):
    """The recipe the error gives: TrainingArguments(max_grad_norm=0) and HybridAdamW(...,
    process_group=WORLD, max_grad_norm=1.0) equals Trainer's DDP + torch AdamW + clipping."""
    for rank, res in enumerate(hf_ranks):
        assert res["zero_recipe"]["error"] is None, res["zero_recipe"]["error"]
        _assert_params_within_dist_rtol(
            res["zero_recipe"]["params"], res["ddp_torch"]["params"], f"rank {rank}"
        )


@distributed
def test_trainer_process_group_recipe_without_trainers_grad_norm_matches_ddp_torch_adamw(hf_ranks):
    """The recipe in a Trainer that computes no grad norm of its own (hf_common.norm_free_trainer):
    Trainer's DDP wrapper stays (its write of the averaged grads is correct and warned about:
    twice the traffic), the clipping is the optimizer's, by the norm of the averaged grads —
    DDP + clip_grad_norm_'s — and the params follow Trainer's DDP + torch AdamW + clipping."""
    for rank, res in enumerate(hf_ranks):
        r = res["zero_recipe_no_norm"]
        assert r["error"] is None, r["error"]
        assert r["steps"] == H.STEPS and r["wrapped"] == "DistributedDataParallel"
        assert r["last_grad_norm"] == pytest.approx(res["ddp_torch"]["norms"][-1], rel=1e-5)
        _assert_params_within_dist_rtol(r["params"], res["ddp_torch"]["params"], f"rank {rank}")
        assert any("DistributedDataParallel" in w and "twice" in w for w in r["warnings"])


@distributed
def test_trainer_checkpoint_under_process_group_is_refused_on_every_rank(hf_ranks):
    """HF Trainer writes optimizer.pt from rank 0 only (rank 0's Shard(0) chunks): resuming
    from it is refused on every rank, not loaded silently (which drifts 1.2e-2 in 3 steps)."""
    msgs = [res["zero_resume"]["resume_error"] for res in hf_ranks]
    assert msgs[1] is not None and "holds rank 0's chunks" in msgs[1], msgs
    assert msgs[0] is not None and "another rank was given a state_dict" in msgs[0], msgs


@distributed
def test_trainer_fsdp_on_cpu_runs_ddp(hf_ranks):
    """A framework limit, not ours: TrainingArguments(fsdp=True) on CPU ranks trains under plain
    DDP without a warning — accelerate (state.py) switches to FSDP only on accelerator devices
    (MULTI_GPU/NPU/XPU/...), never MULTI_CPU — so the run is DDP's, bit for bit."""
    for res in hf_ranks:
        r = res["fsdp_cpu"]
        assert (r["wrapped"], r["fsdp_enabled"], r["distributed_type"]) == (
            "DistributedDataParallel",
            False,
            "DistributedType.MULTI_CPU",
        )
        for a, b in zip(r["params"], res["ddp_torch"]["params"], strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- accelerate


def _accelerate_run(kind):
    accelerator = accelerate.Accelerator(cpu=True)
    model = H.Tiny()
    opt = H.make_optimizer(kind, model.parameters())
    prepared, accelerated, loader = H.accelerate_prepare(accelerator, model, opt)
    norms = H.accelerate_train(accelerator, prepared, accelerated, loader, clip=H.CLIP)
    return H.params_of(model), norms, opt


def test_accelerate_loop_with_clip_grad_norm_matches_torch_adamw():
    """accelerator.prepare(model, opt, loader), accelerator.backward and
    accelerator.clip_grad_norm_ (biting: norms 2-6) between backward and step: HybridAdamW
    follows torch.optim.AdamW within fp32 tolerance."""
    ref, ref_norms, _ = _accelerate_run("torch")
    ours, norms, opt = _accelerate_run("hybrid")
    try:
        assert opt.plan.summary()["host"]["subgroups"] >= 2
        assert min(ref_norms) > H.CLIP
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        _assert_params_close(ours, ref)
    finally:
        opt.close()


ACC_CONFIGS = [
    "acc_ddp_torch",
    "acc_zero_clip",
    "acc_zero_ddp_clip",
    "acc_zero_recipe",
    "acc_zero_recipe_eval_mode",
    "acc_zero_ddp_noclip",
]


@pytest.fixture(scope="module")
def acc_ranks(tmp_path_factory):
    return launch(
        "accelerate_train.py", str(tmp_path_factory.mktemp("accelerate")), *ACC_CONFIGS, timeout_s=180
    )


@distributed
@pytest.mark.parametrize("name", ["acc_zero_clip", "acc_zero_ddp_clip"])
def test_accelerate_clip_grad_norm_under_process_group_is_refused_on_every_rank(acc_ranks, name):
    """accelerator.clip_grad_norm_ after backward under process_group=, the model unprepared (no
    DDP) or prepared (DDP-wrapped, then clipped): GradsEditedError on both ranks at the first
    step, nothing stepped."""
    assert acc_ranks[0][name]["wrapped"] == ("DistributedDataParallel" if "ddp" in name else "Tiny")
    _assert_refused(acc_ranks, name)


@distributed
@pytest.mark.parametrize("name", ["acc_zero_recipe", "acc_zero_recipe_eval_mode"])
def test_accelerate_process_group_recipe_without_ddp_matches_ddp_torch_adamw_with_clipping(acc_ranks, name):
    """The model kept from DDP — only moved to the device, or prepared with
    prepare_model(model, evaluation_mode=True), which still registers it for save_state —,
    HybridAdamW(process_group=WORLD, max_grad_norm=1.0), no clip_grad_norm_ call: params within
    1e-4 of accelerate's DDP + torch AdamW + accelerator.clip_grad_norm_, the same clipping
    norm, no warning."""
    for rank, res in enumerate(acc_ranks):
        r, ref = res[name], res["acc_ddp_torch"]
        assert ref["wrapped"] == "DistributedDataParallel" and r["wrapped"] == "Tiny"
        assert r["registered"] == (1 if name.endswith("eval_mode") else 0)
        assert r["error"] is None and r["steps"] == H.STEPS
        assert min(ref["norms"]) > H.CLIP
        assert r["last_grad_norm"] == pytest.approx(ref["norms"][-1], rel=1e-5)
        _assert_params_within_dist_rtol(r["params"], ref["params"], f"{name} rank {rank}")
        assert not [w for w in r["warnings"] if "process_group" in w]


@distributed
def test_accelerate_ddp_wrapper_under_process_group_is_correct_and_warned(acc_ranks):
    """The same recipe with the model prepared (accelerate wraps it in DDP): DDP's write of the
    averaged grads is accepted — the result is the recipe's — and warned about (the grads are
    communicated twice)."""
    for rank, res in enumerate(acc_ranks):
        r = res["acc_zero_ddp_noclip"]
        assert r["error"] is None and r["wrapped"] == "DistributedDataParallel"
        _assert_params_within_dist_rtol(r["params"], res["acc_ddp_torch"]["params"], f"rank {rank}")
        assert any("DistributedDataParallel" in w and "twice" in w for w in r["warnings"])


def _accelerate_checkpointed(ckpt, *, save_at=None, load=False, safe_serialization=False):
    """STEPS steps of a prepared model, HybridAdamW and StepLR over H.batches(); save_state at
    step `save_at`, or load_state first and take only the steps after `save_at`."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = H.Tiny()
    opt = HybridAdamW(model.parameters(), **H.hybrid_kwargs())
    try:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        prepared, accelerated, sched = accelerator.prepare(model, opt, sched)
        if load:
            accelerator.load_state(ckpt)
        for i, batch in enumerate(H.batches()):
            if load and i < save_at:
                continue
            accelerated.zero_grad()
            accelerator.backward(prepared(**batch)["loss"])
            accelerated.step()
            sched.step()
            if not load and i + 1 == save_at:
                accelerator.save_state(ckpt, safe_serialization=safe_serialization)
        return H.params_of(model)
    finally:
        opt.close()


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch_save"])
def test_accelerate_save_state_resumes_bitwise(tmp_path, caplog, safe):
    """save_state(dir) — safetensors (its default, which keys tensors by storage and drops
    every one it finds shared) or torch.save — then a fresh Accelerator, model, HybridAdamW
    and scheduler, load_state(dir): the steps after the checkpoint are the uninterrupted
    run's, bit for bit. HybridAdamW's params keep their own memory: nothing looks tied."""
    ckpt = str(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        uninterrupted = _accelerate_checkpointed(ckpt, save_at=3, safe_serialization=safe)
    assert not any("shared tensor" in r.getMessage() for r in caplog.records)
    assert ("model.safetensors" if safe else "pytorch_model.bin") in os.listdir(ckpt)
    if safe:
        from safetensors.torch import load_file

        assert sorted(load_file(os.path.join(ckpt, "model.safetensors"))) == sorted(
            n for n, _ in H.Tiny().named_parameters()
        )
    resumed = _accelerate_checkpointed(ckpt, save_at=3, load=True)
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert torch.equal(a, b)


def test_accelerate_save_model_reloads_every_weight_exactly(tmp_path):
    """accelerator.save_model (safetensors) of a model trained with HybridAdamW, loaded into a
    fresh model: every weight is the trained one, bit for bit (none dropped as 'tied')."""
    from safetensors.torch import load_file

    accelerator = accelerate.Accelerator(cpu=True)
    model = H.Tiny()
    opt = HybridAdamW(model.parameters(), **H.hybrid_kwargs())
    try:
        prepared, accelerated = accelerator.prepare(model, opt)
        for batch in H.batches():
            accelerated.zero_grad()
            accelerator.backward(prepared(**batch)["loss"])
            accelerated.step()
        accelerator.save_model(prepared, str(tmp_path))
        fresh = H.Tiny()
        fresh.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")))
        trained = dict(model.named_parameters())
        for name, p in fresh.named_parameters():
            assert torch.equal(p, trained[name]), name
        assert not torch.equal(fresh.net[0].weight, H.Tiny().net[0].weight)  # it trained
    finally:
        opt.close()


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        # inductor generates and compiles C++: measured 16-29 s with an empty inductor cache on
        # these 2 shared cores (the first process ever: 29 s), 2-4 s warm
        pytest.param("inductor", marks=pytest.mark.slow),
    ],
)
def test_torch_compiled_model_matches_torch_adamw(backend):
    """A torch.compile'd model, compiled and run (forward and backward) once before the optimizer
    is built: the params keep their memory (HybridAdamW copies none), and the compiled graph
    (params are its inputs) trains them. Within fp32 tolerance of torch.optim.AdamW on the
    same compiled model."""
    torch._dynamo.reset()

    def run(kind):
        model = H.Tiny()
        compiled = torch.compile(model, backend=backend)
        batches = H.batches()
        t0 = time.perf_counter()
        compiled(**batches[0])["loss"].backward()
        compile_s = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        before = [p.data_ptr() for p in model.parameters()]
        opt = H.make_optimizer(kind, model.parameters())
        assert [p.data_ptr() for p in model.parameters()] == before
        for batch in batches:
            opt.zero_grad()
            compiled(**batch)["loss"].backward()
            opt.step()
        return H.params_of(model), opt, compile_s

    ref, _, compile_s = run("torch")
    ours, opt, _ = run("hybrid")
    try:
        assert opt.stats["speculation"]["committed"] >= 1  # host steps ran in the compiled backward
        _assert_params_close(ours, ref, backend)
    finally:
        opt.close()
    print(f"torch.compile(backend={backend!r}): first forward + backward {compile_s:.1f} s")
