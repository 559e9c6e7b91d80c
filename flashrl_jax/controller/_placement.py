"""Where every part of a run executes: cores, accelerators and device variables, decided up front.

Why a plan: pinning the trainer, the controller thread and each rollout server, and hiding the
rollout accelerators from the trainer, are process-wide side effects that must happen in a fixed
order (before JAX starts its thread pool or its backend). `plan_placement` decides them all as a
pure function of the config and the machine, so they can be read and tested; `applied` performs
them once, at the entry of `run`, and undoes them on exit.

CPU: in async mode rollout servers and the trainer get disjoint cores (`ResourceConfig.cpu_split`),
and the controller's event loop runs on the trainer's cores (on the rollout side's when the trainer
shares the controller's process); sync mode time-shares every core, which is the same budget.
GPU/TPU: accelerators 0..R-1 serve rollout (split evenly over the servers) and the trainer sees
R..R+T-1 (0..T-1 in sync mode, and in async mode with `share_accelerators`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence

from flashrl_jax.controller._config import Mode, RolloutBackend, RunConfig
from flashrl_jax.fleet import device_env

Cpus = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
  """The default places nothing (a trainer-only process of a multi-process run)."""
  trainer_cpus: Cpus | None = None  # this process (JAX's thread pool); None: left alone
  controller_cpus: Cpus | None = None  # the event loop thread; None: same as the trainer
  server_cpus: tuple[Cpus, ...] | None = None  # one core set per local server (CPU only)
  server_env: tuple[dict[str, str], ...] | None = None  # per local server: its device variables
  # Per local server: it shares a core with the trainer, which goes first (CPU async only).
  server_background: tuple[bool, ...] | None = None
  environ: tuple[tuple[str, str], ...] = ()  # set in this process before JAX starts
  num_servers: int = 0  # local servers to start (0 for external SGLang servers)


def plan_placement(config: RunConfig, cores: Sequence[int]) -> Placement:
  """The placement of `config` on a machine whose usable cores are `cores` (pure)."""
  resources, rollout = config.resources, config.rollout
  cores = tuple(sorted(cores))
  is_async = config.mode is Mode.ASYNC
  local = rollout.backend is not RolloutBackend.SGLANG
  n = rollout.num_servers
  if resources.platform == "cpu":
    if is_async:
      rollout_cores, train_cores = map(tuple, resources.cpu_split(list(cores)))
    else:
      rollout_cores = train_cores = cores
    n = n or len(rollout_cores)
    server_cpus = None
    if local:  # disjoint when there are enough, else round-robin over the rollout cores
      server_cpus = (_split(rollout_cores, n) if n <= len(rollout_cores)
                     else tuple((rollout_cores[i % len(rollout_cores)],) for i in range(n)))
    # A server on the trainer's core yields it to the trainer: every step waits for the trainer,
    # while a step needs only the earliest-done of the servers' many requests. Under equal shares
    # the shared core made a train step about twice its time alone (docs/benchmarks.md).
    background = None
    if is_async and server_cpus is not None:
      background = tuple(bool(set(cpus) & set(train_cores)) for cpus in server_cpus)
    # The controller's event loop runs with the trainer when the learner has a process of its own:
    # async's step is bounded by how fast the servers finish the longest response due by α, and
    # the loop beside the server slowed its decode more than the loop beside the trainer slowed
    # training (docs/benchmarks.md). A learner in this process (a multi-process run's process 0)
    # would wait for the loop's interpreter lock, so the loop goes to the rollout cores there.
    controller_cpus = None
    if is_async and not config.learner_process:
      controller_cpus = tuple(c for c in rollout_cores if c not in train_cores) or rollout_cores
    return Placement(trainer_cpus=train_cores, controller_cpus=controller_cpus,
                     server_cpus=server_cpus, server_env=None, server_background=background,
                     num_servers=n if local else 0)
  first = resources.rollout_devices if is_async and not resources.share_accelerators else 0
  visible = ",".join(str(i) for i in range(first, first + resources.train_devices))
  variable = "CUDA_VISIBLE_DEVICES" if resources.platform == "gpu" else "TPU_VISIBLE_CHIPS"
  server_env = None
  n = n or resources.rollout_devices
  if local:
    if resources.rollout_devices % n:
      raise ValueError(f"{resources.rollout_devices} rollout devices do not split evenly over "
                       f"{n} servers.")
    per = resources.rollout_devices // n
    ids = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    if resources.platform == "gpu":
      server_env = tuple(device_env(i, gpu_ids=ids) for i in range(n))
    else:
      if per != 1:
        raise ValueError("TPU rollout servers take one chip each; use --rollout_devices = servers.")
      server_env = tuple(device_env(i, tpu_ids=[i[0] for i in ids]) for i in range(n))
  return Placement(trainer_cpus=None, controller_cpus=None, server_cpus=None,
                   server_env=server_env, environ=((variable, visible),),
                   num_servers=n if local else 0)


def _split(cores: Cpus, n: int) -> tuple[Cpus, ...]:
  per = len(cores) // n
  return tuple(cores[i * per:(i + 1) * per] for i in range(n))


@contextlib.contextmanager
def applied(placement: Placement) -> Iterator[None]:
  """Pins this process and sets its device variables for the duration; restores both after."""
  cores = os.sched_getaffinity(0)
  saved = {key: os.environ.get(key) for key, _ in placement.environ}
  os.environ.update(dict(placement.environ))
  if placement.trainer_cpus is not None:
    os.sched_setaffinity(0, placement.trainer_cpus)
  try:
    yield
  finally:
    os.sched_setaffinity(0, cores)
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
