"""HybridAdamW under real Lightning (lightning.pytorch, CPU): Trainer.fit at the default
offload (host worker tier), with an nvme tier, with a scheduler dict, a ModelCheckpoint resume,
manual optimization through Lightning's forwarding LightningOptimizer wrapper, bf16-mixed with
max_grad_norm (and Lightning's refusal of gradient_clip_val there), gradient_clip_val at 32-bit,
a Trainer dropped without close(), hybrid_opt.lightning_io.DirectCheckpointIO's checkpoints, and
two processes through Lightning's own launcher
(strategy="ddp", and ModelParallelStrategy with FSDP2), which sets LOCAL_RANK on the rank it
starts but not LOCAL_WORLD_SIZE.

Every run is compared with the same Lightning script run with torch.optim.AdamW(foreach=False)
(tests/dist_scripts/lightning_train.py holds the module, data and trainer): within fp32's
tolerance in one process, DIST_RTOL on 2 ranks (against the single-process run on the global
batch), bitwise for a resumed run against an uninterrupted one.
"""

import gc
import os
import subprocess
import sys

import psutil
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from dist_launch import DIST_MARKS, REPO, SCRIPTS, _load_results, wait_bounded  # noqa: E402
from tolerances import DIST_RTOL, assert_close  # noqa: E402

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402
import lightning_train as LT  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# Lightning's own deprecation noise (lightning/pytorch/utilities/_pytree.py, with torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")


class Probe(pl.Callback):
    """Keeps `look(trainer, module)` after every training batch (in `seen`)."""

    def __init__(self, look):
        self.look, self.seen = look, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.seen.append(self.look(trainer, pl_module))


def assert_params_close(actual, expected, what=""):
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, msg=f"{what} param {k}")


@pytest.fixture(scope="module")
def torch_run():
    """The params after LT.STEPS steps of the plain script with torch.optim.AdamW."""
    return LT.fit(LT.Tiny(LT.torch_adamw))[1]


def test_fit_at_default_offload_steps_on_the_host_worker_like_torch(torch_run):
    # once crashed at the first step: a LightningOptimizer collected when Lightning rebuilt it
    # ran its inherited __del__, closing the real optimizer (hybrid_opt/lifetime.py)
    probe = Probe(lambda tr, m: (tr.optimizers[0].plan, tr.optimizers[0].worker_pid))
    _, params = LT.fit(LT.Tiny(LT.hybrid()), callbacks=[probe])
    assert len(probe.seen) == LT.STEPS
    plan, pid = probe.seen[-1]
    assert len(plan.subgroups("host")) >= 3 and not plan.subgroups("device"), plan
    assert pid is not None and all(p == pid for _, p in probe.seen), "one worker for the whole fit"
    assert_params_close(params, torch_run)


def test_fit_with_nvme_tier_keeps_files_while_training_and_removes_them(tmp_path, torch_run):
    probe = Probe(lambda tr, m: sorted(p.name for p in tmp_path.rglob("*.state")))
    tr, params = LT.fit(LT.Tiny(LT.hybrid(nvme_fraction=0.5, nvme_path=str(tmp_path))), callbacks=[probe])
    nvme = tr.optimizers[0].plan.subgroups("nvme")
    assert nvme, tr.optimizers[0].plan
    assert all(len(files) == len(nvme) for files in probe.seen), probe.seen
    assert not list(tmp_path.rglob("*.state")), "close() after fit removes the nvme files"
    assert_params_close(params, torch_run)


def test_fit_with_step_interval_scheduler_dict_follows_torch():
    def lr(tr, m):
        return tr.optimizers[0].param_groups[0]["lr"]

    runs = {}
    for name, make in (("hybrid", LT.hybrid()), ("torch", LT.torch_adamw)):
        probe = Probe(lr)
        runs[name] = (LT.fit(LT.Tiny(make, scheduler=True), callbacks=[probe])[1], probe.seen)
    (params, lrs), (ref, ref_lrs) = runs["hybrid"], runs["torch"]
    assert lrs == ref_lrs and lrs[-1] == LT.LR * 0.5 ** (LT.STEPS // 2), lrs
    assert_params_close(params, ref)


# the resumed fit saves nothing: Lightning's note that it was not given the ModelCheckpoint
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_from_model_checkpoint_is_bitwise_an_uninterrupted_run(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # epochs of n batches, limits in epochs: Lightning resumes an end-of-epoch checkpoint under
    # max_steps as if mid-epoch, replaying a batch (its issue #19617, torch.optim.AdamW alike)
    n, epochs = 3, dict(max_steps=-1)
    data = lambda: LT.loader(steps=n)  # noqa: E731
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="half")
    LT.fit(
        LT.Tiny(LT.hybrid()), data=data(), max_epochs=1, callbacks=[ckpt], enable_checkpointing=True, **epochs
    )
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)
    assert [float(s["step"]) for s in saved["optimizer_states"][0]["state"].values()] == [n] * 4

    probe = Probe(lambda tr, m: tr.global_step)
    _, resumed = LT.fit(
        LT.Tiny(LT.hybrid()),
        data=data(),
        max_epochs=2,
        callbacks=[probe],
        ckpt_path=tmp_path / "half.ckpt",
        **epochs,
    )
    assert probe.seen == list(range(n + 1, 2 * n + 1)), "the resumed fit takes only the last n steps"
    _, whole = LT.fit(LT.Tiny(LT.hybrid()), data=data(), max_epochs=2, **epochs)
    for k, (a, b) in enumerate(zip(resumed, whole)):
        assert torch.equal(a, b), f"param {k}: resumed differs from uninterrupted by {(a - b).abs().max()}"


