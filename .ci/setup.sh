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

# The test extra must not replace that torch: its frameworks' newest releases can ask for a later one
# (accelerate 1.16 asks for torch >= 2.6), and pip would then upgrade a torch 2.4 or 2.5 without a
# word, so that a GPU CI column tests another torch than its name (measured 2026-12-08: torch 2.5.1
# became 2.14.1 here). A constraint holds the installed torch; pip picks framework releases that
# take it, or fails saying which requirement conflicts.
TORCH_PIN=$(mktemp)
trap 'rm -f "$TORCH_PIN"' EXIT
"$PY" - > "$TORCH_PIN" <<'PIN'
import importlib.metadata as m, sys
try:
    print("torch==" + m.version("torch"))
except m.PackageNotFoundError:  # a torch without pip's metadata (built in place): nothing to pin
    print("setup: WARNING: the installed torch has no package metadata; pip may replace it", file=sys.stderr)
PIN
"$PY" -m pip install --quiet -c "$TORCH_PIN" -e ".[test]"

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

"$PY" -c "import cpu_kernels, gpu_kernels, hybrid_opt, torch; print('setup: ok; torch', torch.__version__ + '; cpu_kernels SIMD level', cpu_kernels.simd_level())"
