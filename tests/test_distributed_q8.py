"""q8 moments (issue 38) under torch.distributed: FSDP2 (uneven shards) and process_group=, 2 gloo
ranks, each rank's part on the device, host and nvme tiers (offload 0.75 + nvme 0.25), clipping
at 1.0 (it bites at the last step), speculation on and off, a one-rank GradScaler overflow; DCP
saved at 2 ranks loaded in one process; a q8 param whose dim-0 cut falls inside a block refused.

One torchrun launch (tests/dist_launch.py, bounded) runs every configuration.

Why bitwise against one process: every rank's cut of a q8 param is a block cut (construction
refuses another: hybrid_opt/distributed/q8_shards.py), so a rank steps the very blocks one process
steps, with the same kernels; the single-process reference is fed the grads the ranks reduce (each
rank's local batch's grad, summed in rank order, / world: exact at 2 ranks), as in
test_distributed_compressed.py. Params, codes and absmaxes are then equal bit for bit at every
step, and so are the resumed steps after a 2 -> 1 DCP load.
"""

import os
import sys

import pytest
import torch
from dist_launch import DIST_MARKS, SCRIPTS, launch

sys.path.insert(0, SCRIPTS)
import common as C  # noqa: E402
import q8_train as Q  # noqa: E402

from hybrid_opt.state.state_format import q8_absmax_shape  # noqa: E402

pytestmark = DIST_MARKS

WORLD = 2
NAMES = ["fsdp2", "fsdp2_seq", "fsdp2_overflow", "zero", "zero_seq", "zero_overflow"]
SKIP = {name: (1,) if name.endswith("overflow") else () for name in NAMES}
QUANTIZED = {"0.weight": 0, "1.g": 2, "3.weight": 3}  # fqn -> param index (>= 4,096 elements)


@pytest.fixture(scope="module")
def q8_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("q8_train")
    ckpt = os.path.join(str(out), "ckpt")
    _save_one(os.path.join(ckpt, "one"), str(out))
    names = NAMES + ["zero_refused", "fsdp2_refused", "zero_from1", "fsdp2_from1"]
    return ckpt, launch("q8_train.py", str(out), ckpt, *names, timeout_s=300)


