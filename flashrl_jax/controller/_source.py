"""A deterministic, checkpointable stream of prompts.

Prompt `i` is always the same sample (synthetic tasks are generated in seeded chunks; datasets are
cycled in order), so a run's data position is one integer plus the prompts handed back for re-issue
(dropped as stale, or in flight when the trainer stopped). That is what makes resume exact: nothing is
trained twice, nothing is silently skipped.
"""

from __future__ import annotations

import collections
import functools

from flashrl_jax import envs

_CHUNK = 1024


class PromptSource:

  def __init__(self, *, synthetic: envs.SyntheticConfig | None = None,
               samples: list[envs.Sample] | None = None, seed: int = 0):
    if (synthetic is None) == (samples is None):
      raise ValueError("PromptSource needs exactly one of `synthetic` or `samples`.")
    if samples is not None and not samples:
      raise ValueError("PromptSource got an empty dataset.")
    self._synthetic, self._samples, self._seed = synthetic, samples, seed
    self.next_index = 0
    self._reissue: collections.deque[int] = collections.deque()

  @functools.lru_cache(maxsize=4)
  def _chunk(self, chunk: int) -> list[envs.Sample]:
    return envs.generate_synthetic(self._synthetic, _CHUNK, seed=self._seed * 100_003 + chunk)

  def sample(self, index: int) -> envs.Sample:
    if self._samples is not None:
      return self._samples[index % len(self._samples)]
    return self._chunk(index // _CHUNK)[index % _CHUNK]

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
