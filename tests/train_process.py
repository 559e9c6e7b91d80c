"""What the tests that launch `python -m experiments.train` as processes share: the environment
(CPU JAX, a persistent compilation cache so each launch compiles nothing the last one did) and a
liveness check for the processes a SIGKILLed run leaves behind."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_env(jax_cache: str, **extra: str) -> dict[str, str]:
  """The environment of a launched run, compiling into (and loading from) `jax_cache`."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": jax_cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **extra}


def alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie does not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split()[2] != "Z"
