"""The training loop, async and sync, over one fleet, one learner, one prompt source.

Async (ROLL Flash): a dispatcher keeps prompt groups in flight while the learner trains in a worker
thread; each group lands in the sample buffer as soon as its last response is scored; the learner
takes B fresh groups per step; the staleness bound decides what may be dispatched and what may be
consumed. Sync: generate the whole batch (single-turn tasks) or play it in lock-step (environment
tasks), wait for the longest, score, train, publish — the baseline every speedup is measured
against, in the same code base and at the same resources.

After every update the loop publishes the new version (the learner exports it, the fleet hands it
over), logs one metrics record, then checkpoints when due (the source's position, with prompts in
flight or buffered re-issued after a resume). The record goes first: a process killed in between
resumes from the previous checkpoint and redoes the step, whose record is rolled back with it, so
no step is ever lost from the metrics nor counted twice.

Async mode (α >= 1) hands each new version over *behind* the next training step: the trainer needs
none of the servers' state to train, so it waits only for its own export and for the previous
handoff to have finished (one handoff at a time), while pause, load and resume run on the rollout
side (they were ~40% of an async step when the trainer waited for them). A sync step's handoff has
nothing in flight to pause (single-turn tasks): the servers only load.

A version the servers refuse to load (its directory was damaged after it was written) is exported
again from the learner's weights and published again; if they still refuse it, they go on serving
the previous version (the fleet's version stays there, so the staleness bound stays exact) and the
next update publishes the next one. A handoff behind training learns of a refusal only once the
trainer has moved on, so there the next version, freshly exported, supersedes the refused one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import numpy as np

from flashrl_jax.controller._agentic import EnvGroupRunner, collect_lockstep
from flashrl_jax.controller._config import Mode, RunConfig
from flashrl_jax.controller._counters import Counters
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.controller._learner import Learner
from flashrl_jax.controller._metrics import MetricsLogger, step_sample_metrics
from flashrl_jax.controller._samples import Group
from flashrl_jax.controller._source import PromptSource
from flashrl_jax import _failpoints as failpoints
from flashrl_jax.fleet import Fleet, RequestRejected, VersionRefused
from flashrl_jax.scheduling import SampleBuffer, StalenessBound
from flashrl_jax.trainer import Trajectory

log = logging.getLogger(__name__)

# Times a version the servers refused is exported again before they keep the previous one.
MAX_REEXPORTS = 2


def to_trajectories(groups: list[Group]) -> list[Trajectory]:
  out = []
  for g in groups:
    for r in g.responses:
      out.append(Trajectory(
          sample_id=int(r.sample_id), prompt_ids=np.asarray(g.prompt_ids, np.int32),
          response_ids=np.asarray(r.output_ids, np.int32),
          behavior_logp=np.asarray(r.behavior_logp, np.float32), reward=float(r.reward),
          group_id=g.prompt_index, behavior_version=np.asarray(r.token_versions, np.int32),
          start_version=r.start_version,
          response_mask=None if r.response_mask is None else np.asarray(r.response_mask, bool)))
  return out


class Loop:
  """One run's loop: steps `start_step` .. `config.steps - 1`, then returns.

  `runner` plays one prompt group on the fleet (`GroupRunner`, or `EnvGroupRunner` for environment
  tasks); `counters` are the run's cumulative counters (restored ones on a resume); every step's
  record goes to `logger` and then to `on_step`. `initial_eval`: the held-out metrics before the
  first update (`eval/expected_accuracy[/<set>]`), logged with step 1 as `eval/initial_...`.
  """

  def __init__(self, config: RunConfig, *, fleet: Fleet, learner: Learner, source: PromptSource,
               runner: GroupRunner | EnvGroupRunner, counters: Counters, logger: MetricsLogger,
               start_step: int = 0, initial_eval: dict[str, float] | None = None,
               on_step: Callable[[dict[str, Any]], None] | None = None):
    self.config, self.fleet, self.learner, self.source = config, fleet, learner, source
    self.runner, self.counters, self.logger = runner, counters, logger
    self.start_step, self.initial_eval = start_step, initial_eval
    self.on_step = on_step or (lambda record: None)
    self.bound = StalenessBound(config.async_ratio, config.batch_size)
    self.buffer = SampleBuffer(self.bound)
    self.in_flight: dict[int, Group] = {}  # dispatched prompt groups still generating
    self._last_busy: dict[str, float] = {}
    self._last_dropped = counters.dropped_stale
    self._rejected: list[int] = []  # prompts dropped as invalid since the last record
    self._fleet_seen = (0, 0)  # the fleet's (failures, restarts) already in `counters`
    self._checkpoint_times: dict[str, float] = {}  # the last checkpoint's, for the next record
    self._handoff: asyncio.Task | None = None  # async mode: the handoff running behind training
    self._clock_origin = time.perf_counter()  # `time/clock_s` counts from here

  async def run(self) -> None:
    # Servers start from whatever they loaded; make them serve exactly the learner's version.
    await self._publish()
    try:
      if self.config.mode is Mode.ASYNC:
        await self._run_async()
      else:
        await self._run_sync()
    finally:
      if self._handoff is not None:  # never leave the fleet mid-handoff
        await asyncio.gather(self._handoff, return_exceptions=True)

  # --- one step's end: train, publish, checkpoint, log -------------------------------------------

  async def _export(self) -> tuple[int, str, dict[str, float]]:
    version = self.learner.policy_version
    t0 = time.perf_counter()
    path = await asyncio.to_thread(self.learner.export)
    times = {"time/export_s": time.perf_counter() - t0}
    failpoints.hit("published", version, path=path)
    return version, path, times

  async def _publish(self, *, idle: bool = False) -> dict[str, float]:
    """Exports the learner's version and hands it to the fleet (`idle`: nothing is in flight),
    exporting it again if the servers refuse it."""
    version, path, times = await self._export()
    for attempt in range(MAX_REEXPORTS + 1):
      try:
        times.update(await self.fleet.publish(path, version, idle=idle))
        break
      except VersionRefused as refused:
        self._count_refusal(refused)
        if attempt < MAX_REEXPORTS:
          path = await asyncio.to_thread(self.learner.reexport)
          continue
        if self.config.mode is Mode.ASYNC and self.config.async_ratio == 0:
          raise RuntimeError(f"the servers refuse policy version {version}, and α = 0 cannot "
                             "generate from any other") from refused
        self._keep_serving_previous(version)
    self._handed_over()
    return times

  def _count_refusal(self, refused: VersionRefused) -> None:
    self.counters.versions_refused += 1
    log.error("%s", refused)

  def _keep_serving_previous(self, refused_version: int) -> None:
    log.error("servers go on serving policy version %d; the next update publishes version %d",
              self.fleet.version, refused_version + 1)

  def _handed_over(self) -> None:
    """After a handoff: keep the served version's export, delete the ones nothing needs."""
    self.learner.hold(self.fleet.version)
    self.learner.collect_garbage()

  async def _publish_behind(self, on_published: Callable[[], Awaitable[None]]
                            ) -> dict[str, float]:
    """Async mode: waits for the previous handoff, exports, and starts this version's handoff
    without waiting for it (the next training step runs meanwhile). Returns the wait, the export
    time and the phase times of the previous handoff."""
    t0 = time.perf_counter()
    phases = await self._handoff if self._handoff is not None else {}
    self._handoff = None
    # Waited for before exporting: the handoff's garbage collection never meets an export.
    times = {"time/handoff_wait_s": time.perf_counter() - t0, **phases}
    version, path, export_times = await self._export()
    times.update(export_times)

    async def handoff() -> dict[str, float]:
      try:
        phases = await self.fleet.publish(path, version)
      except VersionRefused as refused:  # the trainer has moved on: the next version supersedes
        self._count_refusal(refused)
        self._keep_serving_previous(version)
        phases = {}
      self._handed_over()
      await on_published()
      return phases

    self._handoff = asyncio.create_task(handoff())
    return times

  def _update(self, trajectories: list[Trajectory]) -> dict[str, float]:
    failpoints.hit("train", self.learner.policy_version, urls=self.fleet.urls)
    return self.learner.update(trajectories)

  async def _train_and_publish(self, groups: list[Group], step: int, times: dict[str, float],
                               step_start: float, *, idle: bool = False,
                               on_published: Callable[[], Awaitable[None]] | None = None) -> None:
    """Trains on `groups`, publishes the new version (behind the next step when `on_published` is
    given; `idle`: nothing is in flight), logs the step and checkpoints when due."""
    cfg = self.config
    sample_metrics = step_sample_metrics(groups, self.learner.policy_version)
    t0 = time.perf_counter()
    train_metrics = await asyncio.to_thread(self._update, to_trajectories(groups))
    # The trainer's staleness (from each token's behaviour version) keeps its own name beside
    # the controller's (from the groups' start versions), so each can check the other.
    train_metrics = {f"trainer/{k}" if k.startswith("staleness") else k: v
                     for k, v in train_metrics.items()}
    t1 = time.perf_counter()
    if on_published is None:
      handoff = await self._publish(idle=idle)
    else:
      handoff = await self._publish_behind(on_published)
    self.counters.samples_trained += sample_metrics["num_samples"]
    end = time.perf_counter()
    wall = end - step_start
    stats = self.fleet.stats()
    failures, restarts = self._fleet_seen
    self.counters.server_failures += stats.server_failures - failures
    self.counters.server_restarts += stats.server_restarts - restarts
    self._fleet_seen = (stats.server_failures, stats.server_restarts)
    busy = {s.url: s.busy_s for s in stats.client.servers}
    # Busy fraction since the previous step (a server counts as busy with any request in flight).
    fractions = [(b - self._last_busy.get(url, 0.0)) / max(wall, 1e-9) for url, b in busy.items()]
    self._last_busy = busy
    dropped_now = self.counters.dropped_stale - self._last_dropped
    self._last_dropped = self.counters.dropped_stale
    record = {
        **train_metrics,
        "step": step + 1, "policy_version": self.learner.policy_version, "mode": cfg.mode.value,
        "async_ratio": cfg.async_ratio, "num_processes": self.learner.num_processes,
        **sample_metrics,
        **times, "time/train_s": t1 - t0, **handoff, "time/step_s": wall,
        # When this step ended (before its evaluation, log and checkpoint), from the loop's start:
        # between two steps' stamps lies everything the run did, bookkeeping included, which
        # `time/step_s` (the step's own span) leaves out. Throughput is measured on these.
        "time/clock_s": end - self._clock_origin,
        "samples_per_s": sample_metrics["num_samples"] / max(wall, 1e-9),
        "dropped_stale": dropped_now,
        # Which prompts a server refused as invalid since the last record (the only prompts a run
        # drops): with sample_ids and the checkpoint's pending prompts, every prompt is accounted.
        "rejected_prompt_ids": self._rejected,
        "server_busy_fraction": float(np.mean(fractions)) if fractions else 0.0,
        "client_retries": stats.client.num_retries,
        "client_malformed": stats.client.num_malformed,
        "client_continuations": stats.client.num_continuations,
        **self.runner.report(), **self.counters.totals(), **self._checkpoint_times,
        "sample_ids": [r.sample_id for g in groups for r in g.responses],
        # The oldest weight version the servers reported for any token of each sample (aligned
        # with sample_ids): the staleness bound checked from the servers' own words.
        "sample_min_token_version": [min(r.token_versions, default=r.start_version)
                                     for g in groups for r in g.responses],
    }
    if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
      record.update(await asyncio.to_thread(self.learner.evaluate) or {})
    if step == 0 and self.initial_eval:
      record.update({k.replace("eval/", "eval/initial_", 1): v for k, v in self.initial_eval.items()})
    self.logger.log(record)
    self._rejected = []
    self.on_step(record)
    # After the record (see the module docstring); its time is reported with the next step.
    self._checkpoint_times = await self._checkpoint_if_due(step + 1)

  async def _checkpoint_if_due(self, step: int) -> dict[str, float]:
    cfg = self.config
    if not (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
      return {}
    # Prompts dispatched but not trained are re-issued after a restore: nothing is lost, and
    # nothing is trained twice.
    pending = sorted(set(self.in_flight) | {g.prompt_index for g in self.buffer.drain_view()})
    t0 = time.perf_counter()
    self.learner.save(step, {"step": step, "source": self.source.state(in_flight=pending),
                             "counters": self.counters.to_json(),
                             "policy_version": self.learner.policy_version})
    return {"time/checkpoint_s": time.perf_counter() - t0}

  def _count_failure(self, group: Group, error: BaseException) -> None:
    if isinstance(error, RequestRejected):
      self.counters.rejected_prompts += 1
      self._rejected.append(group.prompt_index)
      log.error("prompt %d rejected by the server, dropped: %s", group.prompt_index, error)
    else:
      self.counters.failed_groups += 1
      log.error("prompt %d failed (%s); re-issuing it", group.prompt_index, error)
      self.source.give_back(group.prompt_index)

  def _keep(self, group: Group) -> bool:
    """Dynamic filtering: a group whose rewards are all equal carries no advantage signal."""
    if self.config.dynamic_filter and group.all_rewards_equal():
      self.counters.filtered_groups += 1
      return False
    return True

  # --- sync ---------------------------------------------------------------------------------------

  async def _run_sync(self) -> None:
    cfg = self.config
    for step in range(self.start_step, cfg.steps):
      step_start = time.perf_counter()
      if isinstance(self.runner, EnvGroupRunner):
        num_groups = cfg.agentic.groups(cfg.batch_size, cfg.async_ratio, is_async=False)
        groups, times = await collect_lockstep(self.runner, self.source, cfg.batch_size,
                                               num_groups, self.counters)
        times["time/wait_data_s"] = time.perf_counter() - step_start
      else:
        groups, times = await self._generate_batch()
      # A single-turn batch leaves nothing in flight: the servers need no pause to load.
      await self._train_and_publish(groups, step, times, step_start,
                                    idle=not isinstance(self.runner, EnvGroupRunner))

  async def _generate_batch(self) -> tuple[list[Group], dict[str, float]]:
    """B groups generated together, then scored together (refilled while filtering drops some)."""
    cfg = self.config
    groups: list[Group] = []
    gen_s = reward_s = 0.0
    rounds = 0
    while len(groups) < cfg.batch_size:
      rounds += 1
      batch = [self.runner.new_group(*self.source.next())
               for _ in range(cfg.batch_size - len(groups))]
      t0 = time.perf_counter()
      done = await asyncio.gather(*(self.runner.run(g, score=False) for g in batch),
                                  return_exceptions=True)
      t1 = time.perf_counter()
      ok = []
      for group, result in zip(batch, done):
        if isinstance(result, BaseException):
          self._count_failure(group, result)
        else:
          ok.append(group)
      await asyncio.gather(*(self.runner.score(g) for g in ok))
      t2 = time.perf_counter()
      gen_s, reward_s = gen_s + t1 - t0, reward_s + t2 - t1
      groups += [g for g in ok if self._keep(g)]
      if rounds > 20 * cfg.batch_size:
        raise RuntimeError("dynamic filtering rejected every group for too long; check the task.")
    return groups, {"time/generate_s": gen_s, "time/reward_s": reward_s,
                    "time/wait_data_s": gen_s + reward_s}

  # --- async --------------------------------------------------------------------------------------

  async def _run_async(self) -> None:
    cfg = self.config
    cond = asyncio.Condition()
    tasks: set[asyncio.Task] = set()
    stop = asyncio.Event()
    takes = 0
    base_version = self.learner.policy_version

    def may_dispatch() -> bool:
      outstanding = len(self.in_flight) + len(self.buffer)
      return self.bound.may_dispatch(outstanding, base_version + takes, self.fleet.version)

    async def run_group(group: Group) -> None:
      try:
        await self.runner.run(group)
      except Exception as error:  # noqa: BLE001 - any failure re-issues or drops, never loses
        async with cond:
          self.in_flight.pop(group.prompt_index, None)
          self._count_failure(group, error)
          cond.notify_all()
        return
      async with cond:
        self.in_flight.pop(group.prompt_index, None)
        if self._keep(group):
          self.buffer.put(group)
        cond.notify_all()

    async def dispatcher() -> None:
      while True:
        async with cond:
          await cond.wait_for(lambda: stop.is_set() or may_dispatch())
          if stop.is_set():
            return
          group = self.runner.new_group(*self.source.next())
          self.in_flight[group.prompt_index] = group
        task = asyncio.create_task(run_group(group))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def published() -> None:
      async with cond:  # the fleet's version rose: dispatch may proceed
        cond.notify_all()

    # Behind training at α >= 1 (the scheduling rule); at α = 0 the handoff keeps its synchronous
    # path (a refused version is exported again).
    behind = published if self.bound.hands_over_behind_training else None
    dispatch_task = asyncio.create_task(dispatcher())
    try:
      for step in range(self.start_step, cfg.steps):
        step_start = time.perf_counter()
        due_wait = 0.0  # waited with a batch buffered, for an in-flight group due before it
        async with cond:
          while True:
            if dispatch_task.done():
              dispatch_task.result()  # surface a dispatcher crash
            result = self.buffer.take(cfg.batch_size, self.learner.policy_version,
                                      [g.start_version for g in self.in_flight.values()])
            if result is not None and result.stale:
              self.counters.dropped_stale += len(result.stale)
              for g in result.stale:
                self.source.give_back(g.prompt_index)
              cond.notify_all()
            if result is not None and result.groups:
              groups = result.groups
              takes += 1
              cond.notify_all()
              break
            t0, due = time.perf_counter(), len(self.buffer) >= cfg.batch_size
            await cond.wait()
            due_wait += time.perf_counter() - t0 if due else 0.0
        times = {"time/wait_data_s": time.perf_counter() - step_start,
                 "time/wait_due_group_s": due_wait,
                 "in_flight_groups": len(self.in_flight), "buffered_groups": len(self.buffer)}
        await self._train_and_publish(groups, step, times, step_start, on_published=behind)
        if behind is None:
          await published()
    finally:
      stop.set()
      async with cond:
        cond.notify_all()
      await asyncio.gather(dispatch_task, return_exceptions=True)
      for task in list(tasks):
        task.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)
