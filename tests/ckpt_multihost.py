"""One of two `jax.distributed` processes (2 fake CPU devices each) that checkpoint, restore onto
another global mesh, and export a `TrainState` together; prints `OK <process id>`.

  python tests/ckpt_multihost.py DIR COORDINATOR PROCESS_ID
Only process 0 writes the exported version; both then verify it (the filesystem is shared).
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from flashrl_jax.model import load_hf, verify_version  # noqa: E402
from flashrl_jax.testing import tiny_config  # noqa: E402
from flashrl_jax.trainer import (TrainConfig, abstract_train_state, export_version,  # noqa: E402
                                 host_to_global, initialize_distributed, make_mesh, to_host)
from flashrl_jax.trainer._checkpoint import CheckpointConfig, Checkpointer  # noqa: E402


def main(directory: str, coordinator: str, process_id: int) -> None:
  initialize_distributed(coordinator=coordinator, num_processes=2, process_id=process_id)
  assert jax.device_count() == 4 and jax.local_device_count() == 2
  model_config, train_config = tiny_config(), TrainConfig()
  _, abstract = abstract_train_state(model_config, train_config, make_mesh("fsdp:2,tensor:2"))
  rng = np.random.default_rng(0)  # The same host values in every process; each places its shards.
  host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype)
                      if np.issubdtype(x.dtype, np.floating)
                      else rng.integers(0, 1000, x.shape).astype(x.dtype), abstract)
  state = jax.tree.map(lambda v, x: host_to_global(v, x.sharding), host, abstract)
  with Checkpointer(CheckpointConfig(os.path.join(directory, "ckpt"))) as ckpt:
    ckpt.save(3, state, {"cursor": 3})
  _, target = abstract_train_state(model_config, train_config, make_mesh("data:2,fsdp:2"))
  with Checkpointer(CheckpointConfig(os.path.join(directory, "ckpt"))) as ckpt:
    restored, extra = ckpt.restore_latest(target)
  assert extra == {"cursor": 3}, extra
  for got, want in zip(jax.tree.leaves(to_host(restored)), jax.tree.leaves(host)):
    np.testing.assert_array_equal(got, want)

  path = export_version(restored, 1, os.path.join(directory, "exports"), config=model_config,
                        step=3)
  assert verify_version(path)["step"] == 3
  if process_id == 0:
    loaded = nnx.state(load_hf(path), nnx.Param)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(host.params)):
      np.testing.assert_array_equal(np.asarray(got), want)
  print(f"OK {process_id}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
