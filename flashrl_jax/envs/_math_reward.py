"""Verifiable single-turn rewards: math answers (0/1 via a verifier) and exact-match strings.

`MathReward` prefers HuggingFace's `math_verify` (robust LaTeX parsing, sympy equivalence) and falls
back to our own checker when it is not installed or cannot parse either side. Both are CPU-bound and
synchronous: async callers wrap them in `PooledReward` so they run in a process pool.

`math_verify` guards its parsing with `signal.alarm`, which only works in a process's main thread;
in any other thread we call it without its timeout (the pool's workers run tasks in their main
thread, so the guarded path is the one used in training).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading

from flashrl_jax.envs._math_equiv import equivalent
from flashrl_jax.envs._math_extract import extract_answer
from flashrl_jax.envs._types import RewardResult, Sample


_MAX_PARSE_CHARS = 4096


class VerifierBackend(enum.Enum):
  AUTO = "auto"                # math_verify if importable, else ours
  MATH_VERIFY = "math_verify"  # require math_verify (ImportError if missing)
  BUILTIN = "builtin"          # our checker only (deterministic, no sympy)


@functools.cache
def math_verify_available() -> bool:
  try:
    import math_verify  # noqa: F401
  except ImportError:
    return False
  return True


def _math_verify_equal(response: str, answer: str) -> bool | None:
  """math_verify's verdict, or None when it cannot parse the response or the answer."""
  from math_verify import parse, verify

  in_main = threading.current_thread() is threading.main_thread()
  kwargs = {} if in_main else {"parsing_timeout": None}
  gold = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
  try:
    gold_parsed = parse(gold, **kwargs)
    # The answer sits at the end; bounding the text bounds sympy's time when no alarm can fire.
    pred_parsed = parse(response[-_MAX_PARSE_CHARS:], **kwargs)
    if not gold_parsed or not pred_parsed:
      return None
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=5 if in_main else None))
  except Exception:  # math_verify raises many types on adversarial LaTeX; treat as "cannot tell".
    return None


@dataclasses.dataclass(frozen=True)
class MathReward:
  """1.0 if the response's final answer equals `sample.answer`, else 0.0.

  info: `format_ok` (boxed or "answer is" present), `extracted` (our extraction), `source`,
  `backend` (which checker decided).
  """

  backend: VerifierBackend = VerifierBackend.AUTO
  format_penalty: float = 0.0  # subtracted when the format is wrong (0 keeps the reward 0/1)

  def __post_init__(self):
    if self.backend is VerifierBackend.MATH_VERIFY and not math_verify_available():
      raise ImportError("VerifierBackend.MATH_VERIFY needs the `math-verify` package")

  def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    del prompt  # The reference answer carries everything the check needs.
    extracted = extract_answer(response)
    verdict, decided_by = None, VerifierBackend.BUILTIN
    use_mv = self.backend is VerifierBackend.MATH_VERIFY or (
        self.backend is VerifierBackend.AUTO and math_verify_available())
    if use_mv and extracted.text is not None:
      verdict = _math_verify_equal(response, sample.answer)
      decided_by = VerifierBackend.MATH_VERIFY
    if verdict is None:
      decided_by = VerifierBackend.BUILTIN
      verdict = extracted.text is not None and equivalent(extracted.text, sample.answer)
    reward = float(verdict) - (0.0 if extracted.format_ok else self.format_penalty)
    return RewardResult(reward, {"format_ok": extracted.format_ok, "extracted": extracted.text,
                                 "source": extracted.source.value, "backend": decided_by.value,
                                 "correct": bool(verdict)})


@dataclasses.dataclass(frozen=True)
class ExactMatchReward:
  """1.0 iff the response equals the answer after whitespace normalisation (synthetic tasks).

  With `stop_at_newline`, only the first line counts, so a model that keeps babbling after a
  correct answer is still graded on the answer it gave.
  """

  stop_at_newline: bool = True

  def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    del prompt
    text = response.strip()
    if self.stop_at_newline:
      text = text.split("\n", 1)[0] if text else ""
    got, want = " ".join(text.split()), " ".join(sample.answer.split())
    correct = got == want
    return RewardResult(float(correct), {"format_ok": bool(got), "correct": correct})