def _save_one(path: str, tmp: str) -> None:
    """One process's checkpoint after SAVE_AT steps on the averaged grads: dcp.save of model
    and optimizer under path/dcp, torch.save of both state dicts (full tensors) as path/sd.pt."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = Q.build_model()
    with _hybrid(model, tmp) as opt:
        _train_single(model, opt, Q.batches()[: Q.SAVE_AT])
        dcp.save(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=os.path.join(path, "dcp"),
        )
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(path, "sd.pt"))


def _averaged_grads(model, x) -> list:
    """The grads 2 data-parallel ranks reduce: each rank's local batch's grad, summed in rank
    order, / world (exact)."""
    total = None
    for r in range(WORLD):
        model.zero_grad()
        C.loss_fn(model, C.local_batch(x, r, WORLD)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [g / WORLD for g in total]


def _snapshot(model, opt) -> dict:
    sd = opt.state_dict()["state"]
    state = {i: {k: v.detach().clone() for k, v in sd[i].items() if k != "step"} for i in sorted(sd)}
    return dict(params=[p.detach().clone() for p in model.parameters()], state=state)


def _hybrid(model, nvme_path):
    from hybrid_opt import HybridAdamW

    # speculative=False: the grads are set after backward (the bits are the same either way)
    return HybridAdamW(
        model.parameters(),
        lr=C.LR,
        weight_decay=0.01,
        max_grad_norm=Q.CLIP,
        speculative=False,
        nvme_path=nvme_path,
        **Q.Q8,
        **Q.PLACEMENT,
    )


def _train_single(model, opt, xs, skip=(), first=0) -> list:
    steps = []
    for i, x in enumerate(xs, start=first):
        for p, g in zip(model.parameters(), _averaged_grads(model, x)):
            p.grad = g
        if i not in skip:
            opt.step()
        steps.append(_snapshot(model, opt))
    return steps


_SINGLE: dict = {}


def single(skip, tmp) -> list:
    if skip not in _SINGLE:
        model = Q.build_model()
        with _hybrid(model, str(tmp)) as opt:
            _SINGLE[skip] = _train_single(model, opt, Q.batches(), skip=skip)
    return _SINGLE[skip]


def _assert_bitwise(ours: list, ref: list, what: str) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        for k, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert torch.equal(x, y), f"{what}: step {step} param {k}"
        assert a["state"].keys() == b["state"].keys(), what
        for i in b["state"]:
            assert a["state"][i].keys() == b["state"][i].keys(), (what, i)
            for key, y in b["state"][i].items():
                x = a["state"][i][key]
                assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: step {step} {i} {key}"
                assert torch.equal(x, y), f"{what}: step {step} param {i} {key}"


@pytest.mark.parametrize("name", NAMES)
def test_q8_sharded_matches_single_process_bitwise(q8_runs, name, tmp_path):
    """Every rank's params and gathered q8 state (codes, absmaxes; the small params' fp32
    moments) after each step are those of one process with the same options fed the grads the
    ranks reduce, bit for bit — speculation on and off, clipping biting at the last step, a
    one-rank overflow skipped — and the q8 params are quantized on every rank."""
    _, ranks = q8_runs
    ref = single(SKIP[name], tmp_path)
    assert ranks[0][name]["norms"][-1] > Q.CLIP > ranks[0][name]["norms"][0]  # the clip bites once
    for rank, res in enumerate(ranks):
        r = res[name]
        state = r["steps"][-1]["state"]
        for i in QUANTIZED.values():
            assert state[i]["exp_avg_q8"].dtype == torch.uint8 and "exp_avg" not in state[i]
        assert state[5]["exp_avg"].dtype == torch.float32  # the last layer's weight: small
        _assert_bitwise(r["steps"], ref, f"{name} rank {rank}")


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_q8_speculative_equals_sequential_on_2_ranks(q8_runs, mode):
    """Speculation on (the host and nvme subgroups stepped in backward, the clipped step redone)
    and off give the same bits on both ranks."""
    _, ranks = q8_runs
    for rank, res in enumerate(ranks):
        spec, seq = res[mode]["host_stats"], res[mode + "_seq"]["host_stats"]
        assert spec["committed"] > 0 and spec["redone"] > 0, spec  # speculated; redone when clipped
        assert seq["committed"] == seq["redone"] == 0 and seq["stepped"] > 0, seq
        _assert_bitwise(res[mode]["steps"], res[mode + "_seq"]["steps"], f"{mode} rank {rank}")


@pytest.mark.parametrize("name", ["fsdp2_overflow", "zero_overflow"])
def test_q8_overflow_on_one_rank_leaves_the_state_bitwise_unchanged(q8_runs, name):
    """An inf in rank 1's local grads at step 1: both ranks skip it, and params, codes and
    absmaxes are bitwise what step 0 left; the next step moves them."""
    _, (r0, r1) = q8_runs
    assert r0[name]["skipped"] == r1[name]["skipped"] == [False, True, False, False]
    assert r0[name]["scales"] == r1[name]["scales"] == [256.0, 128.0, 128.0, 128.0]
    for res in (r0, r1):
        before, after = res[name]["steps"][0], res[name]["steps"][1]
        _assert_bitwise([after], [before], name)
        assert not torch.equal(
            res[name]["steps"][2]["state"][0]["exp_avg_q8"], before["state"][0]["exp_avg_q8"]
        )


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_q8_absmax_dtensors_are_shaped_like_what_they_describe(q8_runs, mode):
    """get_optimizer_state_dict's absmax of each q8 param is a DTensor of q8_absmax_shape(the
    param's shape): the param's shape with its last dim in blocks where that dim holds whole
    blocks (3.weight, 25 x 256: (25, 1), cut 13 / 12 as the param is; 1.g, 1-D), else one per
    block of the flat index (0.weight, 256 x 32: (32,)) — never a shard's count."""
    _, ranks = q8_runs
    shapes = {fqn: tuple(p.shape) for fqn, p in Q.build_model().named_parameters()}
    for res in ranks:
        got = res[mode]["absmax_shapes"]
        for fqn, shape in shapes.items():
            want = {}
            if fqn in QUANTIZED:
                want = {
                    k: ("DTensor", q8_absmax_shape(shape)) for k in ("exp_avg_absmax", "exp_avg_sq_absmax")
                }
            assert got[fqn] == want, (fqn, got[fqn])
    assert q8_absmax_shape((25, 256)) == (25, 1) and q8_absmax_shape((256, 32)) == (32,)


