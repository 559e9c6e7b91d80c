"""Shared pytest setup: keep JAX on CPU, in float32, and quiet."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def run_model(tmp_path_factory) -> str:
  """A tiny random model for runs launched as processes (1024 positions: any packed row fits)."""
  # Imported here: conftest must not import JAX for tests that check a package stays JAX-free.
  from flashrl_jax.testing import tiny_config, write_tiny_checkpoint
  path = str(tmp_path_factory.mktemp("model"))
  write_tiny_checkpoint(path, tiny_config(max_position_embeddings=1024))
  return path


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> str:
  """One persistent compilation cache per module: each launch compiles nothing the last did."""
  return str(tmp_path_factory.mktemp("jax_cache"))
