#!/usr/bin/env bash
# Sets up a fresh machine for hybrid_opt: torch (only if none is installed), then this
# package (its C kernels compile in seconds) with the test extra.
#
# A CPU torch is installed only where there is no torch and no GPU: on our machines
# `pip install torch==2.13.0` takes a CPU wheel from local disk, while an unpinned `torch`
# pulls a multi-GB CUDA build. A torch the user already has is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: a GPU and no torch: installing torch with CUDA from the package index"
    "$PY" -m pip install --quiet torch
else
    echo "setup: no GPU and no torch: installing the CPU build torch==2.13.0"
    "$PY" -m pip install --quiet torch==2.13.0
fi

"$PY" -m pip install --quiet -e ".[test]"
"$PY" -c "import cpu_kernels, gpu_kernels, hybrid_opt; print('setup: ok; cpu_kernels SIMD level', cpu_kernels.simd_level())"
