"""Multi-process set-up, and host data -> global arrays that work with one process or many.

Why: on a multi-host slice every process runs the same program over a global mesh. JAX must be told
the coordinator and this process's rank before any device is touched, and a host NumPy batch must
become one global array of which each process supplies only its addressable shards. Both are done
here the same way for 1 and N processes, so the trainer has no multi-host branch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

ENV_COORDINATOR = "FLASHRL_COORDINATOR"
ENV_NUM_PROCESSES = "FLASHRL_NUM_PROCESSES"
ENV_PROCESS_ID = "FLASHRL_PROCESS_ID"
AUTO = "auto"  # the coordinator, process count and id come from the cluster (JAX detects it)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Where the coordinator listens (`host:port`) and who this process is; one process by default."""

  coordinator: str | None = None
  num_processes: int = 1
  process_id: int = 0

  def __post_init__(self):
    if self.coordinator == AUTO:
      return
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
    return self.coordinator == AUTO or self.num_processes > 1

  @property
  def coordinator_host(self) -> str | None:
    if not self.coordinator or self.coordinator == AUTO:
      return None
    return self.coordinator.rsplit(":", 1)[0].strip("[]")

  @classmethod
  def from_env(cls, env: Mapping[str, str] | None = None) -> "DistributedConfig":
    """`FLASHRL_COORDINATOR` / `FLASHRL_NUM_PROCESSES` / `FLASHRL_PROCESS_ID` when set; else, in a
    SLURM step of several tasks, SLURM's own variables (one process per task, the coordinator on
    the step's first node, port `FLASHRL_COORDINATOR_PORT` or one derived from the job id); else
    one process."""
    env = os.environ if env is None else env
    if ENV_NUM_PROCESSES in env or ENV_COORDINATOR in env:
      return cls(coordinator=env.get(ENV_COORDINATOR) or None,
                 num_processes=int(env.get(ENV_NUM_PROCESSES, "1")),
                 process_id=int(env.get(ENV_PROCESS_ID, "0")))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
      nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
      port = int(env.get("FLASHRL_COORDINATOR_PORT",
                         12000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
      return cls(coordinator=f"{first_slurm_host(nodes)}:{port}",
                 num_processes=int(env["SLURM_NTASKS"]), process_id=int(env["SLURM_PROCID"]))
    return cls()


def first_slurm_host(nodelist: str) -> str:
  """The first host of a SLURM node list: `"gpu[03-05,9],cpu1"` -> `"gpu03"`."""
  first, depth = "", 0
  for ch in nodelist:  # the first comma outside brackets ends the first entry
    if ch == "," and depth == 0:
      break
    depth += (ch == "[") - (ch == "]")
    first += ch
  if not first:
    raise ValueError("SLURM gives no node list (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST).")
  # Each bracket group is a set of ranges: the first host takes the first value of each.
  return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def initialize_distributed(config: DistributedConfig | None = None, *,
                           coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> DistributedConfig:
  """Calls `jax.distributed.initialize` for a multi-process run; a no-op for one process, or when
  this process has already joined (it then returns the config as JAX knows it).

  Arguments override `config`, which defaults to the environment (`DistributedConfig.from_env`).
  Must run before anything touches a JAX device. On CPU, cross-process collectives use gloo.
  """
  config = config or DistributedConfig.from_env()
  overrides = {k: v for k, v in dict(coordinator=coordinator, num_processes=num_processes,
                                     process_id=process_id).items() if v is not None}
  config = dataclasses.replace(config, **overrides)
  if config.is_multiprocess and jax.distributed.is_initialized():  # the entry point did it
    return DistributedConfig(coordinator=config.coordinator, num_processes=jax.process_count(),
                             process_id=jax.process_index())
  if config.is_multiprocess:
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.coordinator == AUTO:  # a TPU slice or another cluster JAX recognises
      jax.distributed.initialize()
      config = DistributedConfig(coordinator=AUTO, num_processes=jax.process_count(),
                                 process_id=jax.process_index())
    else:
      jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id)
  return config


def shutdown_distributed() -> None:
  """Leaves `jax.distributed` (a barrier of every process) once a run has ended in order.

  Called right after the run's last operation, while every process is still there, rather than
  from JAX's exit hook, when the others may already be gone.
  """
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()


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
