#!/usr/bin/env bash
# Device check (design.md, test tiers): on a machine with a CUDA GPU, build for sm_90, run the
# gpu test tier and the GPU benchmarks, and write benchmarks/results/<date>-<gpu>.md with a JSON
# beside it holding every step's command, exit status, time and output.
#
#   bash benchmarks/device_check.sh                       # repository root; at most 8 minutes
#   DK_DEVICE_CHECK_DRY=1 bash benchmarks/device_check.sh # the plumbing only, with stand-ins
#
# Time: every step has a share of the budget (DK_CHECK_BUDGET_S, default 480 s; another budget
# scales every share alike) and must end by the sum of its share and those of the steps before
# it. So a step that ends early leaves its unused seconds to the steps after it, and one that
# hangs is cut at its deadline with every later step still getting its own share; the whole
# check ends within the budget, inside one 10-minute device command (timeout about 540 s).
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
# (6 files in all: the device tool returns 8). The GPU's name, which names the report, is read
# before the first report is written, so no stale pair of report files takes two of the slots.
# At the end the report also goes to benchmarks/results/.
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

# Step shares in seconds at the reference budget; they add up to it (checked below). Sized for
# one H200 with 16 cores: the build compiles ~50 files (nvcc for sm_90 only); gpu_tests runs the
# single-process tests (~30 s), then the two-rank ones (one pool of two ranks per test, ~5 s to
# start each, every test under 30 s); bench_ws2 is ~16 collectives per size over loopback
# sockets (~4 ms a message) at 8 sizes, 8 iterations at most: ~20 s plus ~10 s of start-up.
REFERENCE_BUDGET=480
STEP_ORDER=(precheck driver toolchain device build info gpu_tests bench_ws1 bench_ws2 bench_kernels)
declare -A LIMIT=(
  [precheck]=5 [driver]=10 [toolchain]=10 [device]=20 [build]=150 [info]=15
  [gpu_tests]=160 [bench_ws1]=30 [bench_ws2]=45 [bench_kernels]=35
)
BUDGET=${DK_CHECK_BUDGET_S:-$REFERENCE_BUDGET}
total=0
for name in "${STEP_ORDER[@]}"; do total=$((total + LIMIT[$name])); done
((total == REFERENCE_BUDGET)) || {
  echo "device_check.sh: step limits add up to ${total}s, not ${REFERENCE_BUDGET}s" >&2
  exit 2
}
# SHARE[name]: the step's share scaled to the budget (at least 1 s). DEADLINE[name]: seconds
# after the start by which the step must end: its share plus the shares of the steps before it
# (at most the budget), so what an earlier step left unused goes to the later ones.
declare -A SHARE DEADLINE
sum=0
for name in "${STEP_ORDER[@]}"; do
  SHARE[$name]=$((LIMIT[$name] * BUDGET / REFERENCE_BUDGET))
  ((SHARE[$name] < 1)) && SHARE[$name]=1
  sum=$((sum + SHARE[$name]))
  DEADLINE[$name]=$((sum > BUDGET ? BUDGET : sum))
done

