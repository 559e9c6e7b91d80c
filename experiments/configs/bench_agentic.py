"""The agentic benchmark's setting: long-tail episodes against slow, unreliable environments.

ROLL Flash's agentic gains (2.72x on ALFWorld, 1.81x on SWE) come from tasks that differ in length —
most levels take a few turns, a few take many — and from environment calls (a simulator, a tool, a
test run) that take long, variable and sometimes pathological time. Here: multi-turn FrozenLake with
a per-level turn budget drawn from a long-tail law (lognormal, median 5 turns, log-std 0.6, clipped
to 2-12: the longest level ~ 3-4x the median), environment steps lognormal around a 0.2 s median
(log-std 0.6; a containerised text game or a light tool call) with 5% of calls 10x longer, 2%
fail-slow (another 10x) and 1% fail-stop (the call raises); the demo's tiny policy on our JAX
servers; the real trainer. B = 4 groups x n = 4
episodes per step; async mode at α = 1 with the same number of environment groups at once as the
lock-step baseline (`num_env_groups` = B). The policy never saw FrozenLake: this measures the
systems side (throughput under environment latency), not learning.
"""

from flashrl_jax import envs
from flashrl_jax.controller import (AgenticConfig, Mode, ResourceConfig, RolloutConfig, RunConfig,
                                    TaskConfig)
from flashrl_jax.losses import LossConfig
from flashrl_jax.scheduling import LengthDistribution, LengthLaw
from flashrl_jax.trainer import BatchConfig, OptimizerConfig, TrainConfig

from experiments.configs.repeat import REPEAT_MODEL_DIR

MAX_TURNS = 12


def bench_env() -> envs.EnvConfig:
  return envs.EnvConfig(
      kind=envs.EnvKind.FROZEN_LAKE, episode=envs.EpisodeConfig(max_turns=MAX_TURNS),
      latency=envs.LatencyConfig(kind=envs.LatencyKind.LONG_TAIL, mean_s=0.2, sigma=0.6,
                                 tail_prob=0.05, tail_factor=10.0),
      failure=envs.FailureConfig(slow_prob=0.02, slow_factor=10.0, stop_prob=0.01))


def get_config() -> RunConfig:
  return RunConfig(
      model_path=REPEAT_MODEL_DIR,
      workdir="runs/bench_agentic",
      task=TaskConfig(env=bench_env(), seed=3),
      train=TrainConfig(
          loss=LossConfig(name="cispo", clip_low=1.0, clip_high=0.28),
          optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=2, max_grad_norm=1.0),
          # First observation ~260 tokens; a turn is <= 6 generated + ~100 observation tokens, so
          # an episode is 0.3-1.5k tokens: 4 rows of 1536 packed with up to 4 each (1 micro-batch
          # per ~6k tokens). One episode per row would pad 16 x 1536 and cost 3.4x the step.
          batch=BatchConfig(row_length=1536, rows=4, sequences_per_row=4,
                            max_response_length=1270),
          temperature=1.0),
      rollout=RolloutConfig(num_servers=2, max_running_requests=16, max_new_tokens=6,
                            temperature=1.0),
      resources=ResourceConfig(rollout_devices=1, train_devices=1),
      agentic=AgenticConfig(num_env_groups=4, turn_max_new_tokens=6, env_step_timeout_s=30.0,
                            turn_budget=LengthDistribution(LengthLaw.LOGNORMAL, median=5,
                                                           sigma=0.6, min_len=2,
                                                           max_len=MAX_TURNS)),
      mode=Mode.ASYNC, async_ratio=1, steps=8, batch_size=4, group_size=4, eval_every=0)
