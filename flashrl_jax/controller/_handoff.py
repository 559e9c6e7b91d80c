"""Checkpoint-based weight handoff: export version v, then suspend -> load -> resume every server.

The trainer writes an HF safetensors directory atomically (`export_version`); the servers are paused
(`/pause_generation` in the configured mode), told to load it (`/update_weights_from_disk` with the
version number) and resumed (`/continue_generation`). In abort mode the client re-submits each
aborted request as a continuation under the new weights, keeping the tokens and behaviour log-probs
already produced; in in_place mode requests keep their state. Nothing in flight is lost. Every phase
is timed, since the paper attributes part of async's overhead to it.
"""

from __future__ import annotations

import asyncio
import os
import time

from flashrl_jax.fleet import PauseMode, RolloutClient, Supervisor
from flashrl_jax.trainer import Trainer
from flashrl_jax.trainer._export import VersionStore, verify_version


def export_current(trainer: Trainer, store: VersionStore) -> str:
  """Exports the trainer's policy version, reusing an intact export left by a previous process."""
  path = store.path(trainer.policy_version)
  if os.path.exists(path):
    verify_version(path)  # raises on a damaged directory rather than serving it
    return path
  return store.export(trainer.model(), trainer.policy_version, config=trainer.model_config,
                      step=trainer.step)


async def publish_version(trainer: Trainer, store: VersionStore, client: RolloutClient,
                          pause_mode: PauseMode, *, keep_versions: int) -> dict[str, float]:
  version = trainer.policy_version
  t0 = time.perf_counter()
  path = await asyncio.to_thread(export_current, trainer, store)
  t1 = time.perf_counter()
  await client.pause(pause_mode)
  t2 = time.perf_counter()
  try:
    await client.update_weights_from_disk(path, str(version))
  finally:
    t3 = time.perf_counter()
    await client.continue_generation()
  t4 = time.perf_counter()
  store.gc(keep_last=keep_versions)
  return {"time/export_s": t1 - t0, "time/pause_s": t2 - t1, "time/load_s": t3 - t2,
          "time/resume_s": t4 - t3}


async def publish(trainer: Trainer, store: VersionStore, supervisor: Supervisor,
                  pause_mode: PauseMode, *, keep_versions: int) -> dict[str, float]:
  """Exports the trainer's version, then hands it to the fleet through the supervisor (servers that
  fail the handoff go to its recovery path); the run's weight publish."""
  t0 = time.perf_counter()
  path = await asyncio.to_thread(export_current, trainer, store)
  times = {"time/export_s": time.perf_counter() - t0}
  times.update(await supervisor.handoff(path, trainer.policy_version, pause_mode))
  store.gc(keep_last=keep_versions)
  return times
