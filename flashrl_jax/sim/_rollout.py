"""The rollout pool: K workers, a request queue, a reward pool, and the two rollout policies.

Why: queue scheduling and prompt replication are the paper's two rollout mechanisms, and the
simulator must run them the way the controller does. Each is a small stateless strategy object:

- *Dispatch* decides when queued work may start and when rewards run.
  `QueueScheduling`: a finished response frees its slot for the next request at once and its reward
  is computed at once (overlapping generation). `BatchRollout`: requests go out in waves that fill
  every slot; the next wave starts only after the whole wave has been generated *and* scored.
- *Placement* decides the unit of work and where it goes.
  `PromptReplication`: a prompt's `n` responses are `n` independent requests, each sent to the
  least-loaded worker with a free slot. `GroupPlacement`: the whole group goes to one worker (the
  least-loaded one with `n` free slots), as when a server is asked for `n` samples of one prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Callable

import numpy as np

from flashrl_jax.sim import _costs
from flashrl_jax.sim._events import EventLoop
from flashrl_jax.sim._worker import Group, Request, Worker


@dataclasses.dataclass(frozen=True)
class PromptReplication:
  """Each response is its own request, placed on the least-loaded worker."""

  def units(self, group: Group) -> list[list[Request]]:
    return [[r] for r in group.requests]


@dataclasses.dataclass(frozen=True)
class GroupPlacement:
  """A prompt's `n` responses stay together on one worker."""

  def units(self, group: Group) -> list[list[Request]]:
    return [list(group.requests)]


@dataclasses.dataclass(frozen=True)
class QueueScheduling:
  """Per-sample lifecycle: admit whenever a slot is free; score each response as it finishes."""

  def kick(self, pool: RolloutPool, now: float) -> None:
    pool.fill(now)

  def finished(self, pool: RolloutPool, requests: list[Request], now: float) -> None:
    pool.score(requests, now)

  def settled(self, pool: RolloutPool, request: Request, now: float) -> None:
    del pool, request, now  # nothing waits on a single response


@dataclasses.dataclass(frozen=True)
class BatchRollout:
  """Wave-by-wave rollout: generate a full wave, then score it, then start the next.

  `pool.wave` holds the ids of the current wave's requests not yet settled (scored or cancelled);
  `pool.wave_generated` those of them generated and waiting for the rest of the wave.
  """

  def kick(self, pool: RolloutPool, now: float) -> None:
    if not pool.wave:
      pool.wave = {id(r) for r in pool.fill(now)}
      pool.wave_generated = []

  def finished(self, pool: RolloutPool, requests: list[Request], now: float) -> None:
    pool.wave_generated.extend(requests)
    self._maybe_score(pool, now)

  def settled(self, pool: RolloutPool, request: Request, now: float) -> None:
    pool.wave.discard(id(request))
    if pool.wave:
      self._maybe_score(pool, now)
    else:
      self.kick(pool, now)

  def _maybe_score(self, pool: RolloutPool, now: float) -> None:
    live = [r for r in pool.wave_generated if not r.cancelled]
    if live and len(live) == len(pool.wave):
      pool.wave_generated = []
      pool.score(live, now)


Placement = PromptReplication | GroupPlacement
Dispatch = QueueScheduling | BatchRollout


