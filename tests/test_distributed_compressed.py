"""Compressed optimizer state (#16: bf16 moments + remainders) under torch.distributed (#15):
FSDP2 (uneven shards, offload 0.5 + nvme 0.25) and process_group= (offload 1.0), 2 gloo
ranks, a bf16 copy of the common model, against single-process HybridAdamW with the same
options and against torch.optim.AdamW; a one-rank GradScaler overflow; DCP 2 -> 1.

One torchrun launch (tests/dist_launch.py, bounded) runs every configuration (about 20 s here).

Why the single-process comparison is bitwise rather than within DIST_RTOL: with bf16 params the
grads are bf16, and data-parallel training rounds each rank's local grad to bf16 before the
reduction averages them (a bf16 sum, then / 2, exact), where one process rounds the global
batch's grad once — the grads differ by up to a bf16 ulp (2^-8 relative), not by fp32
rounding. Measured: the decoded masters 6.9e-4 relative from a single process on the global
batch after 4 steps (DIST_RTOL, 1e-4, is fp32's). So the single-process reference here is fed
the grads the ranks reduce — each rank's local batch's bf16 grad, summed in bf16, / world — and
must then match bit for bit: params, decoded fp32 masters and bf16 moments at every step. That
also proves no master was restarted from its param by a false write detection (FSDP2's lazy
init, its all-gathers, process_group's param gathers): a restart drops the remainders' bits.
"""

import os
import sys

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch
from helpers import with_fp32_masters
from tolerances import RTOL

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402
from compressed_train import COMPRESSED, SAVE_AT  # noqa: E402

pytestmark = DIST_MARKS

WORLD = 2
NAMES = ["fsdp2", "fsdp2_overflow", "zero", "zero_overflow"]
SKIP = {"fsdp2": (), "zero": (), "fsdp2_overflow": (1,), "zero_overflow": (1,)}
# the records' keys: "master_param" is the fp32 master decoded from the state's
# `master_remainder` and the param (hybrid_opt.fp32_master), here and in compressed_train.py
STATE = ("params", "master_param", "exp_avg", "exp_avg_sq")
# bf16 moments against torch's fp32 ones, and bf16 params against fp32 masters: a bf16 param
# is its master rounded (up to 2^-9 relative) and each moment is rounded to bf16 when stored;
# measured 2.1e-3 (params) and 8.3e-4 (masters) after 4 steps
BF16_RTOL = RTOL[torch.bfloat16]


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    out = tmp_path_factory.mktemp("compressed_train")
    ckpt = os.path.join(str(out), "ckpt")
    return ckpt, launch("compressed_train.py", str(out), ckpt, *NAMES, timeout_s=150)


def _bf16_model():
    return C.build_model().to(torch.bfloat16)


def _averaged_grads(model, x) -> list:
    """The grads 2 data-parallel ranks reduce: each rank's local batch's bf16 grad, summed in
    bf16 in rank order, / world (exact)."""
    total = None
    for r in range(WORLD):
        model.zero_grad()
        C.loss_fn(model, C.local_batch(x, r, WORLD).to(torch.bfloat16)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [g / WORLD for g in total]


def _snapshot(model, opt) -> dict:
    params = list(model.parameters())
    sd = with_fp32_masters(opt.state_dict()["state"], params)  # remainders decoded with the params
    state = {k: [sd[i][k].clone() for i in sorted(sd)] for k in STATE[1:]}
    return dict(params=[p.detach().clone() for p in params], **state)


def _train_single(model, opt, xs, *, averaged=True, skip=(), first=0) -> list:
    """Single-process HybridAdamW steps on the averaged grads (or the global batch's); the
    snapshot after each."""
    steps = []
    for i, x in enumerate(xs, start=first):
        if averaged:
            grads = _averaged_grads(model, x)
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        else:
            opt.zero_grad()
            C.loss_fn(model, x.to(torch.bfloat16)).backward()
        if i not in skip:
            opt.step()
        steps.append(_snapshot(model, opt))
    return steps


def _hybrid(model):
    from hybrid_opt import HybridAdamW

    # speculative=False: the grads are set after backward (speculation would redo every step;
    # the bits are the same either way)
    return HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=1.0,
        subgroup_numel=32,
        offload_fraction=0.5,
        speculative=False,
        **COMPRESSED,
    )


_SINGLE = {}


def single(averaged: bool, skip=()) -> list:
    key = (averaged, tuple(skip))
    if key not in _SINGLE:
        model = _bf16_model()
        with _hybrid(model) as opt:
            _SINGLE[key] = _train_single(model, opt, C.batches(), averaged=averaged, skip=skip)
    return _SINGLE[key]


