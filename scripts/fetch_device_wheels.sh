#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks, into .whl/ (git-ignored).
#
# The lent GPU machine (NVIDIA H200) runs Python 3.12 with torch 2.11 + CUDA 13 + cuDNN 9
# (nvidia-cudnn-cu13) and the usual scientific stack, but has no registry access, no
# lightning-thunder and no nvidia-cudnn-frontend. Its package list is in the device tool's
# KINDS.md. We fetch Python 3.12 / manylinux x86_64 wheels with --no-deps and name every
# dependency the image lacks ourselves:
#
#   lightning-thunder 0.2.6  Requires-Dist: torch, looseversion==1.3.0, lightning-utilities,
#                            numpy, networkx, optree, opt_einsum, mpmath<1.4, dill
#                            -> the image lacks looseversion, optree and dill
#   nvidia-cudnn-frontend 1.32.0  Requires-Dist: nvidia-cutlass-dsl[cu13], apache-tvm-ffi
#                            -> apache-tvm-ffi is small and carried; nvidia-cutlass-dsl (hundreds
#                               of MB) is NOT: `import cudnn`, `cudnn.pygraph` SDPA graphs and
#                               `import thunder` all work without it (checked with the modules
#                               blocked); only the CuTe-DSL kernels (cudnn.experimental etc.) need it.
#   optree 0.20.0 / apache-tvm-ffi: typing-extensions (on the image).
#
# Versions are pinned to what the CPU venv tests (constraints/ci.txt and .venv), so the GPU
# run exercises the same code. Exactly one version of each wheel is kept (two versions of
# one package stop the whole `pip install --no-index` there).
#
#   usage: scripts/fetch_device_wheels.sh [DIR]      (default: .whl in the repo root)
#   env:   PYTHON (default python3) runs `pip download`; any Python version works here.
# Then call the device tool with carry [".whl"] and `bash scripts/gpu_check.sh` (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-python3}

WHEELS=(
  lightning-thunder==0.2.6
  nvidia-cudnn-frontend==1.32.0
  looseversion==1.3.0
  optree==0.20.0
  dill==0.4.1
  apache-tvm-ffi==0.1.15.post2
)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/device-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# pip matches manylinux_2_N exactly, so name every N the wheels above are built for.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" "${WHEELS[@]}" \
  2> >(grep -v "is ignored" >&2)

# One wheel per requested package, or stop before touching $dir.
count=$(find "$tmp" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels, got $count:" >&2
  ls -la "$tmp" >&2
  exit 1
fi

# Replace the old set (stale versions would make two of one package).
mkdir -p "$dir"
rm -f "$dir"/*.whl
mv "$tmp"/*.whl "$dir"/

ls -la "$dir"
bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "total: $bytes bytes (~${mib} MiB) in $dir; the device tool carries at most 64 MiB with the working tree"
if [ "$mib" -gt 48 ]; then
  echo "warning: the wheels leave less than 16 MiB for the working tree" >&2
fi
