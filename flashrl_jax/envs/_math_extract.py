"""Pull the final answer out of a free-form math response.

Models are prompted to put the answer in `\\boxed{...}`; many also write "the answer is X", and weak
ones just end with a number. We try those in that order, and report whether the response followed
the requested format (a boxed answer or an explicit "answer is") separately from correctness, so a
format reward or a diagnostic can use it.
"""

from __future__ import annotations

import dataclasses
import enum
import re


class AnswerSource(enum.Enum):
  BOXED = "boxed"
  ANSWER_IS = "answer_is"
  LAST_NUMBER = "last_number"
  NONE = "none"


@dataclasses.dataclass(frozen=True)
class Extracted:
  text: str | None
  source: AnswerSource

  @property
  def format_ok(self) -> bool:
    return self.source in (AnswerSource.BOXED, AnswerSource.ANSWER_IS)


_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?")


def _balanced(text: str, start: int) -> str | None:
  """Content of the brace group whose `{` is at `start - 1`; None if it never closes."""
  depth = 1
  for i in range(start, len(text)):
    if text[i] == "{":
      depth += 1
    elif text[i] == "}":
      depth -= 1
      if depth == 0:
        return text[start:i]
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
  best_pos, best = -1, None
  for opener in _BOX_OPENERS:
    pos = text.rfind(opener)
    if pos > best_pos:
      content = _balanced(text, pos + len(opener))
      if content is not None:
        best_pos, best = pos, content
  return best


def _after_answer_is(text: str) -> str | None:
  matches = list(_ANSWER_IS.finditer(text))
  if not matches:
    return None
  rest = text[matches[-1].end():].strip()
  # The answer runs to the end of the line; a sentence-final period is not part of it.
  rest = rest.splitlines()[0] if rest else ""
  rest = re.split(r"(?<!\d)\.(?:\s|$)|\.\s", rest + " ")[0].strip()
  rest = rest.strip("$ ").rstrip(".")
  return rest or None


def extract_answer(text: str) -> Extracted:
  boxed = last_boxed(text)
  if boxed is not None and boxed.strip():
    return Extracted(boxed.strip(), AnswerSource.BOXED)
  after = _after_answer_is(text)
  if after is not None:
    return Extracted(after, AnswerSource.ANSWER_IS)
  numbers = _NUMBER.findall(text)
  if numbers:
    return Extracted(numbers[-1].replace(" ", ""), AnswerSource.LAST_NUMBER)
  return Extracted(None, AnswerSource.NONE)