def test_direct_checkpoint_io_writes_lightning_s_checkpoint_and_resumes_bitwise(tmp_path):
    """hybrid_opt.lightning_io.DirectCheckpointIO (the checkpoint torch.saved straight into its
    file, not buffered in RAM first): the same checkpoint as Lightning's own CheckpointIO, no
    partial file left beside it, and a resume from it is bitwise the uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hybrid_opt.lightning_io import DirectCheckpointIO

    n, epochs = 3, dict(max_steps=-1)
    data = lambda: LT.loader(steps=n)  # noqa: E731
    for name, plugins in (("direct", [DirectCheckpointIO()]), ("own", [])):
        ckpt = ModelCheckpoint(dirpath=tmp_path / name, filename="half")
        LT.fit(
            LT.Tiny(LT.hybrid()),
            data=data(),
            max_epochs=1,
            callbacks=[ckpt],
            enable_checkpointing=True,
            plugins=plugins,
            **epochs,
        )
    assert os.listdir(tmp_path / "direct") == ["half.ckpt"]
    direct = torch.load(tmp_path / "direct" / "half.ckpt", weights_only=True)
    own = torch.load(tmp_path / "own" / "half.ckpt", weights_only=True)
    assert direct.keys() == own.keys() and (direct["global_step"], direct["epoch"]) == (
        own["global_step"],
        own["epoch"],
    )
    assert all(torch.equal(v, own["state_dict"][k]) for k, v in direct["state_dict"].items())
    for a, b in zip(
        direct["optimizer_states"][0]["state"].values(), own["optimizer_states"][0]["state"].values()
    ):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the same optimizer state"
    _, resumed = LT.fit(
        LT.Tiny(LT.hybrid()), data=data(), max_epochs=2, ckpt_path=tmp_path / "direct" / "half.ckpt", **epochs
    )
    _, whole = LT.fit(LT.Tiny(LT.hybrid()), data=data(), max_epochs=2, **epochs)
    for k, (a, b) in enumerate(zip(resumed, whole)):
        assert torch.equal(a, b), f"param {k}: resumed differs from uninterrupted by {(a - b).abs().max()}"


class WrapperKeys(pl.Callback):
    """The LightningOptimizer wrapper and its __dict__'s keys once Lightning built it, and at
    the end of training."""

    def on_train_start(self, trainer, pl_module):
        self.wrapper = pl_module.optimizers()
        self.keys_start = set(self.wrapper.__dict__)

    def on_train_end(self, trainer, pl_module):
        self.keys_end = set(self.wrapper.__dict__)


def test_manual_optimization_through_the_wrapper_acts_on_the_optimizer():
    from hybrid_opt import HybridAdamW

    ref = LT.fit(LT.Tiny(LT.torch_adamw, manual=True))[1]
    keys = WrapperKeys()
    model, tr = LT.Tiny(LT.hybrid(), manual=True), LT.trainer(callbacks=[keys])
    try:
        tr.fit(model, LT.loader())
        real, wrapper = tr.optimizers[0], model.optimizers()
        assert wrapper is keys.wrapper and wrapper is not real and isinstance(wrapper, HybridAdamW)
        written = keys.keys_end - keys.keys_start
        assert keys.keys_end == keys.keys_start, f"written into the wrapper: {written}"
        assert_params_close(LT.full_params(model), ref)
        assert real.worker_pid is not None
        wrapper.close()
        assert real._closed and real.worker_pid is None, "the wrapper's close() closes the real optimizer"
        assert set(wrapper.__dict__) == keys.keys_start
    finally:
        tr.optimizers[0].close()


def test_bf16_mixed_with_max_grad_norm_matches_torch_with_gradient_clip_val():
    scale = 20.0  # grad norms well above 1: the clip acts at every step
    probe = Probe(lambda tr, m: tr.optimizers[0].last_grad_norm)
    _, params = LT.fit(
        LT.Tiny(LT.hybrid(max_grad_norm=1.0), scale=scale), precision="bf16-mixed", callbacks=[probe]
    )
    assert all(norm > 2.0 for norm in probe.seen), probe.seen
    _, ref = LT.fit(LT.Tiny(LT.torch_adamw, scale=scale), precision="bf16-mixed", gradient_clip_val=1.0)
    _, unclipped = LT.fit(LT.Tiny(LT.torch_adamw, scale=scale), precision="bf16-mixed")
    assert not torch.allclose(unclipped[0], ref[0], rtol=1e-3), "clipping changes this trajectory"
    assert_params_close(params, ref)


def test_32_bit_gradient_clip_val_clips_like_torch():
    # Lightning's 32-bit precision plugin clips with clip_grad_norm_ before step(), whatever the
    # optimizer; HybridAdamW's step() sees the edited grads (its speculated steps are redone)
    scale = 20.0
    _, params = LT.fit(LT.Tiny(LT.hybrid(), scale=scale), gradient_clip_val=1.0)
    _, ref = LT.fit(LT.Tiny(LT.torch_adamw, scale=scale), gradient_clip_val=1.0)
    _, unclipped = LT.fit(LT.Tiny(LT.hybrid(), scale=scale))
    assert not torch.allclose(unclipped[0], ref[0], rtol=1e-3), "clipping changes this trajectory"
    assert_params_close(params, ref)


def test_bf16_mixed_refuses_gradient_clip_val_with_hybrid_adamw():
    # Lightning's MixedPrecision.clip_gradients: an optimizer that declares
    # _step_supports_amp_scaling (HybridAdamW: torch's GradScaler protocol) is refused
    with pytest.raises(
        RuntimeError,
        match="The current optimizer, HybridAdamW, does not allow for "
        "gradient clipping because it performs unscaling",
    ):
        LT.fit(LT.Tiny(LT.hybrid()), precision="bf16-mixed", gradient_clip_val=1.0, max_steps=1)


def test_trainer_and_module_dropped_after_fit_free_the_worker_at_gc():
    from hybrid_opt import UnclosedOptimizerWarning

    tr, model = LT.trainer(), LT.Tiny(LT.hybrid())
    tr.fit(model, LT.loader())
    pid = tr.optimizers[0].worker_pid
    assert psutil.pid_exists(pid)
    with pytest.warns(UnclosedOptimizerWarning, match=r"close\(\)"):
        del tr, model  # a notebook cell run again: Lightning's objects hold each other in cycles
        gc.collect()
    assert not psutil.pid_exists(pid), "the collected optimizer reaped its worker"


# --------------------------------------------------------------- 2 processes, Lightning's launcher

LAUNCH_ENV = (
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "TORCHELASTIC_RUN_ID",
)


def launch_lightning(mode: str, out_dir: str, timeout_s: float = 120.0) -> list:
    """Runs lightning_train.py `mode` as a user would (`python script.py`: Lightning starts
    rank 1 itself), with none of torchrun's variables set; past the deadline every rank and
    worker is killed and the test fails with their output. Returns both ranks' results."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, REPO, env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(SCRIPTS, "lightning_train.py"), mode, out_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        cwd=out_dir,
    )
    out = wait_bounded(proc, f"lightning_train.py {mode}", timeout_s)
    return _load_results("lightning_train.py", out_dir, range(2), out)


