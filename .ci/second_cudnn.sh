#!/usr/bin/env bash
# The cuDNN-judged tests (lowering sweep, compile sweep, rule windows) against a second libcudnn, in the
# already-activated venv, from the repository root. The frontend (nvidia-cudnn-frontend >= 1.32) loads the first
# libcudnn.so.9 it finds on LD_LIBRARY_PATH before the wheel's, so torch's own 9.19 files stay untouched.
#   CUDNN_LIB_DIR=<folder with libcudnn.so.9>   judge with your own cuDNN instead of installing one
#   SECOND_CUDNN_VERSION (default 9.27.0.42), SECOND_CUDNN_DIR (install target, reused when present)
#   SECOND_CUDNN_TESTS (default: the files below)
#   bash .ci/second_cudnn.sh CMD ARGS...   run CMD under that libcudnn instead of the tests, e.g.
#                                          python scripts/compile_table.py (the compile table for that version)
# cuDNN 9.27's runtime-compiled engines link libcuda.so.1: without a driver the tests' stand-in goes on the path.
set -euo pipefail
version=${SECOND_CUDNN_VERSION:-9.27.0.42}
if [ -z "${CUDNN_LIB_DIR:-}" ]; then
    target=${SECOND_CUDNN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/thunder_cudnn_safe/cudnn-$version}
    if [ ! -e "$target/nvidia/cudnn/lib/libcudnn.so.9" ]; then
        tmp="$target.partial.$$"
        python -m pip install --quiet --no-deps --target "$tmp" "nvidia-cudnn-cu13==$version"
        rm -rf "$target" && mv "$tmp" "$target"
    fi
    CUDNN_LIB_DIR="$target/nvidia/cudnn/lib"
    IFS=. read -r major minor patch _ <<<"$version"
    export THUNDER_CUDNN_SAFE_EXPECT_CUDNN=$((major * 10000 + minor * 100 + patch))
fi
ld_path="$CUDNN_LIB_DIR"
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    standin=$(mktemp -d)
    trap 'rm -rf "$standin"' EXIT
    cc -shared -fPIC -O1 -o "$standin/libcuda.so.1" tests/standin_libcuda.c
    ld_path="$ld_path:$standin"
fi
export LD_LIBRARY_PATH="$ld_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python -c "import cudnn; print('=== cuDNN-judged tests with libcudnn', cudnn.backend_version(), 'from $CUDNN_LIB_DIR ===')"
if [ $# -gt 0 ]; then
    "$@"  # not exec: the EXIT trap removes the stand-in afterwards
    exit 0
fi
# shellcheck disable=SC2086
# -m overrides pyproject's addopts, which deselect the compile tier from a plain run.
python -m pytest -p no:cacheprovider -q -m "not gpu" ${SECOND_CUDNN_TESTS:-tests/test_cudnn_lowering.py tests/test_cudnn_compile.py tests/test_defect_rules.py}
