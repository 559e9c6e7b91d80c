"""`Learner`: everything the controller asks of the trainer's devices, behind one small handle.

The loop trains (`update`), exports each new policy version for the fleet (`export`), checkpoints
(`save` / `restore`) and evaluates (`evaluate`). Each of these runs jitted programs over the global
train state, so in a multi-process run each is a collective that every process must join; keeping
them behind this one handle is what lets the loop stay the same for one process or many.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable

from flashrl_jax.model import Decoder
from flashrl_jax.trainer import (Checkpointer, CorruptVersionError, Trainer, Trajectory,
                                 VersionStore, abstract_train_state, verify_version)

log = logging.getLogger(__name__)


class Learner:
  """The trainer, its checkpoints and its exported versions.

  `evaluator(model) -> {name: value}`: the held-out metrics of a policy (None: no evaluation).
  """

  def __init__(self, trainer: Trainer, store: VersionStore, checkpointer: Checkpointer, *,
               keep_versions: int,
               evaluator: Callable[[Decoder], dict[str, float]] | None = None):
    self.trainer, self.store, self.checkpointer = trainer, store, checkpointer
    self.keep_versions, self.evaluator = keep_versions, evaluator
    self._held: int | None = None  # the version the fleet serves: kept by garbage collection

  @property
  def policy_version(self) -> int:
    return self.trainer.policy_version

  def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
    return self.trainer.update(trajectories)

  def export(self) -> str:
    """Exports the current policy version, reusing an intact export left by a previous process
    (a damaged one is written again)."""
    path = self.store.path(self.policy_version)
    if os.path.exists(path):
      try:
        verify_version(path)
        return path
      except CorruptVersionError as error:
        log.error("the export of version %d is damaged (%s); writing it again",
                  self.policy_version, error)
        self.store.discard(self.policy_version)
    return self.store.export(self.trainer.model(), self.policy_version,
                             config=self.trainer.model_config, step=self.trainer.step)

  def reexport(self) -> str:
    """Writes the current version's export again from the trainer's weights (servers refused the
    directory: it was damaged after it was written, or its disk fails)."""
    log.warning("writing policy version %d again", self.policy_version)
    self.store.discard(self.policy_version)
    return self.export()

  def hold(self, version: int) -> None:
    """Keeps `version`'s export from garbage collection (the fleet serves it: a restarted server
    loads it), releasing the one held before."""
    if version == self._held:
      return
    try:
      self.store.acquire(version)
    except FileNotFoundError:  # not exported by this run (the servers' initial weights)
      return
    if self._held is not None:
      self.store.release(self._held)
    self._held = version

  def collect_garbage(self) -> None:
    """Deletes exported versions beyond the newest `keep_versions` that nothing holds."""
    self.store.gc(keep_last=self.keep_versions)

  def evaluate(self) -> dict[str, float] | None:
    return None if self.evaluator is None else self.evaluator(self.trainer.model())

  def save(self, step: int, extra: dict[str, Any]) -> None:
    self.checkpointer.save(step, self.trainer.state, extra)

  def restore(self) -> dict[str, Any] | None:
    """Restores the latest good checkpoint into the trainer; returns its extra state (or None).

    Exports newer than the restored policy are deleted: a killed run wrote them after its last
    checkpoint, so their weights are not the ones this run will train (and must never be served).
    """
    target = abstract_train_state(self.trainer.model_config, self.trainer.config,
                                  self.trainer.mesh)[1]
    restored = self.checkpointer.restore_latest(target)
    extra = None
    if restored is not None:
      state, extra = restored
      self.trainer.set_state(state)
    for stale in [v for v in self.store.versions() if v > self.policy_version]:
      log.warning("removing policy version %d exported after the restored checkpoint", stale)
      shutil.rmtree(self.store.path(stale))
    return extra

  def close(self) -> None:
    self.checkpointer.wait()
    self.checkpointer.close()
