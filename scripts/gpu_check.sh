#!/usr/bin/env bash
# The one script to run on the lent GPU machine: install the carried wheels, print the
# environment, run the GPU-marked tests, probe thunder's built-in cuDNN executor, run the
# GPU benchmark suite, and leave a summary under $OUT. See docs/gpu.md.
#
#   device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
#   here:        GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   (no GPU: CUDA steps skip)
#
# Every step is guarded (one failing does not stop the others) and has its own timeout,
# drawn from one budget so the whole script ends within GPU_CHECK_BUDGET_S seconds
# (default 510, under the device call's timeout_s of 560). What comes back from $OUT is at
# most 8 files, 2 folders deep: the last step packs anything beyond that into one tarball.
#
# Environment:
#   OUT                  where results go (set by the device tool; here default: a new /tmp dir)
#   GPU_CHECK_BUDGET_S   total seconds for all steps (default 510)
#   GPU_CHECK_DRY_RUN=1  rehearsal without a GPU: steps run, CUDA-only work is skipped
#   GPU_CHECK_PYTHON     interpreter (default python3: on the GPU machine the one with torch)
#   GPU_CHECK_SITE       where the wheels are installed (default /tmp/site)
#   GPU_CHECK_SKIP       space-separated steps to skip: install defects env patch tests probe bench
#                        (and tests-emulated, which only dry runs have)
#   GPU_CHECK_PYTEST_ARGS  extra pytest arguments (e.g. "-k zoo")
#   GPU_CHECK_BENCH_ARGS   extra `python3 -m benchmarks.run` arguments
# shellcheck disable=SC2317  # the step functions are called indirectly, through run_step
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${GPU_CHECK_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-510}
SKIP=" ${GPU_CHECK_SKIP:-} "
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_out.XXXXXX")
fi
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")
STEPS=$WORK/steps.tsv
: >"$STEPS"
START=$(date +%s)

export PYTHONUNBUFFERED=1
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg
export THUNDER_CUDNN_SAFE_TEST_SEED=${THUNDER_CUDNN_SAFE_TEST_SEED:-1234}

# Everything printed goes to the console (the device tool's output_tail) and to one log.
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

elapsed() { echo $(( $(date +%s) - START )); }

# step_timeout CAP RESERVE: seconds this step may take, leaving RESERVE for later steps.
step_timeout() {
  local cap=$1 reserve=$2 left
  left=$(( BUDGET - $(elapsed) - reserve ))
  if [ "$left" -lt "$cap" ]; then echo "$left"; else echo "$cap"; fi
}

# record NAME STATUS RC SECONDS NOTE
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$STEPS"; }

# run_step NAME CAP RESERVE CMD...: run CMD under timeout, record the outcome, never fail.
run_step() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local t t0 rc status
  if [[ "$SKIP" == *" $name "* ]]; then
    echo "== [$name] skipped (GPU_CHECK_SKIP)"; record "$name" skipped - 0 "GPU_CHECK_SKIP"; return 0
  fi
  t=$(step_timeout "$cap" "$reserve")
  if [ "$t" -lt 5 ]; then
    echo "== [$name] skipped: no time left in the ${BUDGET}s budget"; record "$name" skipped - 0 "no time left"; return 0
  fi
  echo
  echo "== [$name] start at +$(elapsed)s, timeout ${t}s"
  t0=$(date +%s)
  # timeout runs programs, not shell functions: run the step in a child bash that gets
  # the exported functions and variables; timeout signals that child's whole group.
  timeout -k 10 "$t" bash -c '"$@"' "$name" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  echo
  echo "== [$name] $status (rc=$rc) in $(( $(date +%s) - t0 ))s"
  record "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))"
  return 0
}

have_cuda() {
  [ "$DRY" = 1 ] && return 1
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

export ROOT PY SITE DRY BUDGET OUT WORK START
export -f elapsed step_timeout have_cuda

echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), budget ${BUDGET}s, OUT=$OUT, dry_run=$DRY"
echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed paths)"

