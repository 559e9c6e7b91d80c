"""FrozenLake as a text game: walk from P to G across the ice without stepping into a hole H.

Deterministic (not slippery): the difficulty for an LLM is reading the board and planning, and the
verifiable outcome is binary. Levels are drawn from the reset seed and rejected until the goal is
reachable, so every episode is solvable; `shortest_solution()` gives the optimal moves (for tests
and scripted baselines).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flashrl_jax.envs._actions import Move
from flashrl_jax.envs._grid import EpisodeConfig, GridEnv, bfs_path


@dataclasses.dataclass(frozen=True)
class FrozenLakeConfig:
  size: int = 4
  hole_prob: float = 0.2

  def __post_init__(self):
    if self.size < 2 or not 0 <= self.hole_prob < 1:
      raise ValueError(f"need size >= 2 and 0 <= hole_prob < 1: {self}")


class FrozenLakeEnv(GridEnv):
  def __init__(self, config: FrozenLakeConfig = FrozenLakeConfig(),
               episode: EpisodeConfig = EpisodeConfig()):
    super().__init__(episode)
    self.config = config
    self.holes: np.ndarray = np.zeros((config.size, config.size), bool)
    self.player = self.goal = (0, 0)

  def _inside(self, cell: tuple[int, int]) -> bool:
    return 0 <= cell[0] < self.config.size and 0 <= cell[1] < self.config.size

  def _generate(self, rng: np.random.Generator) -> None:
    n = self.config.size
    for _ in range(1000):
      start, goal = (tuple(int(v) for v in rng.integers(0, n, 2)) for _ in range(2))
      if start == goal:
        continue
      holes = rng.random((n, n)) < self.config.hole_prob
      holes[start] = holes[goal] = False
      self.holes, self.player, self.goal = holes, start, goal
      if self.shortest_solution() is not None:
        return
    raise RuntimeError("could not generate a solvable FrozenLake level")  # hole_prob too high

  def shortest_solution(self) -> list[Move] | None:
    return bfs_path(self.player, self.goal, lambda c: self._inside(c) and not self.holes[c])

  def _move(self, move: Move) -> tuple[bool, bool, dict[str, Any]]:
    target = (self.player[0] + move.delta[0], self.player[1] + move.delta[1])
    moved = self._inside(target)
    if moved:
      self.player = target
    fell = bool(self.holes[self.player])
    return self.player == self.goal, fell, {"moved": moved, "fell": fell}

  def _render(self) -> str:
    n = self.config.size
    rows = []
    for r in range(n):
      row = ""
      for c in range(n):
        row += ("P" if (r, c) == self.player else "G" if (r, c) == self.goal
                else "H" if self.holes[r, c] else ".")
      rows.append(row)
    return "\n".join(rows)

  def _rules(self) -> str:
    return ("FrozenLake: move the player P to the goal G. Stepping on a hole H ends the game. "
            "Moving off the board does nothing. Answer with <action>Up</action>, Down, Left or Right.")
