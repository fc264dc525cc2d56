#!/usr/bin/env bash
# The one script to run on the lent GPU machine (see docs/gpu.md). Steps, in order of what a short or cut-off
# run must not lose; after every step the summary is rewritten and every result packed, so a run cut off at
# any point still returns its summary and logs in a handful of files:
#
#   1. install   the carried wheels (.whl/) into $GPU_CHECK_SITE
#      env       versions, GPU, driver; FAILS FAST (stops the script, with the summary) on an executor problem
#                (cudnn_safe_ex.runtime.environment_problem()), an unexpected libcudnn (cudnn.backend_version()
#                differing from torch.backends.cudnn.version() or from GPU_CHECK_EXPECT_CUDNN), two different
#                libcudnn files loaded in one process (/proc/self/maps after one tiny cuDNN graph), or that tiny
#                graph failing: not run on cuDNN (no build, or a fallback), an exception, or an error to float64
#                beyond the accuracy rule (thunder_cudnn_safe.testing.assert_close_to_reference)
#   2. smoke     tests/test_gpu_smoke.py (under a minute): asserts cuDNN really ran (graphs built, no fallback),
#                for the diffusers layout, a packed-sequence step, a CUDA-graph capture and two threads, each
#                thread on its own CUDA stream
#   3. defects   the gpu-marked tests of tests/test_defect_rules.py (cuDNN's known silent defects)
#   4. sanitizer whether compute-sanitizer (memcheck) can run a CUDA program here; if not, step 4 runs plain
#      packed    tests/test_packed_sequences.py    } the code that has never run on a GPU, each under
#      streams   tests/test_streams.py             } compute-sanitizer --tool memcheck where it works,
#      threads   tests/test_threads.py             } each with its own timeout
#      capture   -k "capture or cuda_graph" over tests/
#   5. rest      the other gpu-marked tests (the layout zoo, GQA, ThunderFX, distributed, upstream/...)
#      patch     upstream/cudnn_sdpa.patch applies to the carried thunder and compiles
#      design    scripts/probe_design_questions.py (a bf16 sink token; the dK/dV rows of padded keys: issue 48)
#      probe     scripts/probe_builtin_cudnn.py (thunder's built-in cuDNN executor with this frontend)
#      bench     python3 -m benchmarks.run --suite gpu: only when asked (GPU_CHECK_BENCH=1, with a larger budget)
#   then the summary: scripts/gpu_check_report.py writes summary.md and packs the rest into rest.tar.gz.
#
#   device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=360)
#   here:        GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   (no GPU: CUDA work skipped; every step's test
#                selection is collected, the smoke test's assertions printed, the smoke test and the gpu tests
#                of six feature files run emulated: step `emulated`, last, 200 s beyond the budget)
#
# Every step is guarded (one failing does not stop the others; only the environment check stops the run) and
# has its own timeout, drawn from one budget so that the whole script, summary included, ends within
# GPU_CHECK_BUDGET_S seconds (default 330: a lent GPU gives about 15 minutes in all, the machine's start of 1-4
# minutes and a rerun included). A timed-out step is interrupted (SIGINT: pytest still writes its JUnit XML and
# summary), then killed. Steps write their results to a work folder; after every step $OUT gets summary.md,
# gpu-tests.xml (every step's JUnit XML), env.json and rest.tar.gz (every log and result), rewritten whole, beside
# gpu_check.log (the console): five files.
#
# Environment:
#   OUT                    where results go (set by the device tool; here default: a new /tmp dir)
#   GPU_CHECK_BUDGET_S     total seconds for all steps and the summary (default 330)
#   GPU_CHECK_BENCH=1      run the benchmark step too (raise GPU_CHECK_BUDGET_S and the call's timeout_s for it)
#   GPU_CHECK_DRY_RUN=1    rehearsal without a GPU: steps run, CUDA-only work is skipped, tests are collected
#   GPU_CHECK_PYTHON       interpreter (default python3: on the GPU machine the one with torch)
#   GPU_CHECK_SITE         where the wheels are installed (default /tmp/site)
#   GPU_CHECK_EXPECT_CUDNN the libcudnn version the run must load (91900 or 9.19.0); unset: torch's
#   GPU_CHECK_SKIP         space-separated steps to skip: install env smoke defects sanitizer packed streams
#                          threads capture rest patch design probe bench (and emulated, which only dry runs have);
#                          skipping sanitizer runs step 4 with plain pytest
#   GPU_CHECK_PYTEST_ARGS  extra pytest arguments for every test step (e.g. "-x"; a -k replaces the step's own)
#   GPU_CHECK_BENCH_ARGS   extra `python3 -m benchmarks.run` arguments
# shellcheck disable=SC2317  # the step functions are called indirectly, through run_step
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${GPU_CHECK_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-330}
SKIP=" ${GPU_CHECK_SKIP:-} "
SUMMARY_S=25 # kept out of every step's timeout for the final summary
KILL_S=10    # after a timeout's SIGINT, how long a step has to write its results before SIGKILL
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_out.XXXXXX")
fi
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")
RES=$WORK/results # every step's logs and results; packed into $OUT after each step
mkdir -p "$RES"
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

