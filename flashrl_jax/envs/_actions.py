"""Parse a grid move out of free-form model output, shared by the grid games.

Accepted: `<action>Left</action>` (the last tag wins; case-insensitive), or a response that is just
a direction word (`left`, `Left.`), or a single arrow/letter shorthand (`L`, `U`, ...). Anything
else is unparsable and the environment penalises it: we do not guess from prose, because rewarding
"I won't go left, I'll go right" for its last word teaches the model nothing about the format.
"""

from __future__ import annotations

import enum
import re


class Move(enum.Enum):
  UP = (-1, 0)
  DOWN = (1, 0)
  LEFT = (0, -1)
  RIGHT = (0, 1)

  @property
  def delta(self) -> tuple[int, int]:
    return self.value


_WORDS = {"up": Move.UP, "down": Move.DOWN, "left": Move.LEFT, "right": Move.RIGHT,
          "u": Move.UP, "d": Move.DOWN, "l": Move.LEFT, "r": Move.RIGHT,
          "north": Move.UP, "south": Move.DOWN, "west": Move.LEFT, "east": Move.RIGHT}
_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)


def parse_move(text: str) -> Move | None:
  tags = _TAG.findall(text)
  candidate = tags[-1] if tags else text
  word = candidate.strip().strip(".!\"'`").strip().lower()
  return _WORDS.get(word)


def format_move(move: Move) -> str:
  """The canonical spelling a scripted policy (or a test) sends: `<action>Left</action>`."""
  return f"<action>{move.name.capitalize()}</action>"