def torch_masters(skip=()) -> list:
    """torch.optim.AdamW(foreach=False) stepping fp32 masters of the bf16 model with its
    global-batch grads, clip_grad_norm_ 1.0 (mixed precision with fp32 masters: what
    remainders store losslessly); the masters after each step."""
    model = _bf16_model()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=C.LR, weight_decay=0.01, foreach=False)
    out = []
    for i, x in enumerate(C.batches()):
        model.zero_grad()
        C.loss_fn(model, x.to(torch.bfloat16)).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        if i not in skip:
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, model.parameters()):
                    p.copy_(m)
        out.append([m.detach().clone() for m in masters])
    return out


def _assert_bitwise(ours: list, ref: list, what: str) -> None:
    for step, (a, b) in enumerate(zip(ours, ref)):
        for key in STATE:
            for k, (x, y) in enumerate(zip(a[key], b[key])):
                assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: step {step} {key} {k}"


@pytest.mark.parametrize("name", NAMES)
def test_compressed_state_matches_single_process_bitwise(compressed, name):
    """FSDP2 (uneven shards: 84/72 and 12/6 elements of the odd layers; offload 0.5 + nvme
    0.25) and process_group= (offload 1.0), bf16 moments + remainders: every rank's params,
    decoded fp32 masters and bf16 moments, gathered after each step, are those of one process
    running the same options on the grads the ranks reduce, bit for bit (module docstring) —
    with a one-rank overflow skipped too — and no master was ever restarted from its param."""
    _, ranks = compressed
    ref = single(averaged=True, skip=SKIP[name])
    for rank, res in enumerate(ranks):
        r = res[name]
        assert r["restarts"] == [], (name, rank, r["restarts"])
        assert r["steps"][0]["exp_avg"][0].dtype == torch.bfloat16
        assert r["steps"][0]["master_param"][0].dtype == torch.float32
        _assert_bitwise(r["steps"], ref, f"{name} rank {rank}")
    if name.startswith("fsdp2"):
        local = [res[name]["local_numels"] for res in ranks]
        assert local[0] != local[1]
        assert [a + b for a, b in zip(*local)] == [p.numel() for p in _bf16_model().parameters()]


def test_a_user_write_restarts_the_masters_in_both_modes(compressed):
    """model.load_state_dict (a write through every param) after training restarts every
    param's master (with remainders: from the bf16 param) in both modes, on every rank — so
    the restart counter the bitwise test reads does see restarts. Under FSDP2 such a write
    bumps only the DTensor's version counter, not its local shard's, so storage.py counts both
    (one alone would leave the host tier's masters at the old values)."""
    _, ranks = compressed
    n = len(list(_bf16_model().parameters()))
    for rank, res in enumerate(ranks):
        for name in ("fsdp2", "zero"):
            seen = sorted({i for _, idx in res[name]["restarts_after_load"] for i in idx})
            assert seen == list(range(n)), (name, rank, res[name]["restarts_after_load"])


@pytest.mark.parametrize("name", NAMES)
def test_compressed_state_is_one_copy_of_6_bytes_per_element_across_ranks(compressed, name):
    """Each rank lays out its shards (chunks) only, the ranks' elements sum to the model's, and
    opt.stats counts 6 B per element (remainder + bf16 m + bf16 v; the high half is the
    model's param): one compressed copy across the ranks."""
    _, ranks = compressed
    total = sum(p.numel() for p in _bf16_model().parameters())
    laid_out = [res[name]["laid_out"] for res in ranks]
    assert sum(laid_out) == total and all(n < total for n in laid_out), laid_out
    assert sum(res[name]["state_bytes"] for res in ranks) == 6 * total


@pytest.mark.parametrize("name", ["fsdp2", "zero"])
def test_compressed_state_near_single_process_on_the_global_batch(compressed, name):
    """Against single-process HybridAdamW with the same options on the global batch (not the
    ranks' averaged grads): the decoded masters within bf16's tolerance (measured 6.9e-4;
    the gap is the grads' bf16 rounding, module docstring), the params too."""
    _, ranks = compressed
    ref = single(averaged=False)
    for rank, res in enumerate(ranks):
        for step, (a, b) in enumerate(zip(res[name]["steps"], ref)):
            for key in ("master_param", "params"):
                for k, (x, y) in enumerate(zip(a[key], b[key])):
                    err = C.rel_err(x, y)
                    assert err <= BF16_RTOL, f"{name} rank {rank} step {step} {key} {k}: {err:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_compressed_state_follows_torch_adamw_with_fp32_masters(compressed, name):
    """Against torch.optim.AdamW stepping fp32 masters of the bf16 model on the global batch
    (overflow step skipped): the decoded masters and the bf16 params within bf16's tolerance
    (BF16_RTOL: bf16 moments and a bf16 param's own rounding); the trajectory moves by more."""
    _, ranks = compressed
    ref = torch_masters(skip=SKIP[name])
    for rank, res in enumerate(ranks):
        for step, (a, masters) in enumerate(zip(res[name]["steps"], ref)):
            for key in ("master_param", "params"):
                for k, (x, y) in enumerate(zip(a[key], masters)):
                    err = C.rel_err(x.float(), y)
                    assert err <= BF16_RTOL, f"{name} rank {rank} step {step} {key} {k}: {err:.2e}"
    moved = [
        C.rel_err(a, b) for a, b in zip(ref[-1], [p.detach().float() for p in _bf16_model().parameters()])
    ]
    assert min(moved) > 2 * BF16_RTOL