elapsed() { echo $(($(date +%s) - START)); }

# step_timeout CAP RESERVE: seconds this step may take, leaving RESERVE for later steps (and the summary).
step_timeout() {
  local cap=$1 reserve=$2 left
  left=$((BUDGET - $(elapsed) - reserve - SUMMARY_S - KILL_S))
  if [ "$left" -lt "$cap" ]; then echo "$left"; else echo "$cap"; fi
}

# record NAME STATUS RC SECONDS NOTE
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$STEPS"; }

# step_note TEXT: a note for the current step's row in the summary (a step function calls it).
step_note() { printf '%s; ' "$*" >>"$WORK/note.${STEP_NAME:-none}"; }

report() { # report SECONDS [--quiet]: summary.md, gpu-tests.xml, env.json and rest.tar.gz in $OUT from $RES
  timeout -k 5 "$1" "$PY" scripts/gpu_check_report.py --out "$OUT" --results "$RES" --steps "$STEPS" "${@:2}"
}

# run_step NAME CAP RESERVE CMD...: run CMD under timeout, record the outcome, never fail.
run_step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local t t0 rc status note
  if [[ "$SKIP" == *" $name "* ]]; then
    echo "== [$name] skipped (GPU_CHECK_SKIP)"
    record "$name" skipped - 0 "GPU_CHECK_SKIP"
    return 0
  fi
  t=$(step_timeout "$cap" "$reserve")
  if [ "$t" -lt 5 ]; then
    echo "== [$name] skipped: no time left in the ${BUDGET}s budget"
    record "$name" skipped - 0 "no time left"
    return 0
  fi
  echo
  echo "== [$name] start at +$(elapsed)s, timeout ${t}s"
  t0=$(date +%s)
  # timeout runs programs, not shell functions: run the step in a child bash that gets the exported
  # functions and variables. On timeout it sends SIGINT to the child's whole process group (pytest then
  # writes its JUnit XML and summary; `tee -i` keeps the log), and SIGKILL KILL_S seconds later.
  STEP_NAME=$name STEP_TIMEOUT=$t timeout -s INT -k "$KILL_S" "$t" bash -c '"$@"' "$name" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  note=$(cat "$WORK/note.$name" 2>/dev/null)
  note=${note%; }
  echo
  echo "== [$name] $status (rc=$rc) in $(($(date +%s) - t0))s${note:+ ($note)}"
  record "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$note"
  # everything packed as of now, in case the run is cut off later
  if report 20 --quiet >/dev/null 2>&1; then echo "== [$name] results packed into $OUT"; else echo "== [$name] packing failed"; fi
  return 0
}

have_cuda() {
  [ "$DRY" = 1 ] && return 1
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

# finish RC: the summary (and packing), then exit.
finish() {
  echo
  echo "== [summary] at +$(elapsed)s"
  if ! report "$SUMMARY_S"; then
    echo "gpu_check_report.py failed; raw step records:"
    cat "$STEPS"
  fi
  echo "gpu_check.sh: done in $(elapsed)s; results in $OUT"
  rm -rf "$WORK"
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit "$1"
}

export ROOT PY SITE DRY BUDGET OUT WORK RES START SUMMARY_S KILL_S
export -f elapsed step_timeout have_cuda step_note

echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), OUT=$OUT, dry_run=$DRY"
echo "budget: ${BUDGET}s for every step and the summary (GPU_CHECK_BUDGET_S; default 330: device call timeout_s=360)"
echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed paths)"
if [ "${GPU_CHECK_BENCH:-0}" = 1 ]; then BENCH_ORDER="bench"; else BENCH_ORDER="(bench: not asked, GPU_CHECK_BENCH=1)"; fi
[ "$DRY" = 1 ] && BENCH_ORDER="$BENCH_ORDER | emulated (dry run only, 200 s beyond the budget)"
echo "order: install env | smoke | defects | sanitizer packed streams threads capture | rest patch design probe $BENCH_ORDER | summary"

