"""Agentic rollout against real stub server processes (no trainer): the multi-turn trajectory
layout, env-level async with deliberately slow and failing environments, redundant candidates, the
lock-step baseline, and malformed server responses rejected and retried."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import numpy as np
import pytest

from flashrl_jax import envs
from flashrl_jax.controller import (AgenticConfig, AgenticStats, Counters, DropCause,
                                   EnvGroupRunner, EpisodeDeps, FixedLevel, PromptSource,
                                   collect_lockstep, to_trajectories)
from flashrl_jax.controller._agentic import LockstepRound, level_seed
from flashrl_jax.controller._agentic_config import ID_STRIDE
from flashrl_jax.controller._agentic_episode import env_factory, level_turns
from flashrl_jax.fleet import Fleet, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.model import char_tokenizer
from flashrl_jax.scheduling import LengthDistribution, LengthLaw
from flashrl_jax.trainer import BatchConfig, pack
from tests.rollout_stubs import configure, start_stubs

VOCAB = 96  # the char tokenizer's ids fit
STEP_S = 0.05
EPISODE = envs.EpisodeConfig(max_turns=3)
GAME = envs.EnvConfig(episode=EPISODE,
                      latency=envs.LatencyConfig(envs.LatencyKind.CONSTANT, mean_s=STEP_S))


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
  with start_stubs(2, "stub", f"--vocab_size={VOCAB}", "--token_latency_s=0.001",
                   log_dir=str(tmp_path_factory.mktemp("stubs"))) as servers:
    yield servers


class _Crashes:
  """An environment whose step raises something that is not an `EnvironmentFailure`."""

  def __init__(self, env):
    self.env = env

  def reset(self, seed):
    return self.env.reset(seed)

  def step(self, action):
    raise ValueError("tool exploded")


def unreliable_factory(level_seed: int, candidate: int) -> envs.AsyncEnvironment:
  """Candidate 0 is fail-slow (10x latency), 1 fail-stops, 2 raises a ValueError, the rest work."""
  game = FixedLevel(envs.make_env(GAME), level_seed)
  failure = envs.FailureConfig()
  if candidate == 0:
    failure = envs.FailureConfig(slow_prob=1.0, slow_factor=10.0)
  elif candidate == 1:
    failure = envs.FailureConfig(stop_prob=1.0)
  elif candidate == 2:
    game = _Crashes(game)
  return envs.AsyncEnv(game, GAME.latency, failure)


def _runner(fleet, make_env, *, n, candidates, groups=8, max_episodes=0, turn_budget=None):
  deps = EpisodeDeps(fleet=fleet, tokenizer=char_tokenizer(),
                     sampling=SamplingParams(max_new_tokens=6, stop_token_ids=(2,)),
                     make_env=make_env, stats=AgenticStats(),
                     row_length=1024, max_response_length=800, step_timeout_s=10.0,
                     turn_budget=turn_budget)
  config = AgenticConfig(env_group_size=candidates, max_episodes_per_group=max_episodes)
  return EnvGroupRunner(deps, config, group_size=n, concurrent_groups=groups, task_seed=7)


def _fleet(urls):
  return Fleet(RolloutClient(urls, request_timeout_s=10.0, max_retries=3, health_interval_s=0.2,
                             vocab_size=VOCAB), pause_mode=PauseMode.ABORT)


def _counts(runner):
  return dict(runner.stats.counts.dropped)


def test_episode_is_one_trajectory_with_masked_observations(stubs):
  tok = char_tokenizer()

  async def main():
    async with _fleet(stubs.urls) as fleet:
      runner = _runner(fleet, env_factory(GAME), n=1, candidates=1)
      return await runner.run(runner.new_group(5, envs.Sample("", "")))

  group = asyncio.run(main())
  (r,) = group.responses
  assert tok.decode(group.prompt_ids) == envs.make_env(GAME).reset(level_seed(7, 5))
  assert r.sample_id == str(5 * ID_STRIDE)
  mask = np.asarray(r.response_mask)
  assert len(mask) == len(r.output_ids) == len(r.behavior_logp) == len(r.token_versions)
  # model turn, observation, model turn, observation, model turn (3 turns, the last one ends it)
  runs = [k for k, _ in itertools.groupby(mask)]
  assert runs == [True, False, True, False, True]
  logp = np.asarray(r.behavior_logp)
  assert np.all(logp[~mask] == 0.0) and np.all(logp[mask] < 0.0)
  ids = np.asarray(r.output_ids)
  observations = tok.decode(ids[~mask].tolist())
  assert observations.count("Invalid action") == 2  # the stub's tokens are never a move
  assert r.reward == pytest.approx(3 * EPISODE.invalid_action_penalty)
  assert r.reward_info["turns"] == 3 and r.finish_reason == "max_turns"
  (traj,) = to_trajectories([group])
  assert traj.response_mask.dtype == bool and traj.response_mask.sum() == mask.sum()
  batch = pack([traj], BatchConfig(row_length=640, rows=1, sequences_per_row=1,
                                   max_response_length=400))
  assert batch.loss_mask.sum() == mask.sum()  # observation tokens are not trained


def test_levels_get_long_tail_turn_budgets(stubs):
  """A turn-budget law gives each level its own length (the same for its candidates), capped by
  the environment's own limit; the stub's garbage actions never end an episode earlier."""
  budget = LengthDistribution(LengthLaw.LOGNORMAL, median=3, sigma=0.8, min_len=1, max_len=6)
  game = dataclasses.replace(GAME, episode=envs.EpisodeConfig(max_turns=5),
                             latency=envs.LatencyConfig(envs.LatencyKind.CONSTANT, mean_s=0.0))

  async def main():
    async with _fleet(stubs.urls) as fleet:
      runner = _runner(fleet, env_factory(game), n=2, candidates=2, turn_budget=budget)
      return await asyncio.gather(*(runner.run(runner.new_group(i, envs.Sample("", "")))
                                    for i in range(8)))

  groups = asyncio.run(main())
  turns = []
  for g in groups:
    want = min(level_turns(budget, level_seed(7, g.prompt_index)), 5)
    assert [r.reward_info["turns"] for r in g.responses] == [want, want]
    turns.append(want)
  assert len(set(turns)) > 1  # levels differ in length


def test_slow_and_failing_envs_never_stall_env_level_async(stubs):
  """n = 2 of 4 candidates per group: the fail-stop and crashing ones are dropped and replaced, the
  fail-slow one is outrun and cancelled; all 6 groups complete before one slow episode would."""

  async def main():
    async with _fleet(stubs.urls) as fleet:
      runner = _runner(fleet, unreliable_factory, n=2, candidates=4)
      start = time.monotonic()
      groups = await asyncio.gather(*(runner.run(runner.new_group(i, envs.Sample("", "")))
                                      for i in range(6)))
      return runner, groups, time.monotonic() - start

  runner, groups, elapsed = asyncio.run(main())
  slow_episode_s = EPISODE.max_turns * STEP_S * 10
  assert elapsed < slow_episode_s, elapsed
  ids = [r.sample_id for g in groups for r in g.responses]
  assert len(ids) == len(set(ids)) == 12
  for g in groups:  # the healthy original and a replacement
    assert {r.reward_info["candidate"] for r in g.responses} <= {3, 4, 5}
  counts = _counts(runner)
  assert counts[DropCause.ENV_FAILURE] == 12  # fail-stop + crash, in every group
  assert counts[DropCause.REDUNDANT] == 12  # the fail-slow one and the slower replacement
  assert runner.stats.report()["env_step_s/p50"] == pytest.approx(STEP_S, rel=0.5)


def _always_fails(level_seed_, candidate):
  del candidate
  return envs.AsyncEnv(FixedLevel(envs.make_env(GAME), level_seed_),
                       failure=envs.FailureConfig(stop_prob=1.0))


def test_group_that_cannot_finish_fails_for_reissue(stubs):
  async def main():
    async with _fleet(stubs.urls) as fleet:
      runner = _runner(fleet, _always_fails, n=1, candidates=1, max_episodes=2)
      with pytest.raises(RuntimeError, match="every candidate dropped"):
        await runner.run(runner.new_group(0, envs.Sample("", "")))
      return runner

  runner = asyncio.run(main())
  assert _counts(runner)[DropCause.ENV_FAILURE] == 2


def test_lockstep_baseline_waits_at_every_barrier(stubs):
  """Same candidates in lock-step: correct groups, but every turn waits for the slow environment."""

  async def main():
    async with _fleet(stubs.urls) as fleet:
      runner = _runner(fleet, unreliable_factory, n=2, candidates=4)
      source = PromptSource(envs.SampleListSource([envs.Sample("", "")]))
      start = time.monotonic()
      counters = Counters()
      groups, times = await collect_lockstep(runner, source, 2, 3, counters)
      return runner, groups, times, counters, time.monotonic() - start

  runner, groups, times, counters, elapsed = asyncio.run(main())
  assert len(groups) == 2 and all(len(g.responses) == 2 for g in groups)
  assert elapsed >= EPISODE.max_turns * STEP_S * 10 * 0.9  # the slow candidate sets the pace
  assert times["time/env_s"] > times["time/generate_s"]
  assert counters.redundant_groups == 1  # 3 started, the first 2 complete were trained
  assert len({r.sample_id for g in groups for r in g.responses}) == 4
  assert _counts(runner)[DropCause.ENV_FAILURE] == 6


def test_lockstep_round_reports_partial_when_everything_fails(stubs):
  async def main():
    async with _fleet(stubs.urls) as fleet:
      runner = _runner(fleet, _always_fails, n=1, candidates=1, max_episodes=2)
      groups = [runner.new_group(i, envs.Sample("", "")) for i in range(2)]
      lockstep = LockstepRound(runner, groups, 2)
      return await lockstep.play(), lockstep

  taken, lockstep = asyncio.run(main())
  assert taken == [] and len(lockstep.failed) == 2


@pytest.mark.parametrize("mode", ["wrong_logprob_count", "bad_token_ids", "non_json",
                                  "missing_fields"])
def test_malformed_responses_are_rejected_and_retried(stubs, mode):
  """One of two servers lies; every episode still gets exactly the stub's true tokens."""
  bad, good = stubs.urls
  configure(bad, misbehave=mode)
  try:
    async def main():
      async with _fleet(stubs.urls) as fleet:
        runner = _runner(fleet, env_factory(GAME), n=2, candidates=2)
        groups = await asyncio.gather(*(runner.run(runner.new_group(i, envs.Sample("", "")))
                                        for i in range(3)))
        return groups, fleet.stats().client

    groups, stats = asyncio.run(main())
  finally:
    configure(bad, misbehave="none")
  assert stats.num_malformed >= 1
  for g in groups:
    for r in g.responses:
      mask = np.asarray(r.response_mask)
      ids = np.asarray(r.output_ids)[mask]
      assert ids.max() < VOCAB
      assert all(lp == pytest.approx(-0.01 * (1 + t % 50))  # the stub's true log-probs
                 for lp, t in zip(np.asarray(r.behavior_logp)[mask], ids))


