"""The CPU demo: a tiny warm-started Qwen3-layout model learns a reasoning-gym task with async RL.

`get_config()` is the default of `python -m experiments.train` (what `launch/demo.sh` runs). The
task is reasoning-gym's `spell_backward` on 3-5 letter words ("Spell this word backward (example:
sun -> nus): bird" -> "drib"), scored by reasoning-gym's own scorer (1 for the exact word, partial
credit per leading letter otherwise). Why this generator: the demo model reads one character per
token, so reversing a word is a skill it can learn and that carries over to words it never saw
(the held-out set is 256 words the training stream never yields); an arithmetic generator at its
easiest settings has ~200 distinct questions, which the model memorises instead of generalising.
Two rollout server processes on one core, the trainer on the other, α = 2.
"""

from flashrl_jax import envs
from flashrl_jax.controller import (Mode, ResourceConfig, RolloutConfig, RunConfig, TaskConfig)
from flashrl_jax.losses import LossConfig
from flashrl_jax.trainer import BatchConfig, OptimizerConfig, TrainConfig

DEMO_MODEL_DIR = ".cache/demo_model"
DEMO_WARMSTART_STEPS = 400


def demo_task() -> envs.ReasoningGymConfig:
  return envs.ReasoningGymConfig(
      datasets=(envs.ReasoningGymDataset("spell_backward",
                                         params={"min_word_len": 3, "max_word_len": 5}),),
      seed=0)


def get_config() -> RunConfig:
  return RunConfig(
      model_path=DEMO_MODEL_DIR,
      workdir="runs/demo",
      task=TaskConfig(reasoning_gym=demo_task(), seed=1),
      train=TrainConfig(
          loss=LossConfig(name="cispo", clip_low=1.0, clip_high=0.28),
          optimizer=OptimizerConfig(learning_rate=6e-4, warmup_steps=10, max_grad_norm=1.0),
          batch=BatchConfig(row_length=128, rows=8, sequences_per_row=4, max_response_length=16),
          temperature=1.0),
      rollout=RolloutConfig(num_servers=2, max_running_requests=16, max_new_tokens=8,
                            temperature=1.0),
      resources=ResourceConfig(rollout_devices=1, train_devices=1),
      mode=Mode.ASYNC, async_ratio=2, steps=150, batch_size=32, group_size=8)
