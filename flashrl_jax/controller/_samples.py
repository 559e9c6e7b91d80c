"""The unit the controller moves around: one prompt's group of `n` scored responses.

A prompt is expanded into `n` independent requests (prompt replication); each finished response is
scored at once and lands in its group; the group is complete when all `n` are scored. Every response
keeps its behaviour log-probs and per-token weight versions (what off-policy losses need), and the
policy version at which its generation started (what the staleness bound is checked against).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashrl_jax.envs import Sample


@dataclasses.dataclass
class Response:
  """One generated, scored response."""

  sample_id: str  # unique across the run: "<prompt_index>:<replica>"
  output_ids: list[int]
  behavior_logp: list[float]
  token_versions: list[int]
  start_version: int
  finish_reason: str
  reward: float = 0.0
  reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)
  generate_s: float = 0.0
  response_mask: list[bool] | None = None  # False: env observation tokens (not trained)


@dataclasses.dataclass
class Group:
  """All `n` responses of one prompt (indexed by the prompt's position in the data stream)."""

  prompt_index: int
  sample: Sample
  prompt_ids: list[int]
  n: int
  responses: list[Response] = dataclasses.field(default_factory=list)
  dispatched_version: int = 0

  @property
  def complete(self) -> bool:
    return len(self.responses) == self.n

  @property
  def start_version(self) -> int:
    """The oldest policy version any of its responses started under (staleness counts from it)."""
    versions = [r.start_version for r in self.responses] or [self.dispatched_version]
    return min(versions)

  @property
  def rewards(self) -> list[float]:
    return [r.reward for r in self.responses]

  def all_rewards_equal(self) -> bool:
    return len(set(self.rewards)) <= 1
