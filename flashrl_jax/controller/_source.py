"""A deterministic, checkpointable stream of prompts.

Prompt `i` is always the same sample (`envs.TaskSource.sample(i)` is a pure function of `i`: synthetic
and reasoning-gym tasks are generated in seeded chunks, dataset files are cycled in order), so a run's
data position is one integer plus the prompts handed back for re-issue
(dropped as stale, or in flight when the trainer stopped). That is what makes resume exact: nothing is
trained twice, nothing is silently skipped.
"""

from __future__ import annotations

import collections
import logging

from flashrl_jax import envs
from flashrl_jax.controller._config import RunConfig

log = logging.getLogger(__name__)


def task_source(config: RunConfig) -> envs.TaskSource:
  """The run's task as a numbered stream of samples (and its held-out sets)."""
  task = config.task
  if task.env is not None:  # the prompt index is the level seed: the source only numbers episodes
    return envs.SampleListSource([envs.Sample(prompt="", answer="", id="env")])
  if task.synthetic is not None:
    return envs.SyntheticSource(task.synthetic, seed=task.seed, eval_size=config.eval_samples)
  if task.reasoning_gym is not None:
    return envs.ReasoningGymSource(task.reasoning_gym, eval_size=config.eval_samples)
  if task.code is not None:
    return envs.CodeTaskSource(task.code, seed=task.seed)
  loaded = envs.load_dataset(task.dataset)
  for error in loaded.errors:
    log.error("dataset %s: %s (row skipped)", task.dataset.path, error)
  return envs.SampleListSource(loaded.samples, name=task.dataset.task_name)


class PromptSource:
  """The run's position in `task`'s stream: the next fresh index and the prompts to re-issue."""

  def __init__(self, task: envs.TaskSource):
    self.task = task
    self.next_index = 0
    self._reissue: collections.deque[int] = collections.deque()

  def sample(self, index: int) -> envs.Sample:
    return self.task.sample(index)

  def next(self) -> tuple[int, envs.Sample]:
    """The next prompt: re-issued ones first, then fresh ones in order."""
    if self._reissue:
      index = self._reissue.popleft()
    else:
      index = self.next_index
      self.next_index += 1
    return index, self.sample(index)

  def give_back(self, index: int) -> None:
    """Queues prompt `index` for re-issue (its samples were dropped or never finished)."""
    self._reissue.append(index)

  @property
  def pending_reissue(self) -> list[int]:
    return list(self._reissue)

  def state(self, in_flight: list[int] = ()) -> dict:
    """JSON state; prompts `in_flight` (dispatched, not trained) are re-issued after a restore."""
    return {"next_index": self.next_index, "reissue": sorted(set(self._reissue) | set(in_flight))}

  def restore(self, state: dict) -> None:
    self.next_index = int(state["next_index"])
    self._reissue = collections.deque(int(i) for i in state["reissue"])
