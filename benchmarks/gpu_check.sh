#!/usr/bin/env bash
# GPU check, for a machine lent for a few minutes: the `gpu`-marked tests, the Triton kernel
# tests on CUDA tensors, the kernel benchmark at reduced sizes, and the end-to-end speculation
# benchmark (host step hidden under backward on a GPU host) — under 6 minutes on one H200.
# The machine has no package registry: install with --no-deps into its own torch/triton.
# torchao (the peer study's CPUOffloadOptimizer row) comes as a wheel carried in .wheels/:
#
#   pip download torchao==0.18.0 --no-deps -d .wheels    # here, before the device call
#   bash benchmarks/gpu_check.sh            # log in bench_out/gpu_check.log
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # log and JSON under $OUT (the device tool's folder)
#
# (the device tool: run with carry [".wheels"]; without the wheel the torchao row is skipped
# with a note). Step limits add up to under the device tool's 10 minutes a call.
#
# Every step runs even when an earlier one fails; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1

failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, remember a failure, go on
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    local start=$SECONDS
    if timeout --kill-after=10 "$limit" "$@"; then
        echo "=== $name: ok in $((SECONDS - start))s"
    else
        echo "=== $name: FAILED (exit $?) after $((SECONDS - start))s"
        failed+=("$name")
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
step versions 30 python -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
step install 60 python -m pip install --no-deps --no-build-isolation -e .
step gpu-tests 60 python -m pytest -m gpu -q tests
step kernel-tests 100 python -m pytest -q -m "not gpu" tests/test_gpu_kernels.py
step benchmark 120 python benchmarks/bench_gpu_kernels.py --quick --sweep --json "$OUT_DIR/bench_gpu_kernels.json"
step end-to-end 100 python benchmarks/bench_step.py --iters 10 --json "$OUT_DIR/bench_step.json"
if compgen -G ".wheels/torchao-*.whl" > /dev/null; then
    step torchao 30 python -m pip install --no-deps --no-index .wheels/torchao-*.whl
fi
step peers 120 python benchmarks/bench_step.py --peers --rounds 1 --iters 5 --sweep 0 0.5 1 \
    --json "$OUT_DIR/bench_peers.json" --png "$OUT_DIR/bench_peers.png"

echo
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]} (log: $LOG)"
    exit 1
fi
echo "gpu_check: all steps passed (log: $LOG)"
