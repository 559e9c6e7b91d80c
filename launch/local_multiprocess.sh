#!/usr/bin/env bash
# One RL run as N processes on this machine, each with its own fake CPU devices: what a multi-host
# run does, over loopback (jax.distributed coordinator + gloo collectives). Process 0 also runs the
# controller and its local rollout servers; every process trains. The global mesh defaults to
# fsdp over all N * DEVICES devices; flags after `--` go to every `experiments.train` process.
#
#   bash launch/local_multiprocess.sh 2 -- --steps=4 --workdir=runs/mp
#   FLASHRL_LOCAL_DEVICES=4 bash launch/local_multiprocess.sh 2 -- --mesh=data:2,fsdp:4 ...
#
# Exits 0 when every process did; if one dies, the others stop within seconds (non-zero).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bash launch/local_multiprocess.sh N [-- flags for experiments.train]}
shift
if [[ "${1:-}" == "--" ]]; then shift; fi
DEVICES=${FLASHRL_LOCAL_DEVICES:-2}
PYTHON=${PYTHON:-.venv/bin/python}
PORT=$("$PYTHON" -c "from flashrl_jax.fleet import free_port; print(free_port())")

pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop INT TERM
for ((i = 0; i < N; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES" \
    "$PYTHON" -m experiments.train --num_processes="$N" --process_id="$i" \
    --coordinator="127.0.0.1:$PORT" --mesh="fsdp:$((N * DEVICES))" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