def _resume(ckpt: str, tmp) -> list:
    """dcp.load of the 2-rank checkpoint into one plain process's q8 HybridAdamW, then the
    remaining steps on the averaged grads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = Q.build_model()
    with _hybrid(model, str(tmp)) as opt:
        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        return _train_single(model, opt, Q.batches()[Q.SAVE_AT :], first=Q.SAVE_AT)


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_dcp_q8_2_ranks_load_1_resumes_bitwise(q8_runs, mode, tmp_path):
    """get_optimizer_state_dict + dcp.save at 2 ranks (codes uint8 shaped like the param,
    absmaxes of their own global shape, no fp32 moment of a q8 param), dcp.load into one
    plain process's q8 HybridAdamW: the resumed steps are the uninterrupted ones, bit for bit
    (the blocks are the param's at both world sizes: nothing is requantized)."""
    import torch.distributed.checkpoint as dcp

    ckpt, ranks = q8_runs
    path = os.path.join(ckpt, mode)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for fqn, p in Q.build_model().named_parameters():
        if fqn not in QUANTIZED:
            assert meta[f"optim.state.{fqn}.exp_avg"].properties.dtype == torch.float32
            continue
        assert f"optim.state.{fqn}.exp_avg" not in meta
        for m in ("exp_avg", "exp_avg_sq"):
            codes, absmax = meta[f"optim.state.{fqn}.{m}_q8"], meta[f"optim.state.{fqn}.{m}_absmax"]
            assert codes.properties.dtype == torch.uint8 and tuple(codes.size) == tuple(p.shape)
            assert absmax.properties.dtype == torch.float32
            assert tuple(absmax.size) == q8_absmax_shape(p.shape)
    _assert_bitwise(_resume(path, tmp_path), ranks[0][mode]["steps"][Q.SAVE_AT :], f"{mode} resumed")


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_q8_param_cut_inside_a_block_is_refused_on_every_rank(q8_runs, mode):
    """A 9 x 1000 q8 param cut after 5 rows (element 5,000, inside block 19) is refused at
    construction on both ranks — and under FSDP2 by add_param_group — naming the param, the
    cut and what to do."""
    _, ranks = q8_runs
    for res in ranks:
        msgs = res[f"{mode}_refused"]
        assert set(msgs) == ({"construct", "add_param_group"} if mode == "fsdp2" else {"construct"})
        for how, msg in msgs.items():
            index = 1 if how == "add_param_group" else 0  # after the optimizer's one param
            assert f"parameter {index} of shape (9, 1000)" in msg, msg
            assert "part 1 of 2 starts at element 5000, inside block 19" in msg, msg
            assert "torch.bfloat16 moments" in msg


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_q8_checkpoint_of_1_process_resumes_at_2_ranks_bitwise(q8_runs, mode, tmp_path):
    """One process's q8 checkpoint after SAVE_AT steps, resumed at 2 ranks — dcp.load into
    the ranks' DTensors (both modes) and, for process_group, load_state_dict of the full state
    dict (each rank slices its elements and blocks): every remaining step is the single
    process's uninterrupted one, bit for bit, on both ranks."""
    _, ranks = q8_runs
    ref = single((), tmp_path)[Q.SAVE_AT :]
    for rank, res in enumerate(ranks):
        runs = res[f"{mode}_from1"]
        assert set(runs) == ({"dcp", "full"} if mode == "zero" else {"dcp"})
        for how, steps in runs.items():
            _assert_bitwise(steps, ref, f"{mode} rank {rank} from 1 ({how})")


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_q8_fp32_save_at_2_ranks_dequantizes_each_ranks_blocks(q8_runs, mode):
    """save_state_dict(f, fp32=True) on each rank: every moment an fp32 DTensor like the param
    (what torch.optim.AdamW keeps under FSDP2), a q8 one the dequantization of the param's own
    codes and blocks (map[code] * absmax), gathered; the small params' moments as they are."""
    from cpu_kernels.q8_reference import Q8Blocks, dequantize_blocks

    _, ranks = q8_runs
    for rank, res in enumerate(ranks):
        last = res[mode]["steps"][-1]["state"]
        for i, entry in res[mode]["fp32"].items():
            assert set(entry) == {"exp_avg", "exp_avg_sq"}, (rank, i, set(entry))
            for m, (kind, got) in entry.items():
                assert kind == "DTensor" and got.dtype == torch.float32, (rank, i, m, kind)
                if m + "_q8" in last[i]:
                    codes, absmax = last[i][m + "_q8"], last[i][m + "_absmax"]
                    want = dequantize_blocks(Q8Blocks(codes.reshape(-1), absmax.reshape(-1)), m == "exp_avg")
                    want = want.view(codes.shape)
                else:
                    want = last[i][m]
                assert torch.equal(got, want), (mode, rank, i, m)
