"""Saves a `TrainState` sharded fsdp=8 on 8 fake CPU devices and restores it onto other meshes.

`python tests/ckpt_mesh.py DIR` (run by tests/test_trainer_checkpoint.py in a fresh process so the
device count can be forced). The shardings come from the trainer's own rules table on each mesh;
prints `OK` when every restore has the saved values and exactly the requested shardings, and the
state restored on the 3-axis mesh exports (gathered from its shards) to the same weights.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from flashrl_jax.testing import tiny_config  # noqa: E402
from flashrl_jax.trainer import (TrainConfig, abstract_train_state, export_version,  # noqa: E402
                                 make_mesh)
from flashrl_jax.model import load_hf, verify_version  # noqa: E402
from flashrl_jax.trainer._checkpoint import CheckpointConfig, Checkpointer  # noqa: E402


def _random_state(abstract, seed: int = 0):
  """The abstract state filled from NumPy and placed on its shardings (nothing to compile)."""
  rng = np.random.default_rng(seed)

  def one(x):
    if np.issubdtype(x.dtype, np.floating):
      value = rng.standard_normal(x.shape).astype(x.dtype)
    else:
      value = rng.integers(0, 2**31 - 1, x.shape).astype(x.dtype)
    return jax.device_put(value, x.sharding)

  return jax.tree.map(one, abstract)


def _check(restored, saved, abstract) -> None:
  for got, want, target in zip(jax.tree.leaves(restored), jax.tree.leaves(saved),
                               jax.tree.leaves(abstract)):
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(target.sharding, got.ndim), (got.sharding, target.sharding)


def main(directory: str) -> None:
  assert jax.device_count() == 8
  model_config, train_config = tiny_config(), TrainConfig()
  _, abstract8 = abstract_train_state(model_config, train_config, make_mesh("fsdp:8"))
  state = _random_state(abstract8)
  assert state.params["embed"].get_value().sharding.spec == P("tensor", "fsdp")  # vocab, embed
  with Checkpointer(CheckpointConfig(directory, async_save=True)) as ckpt:
    ckpt.save(7, state, {"cursor": 7})

  for spec, devices in (("data:2,fsdp:2,tensor:2", jax.devices()), ("fsdp:1", jax.devices()[3:4])):
    mesh = make_mesh(spec, devices)
    _, abstract = abstract_train_state(model_config, train_config, mesh)
    with Checkpointer(CheckpointConfig(directory)) as ckpt:  # As a fresh process would.
      restored, extra = ckpt.restore_latest(abstract)
    assert extra == {"cursor": 7}, extra
    _check(restored, state, abstract)
    embed = restored.params["embed"].get_value()
    assert embed.sharding.mesh.shape == mesh.shape, (spec, embed.sharding)
    print(f"{spec}: {embed.sharding.spec} on {len(embed.sharding.device_set)} devices", flush=True)
    if len(devices) == 8:
      path = export_version(restored, 7, directory.rstrip("/") + "-exports", config=model_config)
      verify_version(path)
      exported = nnx.state(load_hf(path), nnx.Param)
      for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  print("OK", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