# -- 1. install the carried wheels ------------------------------------------------------
install_wheels() {
  shopt -s nullglob
  local wheels=("$ROOT"/.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .whl/: run scripts/fetch_device_wheels.sh here and carry .whl"; return 1
  fi
  printf '  %s\n' "${wheels[@]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    2> >(grep -v "is ignored" >&2)
}
export -f install_wheels
run_step install 120 60 install_wheels

# -- 1b. the first check: regression tests for cuDNN's known silent defects -------------------
# (tests/test_gpu_defects.py, docs/known-cudnn-defects.md): the public repros (NaN dQ at L=704, GQA
# decode steps, rows of very negative scores); the `tests` step below skips this file.
defect_tests() {
  local extra=()
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then extra+=(--timeout 120); fi
  "$PY" -m pytest -m gpu tests/test_gpu_defects.py -q -rA -p no:cacheprovider "${extra[@]}" 2>&1 |
    tee "$OUT/gpu-defects.log"
  return "${PIPESTATUS[0]}"
}
export -f defect_tests
run_step defects 120 330 defect_tests

# -- 2. environment -------------------------------------------------------------------------
env_info() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv || true
    nvidia-smi | head -20 || true
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" - "$OUT/env.json" <<'PYEOF'
import json, platform, sys, traceback
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                torch_cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count)
except Exception:
    info["torch_error"] = traceback.format_exc(limit=2)
try:
    import cudnn
    info["frontend"] = getattr(cudnn, "__version__", None)
    info["frontend_path"] = cudnn.__file__
    info["cudnn_backend"] = int(cudnn.backend_version())
except Exception as exc:
    info["frontend_error"] = f"{type(exc).__name__}: {exc}"
try:
    import thunder_cudnn_safe as tcs, thunder
    info.update(thunder=thunder.__version__, thunder_path=thunder.__file__, thunder_cudnn_safe=tcs.__version__,
                frontend_status={k: getattr(tcs.FRONTEND, k, None) for k in
                                 ("frontend_version", "backend_version", "frontend_problem", "backend_problem")},
                executor_problem=tcs.cudnn_safe_ex.runtime.environment_problem(),
                default_executors=[ex.name for ex in thunder.get_default_executors()])
except Exception:
    info["package_error"] = traceback.format_exc(limit=3)
try:  # the real device's descriptor, to replace the hand-written one in thunder_cudnn_safe.aot.DEVICES
    import os, torch, cudnn
    if torch.cuda.is_available():
        props = cudnn.create_device_properties(0).serialize()
        props = bytes(props).decode() if isinstance(props, (bytes, list)) else str(props)
        open(os.path.join(os.path.dirname(sys.argv[1]), "device_properties.json"), "w").write(props + "\n")
        info["device_properties"] = "device_properties.json"
except Exception as exc:
    info["device_properties_error"] = f"{type(exc).__name__}: {exc}"
for name in ("pytest", "hypothesis", "pytest_benchmark", "pytest_timeout", "matplotlib", "numpy"):
    try:
        mod = __import__(name)
        info.setdefault("packages", {})[name] = getattr(mod, "__version__", "?")
    except Exception:
        info.setdefault("packages", {})[name] = None
text = json.dumps(info, indent=1, default=str)
print(text)
open(sys.argv[1], "w").write(text + "\n")
sys.exit(1 if "package_error" in info or "frontend_error" in info or "torch_error" in info else 0)
PYEOF
}
export -f env_info
run_step env 90 60 env_info

# -- 3. the upstream patch still applies to the carried thunder ----------------------------
patch_check() {
  # On a copy of the carried thunder's file, with the standard tools (nothing installed is modified).
  local src work="$WORK/upstream_patch" patch_file="$PWD/upstream/cudnn_sdpa.patch"
  src=$("$PY" -c 'import importlib.util as u, pathlib as p; s = u.find_spec("thunder"); print(p.Path(list(s.submodule_search_locations)[0]) / "executors" / "cudnn_sdpa.py")') || return 1
  mkdir -p "$work/thunder/executors" && cp "$src" "$work/thunder/executors/cudnn_sdpa.py"
  echo "patching a copy of $src"
  if command -v git >/dev/null; then
    (cd "$work" && GIT_CEILING_DIRECTORIES="$work" git apply --verbose "$patch_file")
  else
    patch -d "$work" -p1 --fuzz=0 --no-backup-if-mismatch -i "$patch_file"
  fi && "$PY" -m py_compile "$work/thunder/executors/cudnn_sdpa.py" && echo "RESULT: applied and compiles"
}
export -f patch_check
run_step patch 60 60 patch_check

