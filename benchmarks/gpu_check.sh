#!/usr/bin/env bash
# GPU check, for a machine lent for a few minutes: the `gpu`-marked tests, the plain tests that
# take a CUDA path where a GPU is present (the Triton kernel tests on CUDA tensors, the demo...),
# the kernel benchmark at reduced sizes, the end-to-end speculation benchmark (host step hidden under backward on a GPU host), peak device memory per placement,
# and at the end one table of those figures (benchmarks/gpu_table.py table: kernel GB/s vs
# torch fused AdamW and vs a D2D copy, % of the host step hidden, peak memory at offload
# 0/0.5/1; a step that failed shows as "missing" there). Each step has a time limit; they add
# up, with each one's kill grace, to under 8 minutes on one H200.
# The machine has no package registry: install with --no-deps into its own torch/triton.
#
#   bash benchmarks/gpu_check.sh                 # log in bench_out/gpu_check.log
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # log and JSON under $OUT (the device tool's folder)
#   PEERS=1 bash benchmarks/gpu_check.sh         # also the one-round peer study, each row in a fresh
#                                                #   process, and the worker's waited step rate
#                                                #   against the in-process kernel's (+4 min 10 s)
#   SWEEP=1 bash benchmarks/gpu_check.sh         # also the kernels' launch-configuration sweep (+2.5 min)
#   SUITE=1 bash benchmarks/gpu_check.sh         # also the demo, HF Trainer, benchmark and planner tests
#                                                #   on the GPU (up to 5 min more; not timed on an H200 yet)
#
# The peer study's torchao row (CPUOffloadOptimizer) comes as a wheel carried in .wheels/:
#   pip download torchao==0.18.0 --no-deps -d .wheels    # here, before the device call
# (the device tool: run with carry [".wheels"]; without the wheel the torchao row is skipped
# with a note).
#
# Every step runs even when an earlier one fails; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
# the summary table reads these: a previous run's must not stand in for a step that fails now
rm -f "$OUT_DIR/bench_gpu_kernels.json" "$OUT_DIR/bench_step.json" "$OUT_DIR/gpu_memory.json" \
    "$OUT_DIR/bench_worker_rate.json"
exec > >(tee "$LOG") 2>&1

failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, remember a failure, go on
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    local start=$SECONDS
    if timeout --kill-after=5 "$limit" "$@"; then
        echo "=== $name: ok in $((SECONDS - start))s"
    else
        echo "=== $name: FAILED (exit $?) after $((SECONDS - start))s"
        failed+=("$name")
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
step versions 10 python -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
step install 35 python -m pip install --no-deps --no-build-isolation -e .
# pytest-xdist where the machine has it (the H200 image does): gpu tests share the GPU, but
# those marked whole_gpu (they fill its memory or launch ranks on it) run one at a time
XDIST=()
if python -c "import xdist" 2>/dev/null; then XDIST=(-n 6); fi
step gpu-tests 90 python -m pytest -m "gpu and not whole_gpu" -q -rfE -p no:cacheprovider "${XDIST[@]}" tests
step gpu-serial 60 python -m pytest -m "gpu and whole_gpu" -q -rfE -p no:cacheprovider tests
# the plain tests that take a CUDA path where a GPU is present (85 s at -n 6 on the H200)
step cuda-suite 90 python -m pytest -q -rfE -p no:cacheprovider "${XDIST[@]}" -m "not gpu" \
    tests/test_gpu_kernels.py tests/test_gpu_kernels_compressed.py tests/test_distributed_spec_edits.py \
    tests/test_device_path.py tests/test_failures_mid_step.py
step benchmark 60 python benchmarks/bench_gpu_kernels.py --quick --json "$OUT_DIR/bench_gpu_kernels.json"
step end-to-end 50 python benchmarks/bench_step.py --iters 10 --json "$OUT_DIR/bench_step.json"
step memory 30 python benchmarks/gpu_table.py memory --json "$OUT_DIR/gpu_memory.json"
if [[ "${SWEEP:-0}" == 1 ]]; then
    step sweep 150 python benchmarks/bench_gpu_kernels.py --quick --sweep --json "$OUT_DIR/bench_gpu_kernels_sweep.json"
fi
if [[ "${SUITE:-0}" == 1 ]]; then
    # the other plain tests with CUDA paths: the demo (it trains on the GPU), the frameworks'
    # Trainer cases, the benchmarks' tiny runs, the planner presets; longer than the default's time
    step cuda-suite-long 300 python -m pytest -q -rfE -p no:cacheprovider "${XDIST[@]}" -m "not gpu" \
        tests/test_demo.py tests/test_frameworks_hf.py tests/test_benchmarks.py tests/test_cost_model.py
fi
if [[ "${PEERS:-0}" == 1 ]]; then
    if compgen -G ".wheels/torchao-*.whl" > /dev/null; then
        step torchao 30 python -m pip install --no-deps --no-index .wheels/torchao-*.whl
    fi
    # the worker's step that step() waits for on every core, against the in-process kernel
    step worker-rate 40 python benchmarks/bench_worker_rate.py --rounds 3 --json "$OUT_DIR/bench_worker_rate.json"
    step peers 240 python benchmarks/bench_step.py --peers --rounds 1 --iters 5 --sweep 0 0.5 1 --worker-shares 0.875 \
        --json "$OUT_DIR/bench_peers.json" --png "$OUT_DIR/bench_peers.png"
fi

echo
echo "=== summary ($OUT_DIR)"
step table 10 python benchmarks/gpu_table.py table "$OUT_DIR"
echo
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]} (log: $LOG)"
    exit 1
fi
echo "gpu_check: all steps passed (log: $LOG)"
