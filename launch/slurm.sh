#!/usr/bin/env bash
# One RL run over the tasks of a SLURM job step: one `experiments.train` process per task (one per
# node is the usual layout). Each process reads SLURM's variables (SLURM_NTASKS, SLURM_PROCID, the
# node list, the job id for the coordinator port; FLASHRL_COORDINATOR_PORT overrides the port) to
# join jax.distributed; the first task is process 0 and also runs the controller and the rollout
# servers. The repository (with its .venv), the model and --workdir must be on a filesystem every
# node mounts. Submit from the repository root:
#
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 launch/slurm.sh -- \
#       --config=experiments/configs/<file>.py --mesh=fsdp:16 --workdir=/shared/runs/x
#
#SBATCH --job-name=flashrl
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [[ "${1:-}" == "--" ]]; then shift; fi
# --kill-on-bad-exit: if one task fails, SLURM stops the others too (they would exit anyway, naming
# the lost process, once they see it gone).
exec srun --kill-on-bad-exit=1 .venv/bin/python -m experiments.train "$@"
