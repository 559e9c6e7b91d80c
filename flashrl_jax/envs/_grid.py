"""The episode rules both grid games share: parse the move, penalise junk, spend the turn budget.

Keeping this in one place means FrozenLake and Sokoban differ only in their level generator, their
move rule and their renderer, and a policy sees the same protocol in both: an instruction header on
reset, one rendered board per turn, `info` with `action_valid`, `success`, `truncated`, `turn`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

from flashrl_jax.envs._actions import Move, parse_move
from flashrl_jax.envs._types import StepResult

_INVALID_HINT = "Invalid action. Reply with one of <action>Up</action>, Down, Left or Right."


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
  max_turns: int = 20
  invalid_action_penalty: float = -0.1  # added to the step reward of an unparsable action
  success_reward: float = 1.0

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError("max_turns must be >= 1")


class GridEnv(abc.ABC):
  """Base of the grid games; subclasses implement `_generate`, `_move`, `_render`, `_rules`."""

  def __init__(self, episode: EpisodeConfig):
    self.episode = episode
    self.turn = 0
    self.done = True  # until the first reset

  @abc.abstractmethod
  def _generate(self, rng: np.random.Generator) -> None:
    """Builds a solvable level from `rng`."""

  @abc.abstractmethod
  def _move(self, move: Move) -> tuple[bool, bool, dict[str, Any]]:
    """Applies a valid move; returns (success, failed, info)."""

  @abc.abstractmethod
  def _render(self) -> str:
    ...

  @abc.abstractmethod
  def _rules(self) -> str:
    ...

  def reset(self, seed: int) -> str:
    self._generate(np.random.default_rng(seed))
    self.turn, self.done = 0, False
    return f"{self._rules()}\nYou have {self.episode.max_turns} turns.\n{self._render()}"

  def step(self, action_text: str) -> StepResult:
    if self.done:
      raise RuntimeError("step() after the episode ended; call reset() first")
    self.turn += 1
    move = parse_move(action_text)
    if move is None:
      reward, done, info = self.episode.invalid_action_penalty, False, {"success": False}
      observation = f"{_INVALID_HINT}\n{self._render()}"
    else:
      success, failed, info = self._move(move)
      reward = self.episode.success_reward if success else 0.0
      done = success or failed
      info = {**info, "success": success}
      observation = self._render()
    truncated = not done and self.turn >= self.episode.max_turns
    self.done = done or truncated
    info.update(action_valid=move is not None, truncated=truncated, turn=self.turn)
    return StepResult(observation, reward, self.done, info)


def bfs_path(start: tuple[int, int], goal: tuple[int, int], passable) -> list[Move] | None:
  """Shortest move sequence from start to goal over cells where `passable(cell)`; None if cut off."""
  parents: dict[tuple[int, int], tuple[tuple[int, int], Move] | None] = {start: None}
  frontier = [start]
  while frontier:
    nxt = []
    for cell in frontier:
      if cell == goal:
        path = []
        while parents[cell] is not None:
          cell, move = parents[cell]
          path.append(move)
        return path[::-1]
      for move in Move:
        n = (cell[0] + move.delta[0], cell[1] + move.delta[1])
        if n not in parents and passable(n):
          parents[n] = (cell, move)
          nxt.append(n)
    frontier = nxt
  return None