# Milliseconds: whole seconds counted from the start's own second would tick as soon as the
# clock crossed a second boundary, and a step due at its 1 s deadline (a small budget) would
# find "no time left" 10 ms after the start (seen in CI at a 48 s budget).
START_MS=$(date +%s%3N)
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
# The GPU names the report: read it before the first report is written (a later rename would
# leave a stale pair of files in $OUT).
GPU=dry-run
if [ "$DRY" != 1 ]; then
  GPU=$(timeout 15 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  GPU=${GPU:-unknown-gpu}
fi

elapsed() { echo $((($(date +%s%3N) - START_MS) / 1000)); }
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
  local command=${7//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "${@:1:6}" "${command//$'\t'/ }" >>"$STEPS"
  [ "$2" = ok ] || [ "$2" = missing ] || FAILED=1
  report 0 "${REPORT_DIRS[@]}"
}

# stand_in NAME: what a dry run executes instead of the step's command.
# DK_DEVICE_CHECK_DRY_SLOW=STEP:SECONDS makes that step's stand-in take SECONDS.
stand_in() {
  local slow=${DK_DEVICE_CHECK_DRY_SLOW:-}
  if [ "${DK_DEVICE_CHECK_DRY_HANG:-}" = "$1" ]; then
    echo "sleep 3600"
  elif [ "${DK_DEVICE_CHECK_DRY_FAIL:-}" = "$1" ]; then
    echo "exit 3"
  elif [ "${slow%%:*}" = "$1" ]; then
    echo "sleep ${slow#*:}"
  else
    echo "true"
  fi
}

# step NAME COMMAND...: runs COMMAND until the step's deadline (DEADLINE), logs its output,
# and records the outcome: ok, failed or timeout. Reads stdin from the caller (heredocs).
step() {
  local name=$1
  shift
  local limit out=$WORK/$name.log t0 rc status
  limit=$((DEADLINE[$name] - $(elapsed)))
  log "== [$(elapsed)s] $name (limit ${limit}s, share ${SHARE[$name]}s): $*"
  if ((limit <= 0)); then
    echo "no time left in the ${BUDGET}s budget" | tee "$out" -a "$LOG"
    record "$name" timeout 124 0 0 "$out" "$*"
    return 1
  fi
  t0=$(date +%s)
  # SIGTERM at the deadline less the grace, SIGKILL at the deadline: the step ends by then.
  local grace=$((limit > 10 ? 5 : 1))
  local term=$((limit - grace > 0 ? limit - grace : 1))
  if [ "$DRY" = 1 ]; then
    echo "dry run: stand-in for: $*" >"$out"
    timeout --kill-after="$grace" "$term" bash -c "$(stand_in "$name")" >>"$out" 2>&1 </dev/null
    rc=$?
    cat "$out" >>"$LOG"
  else
    # Output reaches the log as it comes (tee), so a killed check keeps what the step printed.
    timeout --kill-after="$grace" "$term" "$@" 2>&1 | tee "$out" >>"$LOG"
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
# The default sweep: 8 B to 16 MiB by x8 (8 sizes), 20 timed iterations at most at world size 1;
# at world size 2 (loopback sockets, ~4 ms a message) 8 at most, so it fits its share.
BENCH_SWEEP=${DK_BENCH_ARGS:--b 8 -e 16M -f 8 --iters 20 --warmup 3 --timeout 20}
BENCH_SWEEP_WS2=${DK_BENCH_ARGS:--b 8 -e 16M -f 8 --iters 8 --warmup 2 --timeout 20}
log "device check: budget ${BUDGET}s, dry run ${DRY}, python $PY, GPU $GPU, NCCL_DEBUG=$NCCL_DEBUG"
log "$(printf '%-14s %6s %8s\n' step share 'ends by')"
for name in "${STEP_ORDER[@]}"; do
  log "$(printf '%-14s %5ss %7ss\n' "$name" "${SHARE[$name]}" "${DEADLINE[$name]}")"
done

# 0. One second: what the build and the tests need (Python.h for this interpreter, the tools, a
# CUDA build of torch 2.3 or newer); pytest-timeout is optional (without it no per-test limit).
step precheck "$PY" - <<'PYEOF'
import importlib.util, os, shutil, sys, sysconfig
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
print(sys.executable, sys.version.split()[0], header)
missing = [] if os.path.isfile(header) else [f"{header} (the Python headers: no build possible)"]
missing += [f"{tool} on PATH" for tool in ("nvcc", "cmake", "ninja") if not shutil.which(tool)]
missing += [f"python module {m}" for m in ("torch", "pybind11", "pytest")
            if importlib.util.find_spec(m) is None]
if importlib.util.find_spec("torch") is not None:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda)
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 3):
        missing.append(f"torch >= 2.3 (dist_kernels' minimum), found {torch.__version__}")
    if torch.version.cuda is None:
        missing.append(f"a CUDA build of torch, found {torch.__version__} (CPU only)")
print("pytest-timeout", "present" if importlib.util.find_spec("pytest_timeout") else "absent")
sys.exit("missing: " + "; ".join(missing) if missing else 0)
PYEOF
PRECHECK=$?

