#!/usr/bin/env bash
# The prepared run for a session lent a GPU machine (one H200; see the device tool's notes): every GPU check
# of pdkv in steps, each under its own timeout, every log under $OUT. Prepared and syntax-checked on the CPU.
#
# Here, once: build the device kit's bundle into .device (its build_bundle.sh), then echo /.device/ >> .git/info/exclude
# There, from the repository root (carry .device), in two calls that each fit the 600 s command limit:
#   STEPS="tests engine"               bash tests/gpu/device_session.sh     # about 7-8 minutes
#   STEPS="transfer served one_gpu"    bash tests/gpu/device_session.sh     # about 6 minutes
# Steps:
#   tests     the gpu-marked tests and the Triton kernels compiled on CUDA (tests/triton, test_gpu_engine_parts)
#   engine    gpu_check's engine section: the engine beside transformers (static cache + torch.compile)
#   transfer  gpu_check's transfer section: tcp, shm, CUDA IPC beside the pinned serial and plain D2D copies
#   served    gpu_check's served section: colocated c=1,8,32 and 1P1D on one GPU through Ray and the router
#   one_gpu   python -m pd.launch --config deploy/gpu-1p1d-one-gpu.yaml --run-load (the main job's load)
# Exit status: 0 when every step asked for passed; the failing steps are listed at the end.
set -uo pipefail
OUT=${OUT:-device-out}
STEPS=${STEPS:-"tests engine transfer served one_gpu"}
mkdir -p "$OUT"
[ -f .device/on_device.sh ] && source .device/on_device.sh
unset TRITON_INTERPRET  # compiled kernels on the GPU; the CPU suite's interpreter stays off here
export PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
  > "$OUT/versions.txt" 2>&1
failed=()
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0;; esac
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.txt"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || failed+=("$name(rc=$rc)")
}
step tests 200 python3 -m pytest -q -rs -n 0 -p no:cacheprovider --timeout=150 -m "gpu or not gpu" \
  tests/triton tests/gpu tests/connectors/test_cuda.py tests/engine/test_triton_engine.py
step engine 330 python3 -m pd.tools.gpu_check --sections engine --out "$OUT/engine.md"
step transfer 150 python3 -m pd.tools.gpu_check --sections transfer --out "$OUT/transfer.md"
step served 240 python3 -m pd.tools.gpu_check --sections served --out "$OUT/served.md"
step one_gpu 150 python3 -m pd.launch --config deploy/gpu-1p1d-one-gpu.yaml --run-load --num-prompts 16
echo "failed steps: ${failed[*]:-none}" | tee -a "$OUT/steps.txt"
[ ${#failed[@]} -eq 0 ]
