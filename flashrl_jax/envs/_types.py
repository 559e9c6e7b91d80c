"""The small typed values every reward function and environment speaks.

The controller talks to rewards and environments only through these types, so a new task (a new
verifier, a new game) never touches the rollout loop. Single-turn tasks implement `RewardFn` (sync,
possibly CPU-heavy) or `AsyncRewardFn` (what the controller awaits); multi-turn tasks implement
`Environment` and are driven through `AsyncEnvironment`, whose steps take real, variable time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Sample:
  """One task: a prompt and what a correct response is checked against.

  `answer` is the reference answer (math, exact match) or a reference solution (code); `tests` is
  Python test code (asserts) run after a code response; `reference_time` (seconds) seeds the adaptive
  code timeout before any correct run of this prompt has been seen. `task` names the dataset the
  sample came from (per-dataset metrics and scorers); `metadata` is what its scorer may need beyond
  the answer (reasoning-gym's entry metadata, a dataset file's extra fields). Both stay JSON-able.
  """

  prompt: str
  answer: str
  tests: str | None = None
  reference_time: float | None = None
  id: str = ""
  task: str = ""
  metadata: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class RewardResult:
  """A scalar reward plus diagnostics (e.g. `format_ok`, `extracted`, `status`, `elapsed_s`)."""

  reward: float
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one environment step returns: the next observation, the step reward, and whether it ended."""

  observation: str
  reward: float
  done: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


class EnvironmentFailure(RuntimeError):
  """An environment crashed (fail-stop). Controllers catch this, count it, and drop/restart the episode."""


@runtime_checkable
class RewardFn(Protocol):
  """A synchronous single-turn reward; may be CPU-heavy, so async callers run it in a pool."""

  def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    ...


@runtime_checkable
class AsyncRewardFn(Protocol):
  """What the controller awaits: must never block the event loop."""

  async def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    ...


@runtime_checkable
class Environment(Protocol):
  """A multi-turn text environment (gym-like, but text in and text out)."""

  def reset(self, seed: int) -> str:
    ...

  def step(self, action_text: str) -> StepResult:
    ...


@runtime_checkable
class AsyncEnvironment(Protocol):
  """An environment as the rollout loop drives it; each call may take (simulated or real) time."""

  async def areset(self, seed: int) -> str:
    ...

  async def astep(self, action_text: str) -> StepResult:
    ...
