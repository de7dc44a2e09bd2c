#!/usr/bin/env bash
# Device check (design.md, test tiers): on a machine with a CUDA GPU, build for sm_90, run the
# gpu test tier and the GPU benchmarks, and write benchmarks/results/<date>-<gpu>.md with a JSON
# beside it holding every step's command, exit status, time and output.
#
#   bash benchmarks/device_check.sh                       # repository root; at most ~6 minutes
#   DK_DEVICE_CHECK_DRY=1 bash benchmarks/device_check.sh # the plumbing only, with stand-ins
#
# Time: every step has a limit and the limits add up to the budget (DK_CHECK_BUDGET_S, default
# 360 s; another budget scales every limit alike), so the whole check fits one 10-minute device
# command with room for a rerun. A step also never runs past what is left of the budget.
#
# Installs nothing and needs no network: it builds from this checkout with what is installed
# (python3 with torch (CUDA build), pybind11, cmake, ninja, pytest, pytest-timeout; NCCL from the
# nvidia-nccl wheel that torch uses, or DK_NCCL_LIBRARY). Exits non-zero if any step fails; a
# benchmark that does not exist yet is reported as "missing", not as a failure; after a failed
# build the steps that need it are "skipped" (and the check fails), so no time is spent on them.
#
# Output as it goes: with $OUT set (the device tool's output folder) the log is written there
# line by line and the report (.md and .json) after every step, so a check stopped by its time
# limit still returns what ran; pytest's JUnit XML and the benchmarks' JSON rows go there too
# (at most 6 files: the device tool returns 8). At the end the report also goes to
# benchmarks/results/.
#
# Knobs: PYTHON (default python3), DK_CUDA_ARCHS (default 90), DK_CHECK_BUDGET_S,
# DK_BENCH_ARGS (replace the short default sweep of python -m dist_kernels.bench),
# DK_KERNEL_BENCH_ARGS (for bench_kernels.py), DK_CHECK_RESULTS_DIR (default benchmarks/results;
# a dry run writes none unless it is set). Dry run only: DK_DEVICE_CHECK_DRY_FAIL=STEP and
# DK_DEVICE_CHECK_DRY_HANG=STEP make that step's stand-in fail or hang (tests/test_device_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DRY=${DK_DEVICE_CHECK_DRY:-0}
# cmake and ninja come as pip packages beside the interpreter; nvcc from the CUDA toolkit.
PATH="$(dirname "$(command -v "$PY" || echo /usr/bin/python3)"):$PATH"
command -v nvcc >/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && PATH="/usr/local/cuda/bin:$PATH"; }
export PATH
export DK_CUDA_ARCHS=${DK_CUDA_ARCHS:-90}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} # NCCL says why it fails, and nothing more

# Step limits in seconds at the reference budget; they add up to it (checked below).
REFERENCE_BUDGET=360
STEP_ORDER=(precheck driver toolchain device build info gpu_tests bench_ws1 bench_ws2 bench_kernels)
declare -A LIMIT=(
  [precheck]=5 [driver]=10 [toolchain]=10 [device]=20 [build]=90 [info]=15
  [gpu_tests]=120 [bench_ws1]=25 [bench_ws2]=40 [bench_kernels]=25
)
BUDGET=${DK_CHECK_BUDGET_S:-$REFERENCE_BUDGET}
total=0
for name in "${STEP_ORDER[@]}"; do total=$((total + LIMIT[$name])); done
((total == REFERENCE_BUDGET)) || {
  echo "device_check.sh: step limits add up to ${total}s, not ${REFERENCE_BUDGET}s" >&2
  exit 2
}
# limit_of NAME: the step's limit scaled to the budget (at least 1 s).
limit_of() {
  local scaled=$((LIMIT[$1] * BUDGET / REFERENCE_BUDGET))
  echo $((scaled < 1 ? 1 : scaled))
}

START=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPORT_DIRS=()
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  REPORT_DIRS+=("$OUT")
  LOG=$OUT/device_check.log
else
  LOG=$WORK/device_check.log
fi
: >"$LOG"
if [ "$DRY" = 1 ]; then
  RESULTS_DIR=${DK_CHECK_RESULTS_DIR:-}
else
  RESULTS_DIR=${DK_CHECK_RESULTS_DIR:-benchmarks/results}
fi
STEPS=$WORK/steps.tsv # name, status, rc, seconds, limit, log file, command
: >"$STEPS"
FAILED=0
GPU=unknown-gpu
[ "$DRY" = 1 ] && GPU=dry-run

elapsed() { echo $(($(date +%s) - START)); }
log() { echo "$*" | tee -a "$LOG"; }

