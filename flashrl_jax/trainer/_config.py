"""Typed configuration of the trainer: optimizer, batch layout, and the RL update.

Why: every number the jitted step depends on lives in one frozen tree, validated when it is built
(flag strings become enums here), so a bad combination fails at start-up rather than mid-run, and
the static shapes the step compiles for are visible in one place.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from flashrl_jax._enums import parse_enum
from flashrl_jax.losses import LossConfig


class Schedule(enum.Enum):
  """Learning-rate shape after the linear warmup."""

  CONSTANT = "constant"
  COSINE = "cosine"


class AdvantageEstimator(enum.Enum):
  """How rewards (one per trajectory) become advantages; see `flashrl_jax.losses`."""

  GRPO = "grpo"  # (r - mean_g) / std_g within each group
  DR_GRPO = "dr_grpo"  # r - mean_g
  RLOO = "rloo"  # leave-one-out baseline
  REINFORCE_PP = "reinforce_pp"  # batch-whitened returns, no group baseline


class DType(enum.Enum):
  FLOAT32 = "float32"
  BFLOAT16 = "bfloat16"

  @property
  def jnp(self):
    return jnp.dtype(self.value)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup, then a constant or cosine schedule, and global-norm clipping.

  Weight decay applies to matrices only (norm scales and biases are 1-D and never decayed).
  `total_steps` counts optimizer updates (`ppo_epochs * num_minibatches` per RL step) and is needed
  for the cosine schedule, which decays to `min_lr_ratio * learning_rate`.
  """

  learning_rate: float = 1e-6
  warmup_steps: int = 0
  schedule: Schedule = Schedule.CONSTANT
  total_steps: int | None = None
  min_lr_ratio: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float | None = 1.0

  def __post_init__(self):
    object.__setattr__(self, "schedule", parse_enum(Schedule, self.schedule, "schedule"))
    if not self.learning_rate >= 0:
      raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}.")
    if self.warmup_steps < 0:
      raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}.")
    if self.schedule is Schedule.COSINE and (self.total_steps is None
                                             or self.total_steps <= self.warmup_steps):
      raise ValueError("The cosine schedule needs total_steps > warmup_steps, got "
                       f"total_steps={self.total_steps}, warmup_steps={self.warmup_steps}.")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
    if self.weight_decay < 0:
      raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}.")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}.")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """The static shapes of one micro-batch; a step compiles once per number of micro-batches.

  Trajectories (prompt + response) are packed into `rows` rows of `row_length` tokens, at most
  `sequences_per_row` per row, each with at most `max_response_length` response tokens (the width
  of the per-sequence loss arrays). `rows` should be divisible by the mesh's batch axes
  (`data * fsdp`), else the batch is replicated. The number of micro-batches per minibatch is
  rounded up to `micro_batch_ladder` (1, 2, 3, 4, 6, 8, ...), so an RL step compiles for at most
  about 2·log2(n) shapes.
  """

  row_length: int = 512
  rows: int = 8
  sequences_per_row: int = 4
  max_response_length: int = 256

  def __post_init__(self):
    for name in ("row_length", "rows", "sequences_per_row", "max_response_length"):
      if getattr(self, name) < 1:
        raise ValueError(f"BatchConfig.{name} must be >= 1, got {getattr(self, name)}.")
    if self.max_response_length >= self.row_length:
      raise ValueError(f"max_response_length={self.max_response_length} must be < row_length="
                       f"{self.row_length} (a response needs at least one prompt token).")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The RL update.

  Attributes:
    loss: the policy loss (`flashrl_jax.losses.LossConfig`); `kl_coef > 0` turns on the reference
      model's log-probs.
    optimizer: see `OptimizerConfig`.
    batch: see `BatchConfig`.
    advantage: the advantage estimator applied to rewards and group ids of the whole RL batch.
    ppo_epochs: passes over the batch per RL step.
    num_minibatches: optimizer updates per pass; each minibatch accumulates gradients over its
      micro-batches. An RL step makes `ppo_epochs * num_minibatches` updates.
    shuffle_minibatches: visit the minibatches in a fresh random order each epoch (drawn from the
      train state's rng, so a resumed run repeats it exactly).
    temperature: the sampling temperature of the rollout engine; log-probs are taken under
      `softmax(logits / temperature)` so the ratio against the behaviour log-probs is meaningful.
    param_dtype, compute_dtype: weight storage and matmul dtypes.
    logprob_chunk_size: sequence chunk of the vocabulary projection (memory vs. speed).
  """

  loss: LossConfig = dataclasses.field(default_factory=LossConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
  advantage: AdvantageEstimator = AdvantageEstimator.GRPO
  ppo_epochs: int = 1
  num_minibatches: int = 1
  shuffle_minibatches: bool = True
  temperature: float = 1.0
  param_dtype: DType = DType.FLOAT32
  compute_dtype: DType = DType.FLOAT32
  logprob_chunk_size: int = 128

  def __post_init__(self):
    object.__setattr__(self, "advantage", parse_enum(AdvantageEstimator, self.advantage, "advantage"))
    object.__setattr__(self, "param_dtype", parse_enum(DType, self.param_dtype, "param_dtype"))
    object.__setattr__(self, "compute_dtype", parse_enum(DType, self.compute_dtype, "compute_dtype"))
    if self.ppo_epochs < 1 or self.num_minibatches < 1:
      raise ValueError(f"ppo_epochs and num_minibatches must be >= 1, got {self.ppo_epochs}, "
                       f"{self.num_minibatches}.")
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}.")
    if self.logprob_chunk_size < 1:
      raise ValueError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}.")

  @property
  def updates_per_step(self) -> int:
    return self.ppo_epochs * self.num_minibatches

  @property
  def uses_reference(self) -> bool:
    return self.loss.kl_coef > 0

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)
