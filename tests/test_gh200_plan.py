"""docs/placement.md's GH200 figures ("GH200: SuperOffload's published configuration, planned") are
what `hybrid-opt plan` and the cost model predict: the Qwen3-14B and GPT-OSS-20B rows, the
ZeRO-Offload stand-in and its ratio. Predictions, recomputed here so the docs cannot drift."""

import contextlib
import dataclasses
import io
import json

import pytest

from hybrid_opt.placement import plan_report
from hybrid_opt.placement.cost_model import predict

QWEN = ["--params", "14e9", "--preset", "gh200", "--tokens", "16384"]
GPT_OSS = ["--params", "20.9e9", "--preset", "gh200", "--model-flops", str(6 * 3.6e9 * 16384)]
COMPRESSED = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--store-param-remainders"]


def plan(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_report.main(argv + ["--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize(
    "argv,iteration,tflops,offload,exposed",
    [
        (QWEN, 3.51, 392, 0.85, 0.053),
        (QWEN + ["--gpu-tflops", "600"], 2.37, 582, 0.85, 0.053),
        (QWEN + COMPRESSED, 3.51, 392, 0.65, 0.040),
        (QWEN + ["--host-adam", "5"], 3.65, 377, 0.85, 0.19),
        (QWEN + ["--host-adam", "5", "--gpu-tflops", "600"], 3.27, 421, 0.85, 0.96),
        (GPT_OSS, 2.62, 135, 1.0, 1.73),
        (GPT_OSS + COMPRESSED, 1.82, 194, 1.0, 0.94),
    ],
)
def test_the_readme_gh200_rows_are_the_planners_predictions(argv, iteration, tflops, offload, exposed):
    out = plan(argv)
    assert out["predicted_iteration_seconds"] == pytest.approx(iteration, abs=0.006)
    assert out["model_tflops_per_gpu"] == pytest.approx(tflops, abs=0.6)
    assert out["plan"]["offload_fraction"] == pytest.approx(offload)
    assert out["breakdown"]["host_exposed"] == pytest.approx(exposed, abs=0.006)


def test_gpt_oss_with_the_dense_formula_would_overstate_its_tflops():
    dense = plan(["--params", "20.9e9", "--preset", "gh200", "--tokens", "16384"])
    moe = plan(GPT_OSS)
    # the default counts every parameter as active: 20.9 / 3.6 the FLOPs, a longer predicted
    # backward; read at the MoE's real iteration time it would claim 786 TFLOPS
    assert dense["forward_backward_seconds"] == pytest.approx(moe["forward_backward_seconds"] * 20.9 / 3.6)
    assert 6 * 20.9e9 * 16384 / moe["predicted_iteration_seconds"] / 1e12 == pytest.approx(786, abs=1)


@pytest.mark.parametrize("tflops,zero_offload,ratio", [(None, 4.97, 1.41), ("600", 3.82, 1.61)])
def test_the_zero_offload_stand_in_and_its_ratio(tflops, zero_offload, ratio):
    argv = QWEN + (["--gpu-tflops", tflops] if tflops else [])
    machine, workload = plan_report.build(plan_report._parser().parse_args(argv))
    stand_in = predict(machine, dataclasses.replace(workload, speculative=False), 1.0, 0.0)
    ours = plan(argv)["predicted_iteration_seconds"]
    assert stand_in.iteration_seconds == pytest.approx(zero_offload, abs=0.006)
    assert stand_in.iteration_seconds / ours == pytest.approx(ratio, abs=0.006)
