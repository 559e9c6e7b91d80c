"""`simulate(config, seed)`: run the discrete-event model of the RL cluster and summarise it.

Why: `Run` owns the mutable state of one simulated run (versions, buffer, outstanding prompts,
records) and offers the training policies a few primitives (`issue`, `train`, `sync`, `drop`); the
policies decide *when* to call them. Everything random comes from one seeded generator, and the
event loop breaks ties by insertion order, so a run is a pure function of (config, seed).
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable

import numpy as np

from flashrl_jax.scheduling import SampleBuffer, StalenessBound
from flashrl_jax.sim._config import SimConfig
from flashrl_jax.sim._events import EventLoop
from flashrl_jax.sim._results import SimResult, StepRecord
from flashrl_jax.sim._rollout import RolloutPool
from flashrl_jax.sim._worker import Group, Worker


class Run:
  """State of one simulated run; the training policy drives it through the methods below."""

  def __init__(self, config: SimConfig, seed: int):
    self.config = config
    self.rng = np.random.default_rng(seed)
    self.loop = EventLoop()
    self.workers = [Worker(i, config.slots, config.cost.decode, config.cost.prefill_s_per_token,
                           config.cost.request_s) for i in range(config.workers)]
    self.pool = RolloutPool(self.loop, self.workers, config.dispatch, config.placement,
                            config.cost, version=lambda: self.rollout_version,
                            on_ready=self._on_ready, on_activity=self._rollout_activity)
    self.version = 0          # trainer's policy version t (= train steps done)
    self.rollout_version = 0  # version the rollout servers hold
    self.outstanding = 0      # prompts issued and neither consumed nor dropped
    self.batch: list[Group] = []  # the sync policy's batch being assembled
    # The async policy's: the scheduling package's own bound and buffer (set by its `start`).
    self.bound: StalenessBound | None = None
    self.samples: SampleBuffer[Group] | None = None
    self.trainer_busy = False
    self.training = False     # a train step is under way (the next consumption is at t + 1)
    self.step_started = float("inf")  # sync policies set it; generation is timed from it
    self.records: list[StepRecord] = []
    self._live: dict[int, Group] = {}
    self._reissue: collections.deque[float] = collections.deque()
    self._gids = itertools.count()
    self._trainer_free_since = 0.0
    self._train_busy_s = 0.0
    self._sync_free_at = 0.0
    self._dropped = 0
    self._wasted = 0
    # The train step under way: seconds of trainer work left (at full speed), the current rate
    # (< 1 while a co-located rollout competes), and an epoch that voids superseded end events.
    self._train_left = 0.0
    self._train_rate = 1.0
    self._train_since = 0.0
    self._train_epoch = 0
    # Wall seconds, after warm-up, with the rollout busy, training under way, and both at once:
    # how much of each side's time the interference factors apply to (`SimResult.*_beside`).
    self._pool_busy = False
    self._tally_since = 0.0
    self._busy_s = self._train_s = self._overlap_s = 0.0

  @property
  def finished(self) -> bool:
    return len(self.records) >= self.config.warmup_steps + self.config.steps

  def in_flight(self) -> list[Group]:
    """Issued groups not yet fully scored."""
    return list(self._live.values())

  def issue(self, count: int) -> None:
    """Issue `count` prompts together (dropped prompts are re-issued first, with fresh responses)."""
    groups = []
    for _ in range(count):
      z = self._reissue.popleft() if self._reissue else float(self.rng.standard_normal())
      lengths = self.config.lengths.sample_groups(self.rng, [z], self.config.group_size)[0]
      group = Group(next(self._gids), z, lengths, self.config.prompt_tokens, self.loop.now)
      for request in group.requests:
        # As in the controller, staleness counts from dispatch: queueing for a slot is included.
        request.start_version = self.rollout_version
      self._live[group.gid] = group
      groups.append(group)
    self.outstanding += count
    if groups:
      self.pool.submit(groups)

  def _on_ready(self, group: Group) -> None:
    del self._live[group.gid]
    self.config.training.on_ready(self, group)

  def drop(self, groups: list[Group]) -> None:
    """Drop groups too stale to train on (buffered or in flight); their prompts are re-issued."""
    for group in groups:
      self._live.pop(group.gid, None)
      self._reissue.append(group.prompt_z)
      self._dropped += len(group.requests)
    self.outstanding -= len(groups)
    self._wasted += self.pool.cancel(groups)

  def train(self, batch: list[Group], then: Callable[[], None]) -> None:
    """Consume `batch` at the current version and train on the train pool."""
    now = self.loop.now
    requests = [r for g in batch for r in g.requests]
    train_tokens = sum(g.tokens for g in batch)
    seconds = self.config.cost.train.time(train_tokens, self.config.train_gpus)
    first_start = min(r.start_time for r in requests)
    record = StepRecord(
        step=len(self.records) + 1, policy_version=self.version + 1, start_time=now,
        train_s=seconds, wait_data_s=max(now - self._trainer_free_since, 0.0),
        gen_s=max(g.ready_time for g in batch) - min(first_start, self.step_started),
        first_start=first_start, samples=len(requests), response_tokens=sum(r.length for r in requests),
        train_tokens=train_tokens, staleness=[self.version - r.start_version for r in requests],
        response_lengths=[r.length for r in requests], dropped_samples=self._dropped)
    self._dropped = 0
    self._tally()
    self.trainer_busy = self.training = True
    self._train_left, self._train_since = seconds, now
    self._train_rate = self._rate(self.pool.busy)
    self.pool.set_slow(self.config.cost.rollout_beside_train)
    self._schedule_train_end(record, then)

  def _rate(self, rollout_busy: bool) -> float:
    return 1.0 / self.config.cost.train_beside_rollout if rollout_busy else 1.0

  def _schedule_train_end(self, record: StepRecord, then: Callable[[], None]) -> None:
    self._record, self._then = record, then
    self._train_epoch += 1
    end = self.loop.now + self._train_left / self._train_rate
    self.loop.at(end, self._trained, record, then, self._train_epoch)

  def _tally(self) -> None:
    """Adds the time since the last change of either side's activity to the overlap tallies;
    called before any such change (the warm-up's steps are not counted, as in `SimResult`)."""
    now = self.loop.now
    if len(self.records) >= self.config.warmup_steps:
      dt = now - self._tally_since
      self._busy_s += dt if self._pool_busy else 0.0
      self._train_s += dt if self.training else 0.0
      self._overlap_s += dt if self._pool_busy and self.training else 0.0
    self._tally_since = now

  def _rollout_activity(self, busy: bool) -> None:
    """The rollout turned busy or idle: a training step under way changes speed."""
    self._tally()
    self._pool_busy = busy
    if not self.training or self._train_rate == self._rate(busy):
      return
    now = self.loop.now
    self._train_left = max(self._train_left - (now - self._train_since) * self._train_rate, 0.0)
    self._train_since, self._train_rate = now, self._rate(busy)
    self._schedule_train_end(self._record, self._then)

  def _trained(self, record: StepRecord, then: Callable[[], None], epoch: int) -> None:
    if epoch != self._train_epoch:
      return  # the step's speed changed since this end was scheduled
    self._tally()
    self.version += 1
    self.training = False
    self.pool.set_slow(1.0)
    record.train_s = self.loop.now - record.start_time
    self._train_busy_s += record.train_s
    record.end_time = self.loop.now
    self.records.append(record)
    self.trainer_idle()
    then()

  def trainer_idle(self) -> None:
    self.trainer_busy = False
    self._trainer_free_since = self.loop.now

  @property
  def sync_free_at(self) -> float:
    """When the handoffs already scheduled are over."""
    return self._sync_free_at

  def sync(self, version: int, then: Callable[[], None]) -> None:
    """Load `version` on every rollout worker (serialised with earlier loads), then `then()`."""
    start = max(self.loop.now, self._sync_free_at)
    self._sync_free_at = start + self.config.cost.sync.rollout_s
    self.loop.at(start, self._begin_sync, version, then)

  def _begin_sync(self, version: int, then: Callable[[], None]) -> None:
    seconds = self.config.cost.sync.rollout_s
    # Scheduled before the pool's resume so that requests admitted on resume get the new version.
    self.loop.at(self.loop.now + seconds, self._end_sync, version, then)
    self.pool.pause(seconds, reprefill=self.config.pause.reprefills_in_flight)

  def _end_sync(self, version: int, then: Callable[[], None]) -> None:
    self.rollout_version = max(self.rollout_version, version)
    then()

  def result(self) -> SimResult:
    end = self.records[-1].end_time
    for worker in self.workers:
      worker.advance(end)
    rollout_busy = sum(w.busy_s for w in self.workers) * self.config.gpus_per_worker
    busy = rollout_busy + self._train_busy_s * self.config.train_gpus
    rollout_gpus = len(self.workers) * self.config.gpus_per_worker
    return SimResult.from_records(
        self.records, self.config.warmup_steps, self.config.gpus, busy,
        rollout_busy_fraction=rollout_busy / (rollout_gpus * end), wasted_tokens=self._wasted,
        events=self.loop.handled,
        train_beside_rollout=self._overlap_s / self._train_s if self._train_s > 0 else 0.0,
        rollout_beside_train=self._overlap_s / self._busy_s if self._busy_s > 0 else 0.0)


def simulate(config: SimConfig, seed: int = 0, max_events: int = 50_000_000) -> SimResult:
  """Simulate `config.warmup_steps + config.steps` training steps; deterministic in `seed`."""
  run = Run(config, seed)
  config.training.start(run)
  run.loop.run(lambda: run.finished, max_events=max_events)
  if not run.finished:
    raise RuntimeError(f"simulation stalled after {len(run.records)} steps (no events left)")
  return run.result()
