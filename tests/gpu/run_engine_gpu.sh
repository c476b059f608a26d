#!/usr/bin/env bash
# One device run for the GPU engine's parts, prepared on the CPU (about 4-5 minutes on one H200):
#   1. the compiled Triton kernels (tests/triton's hypothesis cases on CUDA, then tests/gpu/test_gpu_engine_parts.py
#      at the models' head shapes), decode CUDA graphs captured by the engine's runner and replayed against eager,
#      a whole engine on CUDA (Triton, graphs, device sampler), the sampler's single sync, and the Triton engine's
#      tokens against the torch backend's (tests/engine/test_triton_engine.py, on CUDA there);
#   2. the engine beside transformers (static cache + torch.compile) at batch 32, 128 and 1, with float32 agreement.
# Reports land in $OUT (or the current folder): engine_gpu_tests.log, engine_compare.md/.json/.log.
# Usage from the repository root: bash tests/gpu/run_engine_gpu.sh
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels: the CPU suite's interpreter stays off on a GPU
rc=0
timeout 240 python3 -m pytest -q -rs -n 0 -p no:cacheprovider --timeout=200 \
    tests/triton tests/gpu/test_gpu_engine_parts.py tests/engine/test_triton_engine.py 2>&1 | tee "$OUT/engine_gpu_tests.log" || rc=1
timeout 300 python3 -m pd.tools.gpu_check.engine_compare --out "$OUT/engine_compare.md" --budget-s 200 \
    2>&1 | tee "$OUT/engine_compare.log" || rc=1
exit $rc
