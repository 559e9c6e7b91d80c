#!/usr/bin/env bash
# One RL run on a multi-host Cloud TPU slice: every worker runs the same command, and JAX finds the
# coordinator, the process count and each worker's id itself (--coordinator=auto). Worker 0 is
# process 0 and also runs the controller. The repository (with its .venv) must be at
# $FLASHRL_REPO_DIR (default ~/flashrl_jax) on every worker, and the model and --workdir on a
# filesystem every worker mounts (checkpoints and exported versions are read by all of them).
# Rollout on a slice whose chips all train: point the run at rollout servers elsewhere
# (--rollout=sglang --sglang_urls=...).
#
#   bash launch/tpu_slice.sh TPU_NAME ZONE -- --config=experiments/configs/<file>.py \
#       --set=resources.platform=tpu --mesh=fsdp:32 --workdir=/mnt/shared/runs/x
set -euo pipefail
TPU=${1:?usage: bash launch/tpu_slice.sh TPU_NAME ZONE [-- flags for experiments.train]}
ZONE=${2:?usage: bash launch/tpu_slice.sh TPU_NAME ZONE [-- flags for experiments.train]}
shift 2
if [[ "${1:-}" == "--" ]]; then shift; fi
REPO=${FLASHRL_REPO_DIR:-'~/flashrl_jax'}
FLAGS=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all \
  --command="cd $REPO && .venv/bin/python -m experiments.train --coordinator=auto $FLAGS"
