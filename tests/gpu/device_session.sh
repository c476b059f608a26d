#!/usr/bin/env bash
# Every GPU check of pdkv in ONE command of at most 8 minutes (480 s) on one fresh GPU machine (H100 or H200),
# prepared and tested on the CPU (tests/tools/test_device_session_cpu.py).
#
# Usage, from the repository root on a GPU machine:
#   bash tests/gpu/device_session.sh OUT_DIR        # OUT_DIR defaults to $OUT, then device-out
# A machine without a package index needs the device kit's bundle in .device (built beside the checkout by the
# kit's build_bundle.sh, kept out of git); the setup step installs it. Other forms, for the CPU:
#   bash tests/gpu/device_session.sh --dry-run OUT_DIR   every step in its dry form: gpu_check --dry-run (arguments
#                                                        checked, plan written), pytest --collect-only, no install
#   bash tests/gpu/device_session.sh --print-budget      the budget table: one "step seconds" a line
#   bash tests/gpu/device_session.sh --print-gpu-tests   the gpu_tests step's pytest selection, one argument a line
#
# The steps, in this order, each under its own limit (the budget table below: 460 s in all, which leaves 20 s of
# the 480 for the shell, the machine's first Python start and the summary). A step that fails or times out is
# recorded and the next one still runs; a step that would run past DEADLINE_S gets what is left, or is skipped
# for time when that is under MIN_STEP_S.
#   setup      install the .device bundle (if carried), nvidia-smi and versions into env.txt
#   float32    gpu_check float32: the engine's greedy tokens vs transformers' on a float32 copy of the check model
#   engine     gpu_check engine: the engine vs transformers (static cache + torch.compile) at batch 32, then 128;
#              batch 1 only if those two end inside ENGINE_BUDGET_S
#   transfer   gpu_check transfer: tcp, shm and CUDA IPC beside the pinned serial and plain device-to-device copies
#   gpu_tests  the gpu-marked tests (GPU_TESTS: the marker over the files that hold them; no CPU Ray test, no
#              hypothesis sweep of Triton compiles); a skipped test fails the step on a GPU machine
#   served     gpu_check served: colocated through Ray and the router, then 1P1D on one GPU (greedy tokens equal)
#
# What it writes under OUT_DIR, as it goes (7 files, flat: a device run brings back at most 8):
#   summary.txt   the GPU's name, the date, one line per step: ok / failed (rc=N) / timed out / skipped for time /
#                 not asked, with its seconds; a step in progress reads "running"
#   session.log   every step's output in turn, each behind a header that lists what OUT_DIR held when it started
#   env.txt       nvidia-smi, then the torch / triton / CUDA versions
#   float32.json engine.json transfer.json served.json   gpu_check's figures, rewritten after every part it measures
# Test hooks: STEPS="a b" runs only those (the others read "not asked"); LIMIT_<step>=N overrides a limit;
# STANDIN_<step>='shell command' replaces a step's command (run by bash -c, OUT exported); DEADLINE_S, MIN_STEP_S.
# Exit status: 0 when every step asked for is ok, else 1.
set -uo pipefail

ORDER=(setup float32 engine transfer gpu_tests served)
declare -A LIMITS=([setup]=25 [float32]=45 [engine]=190 [transfer]=35 [gpu_tests]=60 [served]=105)  # sum: 460 s
ENGINE_BUDGET_S=110  # a batch that would start after this many seconds of the engine step is skipped (batch 1)
GPU_TESTS=(-m gpu tests/gpu tests/connectors/test_cuda.py
           tests/engine/test_step_metadata.py::test_on_a_gpu_the_device_buffers_mirror_the_host_and_stay_put)
DEADLINE_S=${DEADLINE_S:-470}
MIN_STEP_S=${MIN_STEP_S:-10}

dry=${DEVICE_SESSION_DRY_RUN:-0}
out_arg=""
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    --print-budget) for name in "${ORDER[@]}"; do echo "$name ${LIMITS[$name]}"; done; exit 0 ;;
    --print-gpu-tests) printf '%s\n' "${GPU_TESTS[@]}"; exit 0 ;;
    -*) echo "unknown option: $arg (see the header of $0)" >&2; exit 2 ;;
    *) out_arg=$arg ;;
  esac
done
OUT=${out_arg:-${OUT:-device-out}}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2  # the repository root, wherever it is started from
# the checkout on the path of every process the steps start (Ray workers and P/D peers too)
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels on the GPU; the CPU suite's interpreter stays off here
SUMMARY=$OUT/summary.txt LOG=$OUT/session.log
: > "$LOG"

gpu_name() {
  [ "$dry" = 1 ] && { echo "none (dry run on the CPU)"; return; }
  timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep . \
    || echo "unknown (nvidia-smi gave no name)"
}
{
  echo "device session of pdkv$([ "$dry" = 1 ] && echo ' (dry run)')"
  echo "gpu: $(gpu_name)"
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "budget: $(for n in "${ORDER[@]}"; do printf '%s=%s ' "$n" "${LIMITS[$n]}"; done)(deadline ${DEADLINE_S} s)"
} > "$SUMMARY"

