#!/usr/bin/env bash
# Starts K flashrl_jax rollout servers (our JAX engine behind SGLang's HTTP protocol) on this host,
# each pinned to its own disjoint CPU cores (and, with ACCEL=gpu|tpu, its own GPU or TPU chip),
# waits until each answers GET /health, prints "URL LOG_FILE" per server, and stops them all on
# Ctrl-C or SIGTERM. Hand the URLs to RolloutClient (or the controller's config).
#
#   launch/start_local_servers.sh K MODEL_PATH [BASE_PORT]
#
# Environment:
#   ACCEL=cpu|gpu|tpu   device per server (default cpu; gpu sets CUDA_VISIBLE_DEVICES=i,
#                       tpu sets TPU_VISIBLE_CHIPS=i with one-chip process bounds)
#   SERVER_ARGS="..."   extra flags for every server, e.g. "--max_running_requests=32"
#   LOG_DIR=dir         server logs (default: a fresh temp dir)
#   MODULE=...          server module (default flashrl_jax.rollout.server)
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:?usage: $0 K MODEL_PATH [BASE_PORT]}
MODEL_PATH=${2:?usage: $0 K MODEL_PATH [BASE_PORT]}
args=(--num_servers="$K" --model_path="$MODEL_PATH" --accelerator="${ACCEL:-cpu}"
      --module="${MODULE:-flashrl_jax.rollout.server}")
[ -n "${3:-}" ] && args+=(--base_port="$3")
[ -n "${LOG_DIR:-}" ] && args+=(--server_log_dir="$LOG_DIR")
# shellcheck disable=SC2086  # SERVER_ARGS is a list of flags
exec .venv/bin/python -m flashrl_jax.fleet._local "${args[@]}" -- ${SERVER_ARGS:-}
