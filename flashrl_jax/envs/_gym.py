"""gymnasium's text-friendly games (FrozenLake, Taxi) behind the project's multi-turn interface.

The dynamics, rewards, termination and level generation are gymnasium's own (`gymnasium.make`,
`generate_random_map`), the reference implementations ROLL's agentic examples use; this module only
turns them into text: a board rendered from the environment's state (gymnasium's `ansi` mode marks
the player with terminal colours, which a tokenizer cannot see), an action vocabulary parsed from the
model's reply, and the shared episode rules of `TextGame` (turn budget, invalid-action penalty).

  FrozenLake-v1  walk from S to G without falling into a hole H; a random solvable map per seed;
                 reward 1 at the goal; `slippery` is gymnasium's `is_slippery`.
  Taxi-v4        pick the passenger up at one of R/G/Y/B and drop them off at the destination;
                 gymnasium's rewards (-1 per step, -10 for an illegal pickup/dropoff, +20 on
                 delivery); the start state is drawn from the reset seed.

`shortest_solution()` is a BFS over the environment's own transition table `P` (deterministic
settings only), used by tests and scripted baselines.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from flashrl_jax.envs._actions import MOVE_WORDS, Move
from flashrl_jax.envs._episode import EpisodeConfig, Outcome, TextGame


def _make(env_id: str, **kwargs):
  import gymnasium  # imported lazily: only environment tasks pay for it
  return gymnasium.make(env_id, **kwargs)


class GymGame(TextGame):
  """A gymnasium toy-text environment as a `TextGame`; subclasses build it and render it."""

  ACTION_IDS: dict[Any, int]  # the game's action (from ACTIONS) -> gymnasium's action index

  def __init__(self, episode: EpisodeConfig):
    super().__init__(episode)
    self.env = None
    self.state = 0

  def _apply(self, action: Any) -> Outcome:
    state, reward, terminated, truncated, _ = self.env.step(self.ACTION_IDS[action])
    self.state = int(state)
    success = bool(terminated) and reward > 0
    return Outcome(float(reward), bool(terminated or truncated), success,
                   {"gym_reward": float(reward), "gym_truncated": bool(truncated)})

  def shortest_solution(self) -> list[str] | None:
    """Action names of a shortest winning path from the current state (BFS over gymnasium's `P`);
    None if no deterministic path wins."""
    table = self.env.unwrapped.P
    names = {index: name for name, index in zip(self.ACTION_NAMES, self._name_ids())}
    parents: dict[int, tuple[int, int] | None] = {self.state: None}
    frontier = collections.deque([self.state])
    while frontier:
      state = frontier.popleft()
      for action, transitions in sorted(table[state].items()):
        if len(transitions) != 1:
          return None  # stochastic (slippery / rainy): no guaranteed plan
        _, nxt, reward, terminated = transitions[0]
        if terminated and reward > 0:
          path = [names[action]]
          while parents[state] is not None:
            state, previous = parents[state]
            path.append(names[previous])
          return path[::-1]
        if not terminated and nxt not in parents:
          parents[nxt] = (state, action)
          frontier.append(nxt)
    return None

  def _name_ids(self) -> list[int]:
    return [self.ACTION_IDS[self.ACTIONS[name.lower()]] for name in self.ACTION_NAMES]


@dataclasses.dataclass(frozen=True)
class FrozenLakeConfig:
  size: int = 4
  hole_prob: float = 0.2  # gymnasium's generate_random_map(p = 1 - hole_prob)
  slippery: bool = False  # gymnasium's is_slippery: a move goes sideways 2 times in 3

  def __post_init__(self):
    if self.size < 2 or not 0 <= self.hole_prob < 1:
      raise ValueError(f"need size >= 2 and 0 <= hole_prob < 1: {self}")


class FrozenLakeEnv(GymGame):
  ACTIONS = MOVE_WORDS
  ACTION_NAMES = ("Up", "Down", "Left", "Right")
  ACTION_IDS = {Move.LEFT: 0, Move.DOWN: 1, Move.RIGHT: 2, Move.UP: 3}  # gymnasium's order

  def __init__(self, config: FrozenLakeConfig = FrozenLakeConfig(),
               episode: EpisodeConfig = EpisodeConfig()):
    super().__init__(episode)
    self.config = config

  def _generate(self, seed: int) -> None:
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map
    desc = generate_random_map(self.config.size, 1.0 - self.config.hole_prob, seed=seed)
    self.env = _make("FrozenLake-v1", desc=desc, is_slippery=self.config.slippery)
    self.state = int(self.env.reset(seed=seed)[0])

  def _apply(self, action: Move) -> Outcome:
    before = self.state
    outcome = super()._apply(action)
    row, col = divmod(self.state, self.env.unwrapped.ncol)
    fell = self.env.unwrapped.desc[row, col] == b"H"
    return dataclasses.replace(outcome, info={**outcome.info, "moved": self.state != before,
                                              "fell": bool(fell)})

  def _render(self) -> str:
    desc = self.env.unwrapped.desc
    row, col = divmod(self.state, desc.shape[1])
    rows = [[c.decode() for c in line] for line in desc]
    rows[row][col] = "P"
    return "\n".join("".join(line) for line in rows)

  def _rules(self) -> str:
    slip = " The ice is slippery: a move may go sideways." if self.config.slippery else ""
    return ("FrozenLake: walk from the start S to the goal G over the frozen lake F without "
            "stepping into a hole H (that ends the game). You are P. Moving off the board does "
            f"nothing.{slip}")


@dataclasses.dataclass(frozen=True)
class TaxiConfig:
  rainy: bool = False  # gymnasium's is_rainy: a move may slip sideways
  fickle_passenger: bool = False  # gymnasium's: the passenger may change destination once


_TAXI_WORDS = {**MOVE_WORDS, "pickup": "pickup", "dropoff": "dropoff", "p": "pickup",
               "pick up": "pickup", "drop off": "dropoff"}
_STOPS = "RGYB"  # gymnasium's locs order: (0,0) R, (0,4) G, (4,0) Y, (4,3) B


class TaxiEnv(GymGame):
  ACTIONS = _TAXI_WORDS
  ACTION_NAMES = ("Up", "Down", "Left", "Right", "Pickup", "Dropoff")
  # gymnasium: 0 south, 1 north, 2 east, 3 west, 4 pickup, 5 dropoff
  ACTION_IDS = {Move.DOWN: 0, Move.UP: 1, Move.RIGHT: 2, Move.LEFT: 3, "pickup": 4, "dropoff": 5}

  def __init__(self, config: TaxiConfig = TaxiConfig(),
               episode: EpisodeConfig = EpisodeConfig()):
    super().__init__(episode)
    self.config = config

  def _generate(self, seed: int) -> None:
    if self.env is None:  # the map is fixed: build the transition table once
      self.env = _make("Taxi-v4", is_rainy=self.config.rainy,
                       fickle_passenger=self.config.fickle_passenger)
    self.state = int(self.env.reset(seed=seed)[0])

  def _render(self) -> str:
    game = self.env.unwrapped
    taxi_row, taxi_col, passenger, destination = game.decode(self.state)
    rows = [[c.decode() for c in line] for line in game.desc]
    rows = [["_" if c == " " else c for c in line] for line in rows]
    rows[1 + taxi_row][2 * taxi_col + 1] = "T"
    where = ("in the taxi" if passenger == 4 else f"delivered at {_STOPS[passenger]}"
             if passenger == destination else f"waiting at {_STOPS[passenger]}")
    board = "\n".join("".join(line) for line in rows)
    return f"{board}\nPassenger: {where}. Destination: {_STOPS[destination]}."

  def _rules(self) -> str:
    return ("Taxi: drive the taxi T to the passenger, pick them up, drive to the destination and "
            "drop them off. Stops are R, G, Y, B; | is a wall, : and _ can be driven over. Each "
            "step costs 1, a wrong pickup or dropoff costs 10, a delivery earns 20.")
