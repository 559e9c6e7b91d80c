"""The two training loops, async and sync, over the same runner, trainer and handoff.

Async (ROLL Flash): a dispatcher keeps prompt groups in flight while the trainer trains in a worker
thread; each group lands in the buffer as soon as its last response is scored; the trainer takes B
fresh groups per step; the staleness bound decides what may be dispatched and what may be consumed.
Sync: generate the whole batch, wait for the longest response, score, train, publish — the
baseline every speedup is measured against, in the same code base and at the same resources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable

import numpy as np

from flashrl_jax.controller._config import RunConfig
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.controller._handoff import publish_version
from flashrl_jax.controller._metrics import MetricsLogger, step_sample_metrics
from flashrl_jax.controller._samples import Group
from flashrl_jax.controller._source import PromptSource
from flashrl_jax.fleet import RequestRejected, RolloutClient
from flashrl_jax.scheduling import SampleBuffer, StalenessBound
from flashrl_jax.trainer import Trainer, Trajectory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoopContext:
  config: RunConfig
  trainer: Trainer
  client: RolloutClient
  runner: GroupRunner
  source: PromptSource
  store: Any  # VersionStore
  logger: MetricsLogger
  save_checkpoint: Callable[[int, list[int]], dict[str, float]]
  on_step: Callable[[dict[str, Any]], None] = lambda record: None
  evaluate: Callable[[], float] | None = None  # exact expected accuracy of the current policy
  initial_eval: float | None = None  # the same, before the first update (logged with step 1)
  # Weight handoff after each update; None: `publish_version` to every server (no supervisor).
  publish: Callable[[], Awaitable[dict[str, float]]] | None = None
  extra_metrics: Callable[[], dict[str, Any]] = dict  # merged into every step record
  start_step: int = 0
  published_version: int = 0
  counters: dict[str, int] = dataclasses.field(default_factory=lambda: {
      "dropped_stale": 0, "filtered_groups": 0, "failed_groups": 0, "rejected_prompts": 0,
      "samples_trained": 0})
  trained_sample_ids: list[str] = dataclasses.field(default_factory=list)
  last_busy: dict[str, float] = dataclasses.field(default_factory=dict)
  last_dropped: int = 0


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


async def _train_and_publish(ctx: LoopContext, groups: list[Group], step: int,
                             times: dict[str, float], step_start: float) -> None:
  cfg = ctx.config
  trainer_version = ctx.trainer.policy_version
  sample_metrics = step_sample_metrics(groups, trainer_version)
  t0 = time.perf_counter()
  train_metrics = await asyncio.to_thread(ctx.trainer.update, to_trajectories(groups))
  t1 = time.perf_counter()
  if ctx.publish is not None:
    handoff = await ctx.publish()
  else:
    handoff = await publish_version(ctx.trainer, ctx.store, ctx.client, cfg.rollout.pause_mode,
                                    keep_versions=cfg.keep_versions)
  ctx.published_version = ctx.trainer.policy_version
  ctx.counters["samples_trained"] += sample_metrics["num_samples"]
  ctx.trained_sample_ids.extend(r.sample_id for g in groups for r in g.responses)
  wall = time.perf_counter() - step_start
  stats = ctx.client.stats()
  busy = {s.url: s.busy_s for s in stats.servers}
  # Busy fraction since the previous step (a server counts as busy with any request in flight).
  fractions = [(b - ctx.last_busy.get(url, 0.0)) / max(wall, 1e-9) for url, b in busy.items()]
  ctx.last_busy = busy
  dropped_now = ctx.counters["dropped_stale"] - ctx.last_dropped
  ctx.last_dropped = ctx.counters["dropped_stale"]
  record = {
      **train_metrics,
      "step": step + 1, "policy_version": ctx.trainer.policy_version, "mode": cfg.mode.value,
      "async_ratio": cfg.async_ratio, **sample_metrics,
      **times, "time/train_s": t1 - t0, **handoff, "time/step_s": wall,
      "samples_per_s": sample_metrics["num_samples"] / max(wall, 1e-9),
      "dropped_stale": dropped_now,
      "server_busy_fraction": float(np.mean(fractions)) if fractions else 0.0,
      "client_retries": stats.num_retries,
      "client_malformed": stats.num_malformed, "client_continuations": stats.num_continuations,
      **ctx.extra_metrics(), **{f"total/{k}": v for k, v in ctx.counters.items()},
      "sample_ids": [r.sample_id for g in groups for r in g.responses],
  }
  ckpt = ctx.save_checkpoint(step + 1, [])
  record.update(ckpt)
  if ctx.evaluate is not None and cfg.eval_every and (
      (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
    record["eval/expected_accuracy"] = await asyncio.to_thread(ctx.evaluate)
  if step == 0 and ctx.initial_eval is not None:
    record["eval/initial_expected_accuracy"] = ctx.initial_eval
  ctx.logger.log(record)
  ctx.on_step(record)


async def run_sync(ctx: LoopContext) -> None:
  cfg = ctx.config
  for step in range(ctx.start_step, cfg.steps):
    step_start = time.perf_counter()
    groups: list[Group] = []
    gen_s = reward_s = 0.0
    rounds = 0
    while len(groups) < cfg.batch_size:
      rounds += 1
      batch = [ctx.runner.new_group(*ctx.source.next()) for _ in range(cfg.batch_size - len(groups))]
      t0 = time.perf_counter()
      done = await asyncio.gather(*(ctx.runner.run(g, score=False) for g in batch),
                                  return_exceptions=True)
      t1 = time.perf_counter()
      ok = []
      for group, result in zip(batch, done):
        if isinstance(result, BaseException):
          _count_failure(ctx, group, result)
        else:
          ok.append(group)
      await asyncio.gather(*(ctx.runner.score(g) for g in ok))
      t2 = time.perf_counter()
      gen_s, reward_s = gen_s + t1 - t0, reward_s + t2 - t1
      for group in ok:
        if cfg.dynamic_filter and group.all_rewards_equal():
          ctx.counters["filtered_groups"] += 1
        else:
          groups.append(group)
      if rounds > 20 * cfg.batch_size:
        raise RuntimeError("dynamic filtering rejected every group for too long; check the task.")
    times = {"time/generate_s": gen_s, "time/reward_s": reward_s, "time/wait_data_s": gen_s + reward_s}
    await _train_and_publish(ctx, groups, step, times, step_start)


def _count_failure(ctx: LoopContext, group: Group, error: BaseException) -> None:
  if isinstance(error, RequestRejected):
    ctx.counters["rejected_prompts"] += 1
    log.error("prompt %d rejected by the server, dropped: %s", group.prompt_index, error)
  else:
    ctx.counters["failed_groups"] += 1
    log.error("prompt %d failed (%s); re-issuing it", group.prompt_index, error)
    ctx.source.give_back(group.prompt_index)


async def run_async(ctx: LoopContext) -> None:
  cfg = ctx.config
  bound = StalenessBound(cfg.async_ratio, cfg.batch_size)
  buffer = SampleBuffer(bound)
  cond = asyncio.Condition()
  in_flight: dict[int, Group] = {}
  tasks: set[asyncio.Task] = set()
  takes = {"count": 0}
  stop = asyncio.Event()
  base_version = ctx.trainer.policy_version

  def next_consume_version() -> int:
    return base_version + takes["count"]

  def may_dispatch() -> bool:
    return bound.may_dispatch(len(in_flight) + len(buffer), next_consume_version(),
                              ctx.published_version)

  async def run_group(group: Group) -> None:
    try:
      await ctx.runner.run(group)
    except Exception as error:  # noqa: BLE001 - any failure re-issues or drops, never loses
      async with cond:
        in_flight.pop(group.prompt_index, None)
        _count_failure(ctx, group, error)
        cond.notify_all()
      return
    async with cond:
      in_flight.pop(group.prompt_index, None)
      if cfg.dynamic_filter and group.all_rewards_equal():
        ctx.counters["filtered_groups"] += 1
      else:
        buffer.put(group)
      cond.notify_all()

  async def dispatcher() -> None:
    while True:
      async with cond:
        await cond.wait_for(lambda: stop.is_set() or may_dispatch())
        if stop.is_set():
          return
        group = ctx.runner.new_group(*ctx.source.next())
        in_flight[group.prompt_index] = group
      task = asyncio.create_task(run_group(group))
      tasks.add(task)
      task.add_done_callback(tasks.discard)

  def pending_prompts() -> list[int]:
    return sorted(set(in_flight) | {g.prompt_index for g in buffer.drain_view()})

  ctx.save_checkpoint = _with_pending(ctx.save_checkpoint, pending_prompts)
  dispatch_task = asyncio.create_task(dispatcher())
  try:
    for step in range(ctx.start_step, cfg.steps):
      step_start = time.perf_counter()
      async with cond:
        while True:
          if dispatch_task.done():
            dispatch_task.result()  # surface a dispatcher crash
          result = buffer.take(cfg.batch_size, ctx.trainer.policy_version)
          if result is not None and result.stale:
            ctx.counters["dropped_stale"] += len(result.stale)
            for g in result.stale:
              ctx.source.give_back(g.prompt_index)
            cond.notify_all()
          if result is not None and result.groups:
            groups = result.groups
            takes["count"] += 1
            cond.notify_all()
            break
          await cond.wait()
      times = {"time/wait_data_s": time.perf_counter() - step_start,
               "in_flight_groups": len(in_flight), "buffered_groups": len(buffer)}
      await _train_and_publish(ctx, groups, step, times, step_start)
      async with cond:  # the publish raised `published_version`: dispatch may proceed (α = 0)
        cond.notify_all()
  finally:
    stop.set()
    async with cond:
      cond.notify_all()
    await asyncio.gather(dispatch_task, return_exceptions=True)
    for task in list(tasks):
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    try:
      await asyncio.wait_for(ctx.client.abort_all(), timeout=10)
    except Exception as error:  # noqa: BLE001 - best effort at shutdown
      log.warning("abort_all at shutdown failed: %s", error)


def _with_pending(save, pending: Callable[[], list[int]]):
  def wrapped(step: int, extra_pending: list[int]) -> dict[str, float]:
    return save(step, list(extra_pending) + pending())
  return wrapped
