"""Tiny models and fixtures shared by tests, demos and benchmarks (no downloads)."""

import glob
import os
import sys

import numpy as np
from safetensors.numpy import load_file

from flashrl_jax.testing import _stub
from flashrl_jax.testing._stub import stub_logprob, stub_next_token
from flashrl_jax.testing._tiny import tiny_config, tiny_model, write_tiny_checkpoint


def stub_server_command() -> tuple[str, ...]:
  """The protocol stub server, run as a script (no JAX import: it starts in a blink); the
  `LocalServers.start(command=...)` for fake-model fleets."""
  return (sys.executable, _stub.__file__)


def read_weights(path: str) -> dict[str, np.ndarray]:
  """Every tensor of every `*.safetensors` file in directory `path` (an exported policy version),
  by name: to compare two exports."""
  out = {}
  for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
    out.update(load_file(file))
  return out


__all__ = ["read_weights", "stub_logprob", "stub_next_token", "stub_server_command", "tiny_config",
           "tiny_model", "write_tiny_checkpoint"]
