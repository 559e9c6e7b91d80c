"""Procedural write-a-function tasks with hidden tests, for code RLVR without downloads.

Each task asks for one small Python function ("Write f(x) that returns x plus 3."); its hidden tests
are `CodeTests` whose expected values are computed here by a trusted reference function (never by
running a program), and `Sample.answer` is a reference solution (for warm starts and to check the
tests). Everything is deterministic given a seed, short, and uses only characters of the tiny
character tokenizer (no backticks), so a CPU-sized model can be warm-started on it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import numpy as np

from flashrl_jax.envs._code_grader import CodeTests, TestCase
from flashrl_jax.envs._types import Sample


class CodeFamily(enum.Enum):
  ADD = "add"
  SUB = "sub"
  MUL = "mul"
  SQUARE = "square"
  MAX2 = "max2"
  MIN2 = "min2"
  SUM = "sum"
  LEN = "len"
  COUNT = "count"
  REVERSE = "reverse"
  UPPER = "upper"
  IS_NEGATIVE = "is_negative"


@dataclasses.dataclass(frozen=True)
class _Family:
  signature: str                      # "f(x)"
  prompt: str                         # what it returns, in words; {k} is the task's constant
  body: str                           # the reference's return expression
  fn: Callable[..., Any]              # the same, as trusted Python: fn(k, *args)
  args: Callable[[np.random.Generator], list[Any]]


def _int(rng) -> int:
  return int(rng.integers(-50, 51))


def _ints(rng) -> list[int]:
  return [int(v) for v in rng.integers(-9, 10, size=int(rng.integers(0, 8)))]


def _word(rng) -> str:
  letters = "abcdefghijklmnopqrstuvwxyz"
  return "".join(letters[i] for i in rng.integers(0, 26, size=int(rng.integers(0, 9))))


_FAMILIES = {
    CodeFamily.ADD: _Family("f(x)", "x plus {k}", "x+{k}", lambda k, x: x + k,
                            lambda r: [_int(r)]),
    CodeFamily.SUB: _Family("f(x)", "x minus {k}", "x-{k}", lambda k, x: x - k,
                            lambda r: [_int(r)]),
    CodeFamily.MUL: _Family("f(x)", "x times {k}", "x*{k}", lambda k, x: x * k,
                            lambda r: [_int(r)]),
    CodeFamily.SQUARE: _Family("f(x)", "x squared", "x*x", lambda k, x: x * x, lambda r: [_int(r)]),
    CodeFamily.MAX2: _Family("f(x, y)", "the larger of x and y", "max(x,y)",
                             lambda k, x, y: max(x, y), lambda r: [_int(r), _int(r)]),
    CodeFamily.MIN2: _Family("f(x, y)", "the smaller of x and y", "min(x,y)",
                             lambda k, x, y: min(x, y), lambda r: [_int(r), _int(r)]),
    CodeFamily.SUM: _Family("f(xs)", "the sum of the list xs", "sum(xs)", lambda k, xs: sum(xs),
                            lambda r: [_ints(r)]),
    CodeFamily.LEN: _Family("f(xs)", "the length of the list xs", "len(xs)",
                            lambda k, xs: len(xs), lambda r: [_ints(r)]),
    CodeFamily.COUNT: _Family("f(xs)", "how many times {k} occurs in the list xs", "xs.count({k})",
                              lambda k, xs: xs.count(k), lambda r: [_ints(r)]),
    CodeFamily.REVERSE: _Family("f(s)", "the string s reversed", "s[::-1]", lambda k, s: s[::-1],
                                lambda r: [_word(r)]),
    CodeFamily.UPPER: _Family("f(s)", "the string s in upper case", "s.upper()",
                              lambda k, s: s.upper(), lambda r: [_word(r)]),
    CodeFamily.IS_NEGATIVE: _Family("f(x)", "whether x is negative", "x<0",
                                    lambda k, x: x < 0, lambda r: [_int(r)]),
}


@dataclasses.dataclass(frozen=True)
class CodeTaskConfig:
  """`num_tasks` distinct tasks (cycled by the prompt source), `cases` hidden cases each."""

  families: tuple[CodeFamily, ...] = tuple(CodeFamily)
  num_tasks: int = 512
  cases: int = 5
  max_constant: int = 9  # {k} is drawn from 1..max_constant

  def __post_init__(self):
    object.__setattr__(self, "families", tuple(CodeFamily(f) for f in self.families))
    if not self.families or self.num_tasks < 1 or self.cases < 1 or self.max_constant < 1:
      raise ValueError(f"need families, num_tasks >= 1, cases >= 1, max_constant >= 1: {self}")


def code_task_prompt(family: CodeFamily, k: int) -> str:
  spec = _FAMILIES[family]
  return f"Write {spec.signature} that returns {spec.prompt.format(k=k)}.\n"


def generate_code_tasks(config: CodeTaskConfig, seed: int = 0) -> list[Sample]:
  """`config.num_tasks` samples: prompt, reference solution (`answer`) and hidden tests (JSON)."""
  rng = np.random.default_rng(seed)
  samples = []
  for i in range(config.num_tasks):
    family = config.families[int(rng.integers(len(config.families)))]
    spec = _FAMILIES[family]
    k = int(rng.integers(1, config.max_constant + 1))
    cases = []
    for _ in range(config.cases):
      args = spec.args(rng)
      cases.append(TestCase(tuple(args), spec.fn(k, *args)))
    solution = f"def {spec.signature}:\n    return {spec.body.format(k=k)}\n"
    samples.append(Sample(prompt=code_task_prompt(family, k), answer=solution,
                          tests=CodeTests("f", tuple(cases)).to_json(),
                          id=f"code{seed}-{i}-{family.value}-k{k}"))
  return samples


class CodeTaskSource:
  """A run's code tasks as a numbered stream: a pool of `config.num_tasks` tasks, cycled in order
  (tasks recur, so the adaptive timeout's per-prompt anchors get used). No exact held-out
  evaluation: correctness of a program is not the likelihood of one reference string."""

  def __init__(self, config: CodeTaskConfig, seed: int = 0):
    self.config, self.seed = config, seed
    self._pool = generate_code_tasks(config, seed)

  def sample(self, index: int) -> Sample:
    return self._pool[index % len(self._pool)]

  def eval_sets(self) -> dict[str, list[Sample]]:
    return {}

  def reference(self, sample: Sample) -> str:
    return sample.answer
