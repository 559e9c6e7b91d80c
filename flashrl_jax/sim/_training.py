"""The two training policies, sync (colocated barrier) and async (rollout–train decoupled with α).

Why: these are the policies the controller implements (issue 7), written as small strategy objects
that drive a simulated run through a handful of primitives (`issue`, `train`, `sync`, `drop`).

Sync: every GPU generates the whole batch of B prompts, waits for the last response and reward,
then every GPU trains, then the new weights are loaded; nothing overlaps.

Async: the GPUs are split into a rollout pool and a train pool. The trainer at version t consumes
the first B fully scored groups in completion order whose every sample started at a version
v ≥ t − α; older groups are dropped (counted) and their prompts re-issued, and in-flight groups
that can no longer be consumed are aborted at each update. A new prompt is issued only while the
batch it will land in, t_next + ⌊outstanding/B⌋, is at most α versions ahead of the weights the
servers hold (t_next is the version the trainer will have when it next consumes). Since the servers
lag the trainer (v ≤ t ≤ t_next) this implies the paper's cap of (1+α)·B prompts in flight or
buffered, and with α = 0 it stops generation during training: the run is strictly on-policy.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from flashrl_jax.sim._simulate import Run
  from flashrl_jax.sim._worker import Group


@dataclasses.dataclass(frozen=True)
class SyncTraining:
  """Colocated synchronous baseline: generate all, wait for the longest, train on every GPU."""

  def pools(self, gpus: int) -> tuple[int, int]:
    """(rollout GPUs, train GPUs); colocated, so both are every GPU."""
    return gpus, gpus

  def start(self, run: Run) -> None:
    run.step_started = run.loop.now
    run.issue(run.config.batch_prompts)

  def on_ready(self, run: Run, group: Group) -> None:
    run.buffer.append(group)
    if len(run.buffer) == run.config.batch_prompts:
      batch, run.buffer = run.buffer, []
      run.outstanding -= len(batch)
      run.train(batch, then=lambda: self._trained(run))

  def _trained(self, run: Run) -> None:
    # Colocated: nothing is in flight, so the handoff simply stops everything for its full cost.
    run.loop.at(run.loop.now + run.config.cost.sync.total_s, self._synced, run)

  def _synced(self, run: Run) -> None:
    run.rollout_version = run.version
    if not run.finished:
      self.start(run)


@dataclasses.dataclass(frozen=True)
class AsyncTraining:
  """Rollout–train decoupling with per-sample staleness bound α (the async ratio).

  Attributes:
    alpha: α ≥ 0, the largest allowed `t − v` between the trainer's version t at consumption and
      the version v at which a sample's generation started.
    train_gpus: GPUs of the train pool; the rest serve rollout.
  """

  alpha: int = 2
  train_gpus: int = 1

  def __post_init__(self):
    if self.alpha < 0 or self.train_gpus < 1:
      raise ValueError(f"need alpha >= 0 and train_gpus >= 1, got {self}")

  def pools(self, gpus: int) -> tuple[int, int]:
    if self.train_gpus >= gpus:
      raise ValueError(f"train_gpus={self.train_gpus} leaves no rollout GPU out of {gpus}")
    return gpus - self.train_gpus, self.train_gpus

  def start(self, run: Run) -> None:
    self._refill(run)

  def on_ready(self, run: Run, group: Group) -> None:
    run.buffer.append(group)
    self._try_train(run)

  def _refill(self, run: Run) -> None:
    # Issue while t_next + ⌊outstanding/B⌋ − v ≤ α, i.e. up to (α + v − t_next + 1)·B outstanding.
    if run.finished:
      return
    t_next = run.version + (1 if run.training else 0)
    room = (self.alpha + run.rollout_version - t_next + 1) * run.config.batch_prompts
    run.issue(max(room - run.outstanding, 0))

  def _try_train(self, run: Run) -> None:
    if run.trainer_busy or run.finished:
      return
    stale = [g for g in run.buffer if run.version - g.oldest_version() > self.alpha]
    if stale:
      run.buffer = [g for g in run.buffer if g not in stale]
      run.drop(stale)
    batch_size = run.config.batch_prompts
    if len(run.buffer) >= batch_size:
      batch, run.buffer = run.buffer[:batch_size], run.buffer[batch_size:]
      run.outstanding -= len(batch)
      run.train(batch, then=lambda: self._trained(run))
    self._refill(run)

  def _trained(self, run: Run) -> None:
    # Groups still generating that already hold a sample too old for the new version are hopeless.
    doomed = [g for g in run.in_flight()
              if g.oldest_version() is not None and run.version - g.oldest_version() > self.alpha]
    if doomed:
      run.drop(doomed)
    run.trainer_busy = True  # exporting the new version
    run.loop.at(run.loop.now + run.config.cost.sync.export_s, self._exported, run)

  def _exported(self, run: Run) -> None:
    run.trainer_idle()
    run.sync(run.version, then=lambda: self._refill(run))
    self._try_train(run)
