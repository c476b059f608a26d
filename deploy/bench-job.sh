#!/usr/bin/env bash
# A benchmark run as one Ray job (the RayJob's entrypoint; also usable with `ray job submit`):
# render the config (router.api_key from PDKV_API_KEY), launch pdkv on the cluster, wait for the
# router, run `python -m pd.loadgen` against it with PDKV_BENCH_ARGS, stop pdkv.
#
#   bash deploy/bench-job.sh CONFIG.yaml
#   settings: PDKV_API_KEY (from a Secret), PDKV_BENCH_ARGS (pd.loadgen flags),
#             PDKV_RESULT_DIR (default /models/results when /models exists, else ./results)
set -euo pipefail

CONFIG="${1:?usage: bench-job.sh CONFIG.yaml}"
RENDERED="$(mktemp -d)/pdkv.yaml"
python deploy/render_config.py "$CONFIG" "$RENDERED"
PORT="$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['router']['port'])" "$RENDERED")"
if [ -d /models ]; then DEFAULT_RESULTS=/models/results; else DEFAULT_RESULTS=results; fi
RESULT_DIR="${PDKV_RESULT_DIR:-$DEFAULT_RESULTS}"

python -m pd.launch --config "$RENDERED" --log-level WARNING &
LAUNCH=$!
trap 'kill -TERM "$LAUNCH" 2>/dev/null || true; wait "$LAUNCH" 2>/dev/null || true' EXIT

URL="http://127.0.0.1:$PORT"
for _ in $(seq 1 600); do   # up to 10 minutes: the model loads on every worker first
  if curl -fsS -m 5 "$URL/health" >/dev/null 2>&1; then break; fi
  kill -0 "$LAUNCH" 2>/dev/null || { echo "bench-job: pd.launch exited before the router came up" >&2; exit 1; }
  sleep 1
done
curl -fsS -m 5 "$URL/health" >/dev/null || { echo "bench-job: router at $URL not healthy after 10 minutes" >&2; exit 1; }

export OPENAI_API_KEY="${PDKV_API_KEY:-}"
# shellcheck disable=SC2086  # PDKV_BENCH_ARGS is a list of flags
python -m pd.loadgen --base-url "$URL" ${PDKV_BENCH_ARGS:---num-prompts 100} --disable-tqdm \
  --save-result --result-dir "$RESULT_DIR"
