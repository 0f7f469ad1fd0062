#!/usr/bin/env bash
# Compiles every kernel specialization gpu_kernels' launchers can produce
# (tests/kernel_specializations.py) for sm_80 and sm_90 under each Triton release that the GPU CI
# matrix pins (.github/workflows/gpu-ci.yml), on a machine with no GPU. The compile test in
# .ci/run does this with the one Triton its torch installs; a user of an older torch gets an
# older Triton, whose compiler may reject what a newer one accepts.
#
#   bash .ci/compile_matrix.sh               # every Triton release in gpu-ci.yml
#   bash .ci/compile_matrix.sh 3.0.0 3.6.0   # these
#   bash .ci/compile_matrix.sh --list        # the releases gpu-ci.yml pins, one a line
#
# Each release is installed once into its own folder (pip --target, without dependencies; torch
# stays the installed one) and put first on PYTHONPATH; the two architectures compile in
# parallel, each in a fresh interpreter with an empty Triton cache. About 3-5 minutes a release
# on 2 cores. Prints a line per release and architecture; exits non-zero if any compile fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROOT=${HYBRID_OPT_TRITON_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hybrid_opt/triton}
ARCHS=(80 90)
DEADLINE_S=${HYBRID_OPT_COMPILE_DEADLINE_S:-1800}  # a release and both architectures

if [ $# -gt 0 ] && [ "$1" != --list ]; then
    versions=("$@")
else
    mapfile -t versions < <(grep -o 'triton: "[0-9][0-9.]*"' .github/workflows/gpu-ci.yml |
        grep -o '[0-9][0-9.]*' | sort -uV)
fi
if [ "${1:-}" = --list ]; then
    printf '%s\n' "${versions[@]}"
    exit 0
fi
if [ ${#versions[@]} -eq 0 ]; then
    echo "compile_matrix: no Triton release named, and none found in .github/workflows/gpu-ci.yml" >&2
    exit 2
fi

logs=$(mktemp -d)
failed=()
for v in "${versions[@]}"; do
    dir="$ROOT/$v"
    if [ ! -f "$dir/.installed" ]; then
        rm -rf "$dir"
        "$PY" -m pip install --quiet --no-deps --target "$dir" "triton==$v"
        touch "$dir/.installed"
    fi
    pids=()
    for arch in "${ARCHS[@]}"; do
        cache=$(mktemp -d)
        env -u TRITON_INTERPRET TRITON_CACHE_DIR="$cache" PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" \
            timeout --kill-after=10 "$DEADLINE_S" "$PY" tests/kernel_specializations.py --arch "$arch" \
            >"$logs/$v-sm_$arch.log" 2>&1 &
        pids+=("$!")
    done
    for i in "${!ARCHS[@]}"; do
        arch=${ARCHS[$i]}
        log="$logs/$v-sm_$arch.log"
        code=0
        wait "${pids[$i]}" || code=$?
        # the script names the Triton it imported: a release that did not take is a failure too
        if [ "$code" = 0 ] && grep -q "^OK$" "$log" && grep -q "^sm_$arch (triton $v)" "$log"; then
            echo "triton $v: $(grep "^sm_$arch (triton $v)" "$log")"
        else
            echo "triton $v sm_$arch: FAILED (exit $code; 124: past ${DEADLINE_S} s):"
            tail -n 30 "$log" | sed 's/^/    /'
            failed+=("$v sm_$arch")
        fi
    done
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "compile_matrix: ${#failed[@]} failed: ${failed[*]} (logs in $logs)" >&2
    exit 1
fi
echo "compile_matrix: OK, Triton ${versions[*]}, for sm_80 and sm_90"
