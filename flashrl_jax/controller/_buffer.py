"""The sample buffer and the per-sample staleness bound (the async ratio α of ROLL Flash).

Two rules keep asynchronous training stable and are enforced here, nowhere else:
- consumption: the trainer at version `t` may train on a group whose generation started at version
  `v` only if `t - v <= α`; older groups are dropped (counted, never silently) and their prompts are
  handed back for re-issue;
- admission: at most `(1 + α) * B` prompt groups are in flight or buffered, so the generator can run
  at most α steps ahead of the trainer. `α = 0` is strictly on-policy.
Staleness is judged at consumption time, so time spent waiting in the buffer counts.
"""

from __future__ import annotations

import collections
import dataclasses

from flashrl_jax.controller._samples import Group


@dataclasses.dataclass(frozen=True)
class StalenessBound:
  async_ratio: int  # α
  batch_size: int  # B, prompt groups per training step

  def __post_init__(self):
    if self.async_ratio < 0:
      raise ValueError(f"async_ratio must be >= 0, got {self.async_ratio}.")
    if self.batch_size <= 0:
      raise ValueError(f"batch_size must be > 0, got {self.batch_size}.")

  @property
  def max_outstanding(self) -> int:
    """Prompt groups allowed in flight or buffered at once."""
    return (1 + self.async_ratio) * self.batch_size

  def may_dispatch(self, outstanding: int, next_consume_version: int,
                   published_version: int) -> bool:
    """Whether one more group, generated from `published_version` now, can still be fresh.

    `outstanding` groups (in flight or buffered) are consumed B per step, FIFO, starting at
    trainer version `next_consume_version`; the new group would be consumed at
    `next_consume_version + outstanding // B`. When no training is pending this is exactly the
    `(1 + α)·B` cap; while the trainer is ahead of the servers it is tighter, so α = 0 never
    generates a sample that would be stale on arrival.
    """
    consume_at = next_consume_version + outstanding // self.batch_size
    return consume_at - published_version <= self.async_ratio

  def staleness(self, trainer_version: int, group: Group) -> int:
    return trainer_version - group.start_version

  def is_fresh(self, trainer_version: int, group: Group) -> bool:
    return self.staleness(trainer_version, group) <= self.async_ratio


@dataclasses.dataclass
class TakeResult:
  groups: list[Group]
  stale: list[Group]  # dropped for staleness; their prompts must be re-issued


class SampleBuffer:
  """FIFO of complete groups; `take` applies the consumption rule."""

  def __init__(self, bound: StalenessBound):
    self.bound = bound
    self._groups: collections.deque[Group] = collections.deque()
    self.dropped_stale = 0

  def __len__(self) -> int:
    return len(self._groups)

  def put(self, group: Group) -> None:
    if not group.complete:
      raise ValueError(f"group {group.prompt_index} is incomplete ({len(group.responses)}/{group.n}).")
    self._groups.append(group)

  def drop_stale(self, trainer_version: int) -> list[Group]:
    stale = [g for g in self._groups if not self.bound.is_fresh(trainer_version, g)]
    if stale:
      self._groups = collections.deque(
          g for g in self._groups if self.bound.is_fresh(trainer_version, g))
      self.dropped_stale += len(stale)
    return stale

  def take(self, count: int, trainer_version: int) -> TakeResult | None:
    """Drops stale groups, then returns the `count` oldest fresh ones, or None if too few remain."""
    stale = self.drop_stale(trainer_version)
    if len(self._groups) < count:
      return TakeResult(groups=[], stale=stale) if stale else None
    groups = [self._groups.popleft() for _ in range(count)]
    return TakeResult(groups=groups, stale=stale)

  def drain_view(self) -> list[Group]:
    """The buffered groups, oldest first, without removing them."""
    return list(self._groups)

  def drain(self) -> list[Group]:
    groups = list(self._groups)
    self._groups.clear()
    return groups