asked() { [ -z "${STEPS+x}" ] && return 0; case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
record() {  # record NAME STATUS: replaces NAME's line in summary.txt (a step's "running" line becomes its result)
  sed -i "/^$1 /d" "$SUMMARY"
  printf '%-10s %s\n' "$1" "$2" | tee -a "$SUMMARY"
}

failed=()
step() {  # step NAME COMMAND... : NAME's limit from LIMITS (or LIMIT_NAME), its command or STANDIN_NAME
  local name=$1; shift
  local limit_var="LIMIT_$name" standin_var="STANDIN_$name"
  local limit=${!limit_var:-${LIMITS[$name]}}
  if ! asked "$name"; then record "$name" "not asked"; return 0; fi
  local left=$((DEADLINE_S - SECONDS))
  if (( left < limit )); then
    if (( left < MIN_STEP_S )); then
      record "$name" "skipped for time (${left} s left of ${DEADLINE_S}, its limit ${limit} s)"
      failed+=("$name"); return 0
    fi
    limit=$left
  fi
  local cmd=("$@")
  [ -n "${!standin_var:-}" ] && cmd=(bash -c "${!standin_var}")
  # the grace lets a step end its children before KILL; the step's wall time stays inside its limit
  local grace=$(( limit >= 20 ? 3 : 0 )); local run_s=$(( limit - grace < 1 ? 1 : limit - grace ))
  local t0=$SECONDS
  record "$name" "running since ${t0} s (limit ${limit} s)"
  { echo; echo "== $name (limit ${limit} s) at ${t0} s; $OUT held: $(cd "$OUT" && ls | tr '\n' ' ')"
    echo "== command: ${cmd[*]}"; } >> "$LOG"
  timeout --kill-after="$grace" "$run_s" "${cmd[@]}" >> "$LOG" 2>&1
  local rc=$? took=$((SECONDS - t0)) status
  case $rc in
    0) status="ok" ;;
    124|137) status="timed out (limit ${limit} s)" ;;
    *) status="failed (rc=$rc)" ;;
  esac
  echo "== $name: $status in ${took} s" >> "$LOG"
  record "$name" "$status, ${took} s"
  [ "$status" = ok ] || failed+=("$name")
}

gpu_check() {  # gpu_check SECTION [ARGS...]: one gpu_check section, its JSON report rewritten as it measures
  local section=$1; shift
  local cmd=(python3 -m pd.tools.gpu_check --sections "$section" --json-only --out "$OUT/$section.json" "$@")
  [ "$dry" = 1 ] && cmd+=(--dry-run)
  step "$section" "${cmd[@]}"
}

if [ "$dry" = 1 ]; then
  setup_cmd='if [ -f .device/on_device.sh ]; then bash -n .device/on_device.sh && echo "bundle script parses"; '
  setup_cmd+='else echo "no .device bundle here"; fi; python3 -c "import torch; print(\"torch\", torch.__version__)" > "$OUT/env.txt"'
else
  setup_cmd='if [ -f .device/on_device.sh ]; then source .device/on_device.sh; else echo "no .device bundle: the machine'"'"'s own packages"; fi
    { timeout 20 nvidia-smi; python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))"; } > "$OUT/env.txt" 2>&1'
fi
step setup bash -c "$setup_cmd"
# the bundle installed by the setup step (into /tmp/site): take its PYTHONPATH here, without installing again
if [ "$dry" != 1 ] && [ -f .device/on_device.sh ] && [ -d /tmp/site/ray ]; then source .device/on_device.sh; fi

gpu_check float32
gpu_check engine --engine-batches 32,128,1 --engine-budget-s "$ENGINE_BUDGET_S"
gpu_check transfer
if [ "$dry" = 1 ]; then
  step gpu_tests python3 -m pytest --collect-only -q -n 0 -p no:cacheprovider "${GPU_TESTS[@]}"
else
  step gpu_tests python3 -m pytest -q -rs -n 0 -p no:cacheprovider --timeout=45 "${GPU_TESTS[@]}"
  # on a GPU machine a skipped gpu test hides the very path it is for: it fails the step (as in gpu_check)
  if grep -q '^gpu_tests  *ok' "$SUMMARY" && tail -n 3 "$LOG" | grep -qE '[0-9]+ skipped'; then
    record gpu_tests "failed (gpu tests skipped on a GPU machine: their reasons are in session.log)"
    failed+=(gpu_tests)
  fi
fi
gpu_check served

echo "total: ${SECONDS} s; not ok: ${failed[*]:-none}" | tee -a "$SUMMARY"
[ ${#failed[@]} -eq 0 ]