class RolloutPool:
  """Workers + pending queue + reward pool; calls `on_ready(group)` when a group is fully scored."""

  def __init__(self, loop: EventLoop, workers: list[Worker], dispatch: Dispatch,
               placement: Placement, cost: _costs.CostModel, version: Callable[[], int],
               on_ready: Callable[[Group], None],
               on_activity: Callable[[bool], None] = lambda busy: None):
    self.loop = loop
    self.workers = workers
    self.dispatch = dispatch
    self.placement = placement
    self.cost = cost
    self.version = version
    self.on_ready = on_ready
    self.on_activity = on_activity  # called when the pool turns busy (requests live) or idle
    self.busy = False
    self.pending: collections.deque[list[Request]] = collections.deque()
    self.paused_until = 0.0
    self.wave: set[int] = set()
    self.wave_generated: list[Request] = []
    self._reward_free = [0.0] * (cost.reward_workers or 0)
    # Active requests per worker, mirrored in an array so that placement is one vectorised argmin.
    self._loads = np.zeros(len(workers), dtype=np.int64)
    self._slots = np.array([w.slots for w in workers], dtype=np.int64)

  def submit(self, groups: list[Group]) -> None:
    """Queue `groups` together (one batch-level wave can take them all), then dispatch."""
    for group in groups:
      self.pending.extend(self.placement.units(group))
    self.dispatch.kick(self, self.loop.now)
    self._activity()

  def fill(self, now: float) -> list[Request]:
    """Admit queued units (FIFO) while a worker can take them; returns the admitted requests."""
    admitted: list[Request] = []
    if now < self.paused_until:
      return admitted
    while self.pending:
      unit = self.pending[0]
      if unit[0].group.cancelled:
        self.pending.popleft()
        continue
      worker = self._least_loaded(len(unit))
      if worker is None:
        break
      self.pending.popleft()
      for request in unit:
        if request.start_version is None:
          request.start_version = self.version()
        request.start_time = now
        worker.admit(request, now)
      self._reschedule(worker)
      admitted.extend(unit)
    return admitted

  def _least_loaded(self, size: int) -> Worker | None:
    """Fewest active requests among workers with `size` free slots (lowest id on ties), or None."""
    loads = np.where(self._slots - self._loads >= size, self._loads, np.iinfo(np.int64).max)
    best = int(np.argmin(loads))
    return self.workers[best] if self._slots[best] - self._loads[best] >= size else None

  def _reschedule(self, worker: Worker) -> None:
    self._loads[worker.wid] = worker.load
    event = worker.next_finish(self.loop.now)
    if event is not None:
      self.loop.at(event[0], self._on_finish, worker, worker.epoch, event[1])

  def _activity(self) -> None:
    busy = bool(self.pending) or bool(self._loads.any())
    if busy != self.busy:
      self.busy = busy
      self.on_activity(busy)

  def set_slow(self, factor: float) -> None:
    """Every worker's costs take `factor` times as long from now on (a co-located trainer)."""
    for worker in self.workers:
      if worker.slow != factor:
        worker.set_slow(self.loop.now, factor)
        self._reschedule(worker)

  def _on_finish(self, worker: Worker, epoch: int, finishing: bool = True) -> None:
    if epoch != worker.epoch:
      return  # superseded by a later change on this worker
    now = self.loop.now
    done = worker.pop_finished(now, finishing)
    self._reschedule(worker)
    if not done:
      return  # a re-timing of a long decode, nothing finished
    self.dispatch.finished(self, done, now)
    self.dispatch.kick(self, now)
    self._activity()

  def score(self, requests: list[Request], now: float) -> None:
    """Compute rewards on the reward pool (FIFO over `reward_workers`, or all at once)."""
    for request in requests:
      if request.cancelled:
        continue
      if self.cost.reward_s == 0:
        self._scored(request)
        continue
      start = now
      if self._reward_free:
        start = max(now, heapq.heappop(self._reward_free))
        heapq.heappush(self._reward_free, start + self.cost.reward_s)
      self.loop.at(start + self.cost.reward_s, self._scored, request)

  def _scored(self, request: Request) -> None:
    if request.cancelled:
      return
    group = request.group
    group.unrewarded -= 1
    self.dispatch.settled(self, request, self.loop.now)
    if group.unrewarded == 0:
      group.ready_time = self.loop.now
      self.on_ready(group)

  def pause(self, seconds: float, reprefill: bool) -> None:
    """Weight update: every worker stops for `seconds`; with `reprefill` (abort, retract) each
    in-flight request then re-prefills its prompt and partial output."""
    now = self.loop.now
    self.paused_until = max(self.paused_until, now) + seconds
    for worker in self.workers:
      worker.block(now, seconds)
      if reprefill:
        worker.prefill(now, sum(r.prompt_tokens + worker.generated(r) for _, _, r in worker.active))
      self._reschedule(worker)
    self.loop.at(self.paused_until, self._resume)

  def _resume(self) -> None:
    self.dispatch.kick(self, self.loop.now)
    self._activity()

  def cancel(self, groups: list[Group]) -> int:
    """Abort every request of `groups` (queued or running); returns the tokens thrown away."""
    now = self.loop.now
    doomed = {g.gid for g in groups}
    wasted = 0.0
    for group in groups:
      group.cancelled = True
    removed: list[Request] = []
    for worker in self.workers:
      if any(item[2].group.gid in doomed for item in worker.active):
        gone = worker.remove(doomed, now)
        wasted += sum(worker.generated(r) for r in gone)
        removed.extend(gone)
        self._reschedule(worker)
    for request in removed:  # settle only once every worker is consistent again
      request.cancelled = True
      self.dispatch.settled(self, request, now)
    for group in groups:
      for request in group.requests:
        if not request.cancelled:
          wasted += request.length if request.finish_time is not None else 0
          request.cancelled = True
          self.dispatch.settled(self, request, now)
    self.dispatch.kick(self, now)
    self._activity()
    return int(wasted)
