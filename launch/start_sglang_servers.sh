#!/usr/bin/env bash
# Starts K real SGLang servers for GPU users, one per GPU (or GPUS_PER_SERVER GPUs, tensor
# parallel), each on 127.0.0.1:BASE_PORT+i, waits until each answers GET /health_generate, prints
# "URL LOG_FILE" per server, and stops them all on Ctrl-C or SIGTERM. flashrl_jax's RolloutClient
# talks to these exactly as to our own servers (shared/SGLANG_PROTOCOL.md). SGLang is an optional
# extra that flashrl_jax never imports: install it in its own environment
# (pip install "sglang[all]") and point PYTHON there.
#
#   launch/start_sglang_servers.sh K MODEL_PATH [BASE_PORT]
#
# Per server i this runs (the documented command line):
#   CUDA_VISIBLE_DEVICES=<gpus of i> $PYTHON -m sglang.launch_server --model-path MODEL_PATH \
#       --port $((BASE_PORT + i)) --host 127.0.0.1 [--tp-size GPUS_PER_SERVER] $SGLANG_ARGS
#
# Environment:
#   PYTHON=python3          the interpreter that has sglang installed
#   GPUS_PER_SERVER=1       GPUs per server (passed as --tp-size when > 1)
#   SGLANG_ARGS="..."       extra flags, e.g. "--mem-fraction-static 0.8 --dtype bfloat16"
#   LOG_DIR=dir             server logs (default: a fresh temp dir)
#   STARTUP_TIMEOUT_S=900   seconds to wait for each server
#   DRY_RUN=1               only print the commands
set -euo pipefail
K=${1:?usage: $0 K MODEL_PATH [BASE_PORT]}
MODEL_PATH=${2:?usage: $0 K MODEL_PATH [BASE_PORT]}
BASE_PORT=${3:-30000}
PYTHON=${PYTHON:-python3}
PER=${GPUS_PER_SERVER:-1}
# A dry run starts nothing, so it makes no log directory.
if [ -z "${DRY_RUN:-}" ]; then LOG_DIR=${LOG_DIR:-$(mktemp -d -t sglang_servers_XXXXXX)}; fi
TIMEOUT=${STARTUP_TIMEOUT_S:-900}

pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop_all EXIT
trap 'exit 130' INT TERM

for ((i = 0; i < K; i++)); do
  gpus=$(seq -s, $((i * PER)) $((i * PER + PER - 1)))
  port=$((BASE_PORT + i))
  cmd=("$PYTHON" -m sglang.launch_server --model-path "$MODEL_PATH" --port "$port"
       --host 127.0.0.1)
  ((PER > 1)) && cmd+=(--tp-size "$PER")
  # shellcheck disable=SC2206  # SGLANG_ARGS is a list of flags
  cmd+=(${SGLANG_ARGS:-})
  if [ -n "${DRY_RUN:-}" ]; then
    echo "CUDA_VISIBLE_DEVICES=$gpus ${cmd[*]}"
    continue
  fi
  # setsid: one process group per server, so stop_all also reaches SGLang's worker processes.
  CUDA_VISIBLE_DEVICES=$gpus setsid "${cmd[@]}" > "$LOG_DIR/sglang_${i}_${port}.log" 2>&1 &
  pids+=($!)
done
[ -n "${DRY_RUN:-}" ] && { trap - EXIT; exit 0; }

for ((i = 0; i < K; i++)); do
  url="http://127.0.0.1:$((BASE_PORT + i))"
  log="$LOG_DIR/sglang_${i}_$((BASE_PORT + i)).log"
  for ((t = 0; ; t++)); do
    if "$PYTHON" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=30)" \
        "$url/health_generate" 2>/dev/null; then
      break
    fi
    if ! kill -0 "${pids[i]}" 2>/dev/null || ((t >= TIMEOUT)); then
      echo "SGLang server $i ($url) did not come up; last log lines ($log):" >&2
      tail -n 40 "$log" >&2
      exit 1
    fi
    sleep 1
  done
  echo "$url $log"
done
wait
