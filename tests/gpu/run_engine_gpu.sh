#!/usr/bin/env bash
# A longer run of the GPU engine's part alone (about 6 minutes on one GPU), for when there is time beside the one
# command of tests/gpu/device_session.sh (which runs the engine's checks inside 8 minutes with everything else):
#   1. gpu_check's float32 agreement, then the engine beside transformers (static cache + torch.compile) at
#      batch 32, 128 and, time allowing, 1 (engine_compare.json, rewritten after every part);
#   2. the compiled Triton kernels: tests/triton's hypothesis cases on CUDA, tests/gpu/test_gpu_engine_parts.py at
#      the models' head shapes (decode CUDA graphs against eager, a whole engine on CUDA, the sampler's single
#      sync), and the Triton engine's tokens against the torch backend's (tests/engine/test_triton_engine.py).
# Usage from the repository root: bash tests/gpu/run_engine_gpu.sh [OUT_DIR]   (default: $OUT, then .)
# It writes engine_compare.json and engine_gpu.log there; with the device kit's bundle in .device, source
# .device/on_device.sh first. Exit status: 0 when both parts pass.
set -o pipefail
OUT=${1:-${OUT:-.}}
mkdir -p "$OUT" || exit 2
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels: the CPU suite's interpreter stays off on a GPU
rc=0
timeout --kill-after=5 230 python3 -m pd.tools.gpu_check --sections float32,engine --engine-batches 32,128,1 \
    --engine-budget-s 150 --json-only --out "$OUT/engine_compare.json" 2>&1 | tee "$OUT/engine_gpu.log" || rc=1
timeout --kill-after=5 240 python3 -m pytest -q -rs -n 0 -p no:cacheprovider --timeout=200 \
    tests/triton tests/gpu/test_gpu_engine_parts.py tests/engine/test_triton_engine.py 2>&1 \
    | tee -a "$OUT/engine_gpu.log" || rc=1
exit $rc
