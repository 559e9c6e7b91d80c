"""The synthetic long-tail "repeat" task: a tiny warm-started Qwen3-layout model, async RL.

Answers are "repeat the digit d n times" with long-tailed lengths (lognormal), so rollout time is
set by a few long responses: the regime of the throughput benchmarks (`bench_rlvr*.py` derive from
this config) and of the experiments measured in RESULTS.md (`ablate_losses`, `sweep_async_ratio`,
`resource_split`). Two rollout server processes on one core, the trainer on the other, α = 2.
"""

from flashrl_jax import envs
from flashrl_jax.controller import (Mode, ResourceConfig, RolloutConfig, RunConfig, TaskConfig)
from flashrl_jax.losses import LossConfig
from flashrl_jax.trainer import BatchConfig, OptimizerConfig, TrainConfig

REPEAT_MODEL_DIR = ".cache/repeat_model"
REPEAT_WARMSTART_STEPS = 160


def repeat_task() -> envs.SyntheticConfig:
  """Long-tail answer lengths: most answers are short, a few are 5-8x longer."""
  return envs.SyntheticConfig(
      task=envs.SyntheticTask.REPEAT,
      lengths=envs.LengthDistribution(law=envs.LengthLaw.LOGNORMAL, median=6, sigma=0.8,
                                      min_len=1, max_len=48))


def get_config() -> RunConfig:
  return RunConfig(
      model_path=REPEAT_MODEL_DIR,
      workdir="runs/repeat",
      task=TaskConfig(synthetic=repeat_task(), reward=envs.RewardKind.EXACT_MATCH, seed=1),
      train=TrainConfig(
          loss=LossConfig(name="cispo", clip_low=1.0, clip_high=0.28),
          optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2, max_grad_norm=1.0),
          batch=BatchConfig(row_length=128, rows=8, sequences_per_row=4, max_response_length=64),
          temperature=1.0),
      rollout=RolloutConfig(num_servers=2, max_running_requests=16, max_new_tokens=60,
                            temperature=1.0),
      resources=ResourceConfig(rollout_devices=1, train_devices=1),
      mode=Mode.ASYNC, async_ratio=2, steps=40, batch_size=16, group_size=8)
