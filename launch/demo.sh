#!/usr/bin/env bash
# Sets up .venv (runtime requirements) and runs the main job: the CPU async-RL demo.
# A tiny model is warm-started by a short supervised run on question/answer pairs of a reasoning-gym
# generator (spell_backward, cached in .cache/demo_model), then trained with async RL (α = 2, two
# rollout server processes + the trainer) on the same generator; the held-out accuracy goes up, and
# reward/staleness/time plots land in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "flashrl_jax demo: checking .venv (the first time installs requirements.txt: a few minutes)"
bash launch/setup.sh
echo "flashrl_jax demo: starting (importing JAX and reasoning-gym)"
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}  # the CPU demo
exec .venv/bin/python -m experiments.train --workdir=runs/demo "$@"