def test_weight_update_mid_episode_continues_the_turn(stubs, tmp_path):
  """A publish in abort mode lands in the middle of episodes: the aborted turns are continued under
  the new version, tokens carry the version that produced them, staleness counts from turn one."""
  weights = tmp_path / "weight_v000001"
  weights.mkdir()
  for url in stubs.urls:
    configure(url, token_latency_s=0.02)
  try:
    async def main():
      async with _fleet(stubs.urls) as fleet:
        await fleet.publish(str(weights), 0)
        runner = _runner(fleet, env_factory(GAME), n=2, candidates=2)
        tasks = [asyncio.create_task(runner.run(runner.new_group(i, envs.Sample("", ""))))
                 for i in range(2)]
        while sum(s.in_flight for s in fleet.stats().client.servers) < 2:  # turns are generating
          await asyncio.sleep(0.005)
        await fleet.publish(str(weights), 1)
        groups = await asyncio.gather(*tasks)
        return groups, fleet.stats().client

    groups, stats = asyncio.run(main())
  finally:
    for url in stubs.urls:
      configure(url, token_latency_s=0.001)
  assert stats.num_continuations >= 1
  spanning = 0
  for g in groups:
    for r in g.responses:
      assert r.start_version == 0  # the version of its first turn, whatever came later
      trained = [v for v, m in zip(r.token_versions, r.response_mask) if m]
      assert trained == sorted(trained) and set(trained) <= {0, 1}
      assert len(r.output_ids) == len(r.token_versions) == len(r.behavior_logp)
      spanning += set(trained) == {0, 1}
  assert spanning >= 1


@pytest.mark.parametrize("agentic, message", [
    (AgenticConfig(num_env_groups=1), "num_env_groups=1 < batch_size=2"),
    (AgenticConfig(env_group_size=1), "env_group_size=1 < group_size=2"),
    (AgenticConfig(env_group_size=3, max_episodes_per_group=2), "max_episodes_per_group"),
    (AgenticConfig(max_episodes_per_group=ID_STRIDE + 1), "sample id stride"),
])
def test_redundancy_can_only_add(agentic, message):
  from flashrl_jax.controller import RunConfig, TaskConfig
  with pytest.raises(ValueError, match=message):
    RunConfig(model_path="m", workdir="w", task=TaskConfig(env=GAME), batch_size=2, group_size=2,
              agentic=agentic)
  with pytest.raises(ValueError, match="exactly one"):
    TaskConfig(env=GAME, dataset=envs.DatasetFileConfig("x.jsonl"))
