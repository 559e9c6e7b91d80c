"""The two training policies, sync (barrier) and async (rollout–train decoupled with α).

Why: these are the policies the controller implements (`flashrl_jax.controller`, issue 7), written
as small strategy objects that drive a simulated run through a handful of primitives (`issue`,
`train`, `sync`, `drop`).

Sync: the rollout GPUs generate the whole batch of B prompts, everyone waits for the last response
and reward, the trainer trains, the new weights are loaded; nothing overlaps. Colocated (the
paper's ROLL-Sync) means the same GPUs do both phases.

Async: the GPUs are split into a rollout pool and a train pool. Both rules are the controller's
own objects from `flashrl_jax.scheduling`, not re-implementations: a `StalenessBound` decides how
many prompts may be issued (`dispatch_room`: the batch a new prompt lands in is at most α versions
ahead of the weights the servers hold, which implies the paper's cap of (1+α)·B prompts in flight
or buffered, and with α = 0 stops generation during training) and a `SampleBuffer` holds complete
groups; the trainer at version t takes B of them whose every sample started at a version v ≥ t − α,
earliest deadline (v + α) first, waiting for an in-flight group that would otherwise miss its
deadline; the staler ones are dropped (counted) and their prompts re-issued. After
each step the trainer exports the new version; the servers' pause, load and resume then run either
before the trainer takes the next batch, or behind the next training step (`publish_behind`: the
trainer waits only for its export and for the previous handoff, as the controller's async loop
does).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flashrl_jax.scheduling import SampleBuffer, StalenessBound

if TYPE_CHECKING:
  from flashrl_jax.sim._simulate import Run
  from flashrl_jax.sim._worker import Group


@dataclasses.dataclass(frozen=True)
class SyncTraining:
  """Synchronous baseline: generate the whole batch, wait for the longest, train, load weights.

  Attributes:
    train_gpus: None for the colocated baseline (every GPU generates, then every GPU trains, as in
      the paper's ROLL-Sync); an integer for disaggregated pools (the controller's `--mode=sync`
      on separate rollout and trainer processes).
  """

  train_gpus: int | None = None

  def __post_init__(self):
    if self.train_gpus is not None and self.train_gpus < 1:
      raise ValueError(f"train_gpus must be >= 1 or None, got {self.train_gpus}")

  def pools(self, gpus: int) -> tuple[int, int]:
    """(rollout GPUs, train GPUs); colocated means both are every GPU."""
    if self.train_gpus is None:
      return gpus, gpus
    return _split(gpus, self.train_gpus)

  def start(self, run: Run) -> None:
    run.step_started = run.loop.now
    run.issue(run.config.batch_prompts)

  def on_ready(self, run: Run, group: Group) -> None:
    run.batch.append(group)
    if len(run.batch) == run.config.batch_prompts:
      batch, run.batch = run.batch, []
      run.outstanding -= len(batch)
      run.train(batch, then=lambda: self._trained(run))

  def _trained(self, run: Run) -> None:
    # Nothing is in flight, so the handoff simply stops everything for its full cost.
    run.loop.at(run.loop.now + run.config.cost.sync.total_s, self._synced, run)

  def _synced(self, run: Run) -> None:
    run.rollout_version = run.version
    run.trainer_idle()  # waiting for data is timed from here, as in the controller
    if not run.finished:
      self.start(run)


@dataclasses.dataclass(frozen=True)
class AsyncTraining:
  """Rollout–train decoupling with per-sample staleness bound α (the async ratio).

  Attributes:
    alpha: α ≥ 0, the largest allowed `t − v` between the trainer's version t at consumption and
      the version v at which a sample's generation started.
    train_gpus: GPUs of the train pool; the rest serve rollout.
    abort_hopeless: at each update, abort in-flight groups that can no longer be fresh (the
      controller instead lets them finish and drops them from the buffer, the default here).
    publish_behind: hand each new version to the servers behind the next training step (the
      trainer waits for its export and for the previous handoff only) instead of before it; None:
      as the controller does (`StalenessBound.hands_over_behind_training`: at α >= 1).
  """

  alpha: int = 2
  train_gpus: int = 1
  abort_hopeless: bool = False
  publish_behind: bool | None = None

  @property
  def behind(self) -> bool:
    if self.publish_behind is not None:
      return self.publish_behind
    return StalenessBound(self.alpha, 1).hands_over_behind_training

  def __post_init__(self):
    if self.alpha < 0 or self.train_gpus < 1:
      raise ValueError(f"need alpha >= 0 and train_gpus >= 1, got {self}")

  def pools(self, gpus: int) -> tuple[int, int]:
    return _split(gpus, self.train_gpus)

  def start(self, run: Run) -> None:
    run.bound = StalenessBound(self.alpha, run.config.batch_prompts)
    run.samples = SampleBuffer(run.bound)
    self._refill(run)

  def on_ready(self, run: Run, group: Group) -> None:
    run.samples.put(group)
    self._try_train(run)

  def _refill(self, run: Run) -> None:
    if run.finished:
      return
    # The controller's next consumption is at t + 1 while a step trains (its `takes` counter).
    t_next = run.version + (1 if run.training else 0)
    run.issue(run.bound.dispatch_room(run.outstanding, t_next, run.rollout_version))

  def _try_train(self, run: Run) -> None:
    if run.trainer_busy or run.finished:
      return
    # As the controller: earliest deadline first, waiting for an in-flight group that would
    # otherwise miss its deadline.
    taken = run.samples.take(run.config.batch_prompts, run.version,
                             [g.start_version for g in run.in_flight()])
    if taken is not None and taken.stale:
      run.drop(taken.stale)
    if taken is not None and taken.groups:
      run.outstanding -= len(taken.groups)
      run.train(taken.groups, then=lambda: self._trained(run))
    self._refill(run)

  def _trained(self, run: Run) -> None:
    if self.abort_hopeless:
      doomed = [g for g in run.in_flight() if not run.bound.is_fresh(run.version, g.start_version)]
      if doomed:
        run.drop(doomed)
    # The trainer exports, then the servers pause, load and resume: before the trainer takes the
    # next batch, or behind its next step (it waits for the previous handoff only).
    run.trainer_busy = True
    run.loop.at(run.loop.now + run.config.cost.sync.export_s, self._exported, run)

  def _exported(self, run: Run) -> None:
    if not self.behind:
      run.sync(run.version, then=lambda: self._published(run))
      return
    run.loop.at(max(run.loop.now, run.sync_free_at), self._hand_over, run)

  def _hand_over(self, run: Run) -> None:
    run.sync(run.version, then=lambda: self._refill(run))  # the new version frees dispatch room
    self._published(run)

  def _published(self, run: Run) -> None:
    run.trainer_idle()
    self._refill(run)
    self._try_train(run)


def _split(gpus: int, train_gpus: int) -> tuple[int, int]:
  if train_gpus >= gpus:
    raise ValueError(f"train_gpus={train_gpus} leaves no rollout GPU out of {gpus}")
  return gpus - train_gpus, train_gpus
