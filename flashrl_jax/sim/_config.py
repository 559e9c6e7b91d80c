"""`SimConfig`: one typed, validated value describing a simulated cluster and its policies.

Why: a simulated run is a pure function of (config, seed). Policies are strategy objects chosen
once (`SyncTraining` / `AsyncTraining`, `QueueScheduling` / `BatchRollout`, `PromptReplication` /
`GroupPlacement`); strings only exist at the flag edge and become these values there.
"""

from __future__ import annotations

import dataclasses
import math

from flashrl_jax.scheduling import EmpiricalLengths, LengthDistribution, PauseMode
from flashrl_jax.sim import _costs, _rollout, _training

Training = _training.SyncTraining | _training.AsyncTraining


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """A cluster, a workload and the scheduling policies.

  Attributes:
    gpus: total GPUs (rollout + train for async; all of them do both for sync).
    gpus_per_worker: GPUs per rollout worker (tensor parallelism); rollout GPUs must divide by it.
    slots: concurrent decode slots per worker.
    batch_prompts: B, prompts per training step.
    group_size: n, responses per prompt.
    steps: training steps to simulate after warm-up.
    warmup_steps: leading steps excluded from throughput (pipeline fill).
    lengths: response-length law (`flashrl_jax.scheduling.LengthDistribution`, the synthetic
      tasks' own), with its within-prompt correlation.
    prompt_tokens: prompt length, for prefill and training-token counts.
    cost: every time cost.
    training: `SyncTraining()` or `AsyncTraining(alpha, train_gpus)`.
    dispatch: `QueueScheduling()` or `BatchRollout()`.
    placement: `PromptReplication()` or `GroupPlacement()`.
    pause: what in-flight requests do across weight updates (async only); the modes that drop the
      KV cache (`PauseMode.reprefills_in_flight`) pay a prefill of prompt + partial output.
  """

  gpus: int = 8
  gpus_per_worker: int = 1
  slots: int = 64
  batch_prompts: int = 64
  group_size: int = 8
  steps: int = 10
  warmup_steps: int = 2
  lengths: LengthDistribution | EmpiricalLengths = LengthDistribution(median=math.exp(8.0), sigma=1.0, max_len=32768)
  prompt_tokens: int = 256
  cost: _costs.CostModel = _costs.CostModel()
  training: Training = _training.SyncTraining()
  dispatch: _rollout.Dispatch = _rollout.QueueScheduling()
  placement: _rollout.Placement = _rollout.PromptReplication()
  pause: PauseMode = PauseMode.IN_PLACE

  def __post_init__(self):
    object.__setattr__(self, "pause", PauseMode(self.pause))
    for name in ("gpus", "gpus_per_worker", "slots", "batch_prompts", "group_size", "steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.prompt_tokens < 0:
      raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
    if self.warmup_steps < 0:
      raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
    if not isinstance(self.training, (_training.SyncTraining, _training.AsyncTraining)):
      raise TypeError(f"training must be SyncTraining or AsyncTraining, got {self.training!r}")
    if not isinstance(self.dispatch, (_rollout.QueueScheduling, _rollout.BatchRollout)):
      raise TypeError(f"dispatch must be QueueScheduling or BatchRollout, got {self.dispatch!r}")
    if not isinstance(self.placement, (_rollout.PromptReplication, _rollout.GroupPlacement)):
      raise TypeError(f"placement must be PromptReplication or GroupPlacement, got {self.placement!r}")
    rollout_gpus, _ = self.training.pools(self.gpus)  # raises if the split is impossible
    if rollout_gpus % self.gpus_per_worker:
      raise ValueError(f"{rollout_gpus} rollout GPUs do not divide into workers of "
                       f"{self.gpus_per_worker}")
    if isinstance(self.placement, _rollout.GroupPlacement) and self.slots < self.group_size:
      raise ValueError(f"GroupPlacement needs slots >= group_size ({self.slots} < {self.group_size})")

  @property
  def workers(self) -> int:
    return self.training.pools(self.gpus)[0] // self.gpus_per_worker

  @property
  def train_gpus(self) -> int:
    return self.training.pools(self.gpus)[1]

  @property
  def samples_per_step(self) -> int:
    return self.batch_prompts * self.group_size

  def replace(self, **changes) -> SimConfig:
    return dataclasses.replace(self, **changes)
