"""The run's cumulative counters, as one typed value: checkpointed, restored, logged as `total/*`.

Why typed: every counter the loop, the agentic runner and the fleet report has a field here, so a
misspelt counter is an AttributeError rather than a new key, and a checkpoint holds them in one
JSON object (`to_json` / `from_json`, the flat keys the metrics use).
"""

from __future__ import annotations

import dataclasses
import logging

from flashrl_jax.controller._agentic_config import DropCause

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EpisodeCounts:
  """Multi-turn episodes (environment tasks only)."""
  finished: int = 0
  env_steps: int = 0
  dropped: dict[DropCause, int] = dataclasses.field(
      default_factory=lambda: {cause: 0 for cause in DropCause})


@dataclasses.dataclass
class Counters:
  samples_trained: int = 0
  dropped_stale: int = 0  # groups dropped by the staleness bound (their prompts re-issued)
  filtered_groups: int = 0  # dynamic filtering: all rewards equal
  failed_groups: int = 0  # generation failed (re-issued)
  rejected_prompts: int = 0  # a server answered 400 (dropped)
  redundant_groups: int = 0  # lock-step rounds: complete groups beyond the step's B
  server_failures: int = 0
  server_restarts: int = 0
  versions_refused: int = 0  # publishes the servers refused (exported again, or superseded)
  episodes: EpisodeCounts = dataclasses.field(default_factory=EpisodeCounts)

  def to_json(self) -> dict[str, int]:
    flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "episodes"}
    flat["episodes_finished"] = self.episodes.finished
    flat["env_steps"] = self.episodes.env_steps
    for cause, count in self.episodes.dropped.items():
      flat[f"episodes_dropped/{cause.value}"] = count
    return flat

  @classmethod
  def from_json(cls, flat: dict[str, int]) -> Counters:
    counters = cls()
    names = {f.name for f in dataclasses.fields(cls)} - {"episodes"}
    causes = {f"episodes_dropped/{c.value}": c for c in DropCause}
    for key, value in flat.items():
      if key in names:
        setattr(counters, key, int(value))
      elif key == "episodes_finished":
        counters.episodes.finished = int(value)
      elif key == "env_steps":
        counters.episodes.env_steps = int(value)
      elif key in causes:
        counters.episodes.dropped[causes[key]] = int(value)
      else:  # a counter this version no longer keeps: the rest of the checkpoint still resumes
        log.warning("checkpointed counter %r is unknown; ignored", key)
    return counters

  def totals(self) -> dict[str, int]:
    """The metric record's `total/<name>` entries."""
    return {f"total/{key}": value for key, value in self.to_json().items()}
