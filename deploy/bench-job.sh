#!/usr/bin/env bash
# A benchmark run as one Ray job (the RayJob's entrypoint; also usable with `ray job submit`):
# render the config (router.api_key from PDKV_API_KEY), launch pdkv on the cluster, wait for the
# router, run `python -m pd.loadgen` against it with PDKV_BENCH_ARGS, check that every KV pool is
# free again, stop pdkv.
#
#   bash deploy/bench-job.sh CONFIG.yaml
#   settings: PDKV_API_KEY, PDKV_ADMIN_KEY (from Secrets; the admin key opens the pool audit),
#             PDKV_BENCH_ARGS (pd.loadgen flags),
#             PDKV_RESULT_DIR (default /models/results when /models exists, else ./results),
#             PDKV_HEALTH_TIMEOUT_S (default 600: the model loads on every worker first),
#             PDKV_LAUNCH_ARGS (extra `python -m pd.launch` flags, e.g. --num-cpus 2 off a cluster)
#
# Tools: bash, coreutils (mktemp) and the image's python only. Ray's images ship wget but no
# curl, so every HTTP call goes through deploy/router_check.py (standard library).
set -euo pipefail

CONFIG="${1:?usage: bench-job.sh CONFIG.yaml}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for tool in python mktemp; do
  command -v "$tool" >/dev/null || { echo "bench-job: '$tool' not found on PATH" >&2; exit 1; }
done
RENDERED="$(mktemp -d)/pdkv.yaml"
python "$HERE/render_config.py" "$CONFIG" "$RENDERED"
PORT="$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['router']['port'])" "$RENDERED")"
if [ -d /models ]; then DEFAULT_RESULTS=/models/results; else DEFAULT_RESULTS=results; fi
RESULT_DIR="${PDKV_RESULT_DIR:-$DEFAULT_RESULTS}"

# shellcheck disable=SC2086  # PDKV_LAUNCH_ARGS is a list of flags
python -m pd.launch --config "$RENDERED" --log-level WARNING ${PDKV_LAUNCH_ARGS:-} &
LAUNCH=$!
trap 'kill -TERM "$LAUNCH" 2>/dev/null || true; wait "$LAUNCH" 2>/dev/null || true' EXIT

URL="http://127.0.0.1:$PORT"
python "$HERE/router_check.py" health "$URL" --timeout-s "${PDKV_HEALTH_TIMEOUT_S:-600}" --pid "$LAUNCH" \
  || { echo "bench-job: no healthy router at $URL" >&2; exit 1; }

export OPENAI_API_KEY="${PDKV_API_KEY:-}"
# shellcheck disable=SC2086  # PDKV_BENCH_ARGS is a list of flags
python -m pd.loadgen --base-url "$URL" ${PDKV_BENCH_ARGS:---num-prompts 100} --disable-tqdm \
  --save-result --result-dir "$RESULT_DIR"
# the KV pool audit (/pd/workers) takes router.admin_key: without PDKV_ADMIN_KEY the router may refuse it
rc=0
python "$HERE/router_check.py" pools "$URL" --timeout-s 60 || rc=$?
if [ "$rc" = 3 ]; then echo "bench-job: KV pool audit refused (set PDKV_ADMIN_KEY); not checked" >&2; rc=0; fi
exit "$rc"