# -- 4. the GPU-marked tests ----------------------------------------------------------------
gpu_tests() {
  local paths=(tests/) extra=()
  [ -d upstream ] && paths+=(upstream/)
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then extra+=(--timeout 150); fi
  # shellcheck disable=SC2206  # word splitting of the user's extra args is intended
  [ -n "${GPU_CHECK_PYTEST_ARGS:-}" ] && extra+=(${GPU_CHECK_PYTEST_ARGS})
  echo "python3 -m pytest -m gpu ${paths[*]} -q -rA ${extra[*]}"
  # --continue-on-collection-errors: a test module that cannot be imported there (a
  # package the image lacks) must not stop the GPU tests of the other modules.
  "$PY" -m pytest -m gpu "${paths[@]}" -q -rA -p no:cacheprovider --durations=15 --continue-on-collection-errors \
    --ignore=tests/test_gpu_defects.py \
    --junitxml="$OUT/gpu-tests.xml" "${extra[@]}" 2>&1 | tee "$OUT/gpu-tests.log"
  return "${PIPESTATUS[0]}"
}
export -f gpu_tests
run_step tests 300 45 gpu_tests

# Dry run only: rehearse tests/test_gpu.py's own logic on CPU against the emulated runtime
# (same Python, same carried wheels; the emulation is not cuDNN).
emulated_tests() {
  THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 "$PY" -m pytest --noconftest tests/test_gpu.py -q -p no:cacheprovider \
    --show-capture=no -o log_level=WARNING
}
export -f emulated_tests
if [ "$DRY" = 1 ]; then run_step tests-emulated 200 45 emulated_tests; fi

# -- 5. what thunder's built-in cuDNN executor does with this frontend -----------------------
run_step probe 90 25 "$PY" scripts/probe_builtin_cudnn.py --json "$WORK/builtin_cudnn_probe.json"

# -- 6. the GPU benchmark suite ---------------------------------------------------------------
gpu_bench() {
  if [ ! -f benchmarks/run.py ] && [ ! -f benchmarks/run/__main__.py ]; then
    echo "benchmarks/run.py: not in this tree"; return 1
  fi
  if ! have_cuda; then
    echo "no CUDA (or dry run): the gpu suite needs a GPU; checking the CLI only"
    "$PY" -m benchmarks.run --help
    return $?
  fi
  # Size the run to the time this step has: pass the CLI's time-budget flag (benchmarks.run
  # has --gpu-budget: stop starting new configs after N s) and its --quick flag (the
  # headline sequence lengths with fewer repetitions), whichever it has.
  local t help flag flags=()
  t=$(step_timeout 270 20)
  help=$("$PY" -m benchmarks.run --help 2>&1)
  has_flag() { grep -qE -- "(^|[^-[:alnum:]])$1([^-[:alnum:]]|\$)" <<<"$help"; }
  for flag in --gpu-budget --budget-s --time-budget --budget; do
    if has_flag "$flag"; then flags+=("$flag" $(( t > 90 ? t - 45 : t / 2 ))); break; fi
  done
  if has_flag --quick; then flags+=(--quick); fi
  # shellcheck disable=SC2206  # word splitting of the user's extra args is intended
  [ -n "${GPU_CHECK_BENCH_ARGS:-}" ] && flags+=(${GPU_CHECK_BENCH_ARGS})
  echo "python3 -m benchmarks.run --suite gpu --out $OUT/bench ${flags[*]}"
  "$PY" -m benchmarks.run --suite gpu --out "$OUT/bench" "${flags[@]}"
}
export -f gpu_bench
run_step bench 270 20 gpu_bench

# -- 7. summary, and keep $OUT within what comes back -----------------------------------------
echo
echo "== [summary] at +$(elapsed)s"
if ! timeout -k 5 40 "$PY" scripts/gpu_check_report.py --out "$OUT" --work "$WORK" --steps "$STEPS"; then
  echo "gpu_check_report.py failed; raw step records:"
  cat "$STEPS"
fi
echo "gpu_check.sh: done in $(elapsed)s; results in $OUT"
rm -rf "$WORK"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit 0
