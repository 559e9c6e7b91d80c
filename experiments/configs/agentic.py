"""The agentic CPU demo: multi-turn FrozenLake, long-tail tool latency, unreliable environments.

`python -m experiments.train --config=experiments/configs/agentic.py` runs env-level async rollout
(every episode its own task, no barrier across environments) with redundant env rollout: 3
candidate episodes per group of n = 2, the first two to finish win. Environment steps take a
long-tailed time (lognormal body, 5% of steps 10x longer), 5% of steps are fail-slow (another 10x)
and 2% fail-stop (the environment raises); neither stalls a step. `--mode=sync` runs the lock-step
baseline on the same resources. The policy is the demo's tiny warm-started model: it has never seen
FrozenLake, so this demonstrates the systems side (throughput, fault tolerance), not learning.
"""

from flashrl_jax import envs
from flashrl_jax.controller import (AgenticConfig, Mode, ResourceConfig, RolloutConfig, RunConfig,
                                    TaskConfig)
from flashrl_jax.losses import LossConfig
from flashrl_jax.trainer import BatchConfig, OptimizerConfig, TrainConfig

from experiments.configs.repeat import REPEAT_MODEL_DIR


def agentic_env(max_turns: int = 4) -> envs.EnvConfig:
  return envs.EnvConfig(
      kind=envs.EnvKind.FROZEN_LAKE, episode=envs.EpisodeConfig(max_turns=max_turns),
      latency=envs.LatencyConfig(kind=envs.LatencyKind.LONG_TAIL, mean_s=0.05, sigma=0.8,
                                 tail_prob=0.05, tail_factor=10.0),
      failure=envs.FailureConfig(slow_prob=0.05, slow_factor=10.0, stop_prob=0.02))


def get_config() -> RunConfig:
  return RunConfig(
      model_path=REPEAT_MODEL_DIR,
      workdir="runs/agentic",
      task=TaskConfig(env=agentic_env(), seed=1),
      train=TrainConfig(
          loss=LossConfig(name="cispo", clip_low=1.0, clip_high=0.28),
          optimizer=OptimizerConfig(learning_rate=5e-4, warmup_steps=2, max_grad_norm=1.0),
          # FrozenLake's first observation is ~210 tokens, each turn ~12 + ~100 observation tokens.
          batch=BatchConfig(row_length=640, rows=8, sequences_per_row=2, max_response_length=432),
          temperature=1.0),
      rollout=RolloutConfig(num_servers=2, max_running_requests=16, max_new_tokens=12,
                            temperature=1.0),
      resources=ResourceConfig(rollout_devices=1, train_devices=1),
      agentic=AgenticConfig(env_group_size=3, turn_max_new_tokens=12, env_step_timeout_s=20.0),
      mode=Mode.ASYNC, async_ratio=1, steps=10, batch_size=4, group_size=2)
