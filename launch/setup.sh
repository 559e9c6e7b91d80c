#!/usr/bin/env bash
# Creates .venv/ at the repo root from the pinned requirements (idempotent).
#   launch/setup.sh          runtime requirements only
#   launch/setup.sh --test   runtime + test-only requirements (torch CPU, transformers, pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp() { sha1sum "$@" | sha1sum | cut -c1-16; }
want=requirements.txt
[ "${1:-}" = "--test" ] && want="requirements.txt requirements-test.txt"
key=$(stamp $want)
if [ "$(cat .venv/.installed 2>/dev/null)" != "$key" ]; then
  for f in $want; do .venv/bin/python -m pip install -q -r "$f"; done
  echo "$key" > .venv/.installed
fi