# gpu_pytest NAME PER_TEST_S SANITIZE ARGS...: the gpu-marked tests ARGS select; log and JUnit XML in $RES
# (gpu-NAME.log, gpu-NAME.xml). SANITIZE=1: under compute-sanitizer where the sanitizer step found it works.
# A dry run collects the same selection instead (a broken import shows up here, not on the GPU).
gpu_pytest() {
  local name=$1 per_test=$2 sanitize=$3
  shift 3
  local args=(-m gpu -p no:cacheprovider -n 0 "$@") runner=()
  # shellcheck disable=SC2206  # word splitting of the user's extra args is intended
  [ -n "${GPU_CHECK_PYTEST_ARGS:-}" ] && args+=(${GPU_CHECK_PYTEST_ARGS})
  if [ "$DRY" = 1 ]; then
    echo "dry run: collecting this step's selection: python3 -m pytest ${args[*]}"
    step_note "dry run: collected only"
    "$PY" -m pytest "${args[@]}" --collect-only -q 2>&1 | tee -i "$RES/gpu-$name.log"
    return "${PIPESTATUS[0]}"
  fi
  if [ "$sanitize" = 1 ] && [ -s "$WORK/sanitizer" ]; then
    read -r -a runner <"$WORK/sanitizer"
    per_test=$((per_test * 3))
    step_note "under ${runner[*]}"
  elif [ "$sanitize" = 1 ]; then
    step_note "plain pytest (no working compute-sanitizer)"
  fi
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    local left=$((${STEP_TIMEOUT:-600} - 10))
    [ "$left" -lt "$per_test" ] && per_test=$left
    [ "$per_test" -lt 10 ] && per_test=10
    args+=(--timeout "$per_test")
  fi
  # -v: one line per test as it ends, so a step cut off by its timeout still shows what ran.
  echo "${runner[*]}${runner[*]:+ }python3 -m pytest ${args[*]} -v -rA"
  "${runner[@]}" "$PY" -m pytest "${args[@]}" -v -rA --durations=10 --junitxml="$RES/gpu-$name.xml" 2>&1 |
    tee -i "$RES/gpu-$name.log"
  return "${PIPESTATUS[0]}"
}
export -f gpu_pytest

