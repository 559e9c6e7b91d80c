"""Code RLVR on CPU: write-a-function tasks with hidden tests, scored by the sandboxed code reward.

Procedural tasks ("Write f(x) that returns x plus 3.", `envs.CodeTaskConfig`), whose hidden tests
stay in the controller: the response's function runs in the sandbox with the arguments only and is
judged outside it (`docs/sandbox.md`). Each run's time limit is RollPacker's adaptive timeout (the
slowest correct run of the same prompt times λ, between T_min and T_max). The tiny policy is
warm-started on the tasks' reference solutions (cached in `.cache/code_model`), so RL starts with
some reward to climb.

  python -m experiments.train --config=experiments/configs/code_rlvr.py
"""

from flashrl_jax import envs
from flashrl_jax.controller import Mode, ResourceConfig, RolloutConfig, RunConfig, TaskConfig
from flashrl_jax.losses import LossConfig
from flashrl_jax.trainer import BatchConfig, OptimizerConfig, TrainConfig

CODE_MODEL_DIR = ".cache/code_model"
CODE_WARMSTART_STEPS = 120


def code_tasks() -> envs.CodeTaskConfig:
  """Three arithmetic families a 2-layer character model can learn the format of in a minute."""
  return envs.CodeTaskConfig(
      families=(envs.CodeFamily.ADD, envs.CodeFamily.SUB, envs.CodeFamily.MUL), num_tasks=64,
      cases=5)


def get_config() -> RunConfig:
  return RunConfig(
      model_path=CODE_MODEL_DIR,
      workdir="runs/code_rlvr",
      task=TaskConfig(
          code=code_tasks(), seed=0,
          sandbox=envs.SandboxConfig(timeout_s=5.0, memory_mb=256, max_concurrency=8),
          # T_min well above a correct program's ~0.1-0.4 s (sandbox setup included, under load).
          adaptive_timeout=envs.AdaptiveTimeoutConfig(t_min=1.0, lam=1.5, t_max=5.0)),
      train=TrainConfig(
          loss=LossConfig(name="cispo", clip_low=1.0, clip_high=0.28),
          optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=2, max_grad_norm=1.0),
          batch=BatchConfig(row_length=128, rows=8, sequences_per_row=4, max_response_length=48),
          temperature=1.0),
      rollout=RolloutConfig(num_servers=2, max_running_requests=16, max_new_tokens=40,
                            temperature=1.0),
      resources=ResourceConfig(rollout_devices=1, train_devices=1),
      mode=Mode.ASYNC, async_ratio=2, steps=30, batch_size=8, group_size=8, eval_every=0)