def assert_two_ranks_like_torch(results, torch_run):
    assert [r["rank"] for r in results] == [0, 1] and all(r["world"] == 2 for r in results)
    for r in results:
        assert r["env"] == {"LOCAL_RANK": str(r["rank"]), "LOCAL_WORLD_SIZE": None}, r["env"]
        assert r["node"] == (r["rank"], 2), f"rank {r['rank']}: (local rank, ranks on the node) {r['node']}"
        for k, (a, e) in enumerate(zip(r["params"], torch_run)):
            err = C.rel_err(a, e)
            assert err <= DIST_RTOL, f"rank {r['rank']} param {k}: relative error {err:.2e}"
    cores = [set(r["worker_cores"]) for r in results]
    assert all(cores) and not cores[0] & cores[1], f"the ranks' workers share cores: {cores}"
    assert cores[0] | cores[1] <= os.sched_getaffinity(0)  # on 2 cores: one each


def dist_marks(test):
    for mark in DIST_MARKS:  # gloo available, torch >= 2.6 (FSDP2)
        test = mark(test)
    return test


@dist_marks
def test_ddp_two_cpu_processes_without_local_world_size_split_the_node(tmp_path, torch_run):
    results = launch_lightning("ddp", str(tmp_path))
    assert_two_ranks_like_torch(results, torch_run)
    for r in results:  # plain DDP: each rank steps the whole (replicated) state, and is told so
        assert any("replicated" in w for w in r["warnings"]), r["warnings"]


@dist_marks
def test_model_parallel_strategy_fsdp2_two_cpu_processes_like_torch(tmp_path, torch_run):
    results = launch_lightning("fsdp2", str(tmp_path))
    assert_two_ranks_like_torch(results, torch_run)
    for r in results:  # DTensor shards: each rank steps its own share, no replication warning
        assert not any("replicated" in w for w in r["warnings"]), r["warnings"]
