#!/usr/bin/env bash
# Device check (design.md, test tiers): on a machine with a CUDA GPU, build for sm_90, run the
# gpu test tier and the GPU benchmarks, and write benchmarks/results/<date>-<gpu>.md with a JSON
# beside it holding every step's command, exit status, time and output.
#
#   bash benchmarks/device_check.sh          # from the repository root; ~2-5 min on one H200
#
# Installs nothing and needs no network: it builds from this checkout with what is installed
# (python3 with torch (CUDA build), pybind11, cmake, ninja, pytest; NCCL from the nvidia-nccl
# wheel that torch uses, or DK_NCCL_LIBRARY). Exits non-zero if any step fails; a benchmark that
# does not exist yet is reported as "missing", not as a failure. If $OUT is set (the device
# tool's output folder), the report, the JSON and the full log are copied there too.
#
# Knobs: PYTHON (default python3), DK_CUDA_ARCHS (default 90), DK_CHECK_BUDGET_S (total seconds
# for all steps, default 340 so the whole run stays under 6 minutes), DK_BENCH_ARGS (extra
# arguments for python -m dist_kernels.bench), DK_KERNEL_BENCH_ARGS (for bench_kernels.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
# cmake and ninja come as pip packages beside the interpreter; nvcc from the CUDA toolkit.
PATH="$(dirname "$(command -v "$PY")"):$PATH"
command -v nvcc >/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && PATH="/usr/local/cuda/bin:$PATH"; }
export PATH
export DK_CUDA_ARCHS=${DK_CUDA_ARCHS:-90}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
BUDGET=${DK_CHECK_BUDGET_S:-340}
START=$(date +%s)
WORK=$(mktemp -d)
LOG=$WORK/device_check.log
STEPS=$WORK/steps.tsv   # name, status, rc, seconds, log file, command
: >"$STEPS"
FAILED=0

remaining() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT_S COMMAND...: runs COMMAND with a time limit (capped by the budget left), logs
# its output, and records the outcome. Status: ok, failed, timeout.
step() {
  local name=$1 limit=$2
  shift 2
  local left
  left=$(remaining)
  ((left < limit)) && limit=$left
  local out=$WORK/$name.log t0 rc status
  echo "== [$(($(date +%s) - START))s] $name (limit ${limit}s): $*" | tee -a "$LOG"
  if ((limit <= 0)); then
    echo "no time left in the ${BUDGET}s budget" | tee "$out" -a "$LOG"
    printf '%s\ttimeout\t124\t0\t%s\t%s\n' "$name" "$out" "$*" >>"$STEPS"
    FAILED=1
    return 1
  fi
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out" 2>&1
  rc=$?
  cat "$out" >>"$LOG"
  tail -n 25 "$out"
  status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  [ "$status" != ok ] && FAILED=1
  echo "-- $name: $status (rc $rc, $(($(date +%s) - t0))s)" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$out" "$*" >>"$STEPS"
  return "$rc"
}

# missing NAME WHY: records a benchmark that is not in this checkout yet (not a failure).
missing() {
  echo "== $1: missing ($2)" | tee -a "$LOG" "$WORK/$1.log"
  printf '%s\tmissing\t0\t0\t%s\t%s\n' "$1" "$WORK/$1.log" "$2" >>"$STEPS"
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

# 1. What the machine has.
step driver 20 nvidia-smi
step toolchain 20 bash -c 'nvcc --version | tail -n 2; cmake --version | head -n 1; ninja --version'
step device 60 "$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB")
PYEOF

