"""Saves a train state sharded fsdp=8 on 8 fake CPU devices and restores it onto other meshes.

`python tests/ckpt_mesh.py DIR` (run by tests/test_trainer_checkpoint.py in a fresh process so the
device count can be forced); prints `OK` when every restore has the saved values and exactly the
requested shardings.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

from flax import nnx  # noqa: E402

from flashrl_jax.testing import tiny_config, tiny_model  # noqa: E402
from flashrl_jax.trainer._checkpoint import CheckpointConfig, Checkpointer  # noqa: E402


def _host_state() -> dict:
  """A train-state-shaped pytree of host arrays (no per-shape compilations to build it)."""
  _, abstract = nnx.split(nnx.eval_shape(lambda: tiny_model(tiny_config())), nnx.Param)
  rng = np.random.default_rng(0)
  randn = lambda x: rng.standard_normal(x.shape).astype(x.dtype)  # noqa: E731
  return {"params": jax.tree.map(randn, abstract),
          "opt_state": {"mu": jax.tree.map(randn, abstract), "count": np.int32(3)},
          "step": np.int32(7), "rng": jax.random.key(0)}


def _fsdp_spec(x, n: int) -> P:
  return P("fsdp") if x.ndim and x.shape[0] % n == 0 else P()


def _3d_spec(x) -> P:
  """fsdp on the first axis, tensor on the last, where they divide (a different layout from 8-way)."""
  if x.ndim == 0:
    return P()
  spec = ["fsdp" if x.shape[0] % 2 == 0 else None] + [None] * (x.ndim - 1)
  if x.ndim > 1 and x.shape[-1] % 2 == 0:
    spec[-1] = "tensor"
  return P(*spec)


def _check(restored, state, shardings) -> None:
  for got, want, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                                 jax.tree.leaves(shardings)):
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(sharding, got.ndim), (got.sharding, sharding)


def main(directory: str) -> None:
  assert jax.device_count() == 8
  state = _host_state()
  mesh8 = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  state = jax.device_put(state, jax.tree.map(lambda x: NamedSharding(mesh8, _fsdp_spec(x, 8)),
                                             state))
  assert state["params"]["embed"].get_value().sharding.spec == P("fsdp")
  with Checkpointer(CheckpointConfig(directory, async_save=True)) as ckpt:
    ckpt.save(7, state, {"cursor": 7})

  mesh3 = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  single = SingleDeviceSharding(jax.devices()[3])
  for shardings in (jax.tree.map(lambda x: NamedSharding(mesh3, _3d_spec(x)), state),
                    jax.tree.map(lambda x: single, state)):
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)
    with Checkpointer(CheckpointConfig(directory)) as ckpt:  # A fresh process would do this.
      restored, extra = ckpt.restore_latest(abstract)
    assert extra == {"cursor": 7}, extra
    _check(restored, state, shardings)
  q = restored["params"]["layers"][0]["attn"]["q_proj"].get_value()
  assert q.sharding == single
  print("OK", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