# == 1. install the carried wheels, then the environment (fail fast) ==================================
install_wheels() {
  shopt -s nullglob
  local wheels=("$ROOT"/.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .whl/: run scripts/fetch_device_wheels.sh here and carry .whl"
    step_note "no wheels in .whl/"
    return 1
  fi
  printf '  %s\n' "${wheels[@]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    2> >(grep -v "is ignored" >&2)
}
export -f install_wheels
run_step install 60 230 install_wheels

env_info() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv || true
    nvidia-smi | head -20 || true
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" - "$RES/env.json" "$WORK/env_fatal" <<'PYEOF'
"""The environment, and the verdicts that stop the run: an executor problem, an unexpected libcudnn, two libcudnn."""
import json, os, platform, sys, traceback

out_path, fatal_path = sys.argv[1], sys.argv[2]
info = {"python": platform.python_version(), "executable": sys.executable}
fatal = []  # reasons to stop the whole run


def version_number(text):  # "9.19.0" or "91900" -> 91900
    text = str(text).strip()
    if "." in text:
        parts = [int(p) for p in text.split(".")] + [0, 0]
        return parts[0] * 10000 + parts[1] * 100 + parts[2]
    return int(text)


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
    fatal.append("torch does not import")
try:
    import cudnn
    info["frontend"] = getattr(cudnn, "__version__", None)
    info["frontend_path"] = cudnn.__file__
    info["cudnn_backend"] = int(cudnn.backend_version())
except Exception as exc:
    info["frontend_error"] = f"{type(exc).__name__}: {exc}"
try:
    import thunder_cudnn_safe as tcs  # before thunder: the compat steps
    import thunder
    info.update(thunder=thunder.__version__, thunder_path=thunder.__file__, thunder_cudnn_safe=tcs.__version__,
                frontend_status={k: getattr(tcs.FRONTEND, k, None) for k in
                                 ("frontend_version", "backend_version", "frontend_problem", "backend_problem")},
                executor_problem=tcs.cudnn_safe_ex.runtime.environment_problem(),
                default_executors=[ex.name for ex in thunder.get_default_executors()])
    if info["executor_problem"] is not None:
        fatal.append(f"executor problem: {info['executor_problem']}")
except Exception:
    info["package_error"] = traceback.format_exc(limit=3)
    fatal.append("thunder_cudnn_safe or thunder does not import (were the wheels installed?)")
    tcs = None

# -- which libcudnn: torch's and the frontend's must be one, and the expected one
torch_v, backend_v = info.get("torch_cudnn"), info.get("cudnn_backend")
if backend_v is not None or torch_v is not None:
    if torch_v != backend_v:
        fatal.append(f"unexpected libcudnn: the frontend loaded {backend_v}, torch reports {torch_v}")
    expect = os.environ.get("GPU_CHECK_EXPECT_CUDNN", "").strip()
    if expect:
        info["expected_cudnn"] = version_number(expect)
        if backend_v != info["expected_cudnn"]:
            fatal.append(f"unexpected libcudnn: loaded {backend_v}, GPU_CHECK_EXPECT_CUDNN={expect}")

# -- one tiny cuDNN graph (and one torch cuDNN convolution), then which libcudnn files this process maps
if tcs is not None and info.get("executor_problem") is None and info.get("cuda_available"):
    try:
        import torch.nn.functional as F
        x = torch.randn(1, 8, 16, 16, device="cuda", dtype=torch.bfloat16)
        F.conv2d(x, torch.randn(8, 8, 3, 3, device="cuda", dtype=torch.bfloat16))  # torch's own cuDNN
        q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        before = tcs.cache_info()
        out = tcs.cudnn_safe_ex.dispatcher.forward(q, k, v, None, 0.0, False, need_stats=False)[0]
        torch.cuda.synchronize()
        after = tcs.cache_info()
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        info["tiny_graph"] = {"builds": after.builds - before.builds, "fallbacks": after.fallbacks - before.fallbacks,
                              "max_abs_error_vs_float64": float((out.double() - ref).abs().max())}
        if after.fallbacks != before.fallbacks or after.builds == before.builds:
            info["tiny_graph"]["problem"] = "it did not run on cuDNN (no graph built, or a fallback)"
        else:  # the package's accuracy rule: at most twice eager bf16's error to the float64 reference
            from thunder_cudnn_safe.testing import assert_close_to_reference
            try:
                assert_close_to_reference(out, F.scaled_dot_product_attention(q, k, v), ref, "its output")
            except AssertionError as exc:
                info["tiny_graph"]["problem"] = str(exc)
    except Exception as exc:
        info["tiny_graph"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    tiny = info["tiny_graph"]
    if "problem" in tiny or "error" in tiny:  # the first cuDNN graph wrong: nothing later can be trusted
        fatal.append(f"the tiny cuDNN graph failed: {tiny.get('problem') or tiny.get('error')}")
try:
    libs = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if "/libcudnn" in path:
                path = os.path.realpath(path.removesuffix(" (deleted)"))
                libs.setdefault(os.path.basename(path).split(".so")[0], set()).add(path)
    info["libcudnn_loaded"] = {kind: sorted(paths) for kind, paths in sorted(libs.items())}
    twice = {kind: sorted(paths) for kind, paths in libs.items() if len(paths) > 1}
    if twice:
        fatal.append(f"two different libcudnn files loaded in one process: {twice}")
except OSError as exc:
    info["libcudnn_loaded"] = f"unreadable /proc/self/maps: {exc}"

try:  # the real device's descriptor, to replace the hand-written one in thunder_cudnn_safe.runtimes.aot.DEVICES
    import torch, cudnn
    if torch.cuda.is_available():
        props = cudnn.create_device_properties(0).serialize()
        props = bytes(props).decode() if isinstance(props, (bytes, list)) else str(props)
        open(os.path.join(os.path.dirname(out_path), "device_properties.json"), "w").write(props + "\n")
        info["device_properties"] = "device_properties.json"
except Exception as exc:
    info["device_properties_error"] = f"{type(exc).__name__}: {exc}"
for name in ("pytest", "hypothesis", "pytest_benchmark", "pytest_timeout", "matplotlib", "numpy"):
    try:
        mod = __import__(name)
        info.setdefault("packages", {})[name] = getattr(mod, "__version__", "?")
    except Exception:
        info.setdefault("packages", {})[name] = None
info["fatal"] = fatal
text = json.dumps(info, indent=1, default=str)
print(text)
open(out_path, "w").write(text + "\n")
if fatal:
    open(fatal_path, "w").write("\n".join(fatal) + "\n")
    print("ENVIRONMENT PROBLEM:\n  " + "\n  ".join(fatal))
    sys.exit(3)
print("RESULT: one libcudnn, the expected version, and the executor can run")
PYEOF
  local rc=$?
  if [ -s "$WORK/env_fatal" ]; then step_note "STOP: $(paste -sd ';' "$WORK/env_fatal" | tr '\t|' '  ')"; fi
  return "$rc"
}
export -f env_info
run_step env 60 210 env_info
if [ -s "$WORK/env_fatal" ]; then
  if [ "$DRY" = 1 ]; then
    echo "== [env] dry run: the environment check found (a real run would STOP here):"
    sed 's/^/     /' "$WORK/env_fatal"
  else
    echo
    echo "== STOP: the environment check failed; no test can show anything about cuDNN here:"
    sed 's/^/     /' "$WORK/env_fatal"
    record stopped "not run" - 0 "every later step: $(paste -sd ';' "$WORK/env_fatal" | tr '\t|' '  ')"
    finish 3
  fi
fi

# == 2. the smoke test: cuDNN really ran (at most a minute) ============================================
smoke_tests() {
  if [ "$DRY" = 1 ]; then
    echo "what the smoke test asserts (tests/test_gpu_smoke.py):"
    "$PY" - tests/test_gpu_smoke.py <<'PYEOF'
import ast, sys
for node in ast.parse(open(sys.argv[1]).read()).body:  # in file order, without importing the module
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
        doc = (ast.get_docstring(node) or "(no docstring)").split("\n\n")[0]
        print(f"  {node.name}:\n      " + " ".join(doc.split()))
PYEOF
  fi
  gpu_pytest smoke 60 0 tests/test_gpu_smoke.py
}
export -f smoke_tests
run_step smoke 60 190 smoke_tests

# == 3. the regression tests for cuDNN's known silent defects, before the slow memcheck steps ============
run_step defects 90 140 gpu_pytest defects 60 0 tests/test_defect_rules.py

# == 4. the code that has never run on a GPU, under compute-sanitizer where it works ===================
sanitizer_check() {
  local cmd=(compute-sanitizer --tool memcheck --error-exitcode 86 --report-api-errors no --print-limit 50) rc
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer: not on PATH; packed, streams, threads and capture run with plain pytest"
    step_note "not found: plain pytest"
    return 0
  fi
  echo "$(command -v compute-sanitizer): $(compute-sanitizer --version 2>&1 | tail -1)"
  if ! have_cuda; then
    echo "no CUDA (or dry run): not tried; step 4 would run under: ${cmd[*]}"
    step_note "not tried (no CUDA)"
    return 0
  fi
  # On some runtimes (gVisor) it refuses the device ("Device not supported", error 999 at the first allocation).
  "${cmd[@]}" "$PY" -c 'import torch; x = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize(); print("memcheck probe:", float(x.sum()))'
  rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "${cmd[*]}" >"$WORK/sanitizer"
    echo "RESULT: packed, streams, threads and capture run under ${cmd[*]}"
    step_note "memcheck works"
    return 0
  fi
  echo "RESULT: compute-sanitizer could not run a CUDA program here (rc=$rc): step 4 runs plain pytest"
  step_note "memcheck failed (rc=$rc): plain pytest"
  return 1
}
export -f sanitizer_check
run_step sanitizer 30 130 sanitizer_check

# The packed file's timing test means nothing under memcheck: with the sanitizer it moves to `rest`.
TIMING_K=timing
if [ -s "$WORK/sanitizer" ]; then
  PACKED_K=(-k "not $TIMING_K")
  REST_PACKED="not (test_packed_sequences and not $TIMING_K)"
else
  PACKED_K=()
  REST_PACKED="not test_packed_sequences"
fi
run_step packed 60 100 gpu_pytest packed 60 1 tests/test_packed_sequences.py "${PACKED_K[@]}"
run_step streams 30 85 gpu_pytest streams 30 1 tests/test_streams.py
run_step threads 30 70 gpu_pytest threads 30 1 tests/test_threads.py
run_step capture 45 55 gpu_pytest capture 45 1 tests/ -k "capture or cuda_graph" --ignore=tests/test_gpu_smoke.py \
  --continue-on-collection-errors

# == 5. the rest of the gpu-marked tests, the patch, the probe, the benchmarks ========================
rest_tests() {
  local paths=(tests/)
  [ -d upstream ] && paths+=(upstream/)
  # --continue-on-collection-errors: a test module that cannot be imported there (a package the image
  # lacks) must not stop the GPU tests of the other modules. What steps 2-4 ran is left out.
  gpu_pytest rest 120 0 "${paths[@]}" --continue-on-collection-errors \
    --ignore=tests/test_gpu_smoke.py --ignore=tests/test_streams.py --ignore=tests/test_threads.py \
    --ignore=tests/test_defect_rules.py -k "not (capture or cuda_graph) and $REST_PACKED"
}
export -f rest_tests
export REST_PACKED
run_step rest 120 45 rest_tests

# Dry run only: rehearse the GPU tests' own logic on CPU against the emulated runtime (same Python, same carried
# wheels; the emulation is not cuDNN): the smoke test, and the gpu-marked tests of the layout zoo, masks, the
# checker, the compile options, the attention block and dynamic shapes, each in its feature's file (-m gpu: without
# the conftest those files' CPU tests would lack their fixtures).
emulated_tests() {
  local files=(tests/test_gpu_smoke.py tests/test_support.py tests/test_accuracy_zoo.py tests/test_masks.py
    tests/test_parity.py tests/test_module_block.py tests/test_dynamic_shapes.py)
  THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 "$PY" -m pytest --noconftest -m gpu "${files[@]}" -v \
    -p no:cacheprovider -n 0 --show-capture=no -o log_level=WARNING -rf --junitxml="$RES/gpu-emulated.xml" 2>&1 |
    tee -i "$RES/gpu-emulated.log"
  return "${PIPESTATUS[0]}"
}
export -f emulated_tests

# -- the upstream patch still applies to the carried thunder (no GPU needed, seconds) --------------------
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
run_step patch 15 30 patch_check

# -- cuDNN's answers to the questions issue 48's last design changes wait on (data, not a verdict) --------
run_step design 30 0 "$PY" scripts/probe_design_questions.py --json "$RES/design_questions.json"

# -- what thunder's built-in cuDNN executor does with this frontend -------------------------------------
run_step probe 30 0 "$PY" scripts/probe_builtin_cudnn.py --json "$RES/builtin_cudnn_probe.json"

# -- the GPU benchmark suite ------------------------------------------------------------------------------
gpu_bench() {
  if [ ! -f benchmarks/run.py ] && [ ! -f benchmarks/run/__main__.py ]; then
    echo "benchmarks/run.py: not in this tree"
    return 1
  fi
  if ! have_cuda; then
    echo "no CUDA (or dry run): the gpu suite needs a GPU; checking the CLI only"
    "$PY" -m benchmarks.run --help
    return $?
  fi
  # Size the run to the time this step has: pass the CLI's time-budget flag (benchmarks.run
  # has --gpu-budget: stop starting new configs after N s) and its --quick flag (the
  # headline sequence lengths with fewer repetitions), whichever it has.
  local t=${STEP_TIMEOUT:-200} help flag flags=()
  help=$("$PY" -m benchmarks.run --help 2>&1)
  has_flag() { grep -qE -- "(^|[^-[:alnum:]])$1([^-[:alnum:]]|\$)" <<<"$help"; }
  for flag in --gpu-budget --budget-s --time-budget --budget; do
    if has_flag "$flag"; then
      flags+=("$flag" $((t > 90 ? t - 45 : t / 2)))
      break
    fi
  done
  if has_flag --quick; then flags+=(--quick); fi
  # shellcheck disable=SC2206  # word splitting of the user's extra args is intended
  [ -n "${GPU_CHECK_BENCH_ARGS:-}" ] && flags+=(${GPU_CHECK_BENCH_ARGS})
  echo "python3 -m benchmarks.run --suite gpu --out $RES/bench ${flags[*]}"
  "$PY" -m benchmarks.run --suite gpu --out "$RES/bench" "${flags[@]}"
}
export -f gpu_bench
if [ "${GPU_CHECK_BENCH:-0}" = 1 ]; then
  run_step bench 270 0 gpu_bench
else
  echo "== [bench] skipped: not asked (GPU_CHECK_BENCH=1, with a larger GPU_CHECK_BUDGET_S)"
  record bench skipped - 0 "not asked (GPU_CHECK_BENCH=1)"
fi

# Dry run only, last: the rehearsal on CPU gets its 200 s on top of the budget (no device time is spent here).
if [ "$DRY" = 1 ]; then BUDGET=$((BUDGET + 200)) run_step emulated 200 0 emulated_tests; fi

# -- summary, and keep $OUT within what comes back ----------------------------------------------------------
finish 0
