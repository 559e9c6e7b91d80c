#!/usr/bin/env bash
# Sets up .venv (runtime + test requirements) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