@pytest.mark.parametrize("name", ["fsdp2_overflow", "zero_overflow"])
def test_overflow_on_one_rank_leaves_compressed_state_bitwise_unchanged(compressed, name):
    """An inf in rank 1's local grads at step 1: both ranks skip it, the scales stay equal, and
    the whole state — params (the masters' high halves), decoded masters (so the remainders:
    the encoding is a bijection), bf16 moments — is bitwise what step 0 left."""
    _, (r0, r1) = compressed
    assert r0[name]["skipped"] == r1[name]["skipped"] == [False, True, False, False]
    assert r0[name]["scales"] == r1[name]["scales"] == [256.0, 128.0, 128.0, 128.0]
    for res in (r0, r1):
        before, after = res[name]["steps"][0], res[name]["steps"][1]
        for key in STATE:
            for x, y in zip(before[key], after[key]):
                assert torch.equal(x, y), (name, key)
        assert not torch.equal(res[name]["steps"][2]["params"][0], before["params"][0])


def _resume_hybrid(ckpt: str) -> list:
    """dcp.load of the 2-rank checkpoint into one plain process's compressed HybridAdamW (bf16
    model), then the remaining steps on the averaged grads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _bf16_model()
    with _hybrid(model) as opt:
        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        return _train_single(model, opt, C.batches()[SAVE_AT:], first=SAVE_AT)


@pytest.mark.parametrize("name", ["fsdp2", "zero"])
def test_dcp_compressed_2_ranks_load_1_resumes_bitwise(compressed, name):
    """get_optimizer_state_dict + dcp.save at 2 ranks with compressed state (the checkpoint
    holds bf16 moments and the int16 master_remainder, the fp32 master's low half), dcp.load
    into one plain process's compressed HybridAdamW: the resumed steps are the uninterrupted
    ones, bit for bit."""
    import torch.distributed.checkpoint as dcp

    ckpt, ranks = compressed
    path = os.path.join(ckpt, name)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert meta["optim.state.0.weight.exp_avg"].properties.dtype == torch.bfloat16
    assert meta["optim.state.0.weight.exp_avg_sq"].properties.dtype == torch.bfloat16
    assert meta["optim.state.0.weight.master_remainder"].properties.dtype == torch.int16
    assert "optim.state.0.weight.master_param" not in meta
    _assert_bitwise(_resume_hybrid(path), ranks[0][name]["steps"][SAVE_AT:], f"{name} resumed")


@pytest.mark.parametrize("name", ["fsdp2", "zero"])
def test_dcp_compressed_2_ranks_load_into_torch_adamw(compressed, name):
    """The same checkpoint into torch.optim.AdamW over an fp32 copy of the model (dcp.load
    widens the bf16 moments; the params are the saved fp32 masters — master_remainder decoded
    with the saved bf16 params, its high half — not the bf16 params):
    stepping those masters with the bf16 model's averaged grads stays within bf16's tolerance
    of the uninterrupted masters and params (torch keeps fp32 moments from there on)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ckpt, ranks = compressed
    model, masters = _bf16_model(), C.build_model()
    opt = torch.optim.AdamW(masters.parameters(), lr=C.LR, weight_decay=0.01, foreach=False)
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(masters, opt)}
    from hybrid_opt import fp32_master

    for fqn, p in masters.named_parameters():
        sd["optim"]["state"][fqn]["master_remainder"] = torch.empty(p.shape, dtype=torch.int16)
    dcp.load(sd, checkpoint_id=os.path.join(ckpt, name))
    model.load_state_dict(sd["model"])
    with torch.no_grad():
        for (fqn, p), bf16 in zip(masters.named_parameters(), model.parameters()):
            p.copy_(
                fp32_master({"master_remainder": sd["optim"]["state"][fqn].pop("master_remainder")}, bf16)
            )
    set_optimizer_state_dict(masters, opt, sd["optim"])
    uninterrupted = ranks[0][name]["steps"][SAVE_AT:]
    for i, x in enumerate(C.batches()[SAVE_AT:]):
        for m, g in zip(masters.parameters(), _averaged_grads(model, x)):
            m.grad = g.float()
        torch.nn.utils.clip_grad_norm_(masters.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters.parameters(), model.parameters()):
                p.copy_(m)
        for k, (m, p) in enumerate(zip(masters.parameters(), model.parameters())):
            for ours, ref in (
                (m.detach(), uninterrupted[i]["master_param"][k]),
                (p.detach(), uninterrupted[i]["params"][k]),
            ):
                err = C.rel_err(ours.float(), ref.float())
                assert err <= BF16_RTOL, f"{name} step {SAVE_AT + i} param {k}: {err:.2e}"
