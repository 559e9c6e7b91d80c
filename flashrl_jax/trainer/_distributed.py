"""Multi-process set-up, and host data -> global arrays that work with one process or many.

Why: on a multi-host slice every process runs the same program over a global mesh. JAX must be told
the coordinator and this process's rank before any device is touched, and a host NumPy batch must
become one global array of which each process supplies only its addressable shards. Both are done
here the same way for 1 and N processes, so the trainer has no multi-host branch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

ENV_COORDINATOR = "FLASHRL_COORDINATOR"
ENV_NUM_PROCESSES = "FLASHRL_NUM_PROCESSES"
ENV_PROCESS_ID = "FLASHRL_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Where the coordinator listens (`host:port`) and who this process is; one process by default."""

  coordinator: str | None = None
  num_processes: int = 1
  process_id: int = 0

  def __post_init__(self):
    if self.num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {self.num_processes}.")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id={self.process_id} is not in [0, {self.num_processes}).")
    if self.num_processes > 1 and not self.coordinator:
      raise ValueError("A multi-process run needs a coordinator address 'host:port'.")
    if self.coordinator and ":" not in self.coordinator:
      raise ValueError(f"coordinator must be 'host:port', got {self.coordinator!r}.")

  @property
  def is_multiprocess(self) -> bool:
    return self.num_processes > 1

  @classmethod
  def from_env(cls, env: Mapping[str, str] | None = None) -> "DistributedConfig":
    """Reads `FLASHRL_COORDINATOR`, `FLASHRL_NUM_PROCESSES`, `FLASHRL_PROCESS_ID`."""
    env = os.environ if env is None else env
    return cls(coordinator=env.get(ENV_COORDINATOR) or None,
               num_processes=int(env.get(ENV_NUM_PROCESSES, "1")),
               process_id=int(env.get(ENV_PROCESS_ID, "0")))


def initialize_distributed(config: DistributedConfig | None = None, *,
                           coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> DistributedConfig:
  """Calls `jax.distributed.initialize` for a multi-process run; a no-op for one process.

  Arguments override `config`, which defaults to the environment (`DistributedConfig.from_env`).
  Must run before anything touches a JAX device. On CPU, cross-process collectives use gloo.
  """
  config = config or DistributedConfig.from_env()
  overrides = {k: v for k, v in dict(coordinator=coordinator, num_processes=num_processes,
                                     process_id=process_id).items() if v is not None}
  config = dataclasses.replace(config, **overrides)
  if config.is_multiprocess:
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id)
  return config


def host_to_global(value: np.ndarray, sharding: Sharding) -> jax.Array:
  """A global array from a host array every process holds in full; each supplies its own shards."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def tree_to_global(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(host_to_global, tree, shardings)


def to_host(tree: Any) -> Any:
  """Global arrays -> full NumPy arrays in every process (a collective when multi-process)."""

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  return jax.tree.map(one, tree)