# report FINAL DIR...: the .md and .json from the steps so far (benchmarks/device_check_report.py).
report() {
  local final=$1
  shift
  (($# == 0)) && return 0
  "$PY" benchmarks/device_check_report.py "$STEPS" "$GPU" "$BUDGET" "$(elapsed)" "$final" "$@" \
    >/dev/null || log "device_check_report.py failed (rc $?)"
}

# record NAME STATUS RC SECONDS LIMIT LOGFILE COMMAND: one line of steps.tsv, then the report.
record() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STEPS"
  [ "$2" = ok ] || [ "$2" = missing ] || FAILED=1
  report 0 "${REPORT_DIRS[@]}"
}

# stand_in NAME: what a dry run executes instead of the step's command.
stand_in() {
  if [ "${DK_DEVICE_CHECK_DRY_HANG:-}" = "$1" ]; then
    echo "sleep 3600"
  elif [ "${DK_DEVICE_CHECK_DRY_FAIL:-}" = "$1" ]; then
    echo "exit 3"
  else
    echo "true"
  fi
}

# step NAME COMMAND...: runs COMMAND with the step's limit (capped by the budget left), logs its
# output, and records the outcome: ok, failed or timeout. Reads stdin from the caller (heredocs).
step() {
  local name=$1
  shift
  local limit left out=$WORK/$name.log t0 rc status
  limit=$(limit_of "$name")
  left=$((BUDGET - $(elapsed)))
  ((left < limit)) && limit=$left
  log "== [$(elapsed)s] $name (limit ${limit}s): $*"
  if ((limit <= 0)); then
    echo "no time left in the ${BUDGET}s budget" | tee "$out" -a "$LOG"
    record "$name" timeout 124 0 0 "$out" "$*"
    return 1
  fi
  t0=$(date +%s)
  if [ "$DRY" = 1 ]; then
    echo "dry run: stand-in for: $*" >"$out"
    timeout --kill-after=2 "$limit" bash -c "$(stand_in "$name")" >>"$out" 2>&1 </dev/null
    rc=$?
    cat "$out" >>"$LOG"
  else
    # Output reaches the log as it comes (tee), so a killed check keeps what the step printed.
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out" >>"$LOG"
    rc=${PIPESTATUS[0]}
  fi
  tail -n 25 "$out"
  status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  log "-- $name: $status (rc $rc, $(($(date +%s) - t0))s)"
  record "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" "$out" "$*"
  return "$rc"
}

# missing NAME WHY: a benchmark that is not in this checkout yet (not a failure).
missing() {
  log "== $1: missing ($2)"
  echo "$2" >"$WORK/$1.log"
  record "$1" missing 0 0 0 "$WORK/$1.log" "$2"
}

# skip NAME WHY: a step not run because one it needs failed (the check fails).
skip() {
  log "== $1: skipped ($2)"
  echo "$2" >"$WORK/$1.log"
  record "$1" skipped 0 0 0 "$WORK/$1.log" "$2"
}

# Two ranks on one GPU through NCCL's socket transport (design.md): a different NCCL_HOSTID per
# process makes NCCL see two nodes and skip its duplicate-GPU check.
cat >"$WORK/rank_env.sh" <<'SH'
#!/usr/bin/env bash
export NCCL_HOSTID=dk-check-host-${LOCAL_RANK:-${RANK:-0}}
exec "$@"
SH
chmod +x "$WORK/rank_env.sh"
TWO_RANK_ENV=(env NCCL_NET=Socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
# The default sweep: 8 B to 16 MiB by x8 (8 sizes), 20 timed iterations at most: seconds per
# world size even over loopback sockets (~4 ms a message), against the full sweep's minutes.
BENCH_SWEEP=${DK_BENCH_ARGS:--b 8 -e 16M -f 8 --iters 20 --warmup 3 --timeout 20}
log "device check: budget ${BUDGET}s, dry run ${DRY}, python $PY, NCCL_DEBUG=$NCCL_DEBUG"

# 0. One second: what the build needs (Python.h for this interpreter, the tools).
step precheck "$PY" - <<'PYEOF'
import os, shutil, sys, sysconfig
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
print(sys.executable, sys.version.split()[0], header)
missing = [] if os.path.isfile(header) else [f"{header} (the Python headers: no build possible)"]
missing += [f"{tool} on PATH" for tool in ("nvcc", "cmake", "ninja") if not shutil.which(tool)]
sys.exit("missing: " + "; ".join(missing) if missing else 0)
PYEOF
PRECHECK=$?

# 1. What the machine has.
step driver nvidia-smi
if [ "$DRY" != 1 ]; then
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  GPU=${GPU:-unknown-gpu}
fi
step toolchain bash -c 'nvcc --version | tail -n 2; cmake --version | head -n 1; ninja --version'
step device "$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB")
# The ceiling for the kernels' GB/s: a device-to-device copy of 1 GiB (bytes read + written).
src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
dst.copy_(src)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    dst.copy_(src)
end.record()
torch.cuda.synchronize()
seconds = start.elapsed_time(end) / 1e3 / 10
print(f"device copy: {2 * src.numel() / seconds / 1e9:.0f} GB/s (read + write, 1 GiB, mean of 10)")
PYEOF

# 2. Build for sm_90 in place (tools/dev_build.sh: no pip, nothing installed).
BUILT=1
if ((PRECHECK != 0)); then
  skip build "the precheck failed (see its output)"
  BUILT=0
else
  step build env PYTHON="$PY" DK_WITH_CUDA=1 DK_BUILD_JOBS="$(nproc)" tools/dev_build.sh || BUILT=0
fi
if ((BUILT)); then
  step info "$PY" - <<'PYEOF'
import json, dist_kernels
info = dist_kernels.build_info()
print(json.dumps(info, indent=2))
assert info["cuda_compiled"], "the build has no CUDA"
assert info["device_count"] > 0, "the extension sees no CUDA device"
assert info["nccl_version"], "NCCL was not found (set DK_NCCL_LIBRARY)"
from dist_kernels.comm import cuda as _cuda_comm
assert _cuda_comm.unavailable_reason() is None, _cuda_comm.unavailable_reason()
PYEOF
else
  skip info "the build failed"
fi

# 3. The gpu tier. Per-test timeout below the step's limit, so a hang still ends in pytest's
# summary (the 2-rank tests set the NCCL socket variables per rank themselves).
GPU_LIMIT=$(limit_of gpu_tests)
PYTEST_ARGS=(-q -m gpu -rs -p no:cacheprovider --durations=10 --timeout=$((GPU_LIMIT * 6 / 10)))
if "$PY" -c 'import inspect, pytest_timeout, sys; sys.exit("session_timeout" not in inspect.getsource(pytest_timeout))' 2>/dev/null; then
  PYTEST_ARGS+=(--session-timeout=$((GPU_LIMIT * 85 / 100)))
fi
[ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && PYTEST_ARGS+=(--junitxml="$OUT/gpu_tests.xml")
if ((BUILT)); then
  # DK_REQUIRE_GPU=1: the tier fails, rather than skips, where it cannot run here.
  step gpu_tests env DK_REQUIRE_GPU=1 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/
else
  skip gpu_tests "the build failed"
fi

# 4. Benchmarks: our collectives against NCCL at world size 1 (one rank) and 2 (two ranks on the
# one GPU over sockets); our kernels.
# Each benchmark's rows as JSON beside the report, where $OUT is set.
bench_json() { [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && echo "--json $OUT/$1.json"; }
if ((!BUILT)); then
  skip bench_ws1 "the build failed"
  skip bench_ws2 "the build failed"
elif [ "$DRY" = 1 ] || "$PY" -m dist_kernels.bench --help 2>&1 | grep -q -- "--device"; then
  # shellcheck disable=SC2086
  step bench_ws1 "$PY" -m dist_kernels.bench --device cuda --nproc 1 $BENCH_SWEEP \
    $(bench_json bench_ws1)
  # shellcheck disable=SC2086
  step bench_ws2 "${TWO_RANK_ENV[@]}" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node=2 --no-python "$WORK/rank_env.sh" "$PY" -m dist_kernels.bench --device cuda \
    $BENCH_SWEEP $(bench_json bench_ws2)
else
  missing bench_ws1 "dist_kernels.bench with a --device option is not in this checkout"
  missing bench_ws2 "dist_kernels.bench with a --device option is not in this checkout"
fi
if ((!BUILT)); then
  skip bench_kernels "the build failed"
elif [ -f benchmarks/bench_kernels.py ]; then
  # shellcheck disable=SC2086
  step bench_kernels "$PY" benchmarks/bench_kernels.py --device cuda \
    ${DK_KERNEL_BENCH_ARGS:---sizes 64MiB 256MiB --repeats 10}
else
  missing bench_kernels "benchmarks/bench_kernels.py is not in this checkout"
fi

# 5. The final report, also in benchmarks/results/ (commit it).
[ -n "$RESULTS_DIR" ] && REPORT_DIRS+=("$RESULTS_DIR")
report 1 "${REPORT_DIRS[@]}"
[ -n "$RESULTS_DIR" ] && log "wrote the report into $RESULTS_DIR"
log "steps: $(cut -f1,2 "$STEPS" | tr '\t\n' ': ')"
if ((FAILED)); then
  log "device check FAILED after $(elapsed)s"
  exit 1
fi
log "device check passed in $(elapsed)s"
