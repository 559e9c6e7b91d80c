"""The episode rules every text game shares: parse the action, penalise junk, spend the turn budget.

Keeping this in one place means the games (gymnasium's FrozenLake and Taxi, our Sokoban) differ only
in their level, their action vocabulary, their transition rule and their renderer, and a policy sees
the same protocol in all of them: an instruction header on reset, one rendered board per turn, `info`
with `action_valid`, `success`, `truncated`, `turn`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping

from flashrl_jax.envs._actions import parse_action
from flashrl_jax.envs._types import StepResult


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
  max_turns: int = 20
  invalid_action_penalty: float = -0.1  # added to the step reward of an unparsable action
  success_reward: float = 1.0  # our own games' reward for solving (gymnasium games keep theirs)

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError("max_turns must be >= 1")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one valid action did: its reward, whether the episode ended, and whether it was won."""

  reward: float
  done: bool
  success: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


class TextGame(abc.ABC):
  """Base of the text games: subclasses set the vocabulary and implement the game itself."""

  ACTIONS: ClassVar[Mapping[str, Any]]  # lower-case word -> the game's action
  ACTION_NAMES: ClassVar[tuple[str, ...]]  # canonical spellings, for the instructions

  def __init__(self, episode: EpisodeConfig):
    self.episode = episode
    self.turn = 0
    self.done = True  # until the first reset

  @abc.abstractmethod
  def _generate(self, seed: int) -> None:
    """Sets up the (solvable) level of `seed`."""

  @abc.abstractmethod
  def _apply(self, action: Any) -> Outcome:
    ...

  @abc.abstractmethod
  def _render(self) -> str:
    ...

  @abc.abstractmethod
  def _rules(self) -> str:
    ...

  def _action_hint(self) -> str:
    first, *rest = self.ACTION_NAMES
    return f"<action>{first}</action>, {', '.join(rest[:-1])} or {rest[-1]}"

  def reset(self, seed: int) -> str:
    self._generate(seed)
    self.turn, self.done = 0, False
    return (f"{self._rules()} Answer with {self._action_hint()}.\n"
            f"You have {self.episode.max_turns} turns.\n{self._render()}")

  def step(self, action_text: str) -> StepResult:
    if self.done:
      raise RuntimeError("step() after the episode ended; call reset() first")
    self.turn += 1
    action = parse_action(action_text, self.ACTIONS)
    if action is None:
      reward, done, info = self.episode.invalid_action_penalty, False, {"success": False}
      observation = f"Invalid action. Reply with one of {self._action_hint()}.\n{self._render()}"
    else:
      outcome = self._apply(action)
      reward, done = outcome.reward, outcome.done
      info = {**outcome.info, "success": outcome.success}
      observation = self._render()
    truncated = not done and self.turn >= self.episode.max_turns
    self.done = done or truncated
    info.update(action_valid=action is not None, truncated=truncated, turn=self.turn)
    return StepResult(observation, reward, self.done, info)
