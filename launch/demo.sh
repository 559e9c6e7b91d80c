#!/usr/bin/env bash
# Sets up .venv (runtime requirements) and runs the main job: the CPU async-RL demo.
# A tiny model is warm-started by a short supervised run (cached in .cache/demo_model), then trained
# with async RL (α = 2, two rollout server processes + the trainer) on a long-tail "repeat" task;
# reward goes up, and reward/staleness/time plots land in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}  # the CPU demo
exec .venv/bin/python -m experiments.train --workdir=runs/demo "$@"
