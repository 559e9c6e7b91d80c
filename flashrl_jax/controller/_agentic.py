"""Agentic rollout: environment-level async with redundant env rollout, and the lock-step baseline.

Env-level async (ROLL Flash): every candidate episode is its own task that runs reset -> generate ->
step -> generate ... with no barrier across environments, so while one environment waits for a slow
tool call the servers generate for the others. `EnvGroupRunner` has the interface of `GroupRunner`
(`new_group`, `run`, `report`), so the async loop (`Loop`) drives it unchanged: the same staleness
bound, sample buffer, admission rule and weight handoff, with staleness counted from an episode's
first turn. Redundant env rollout: a group starts `env_group_size` >= n candidates on the same level
and keeps the first n to finish; a dropped episode (the environment raised or timed out, the
generation failed) is replaced by a fresh candidate, keeping the margin over n; the rest are
cancelled and counted. A group
that cannot be completed within `max_episodes_per_group` fails, and its prompt is re-issued.

Sync baseline (`collect_lockstep`, driven by the sync loop): per step, `num_env_groups` groups of candidates advance in
lock-step, with a barrier per phase: reset all, then per turn generate for every live episode and
wait for all, step every environment and wait for all. The first B complete groups are trained; the
rest are cancelled and counted. Same episode code, same servers, same resources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Awaitable, Callable

import numpy as np

from flashrl_jax import envs
from flashrl_jax.controller._agent_episode import AgentEpisode, AgentFn, chat_agent
from flashrl_jax.controller._agent_proxy import AgentProxy
from flashrl_jax.controller._agentic_config import AgenticConfig, DropCause
from flashrl_jax.controller._agentic_episode import (AgenticStats, Episode, EpisodeDeps,
                                                     EpisodeDropped, env_factory)
from flashrl_jax.controller._config import Mode
from flashrl_jax.controller._counters import Counters
from flashrl_jax.controller._samples import Group, Response
from flashrl_jax.controller._source import PromptSource
from flashrl_jax.fleet import Fleet, RequestRejected, SamplingParams

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
  """A group could not collect n finished episodes within its episode budget."""


def level_seed(task_seed: int, prompt_index: int) -> int:
  return int(np.random.SeedSequence([task_seed, prompt_index]).generate_state(1)[0])


class EnvGroupRunner:
  """Plays environment groups; `new_group` / `run` / `report` as `GroupRunner`, for the loop."""

  def __init__(self, deps: EpisodeDeps, config: AgenticConfig, *, group_size: int,
               concurrent_groups: int, task_seed: int = 0, proxy: AgentProxy | None = None,
               agent: AgentFn | None = None):
    """With `proxy`, episodes are played by `agent` code through the OpenAI API (`AgentEpisode`)."""
    self.deps, self.config, self.group_size = deps, config, group_size
    self.proxy, self.agent = proxy, agent
    self.candidates = config.candidates(group_size)
    self.max_episodes = config.max_episodes(group_size)
    self.task_seed = task_seed
    self._slots = asyncio.Semaphore(concurrent_groups)

  @property
  def stats(self) -> AgenticStats:
    return self.deps.stats

  def new_group(self, index: int, sample: envs.Sample) -> Group:
    # prompt_ids are the first observation, filled in by the first candidate's reset.
    return Group(prompt_index=index, sample=sample, prompt_ids=[], n=self.group_size,
                 dispatched_version=self.deps.fleet.version)

  def report(self) -> dict[str, float]:
    """Environment-step latency percentiles since the last report."""
    return self.stats.report()

  def episode(self, group: Group, candidate: int) -> Episode | AgentEpisode:
    seed = level_seed(self.task_seed, group.prompt_index)
    if self.proxy is not None:
      return AgentEpisode(self.deps, group, candidate, seed, self.proxy, self.agent)
    return Episode(self.deps, group, candidate, seed)

  async def run(self, group: Group, *, score: bool = True) -> Group:
    """Plays candidates of `group` until n have finished; raises `GroupFailed` if it cannot."""
    del score  # episodes are rewarded by their environment as they go
    async with self._slots:
      return await self._race(group)

  async def _race(self, group: Group) -> Group:
    running: dict[asyncio.Task, Episode] = {}
    winners: list[Response] = []
    causes: list[DropCause] = []
    started = 0

    def launch() -> None:
      nonlocal started
      episode = self.episode(group, started)
      started += 1
      running[asyncio.create_task(episode.play())] = episode

    for _ in range(self.candidates):
      launch()
    complete = False
    try:
      while len(winners) < group.n:
        if not running:
          raise _group_failure(group, causes)
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
          running.pop(task)
          try:
            winners.append(task.result())
          except EpisodeDropped as error:
            self.stats.drop(error.cause)
            causes.append(error.cause)
            log.warning("episode of group %d dropped: %s", group.prompt_index, error)
        # Keep the redundancy margin: a dropped candidate is replaced while the group is open.
        while len(winners) + len(running) < self.candidates and started < self.max_episodes:
          launch()
      complete = True
    finally:
      for task in running:
        task.cancel()
      await asyncio.gather(*running, return_exceptions=True)
      if complete:  # first finishers won; cancelled or late candidates were redundant
        self.stats.drop(DropCause.REDUNDANT, len(running) + len(winners) - group.n)
    group.responses = winners[:group.n]
    return group


def _group_failure(group: Group, causes: list[DropCause]) -> Exception:
  detail = f"group {group.prompt_index}: every candidate dropped ({[c.value for c in causes]})"
  if causes and all(c is DropCause.REJECTED for c in causes):
    return RequestRejected(detail)  # the level itself cannot be served: drop, do not re-issue
  return GroupFailed(detail)


# --- the lock-step baseline ----------------------------------------------------------------------

async def _barrier(episodes: list[Episode], phase: Callable[[Episode], Awaitable[None]],
                   stats: AgenticStats) -> list[Episode]:
  """Runs `phase` for every episode at once and waits for all; returns those not dropped."""
  results = await asyncio.gather(*(phase(e) for e in episodes), return_exceptions=True)
  alive = []
  for episode, result in zip(episodes, results):
    if isinstance(result, EpisodeDropped):
      stats.drop(result.cause)
      log.warning("episode %d dropped: %s", episode.sample_id, result)
    elif isinstance(result, BaseException):
      raise result
    else:
      alive.append(episode)
  return alive


class LockstepRound:
  """Groups advancing turn by turn behind a barrier until `needed` of them are complete."""

  def __init__(self, runner: EnvGroupRunner, groups: list[Group], needed: int):
    self.runner, self.groups, self.needed = runner, groups, needed
    self.winners: dict[int, list[Response]] = {g.prompt_index: [] for g in groups}
    self.started = {g.prompt_index: 0 for g in groups}
    self.complete: list[Group] = []  # in completion order
    self.failed: list[Group] = []
    self.times = {"time/generate_s": 0.0, "time/env_s": 0.0}

  def _spawn(self, group: Group) -> Episode:
    episode = self.runner.episode(group, self.started[group.prompt_index])
    self.started[group.prompt_index] += 1
    return episode

  async def _phase(self, episodes: list[Episode], phase, timer: str) -> list[Episode]:
    start = time.perf_counter()
    alive = await _barrier(episodes, phase, self.runner.stats)
    self.times[timer] += time.perf_counter() - start
    return alive

  async def play(self) -> list[Group]:
    """Plays the round; returns the first `needed` complete groups (fewer if too many failed)."""
    live = [self._spawn(g) for g in self.groups for _ in range(self.runner.candidates)]
    live = await self._phase(live, Episode.reset, "time/env_s")
    while live and len(self.complete) < self.needed:
      live = await self._phase(live, Episode.act, "time/generate_s")
      live = await self._phase(live, _observe_unless_done, "time/env_s")
      live = await self._harvest(live)
    taken = self.complete[:self.needed]
    for group in taken:
      group.responses = self.winners[group.prompt_index][:group.n]
    kept = {g.prompt_index for g in taken}
    wasted = len(live) + sum(len(w) for i, w in self.winners.items() if i not in kept)
    self.runner.stats.drop(DropCause.REDUNDANT, wasted)
    return taken

  async def _harvest(self, live: list[Episode]) -> list[Episode]:
    """Keeps finished episodes, retires complete groups, replaces dropped candidates."""
    closed = {g.prompt_index for g in self.complete + self.failed}
    for episode in [e for e in live if e.done]:
      winners = self.winners[episode.group.prompt_index]
      if episode.group.prompt_index in closed or len(winners) >= episode.group.n:
        self.runner.stats.drop(DropCause.REDUNDANT)
      else:
        winners.append(episode.response())
    live = [e for e in live if not e.done]
    fresh: list[Episode] = []
    for group in self.groups:
      i = group.prompt_index
      if i in closed:
        continue
      mine = [e for e in live if e.group is group]
      while (len(self.winners[i]) < group.n
             and len(self.winners[i]) + len(mine) < self.runner.candidates
             and self.started[i] < self.runner.max_episodes):
        mine.append(self._spawn(group))
        fresh.append(mine[-1])
      if len(self.winners[i]) >= group.n or len(self.winners[i]) + len(mine) < group.n:
        (self.complete if len(self.winners[i]) >= group.n else self.failed).append(group)
        self.runner.stats.drop(DropCause.REDUNDANT, len(mine))
        live = [e for e in live if e.group is not group]
        fresh = [e for e in fresh if e.group is not group]
    if fresh:  # replacements join at the next turn boundary, after their own reset barrier
      live += await self._phase(fresh, Episode.reset, "time/env_s")
    return live


async def _observe_unless_done(episode: Episode) -> None:
  if not episode.done:
    await episode.observe()


async def collect_lockstep(runner: EnvGroupRunner, source: PromptSource, batch_size: int,
                           num_groups: int, counters: Counters
                           ) -> tuple[list[Group], dict[str, float]]:
  """B complete groups played in lock-step; another round starts if failures left the step short."""
  taken: list[Group] = []
  times = {"time/generate_s": 0.0, "time/env_s": 0.0}
  for _ in range(20):
    need = batch_size - len(taken)
    groups = [runner.new_group(*source.next()) for _ in range(max(num_groups - len(taken), need))]
    lockstep = LockstepRound(runner, groups, need)
    got = await lockstep.play()
    for key, value in lockstep.times.items():
      times[key] += value
    taken += got
    counters.redundant_groups += len(groups) - len(got) - len(lockstep.failed)
    for group in lockstep.failed:
      counters.failed_groups += 1
      source.give_back(group.prompt_index)
    if len(taken) == batch_size:
      return taken, times
  raise RuntimeError("lock-step rollout could not complete a step in 20 rounds; check the env.")


def make_env_runner(config, fleet: Fleet, tokenizer, sampling: SamplingParams,
                    counters: Counters, proxy: AgentProxy | None = None) -> EnvGroupRunner:
  """The runner of an environment task (`config.task.env`), from the run's typed config; episode
  counts go to `counters.episodes`. `proxy` (for `agentic.policy=openai`) serves the agent code."""
  agentic, batch = config.agentic, config.train.batch
  deps = EpisodeDeps(
      fleet=fleet, tokenizer=tokenizer,
      sampling=dataclasses.replace(sampling, max_new_tokens=agentic.turn_max_new_tokens),
      make_env=env_factory(config.task.env), stats=AgenticStats(counters.episodes),
      row_length=batch.row_length,
      max_response_length=batch.max_response_length, step_timeout_s=agentic.env_step_timeout_s,
      turn_budget=agentic.turn_budget)
  is_async = config.mode is Mode.ASYNC
  agent = functools.partial(chat_agent, max_tokens=agentic.turn_max_new_tokens)
  return EnvGroupRunner(deps, agentic, group_size=config.group_size, task_seed=config.task.seed,
                        concurrent_groups=agentic.groups(config.batch_size, config.async_ratio,
                                                         is_async),
                        proxy=proxy, agent=agent if proxy is not None else None)