# 1. What the machine has: the GPU, its compute mode (two processes share it only in Default
# mode), the driver and torch first, then nvidia-smi's full view.
QUERY=name,compute_mode,driver_version,memory.total,clocks.max.sm
step driver bash -c 'nvidia-smi --query-gpu="$1" --format=csv; "$0" -c "$2"; nvidia-smi' "$PY" \
  "$QUERY" 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
TWO_RANKS_WHY=""
if [ "$DRY" != 1 ]; then
  MODE=$(timeout 15 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n 1)
  case "$MODE" in
    *Exclusive* | *Prohibited*) TWO_RANKS_WHY="compute mode $MODE: two processes cannot share the GPU" ;;
  esac
  [ -n "$TWO_RANKS_WHY" ] && log "$TWO_RANKS_WHY: the two-rank tests and bench_ws2 are skipped"
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

# 3. The gpu tier: single-process tests first, the two-rank ones last (tests/conftest.py), so
# a hang of two ranks cannot hide the rest. Per-test timeout below the step's share, so a hang
# still ends in pytest's summary (the 2-rank tests set the NCCL socket variables per rank and
# time out at 30 s themselves).
GPU_SHARE=${SHARE[gpu_tests]}
PYTEST_ARGS=(-q -m gpu -rs -p no:cacheprovider --durations=10)
# (A dry run takes the device's pytest-timeout as present.)
if [ "$DRY" = 1 ] || "$PY" -c 'import pytest_timeout' 2>/dev/null; then
  PYTEST_ARGS+=(--timeout=$((GPU_SHARE * 4 / 10)))
  if [ "$DRY" = 1 ] || "$PY" -c 'import inspect, pytest_timeout, sys; sys.exit("session_timeout" not in inspect.getsource(pytest_timeout))' 2>/dev/null; then
    PYTEST_ARGS+=(--session-timeout=$((GPU_SHARE * 85 / 100)))
  fi
fi
[ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && PYTEST_ARGS+=(--junitxml="$OUT/gpu_tests.xml")
GPU_ENV=(env DK_REQUIRE_GPU=1)
[ -n "$TWO_RANKS_WHY" ] && GPU_ENV+=(DK_GPU_TWO_RANKS=0)
if ((BUILT)); then
  # DK_REQUIRE_GPU=1: the tier fails, rather than skips, where it cannot run here.
  step gpu_tests "${GPU_ENV[@]}" "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/
else
  skip gpu_tests "the build failed"
fi

# 4. Benchmarks: our collectives against NCCL at world size 1 (one rank) and 2 (two ranks on the
# one GPU over sockets); our kernels.
# Each benchmark's rows as JSON beside the report, where $OUT is set.
# The rows reach the JSON as each size is measured, so a benchmark cut at its deadline keeps
# what it measured.
bench_json() { [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && echo "--json $OUT/$1.json"; }
# The probe reads the whole help text before matching: `--help | grep -q` under pipefail would
# fail the pipeline whenever grep stops reading first.
BENCH_HELP=$([ "$DRY" = 1 ] && echo "--device" || "$PY" -m dist_kernels.bench --help 2>&1)
if ((!BUILT)); then
  skip bench_ws1 "the build failed"
  skip bench_ws2 "the build failed"
elif [[ "$BENCH_HELP" == *--device* ]]; then
  # shellcheck disable=SC2086
  step bench_ws1 "$PY" -m dist_kernels.bench --device cuda --nproc 1 $BENCH_SWEEP \
    $(bench_json bench_ws1)
  if [ -n "$TWO_RANKS_WHY" ]; then
    skip bench_ws2 "$TWO_RANKS_WHY"
  else
    # shellcheck disable=SC2086
    step bench_ws2 "${TWO_RANK_ENV[@]}" "$PY" -m torch.distributed.run --standalone \
      --nproc_per_node=2 --no-python "$WORK/rank_env.sh" "$PY" -m dist_kernels.bench \
      --device cuda $BENCH_SWEEP_WS2 $(bench_json bench_ws2)
  fi
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
