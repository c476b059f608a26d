#!/usr/bin/env bash
# Submit a pdkv deployment to a running Ray cluster as a Ray job.
#
#   deploy/submit.sh [CONFIG.yaml] [extra `python -m pd.launch` args, e.g. --run-load]
#
# Ray 2.60 turns on token authentication by default for new clusters; the job
# client only sends the token when RAY_AUTH_MODE=token is set in *its own*
# environment, so a bare `ray job submit` is refused (401). This script makes
# the choice explicit:
#   RAY_AUTH_MODE=token     (default) send the cluster token, taken from RAY_AUTH_TOKEN,
#                           or from the file RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token,
#                           which `ray start --head` writes on the head node;
#                           `ray get-auth-token` prints it there).
#   RAY_AUTH_MODE=disabled  for a cluster started with RAY_AUTH_MODE=disabled.
# Other settings: RAY_JOB_ADDRESS (dashboard URL, default http://127.0.0.1:8265).
#
# How pdkv reaches the cluster (PDKV_INSTALL):
#   source  (default) the repository is the job's working_dir: pd/ is importable from it; the
#           cluster's Python must already have pdkv's dependencies (e.g. deploy/Dockerfile's image).
#   wheel   for a cluster where pdkv is not installed: builds pdkv's wheel here, ships it with
#           deploy/ as the working_dir, and has Ray's pip runtime_env install it (with the extras in
#           PDKV_EXTRAS, e.g. "serve"; default none) into the job's own virtualenv on every node; pip
#           fetches whichever dependencies that node's Python lacks.
set -euo pipefail

CONFIG="${1:-deploy/local.yaml}"
[ $# -gt 0 ] && shift
[ -f "$CONFIG" ] || { echo "submit.sh: config $CONFIG not found (run from the repository root)" >&2; exit 2; }

export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
case "$RAY_AUTH_MODE" in
  token)
    if [ -z "${RAY_AUTH_TOKEN:-}" ]; then
      export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
      if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
        echo "submit.sh: RAY_AUTH_MODE=token but no token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to a" >&2
        echo "           token file (on the head node: ray get-auth-token), or RAY_AUTH_MODE=disabled" >&2
        exit 2
      fi
    fi ;;
  disabled) ;;
  *) echo "submit.sh: RAY_AUTH_MODE must be 'token' or 'disabled', got '$RAY_AUTH_MODE'" >&2; exit 2 ;;
esac

ADDRESS="${RAY_JOB_ADDRESS:-http://127.0.0.1:8265}"
INSTALL="${PDKV_INSTALL:-source}"
case "$INSTALL" in
  source)
    WORKING_DIR=.
    RUNTIME_ENV='{"excludes": [".git", "results", "*.png", "__pycache__", "build", "dist"]}' ;;
  wheel)
    WORKING_DIR="$(mktemp -d)"
    trap 'rm -rf "$WORKING_DIR"' EXIT
    python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$WORKING_DIR" . >&2
    cp -r deploy "$WORKING_DIR/deploy"
    WHEEL="$(cd "$WORKING_DIR" && ls pdkv-*.whl)"
    EXTRAS="${PDKV_EXTRAS:+[$PDKV_EXTRAS]}"
    RUNTIME_ENV="{\"pip\": [\"\${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}/$WHEEL$EXTRAS\"]}" ;;
  *) echo "submit.sh: PDKV_INSTALL must be 'source' or 'wheel', got '$INSTALL'" >&2; exit 2 ;;
esac
echo "submitting $CONFIG to $ADDRESS (RAY_AUTH_MODE=$RAY_AUTH_MODE, PDKV_INSTALL=$INSTALL)" >&2
ray job submit --address "$ADDRESS" --working-dir "$WORKING_DIR" --runtime-env-json "$RUNTIME_ENV" \
  -- python -m pd.launch --config "$CONFIG" "$@"
