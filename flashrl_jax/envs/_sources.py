"""Where an RLVR run's prompts come from: one small interface over every kind of task.

A `TaskSource` numbers its training prompts: `sample(i)` is a pure function of `i`, so the controller's
checkpointable prompt stream is one integer plus the prompts to re-issue, whatever the task. It also
offers held-out sets for the exact evaluation (one per dataset of the task) and the canonical
correct response of a sample (what the supervised warm start trains on and what the exact
evaluation scores).

Implementations: `SyntheticSource` (the long-tail generators), `SampleListSource` (a dataset file,
cycled in order), and `ReasoningGymSource` (in `_reasoning_gym.py`).
"""

from __future__ import annotations

import functools
from typing import Protocol, Sequence, runtime_checkable

from flashrl_jax.envs._synthetic import SyntheticConfig, generate_synthetic
from flashrl_jax.envs._types import Sample

_CHUNK = 1024
_EVAL_SALT = 1_000_003


@runtime_checkable
class TaskSource(Protocol):

  def sample(self, index: int) -> Sample:
    """Training prompt `index` (the same sample for the same index, always)."""

  def eval_sets(self) -> dict[str, list[Sample]]:
    """Held-out samples per dataset name (empty when the task has no exact evaluation)."""

  def reference(self, sample: Sample) -> str:
    """The canonical correct response to `sample`."""


class SyntheticSource:
  """Synthetic long-tail problems, generated in seeded chunks of 1024; held out: another seed."""

  def __init__(self, config: SyntheticConfig, seed: int = 0, eval_size: int = 256):
    self.config, self.seed, self.eval_size = config, seed, eval_size

  @functools.lru_cache(maxsize=4)
  def _chunk(self, chunk: int) -> list[Sample]:
    return generate_synthetic(self.config, _CHUNK, seed=self.seed * 100_003 + chunk)

  def sample(self, index: int) -> Sample:
    return self._chunk(index // _CHUNK)[index % _CHUNK]

  def eval_sets(self) -> dict[str, list[Sample]]:
    if not self.eval_size:
      return {}
    return {self.config.task.value: generate_synthetic(self.config, self.eval_size,
                                                       seed=self.seed + _EVAL_SALT)}

  def reference(self, sample: Sample) -> str:
    return sample.answer


class SampleListSource:
  """A fixed list of samples (a dataset file), cycled in order; `eval` is an optional held-out list."""

  def __init__(self, samples: Sequence[Sample], eval: Sequence[Sample] = (), name: str = "data"):
    if not samples:
      raise ValueError("the dataset has no samples.")
    self._samples, self._eval, self._name = list(samples), list(eval), name

  def __len__(self) -> int:
    return len(self._samples)

  def sample(self, index: int) -> Sample:
    return self._samples[index % len(self._samples)]

  def eval_sets(self) -> dict[str, list[Sample]]:
    return {self._name: list(self._eval)} if self._eval else {}

  def reference(self, sample: Sample) -> str:
    return sample.answer