# 2. Build for sm_90 in place (tools/dev_build.sh: no pip, nothing installed).
step build 200 env PYTHON="$PY" DK_WITH_CUDA=1 DK_BUILD_JOBS="$(nproc)" tools/dev_build.sh
step info 60 "$PY" - <<'PYEOF'
import json, dist_kernels
info = dist_kernels.build_info()
print(json.dumps(info, indent=2))
assert info["cuda_compiled"], "the build has no CUDA"
assert info["device_count"] > 0, "the extension sees no CUDA device"
assert info["nccl_version"], "NCCL was not found (set DK_NCCL_LIBRARY)"
from dist_kernels.comm import cuda as _cuda_comm
assert _cuda_comm.unavailable_reason() is None, _cuda_comm.unavailable_reason()
PYEOF

# 3. The gpu tier (its 2-rank test sets the NCCL socket variables per rank itself).
step gpu_tests 150 "$PY" -m pytest -q -m gpu -rs tests/

# 4. Benchmarks: our collectives against NCCL, at world size 1 and 2; our kernels.
if "$PY" -c "import dist_kernels.bench" >/dev/null 2>&1 &&
  "$PY" -m dist_kernels.bench --help 2>&1 | grep -q -- "--device"; then
  # shellcheck disable=SC2086
  step bench_ws1 60 "$PY" -m dist_kernels.bench --device cuda ${DK_BENCH_ARGS:-}
  # shellcheck disable=SC2086
  step bench_ws2 90 "${TWO_RANK_ENV[@]}" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node=2 --no-python "$WORK/rank_env.sh" "$PY" -m dist_kernels.bench --device cuda \
    ${DK_BENCH_ARGS:-}
else
  missing bench_ws1 "dist_kernels.bench with a --device option is not in this checkout"
  missing bench_ws2 "dist_kernels.bench with a --device option is not in this checkout"
fi
if [ -f benchmarks/bench_kernels.py ]; then
  # shellcheck disable=SC2086
  step bench_kernels 60 "$PY" benchmarks/bench_kernels.py --device cuda ${DK_KERNEL_BENCH_ARGS:-}
else
  missing bench_kernels "benchmarks/bench_kernels.py is not in this checkout"
fi

# 5. The report: benchmarks/results/<date>-<gpu>.md and .json.
"$PY" - "$STEPS" "$FAILED" "$(($(date +%s) - START))" "$WORK/base" <<'PYEOF' | tee -a "$LOG"
import datetime, json, os, re, subprocess, sys
steps_file, failed, seconds = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
except Exception:
    gpu = "unknown-gpu"
slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown-gpu"
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
steps = []
for line in open(steps_file):
    name, status, rc, secs, log, command = line.rstrip("\n").split("\t", 5)
    steps.append({"name": name, "status": status, "rc": int(rc), "seconds": int(secs),
                  "command": command, "output": open(log, errors="replace").read()})
report = {"date": date, "gpu": gpu, "passed": not failed, "seconds": seconds, "steps": steps}
os.makedirs("benchmarks/results", exist_ok=True)
base = f"benchmarks/results/{date}-{slug}"
with open(base + ".json", "w") as f:
    json.dump(report, f, indent=2)
lines = [f"# Device check, {date}, {gpu}", "",
         f"Result: **{'passed' if not failed else 'FAILED'}** in {seconds} s "
         "(`bash benchmarks/device_check.sh`; every step's full output is in the JSON beside).", "",
         "| step | status | rc | seconds |", "|---|---|---|---|"]
lines += [f"| {s['name']} | {s['status']} | {s['rc']} | {s['seconds']} |" for s in steps]
for s in steps:
    lines += ["", f"## {s['name']}: {s['status']}", "", f"`{s['command']}`", "", "```",
              s["output"].rstrip()[-20000:], "```"]
with open(base + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
open(sys.argv[4], "w").write(base)
print(f"wrote {base}.md and {base}.json")
print("\n".join(lines[:6 + len(steps)]))
PYEOF

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  base=$(cat "$WORK/base" 2>/dev/null) && cp "$base.md" "$base.json" "$OUT"/
  cp "$LOG" "$OUT"/device_check.log
fi
rm -rf "$WORK"
if ((FAILED)); then
  echo "device check FAILED"
  exit 1
fi
echo "device check passed"
