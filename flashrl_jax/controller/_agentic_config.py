"""How multi-turn (agentic) rollout runs: redundancy, per-turn budget, environment time limits.

Kept apart from `_config.py` because only environment tasks (`TaskConfig.env`) read it. Redundant
environment rollout (ROLL Flash) has two knobs: more environment groups than a step needs
(`num_env_groups` >= B) and more candidate episodes per group than it trains on
(`env_group_size` >= n). The first n finished episodes of a group form its training group, the first
B complete groups feed a step, and everything else is cancelled and counted. That is what keeps a
fail-slow environment (10x latency) or a fail-stop one (raises) from stalling a step.
"""

from __future__ import annotations

import dataclasses
import enum

from flashrl_jax._enums import parse_enum
from flashrl_jax.scheduling import LengthDistribution

# Sample ids of episodes are `prompt_index * ID_STRIDE + candidate`: unique across the run and the
# same for a re-issued prompt's candidates after a resume (nothing is trained twice).
ID_STRIDE = 1000


class DropCause(enum.Enum):
  """Why an episode did not become training data (each is counted in the metrics)."""
  ENV_FAILURE = "env_failure"  # the environment raised (fail-stop)
  ENV_TIMEOUT = "env_timeout"  # one environment call took longer than `env_step_timeout_s`
  GENERATION = "generation"    # the rollout client ran out of retries
  REJECTED = "rejected"        # a server answered HTTP 400 (the request itself is bad)
  REDUNDANT = "redundant"      # its group (or the step) was complete without it


class AgentPolicy(enum.Enum):
  """Who plays the model's side of an episode."""
  TOKENS = "tokens"  # the controller's own turn loop over token ids (`Episode`)
  OPENAI = "openai"  # ordinary agent code through the OpenAI API, recorded by the controller's
                     # proxy (`AgentEpisode`, async mode only: agent code has no turn barrier)


@dataclasses.dataclass(frozen=True)
class AgenticConfig:
  """Rollout of multi-turn environment tasks.

  Attributes:
    num_env_groups: environment groups running at once. Sync: groups started per step (the first B
      complete ones are trained). Async: cap on groups in flight, on top of the staleness admission
      rule. 0 means B (sync) or (1 + α)·B (async).
    env_group_size: candidate episodes started per group (same level, independent environment
      workers); the first n to finish are kept. 0 means n.
    turn_max_new_tokens: generation budget of one model turn.
    env_step_timeout_s: an environment call (reset or step) slower than this drops its episode
      (0: wait forever).
    max_episodes_per_group: candidates a group may start in total, replacements of dropped episodes
      included, before the group fails and its prompt is re-issued. 0 means 2 * env_group_size.
    turn_budget: the law of the number of turns a level allows (drawn once per level, so every
      candidate of a group gets the same budget), for tasks whose length varies from one to the
      next as ALFWorld's or SWE's do; None: the environment's own `max_turns` for every level.
    policy: the controller's turn loop, or agent code through the OpenAI API (`AgentPolicy`).
  """

  num_env_groups: int = 0
  env_group_size: int = 0
  turn_max_new_tokens: int = 16
  env_step_timeout_s: float = 60.0
  max_episodes_per_group: int = 0
  turn_budget: LengthDistribution | None = None
  policy: AgentPolicy = AgentPolicy.TOKENS

  def __post_init__(self):
    object.__setattr__(self, "policy", parse_enum(AgentPolicy, self.policy, "policy"))
    for name in ("num_env_groups", "env_group_size", "max_episodes_per_group"):
      if getattr(self, name) < 0:
        raise ValueError(f"AgenticConfig.{name} must be >= 0, got {getattr(self, name)}.")
    if self.turn_max_new_tokens < 1:
      raise ValueError("AgenticConfig.turn_max_new_tokens must be >= 1.")
    if self.env_step_timeout_s < 0:
      raise ValueError("AgenticConfig.env_step_timeout_s must be >= 0.")

  def groups(self, batch_size: int, async_ratio: int, is_async: bool) -> int:
    if self.num_env_groups:
      return self.num_env_groups
    return (1 + async_ratio) * batch_size if is_async else batch_size

  def candidates(self, group_size: int) -> int:
    return self.env_group_size or group_size

  def max_episodes(self, group_size: int) -> int:
    return self.max_episodes_per_group or 2 * self.candidates(group_size)

  def validate(self, batch_size: int, group_size: int) -> None:
    """Redundancy only adds: fewer groups or candidates than a step trains could never fill it."""
    if self.num_env_groups and self.num_env_groups < batch_size:
      raise ValueError(f"num_env_groups={self.num_env_groups} < batch_size={batch_size}: a step "
                       "could never be filled.")
    if self.env_group_size and self.env_group_size < group_size:
      raise ValueError(f"env_group_size={self.env_group_size} < group_size={group_size}: a group "
                       "could never be filled.")
    if self.max_episodes(group_size) < self.candidates(group_size):
      raise ValueError("max_episodes_per_group must be >= env_group_size.")
    if self.max_episodes(group_size) > ID_STRIDE:
      raise ValueError(f"max_episodes_per_group must be <= {ID_STRIDE} (sample id stride).")
