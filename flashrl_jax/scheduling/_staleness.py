"""The per-sample staleness bound (the async ratio α of ROLL Flash) and the sample buffer.

Two rules keep asynchronous training stable; they are written here once, and the controller and
the simulator both run them:
- consumption: the trainer at version `t` may train on a group whose generation started at version
  `v` only if `t - v <= α`; older groups are dropped (counted, never silently) and their prompts are
  handed back for re-issue. Complete groups are consumed earliest deadline (`v + α`) first, and the
  trainer waits for an in-flight group that would otherwise miss its deadline, so a group with a
  long response is trained on, not dropped and re-issued (which would waste its generation and
  bias training toward short answers);
- admission: at most `(1 + α) * B` prompt groups are in flight or buffered, so the generator can run
  at most α steps ahead of the trainer (tighter while the servers lag the trainer: see
  `may_dispatch`). `α = 0` is strictly on-policy.
Staleness is judged at consumption time, so time spent waiting in the buffer counts.

The buffer holds anything with a `start_version` and a `complete` flag (`Buffered`): the
controller's groups of scored responses and the simulator's simulated groups alike.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Generic, Protocol, Sequence, TypeVar


class Buffered(Protocol):
  """What the buffer needs of a group: the oldest version its generation started at, and whether
  every response is scored."""

  @property
  def start_version(self) -> int: ...

  @property
  def complete(self) -> bool: ...


G = TypeVar("G", bound=Buffered)


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
  def hands_over_behind_training(self) -> bool:
    """Whether each new version goes to the servers behind the next training step (the trainer
    waits only for its export and the previous handoff). At α = 0 nothing can be generated before
    the handoff, so it gains nothing behind training and keeps the synchronous path."""
    return self.async_ratio > 0

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

  def dispatch_room(self, outstanding: int, next_consume_version: int,
                    published_version: int) -> int:
    """How many groups `may_dispatch` admits now, one after another (0 when it admits none).

    `may_dispatch(o)` holds iff `o // B <= α + published − next`, i.e. iff
    `o < (α + published − next + 1)·B`: the room is that product minus what is outstanding.
    """
    windows = self.async_ratio + published_version - next_consume_version + 1
    return max(windows * self.batch_size - outstanding, 0)

  def staleness(self, trainer_version: int, start_version: int) -> int:
    return trainer_version - start_version

  def is_fresh(self, trainer_version: int, start_version: int) -> bool:
    return self.staleness(trainer_version, start_version) <= self.async_ratio


@dataclasses.dataclass
class TakeResult(Generic[G]):
  groups: list[G]
  stale: list[G]  # dropped for staleness; their prompts must be re-issued


class SampleBuffer(Generic[G]):
  """The complete groups, in completion order; `take` applies the consumption rule."""

  def __init__(self, bound: StalenessBound):
    self.bound = bound
    self._groups: collections.deque[G] = collections.deque()
    self.dropped_stale = 0

  def __len__(self) -> int:
    return len(self._groups)

  def put(self, group: G) -> None:
    if not group.complete:
      raise ValueError(f"group {getattr(group, 'prompt_index', '?')} is incomplete: only complete "
                       "groups are buffered.")
    self._groups.append(group)

  def drop_stale(self, trainer_version: int) -> list[G]:
    fresh, stale = [], []
    for g in self._groups:
      (fresh if self.bound.is_fresh(trainer_version, g.start_version) else stale).append(g)
    if stale:
      self._groups = collections.deque(fresh)
      self.dropped_stale += len(stale)
    return stale

  def take(self, count: int, trainer_version: int,
           in_flight_starts: Sequence[int] = ()) -> TakeResult[G] | None:
    """Drops stale groups, then returns `count` fresh ones, earliest deadline first; None to wait.

    `in_flight_starts`: the start versions of groups still generating. The trainer waits (None)
    while taking now would leave some of them, or of the buffered groups, unable to be consumed by
    their deadline `start + α` (the takes at versions `t+1 .. t+k` hold `k·count` groups) — but only
    when waiting can help: the choice still holds a group due later than the ones that would miss.
    Under the admission rule (`may_dispatch`) nothing then goes stale. Without `in_flight_starts`
    this is earliest-deadline-first over the complete groups, never waiting.
    """
    stale = self.drop_stale(trainer_version)
    if len(self._groups) < count:
      return TakeResult(groups=[], stale=stale) if stale else None
    # Stable sort: equal start versions keep completion order.
    order = sorted(range(len(self._groups)), key=lambda i: self._groups[i].start_version)
    chosen = set(order[:count])
    if in_flight_starts and self._must_wait(
        [self._groups[i].start_version for i in order[:count]],
        [self._groups[i].start_version for i in order[count:]], in_flight_starts, count,
        trainer_version):
      return TakeResult(groups=[], stale=stale) if stale else None
    groups = [self._groups[i] for i in order[:count]]
    self._groups = collections.deque(g for i, g in enumerate(self._groups) if i not in chosen)
    return TakeResult(groups=groups, stale=stale)

  def _must_wait(self, chosen: list[int], rest: list[int], in_flight: Sequence[int], count: int,
                 trainer_version: int) -> bool:
    """Whether some deadline `t + k` would be overcommitted after this take, and swapping a chosen
    group due later than `t + k` for one due by then (once it completes) could fix it."""
    alpha = self.bound.async_ratio
    deadlines = sorted(v + alpha for v in (*rest, *in_flight) if v + alpha >= trainer_version)
    latest_chosen = max(v + alpha for v in chosen)
    for due_by in range(trainer_version, latest_chosen):
      k = due_by - trainer_version  # takes left before `due_by` passes: versions t+1 .. t+k
      if bisect.bisect_right(deadlines, due_by) > k * count:
        return True
    return False

  def drain_view(self) -> list[G]:
    """The buffered groups, oldest first, without removing them."""
    return list(self._groups)

  def drain(self) -> list[G]:
    groups = list(self._groups)
    self._groups.clear()
    return groups
