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

# tests/test_aarch64_emulation.py: cpu_kernels cross-compiled for aarch64 and run under qemu
# (NEON and SVE bitwise against this machine's x86 levels). Debian/Ubuntu packages, installed
# where apt-get is there and works; elsewhere the test is skipped and says why. Never fatal.
if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then
    echo "setup: aarch64 cross compiler and qemu-aarch64 already installed"
elif ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: WARNING: no apt-get here: gcc-aarch64-linux-gnu and qemu-user not installed;" \
         "tests/test_aarch64_emulation.py will be skipped"
else
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
    # libc6-dev-arm64-cross: the cross compiler's C library (only recommended by the package)
    if timeout 300 $SUDO apt-get update -qq >/dev/null &&
       timeout 600 $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null; then
        echo "setup: installed gcc-aarch64-linux-gnu and qemu-user (aarch64 emulation test)"
    else
        echo "setup: WARNING: apt-get could not install gcc-aarch64-linux-gnu and qemu-user" \
             "(exit $?; no root, no network?): tests/test_aarch64_emulation.py will be skipped"
    fi
fi

"$PY" -c "import cpu_kernels, gpu_kernels, hybrid_opt; print('setup: ok; cpu_kernels SIMD level', cpu_kernels.simd_level())"
