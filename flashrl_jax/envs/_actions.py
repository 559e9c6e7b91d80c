"""Parse a game action out of free-form model output, shared by the text games.

Accepted: `<action>Left</action>` (the last tag wins; case-insensitive), or a response that is just
an action word (`left`, `Left.`), or a shorthand the game lists (`L`, `U`, ...). Anything else is
unparsable and the environment penalises it: we do not guess from prose, because rewarding
"I won't go left, I'll go right" for its last word teaches the model nothing about the format.
"""

from __future__ import annotations

import enum
import re
from typing import Mapping, TypeVar

A = TypeVar("A")


class Move(enum.Enum):
  UP = (-1, 0)
  DOWN = (1, 0)
  LEFT = (0, -1)
  RIGHT = (0, 1)

  @property
  def delta(self) -> tuple[int, int]:
    return self.value


# The grid vocabulary every game that moves on a grid accepts.
MOVE_WORDS: Mapping[str, Move] = {
    "up": Move.UP, "down": Move.DOWN, "left": Move.LEFT, "right": Move.RIGHT,
    "u": Move.UP, "d": Move.DOWN, "l": Move.LEFT, "r": Move.RIGHT,
    "north": Move.UP, "south": Move.DOWN, "west": Move.LEFT, "east": Move.RIGHT}
_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)


def parse_action(text: str, words: Mapping[str, A]) -> A | None:
  """The action `text` names from `words` (lower-case keys), or None."""
  tags = _TAG.findall(text)
  candidate = tags[-1] if tags else text
  word = candidate.strip().strip(".!\"'`").strip().lower()
  return words.get(word)


def parse_move(text: str) -> Move | None:
  return parse_action(text, MOVE_WORDS)


def format_action(name: str) -> str:
  """The canonical spelling a scripted policy (or a test) sends: `<action>Left</action>`."""
  return f"<action>{name}</action>"
