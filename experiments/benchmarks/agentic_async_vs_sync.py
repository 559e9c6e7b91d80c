"""Env-level async vs the sync lock-step agentic loop, same servers and env slots, one run.

Both modes are the real training loop (`Loop`: async driving `EnvGroupRunner`, sync driving the
lock-step rounds), the real rollout client, real server processes
and the real weight handoff (pause in abort mode -> load -> continue) after every step. Episodes are
multi-turn FrozenLake whose environment steps take a long-tailed time (a tool or sandbox call:
lognormal body, median `--env_median_s`, 5% of steps 10x longer; plus 2% fail-slow steps at another
10x and 1% fail-stop steps that raise), and whose task lengths vary from 3 to 12 turns (like
ALFWorld tasks). Generation goes through protocol stub servers with a fixed time to first token
and a fixed time per token, whatever the batch: that is how a GPU's batched decode behaves up to
its batch capacity, it keeps two shared CPU cores from being the bottleneck of either mode (our JAX
server on them would measure CPU contention, not scheduling), and it favours the sync baseline,
whose whole-batch generation phases are never slowed by their batch size. The trainer is replaced
by a fixed `--train_s` sleep per step, the same in both modes.

Same resources: the same 2 servers and the same number of environment instances at any time
(`batch_size * group_size`): sync plays B groups of n in lock-step (barrier per turn: generate for
every live episode and wait, step every environment and wait); async runs at most B groups at once,
each episode its own task, α = 1. Throughput is trained episodes per second over all steps, ramp-up
included. The redundant variant (one extra candidate per group) is printed for information.

  python -m experiments.benchmarks.agentic_async_vs_sync [--steps=4]

Last line: `agentic_async_speedup_vs_sync: <async episodes/s / sync episodes/s>`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time

from absl import app, flags

from flashrl_jax import envs
from flashrl_jax.controller import (AgenticConfig, AgenticStats, Counters, EnvGroupRunner,
                                   EpisodeDeps, FixedLevel, Loop, MetricsLogger, Mode,
                                   PromptSource, RunConfig, TaskConfig)
from flashrl_jax.fleet import Fleet, LocalServers, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.model import char_tokenizer
from flashrl_jax.testing import stub_server_command

_STEPS = flags.DEFINE_integer("steps", 4, "Training steps per mode.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Env groups per step (B).")
_GROUP = flags.DEFINE_integer("group_size", 4, "Episodes per group (n).")
_ENV_MEDIAN = flags.DEFINE_float("env_median_s", 0.05, "Median environment step latency.")
_TOKEN_S = flags.DEFINE_float("token_latency_s", 0.004, "Decode time per token (per request).")
_TTFT_S = flags.DEFINE_float("ttft_s", 0.02, "Time to first token (per request).")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 32, "Tokens per model turn.")
_TRAIN_S = flags.DEFINE_float("train_s", 1.0, "Simulated train step time.")
_SERVERS = flags.DEFINE_integer("num_servers", 2, "Rollout servers.")
_SLOW = flags.DEFINE_float("fail_slow_prob", 0.02, "P(an env step takes another 10x).")
_STOP = flags.DEFINE_float("fail_stop_prob", 0.01, "P(an env step raises).")

VOCAB = 96  # the char tokenizer's


def env_config() -> envs.EnvConfig:
  return envs.EnvConfig(
      kind=envs.EnvKind.FROZEN_LAKE,
      latency=envs.LatencyConfig(kind=envs.LatencyKind.LONG_TAIL, mean_s=_ENV_MEDIAN.value,
                                 sigma=0.6, tail_prob=0.05, tail_factor=10.0),
      failure=envs.FailureConfig(slow_prob=_SLOW.value, slow_factor=10.0,
                                 stop_prob=_STOP.value))


def make_env(level_seed: int, candidate: int) -> envs.AsyncEnvironment:
  """Tasks of 3 to 12 turns (fixed per level), independent latency noise per worker."""
  del candidate
  config = env_config()
  config = dataclasses.replace(config, episode=envs.EpisodeConfig(max_turns=3 + level_seed % 10))
  return envs.AsyncEnv(FixedLevel(envs.make_env(config), level_seed), config.latency,
                       config.failure)


class SleepLearner:
  """Stands in for `Learner`: a fixed train time per step, the policy version, and one weights
  directory published as every version (no checkpoints, no evaluation)."""

  def __init__(self, seconds: float, weights: str):
    self.seconds, self.weights, self.policy_version = seconds, weights, 0

  def update(self, trajectories) -> dict[str, float]:
    time.sleep(self.seconds)
    self.policy_version += 1
    return {"num_trajectories": float(len(trajectories))}

  def export(self) -> str:
    return self.weights

  def collect_garbage(self) -> None:
    pass

  def evaluate(self) -> None:
    return None

  def save(self, step, extra) -> None:
    del step, extra


async def measure(urls: list[str], mode: Mode, workdir: str, weights: str, *,
                  env_group_size: int = 0) -> dict[str, float]:
  b, n = _BATCH.value, _GROUP.value
  agentic = AgenticConfig(num_env_groups=b, env_group_size=env_group_size,
                          turn_max_new_tokens=_TURN_TOKENS.value, env_step_timeout_s=60.0)
  config = RunConfig(model_path=workdir, workdir=workdir, task=TaskConfig(env=env_config()),
                     mode=mode, async_ratio=1 if mode is Mode.ASYNC else 0, steps=_STEPS.value,
                     batch_size=b, group_size=n, agentic=agentic)
  learner = SleepLearner(_TRAIN_S.value, weights)
  counters = Counters()
  client = RolloutClient(urls, request_timeout_s=60.0, vocab_size=VOCAB)
  async with Fleet(client, pause_mode=PauseMode.ABORT) as fleet:
    deps = EpisodeDeps(fleet=fleet, tokenizer=char_tokenizer(),
                       sampling=SamplingParams(max_new_tokens=_TURN_TOKENS.value),
                       make_env=make_env, stats=AgenticStats(counters.episodes), row_length=4096,
                       max_response_length=3500, step_timeout_s=agentic.env_step_timeout_s)
    runner = EnvGroupRunner(deps, agentic, group_size=n, concurrent_groups=b)
    logger = MetricsLogger(workdir, tensorboard=False)
    start = time.perf_counter()
    await Loop(config, fleet=fleet, learner=learner,
               source=PromptSource(envs.SampleListSource([envs.Sample("", "")])), runner=runner,
               counters=counters, logger=logger).run()
    wall = time.perf_counter() - start
    logger.close()
  episodes = counters.samples_trained
  return {"episodes_per_s": episodes / wall, "env_steps_per_s": counters.episodes.env_steps / wall,
          "wall_s": wall, "episodes": episodes,
          "dropped": {k.value: v for k, v in counters.episodes.dropped.items() if v}}


def main(argv):
  del argv
  out = tempfile.mkdtemp(prefix="agentic_bench_")
  weights = tempfile.mkdtemp(prefix="weights_", dir=out)
  servers = LocalServers.start(
      "stub", _SERVERS.value, command=stub_server_command(), log_dir=out,
      extra_args=(f"--vocab_size={VOCAB}", "--max_running_requests=512",
                  f"--latency_s={_TTFT_S.value}", f"--token_latency_s={_TOKEN_S.value}"))
  b, n = _BATCH.value, _GROUP.value
  print(f"FrozenLake, 3-12 turns, env step lognormal median {_ENV_MEDIAN.value}s (5% x10, "
        f"{_SLOW.value:.0%} fail-slow x10, {_STOP.value:.0%} fail-stop); "
        f"{_SERVERS.value} stub servers, "
        f"{_TTFT_S.value}s + {_TOKEN_S.value}s/token, {_TURN_TOKENS.value} tokens/turn; "
        f"B={b} groups x n={n}, {b * n} env instances; train {_TRAIN_S.value}s/step; "
        f"{_STEPS.value} steps per mode", flush=True)
  results = {}
  with servers:
    for name, mode, extra in (("sync lock-step", Mode.SYNC, 0), ("env-level async", Mode.ASYNC, 0),
                              ("async + redundant", Mode.ASYNC, n + 1)):
      r = asyncio.run(measure(servers.urls, mode, f"{out}/{name.replace(' ', '_')}", weights,
                              env_group_size=extra))
      results[name] = r
      print(f"{name:>18}: {r['episodes_per_s']:6.2f} episodes/s  {r['env_steps_per_s']:7.1f} "
            f"env-steps/s  ({r['episodes']} episodes in {r['wall_s']:.1f}s; dropped "
            f"{r['dropped']})", flush=True)
  sync, async_ = results["sync lock-step"], results["env-level async"]
  print(f"env-steps/s ratio: {async_['env_steps_per_s'] / sync['env_steps_per_s']:.2f}; "
        f"redundant variant ({n + 1} candidates per group of {n}): "
        f"{results['async + redundant']['episodes_per_s'] / sync['episodes_per_s']:.2f}x sync")
  print(f"agentic_async_speedup_vs_sync: "
        f"{async_['episodes_per_s'] / sync['episodes_per_s']:.2f}")


if __name__ == "__main__":
  app.run(main)
