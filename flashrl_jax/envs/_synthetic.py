"""Synthetic tasks whose correct answers have long-tail lengths, for CPU demos of async RL.

Asynchronous rollout pays off when a few responses are much longer than the rest (the long tail
stalls a synchronous batch). On a CPU with a tiny model we cannot rely on a real model's length
distribution, so these generators make the *required* response length follow a chosen law: the
answer of each problem is exactly `n` items long, with `n` drawn from a lognormal or Pareto
distribution (tail knobs `sigma` / `alpha`; `flashrl_jax.scheduling.LengthDistribution`, the law
the simulator draws its workloads from). Everything is deterministic given a seed and uses only
digits, letters, spaces, `+` and `=`, so a tiny character-level tokenizer covers it.

Tasks (answers are graded by exact match after whitespace normalisation):
  REPEAT       "repeat 7 x 5 ="      -> "77777"            (n digits)
  COUNT        "count 8 to 11 ="     -> "8 9 10 11"        (n numbers)
  RUNNING_SUM  "sums 3+5+2 ="        -> "3 8 10"           (n partial sums; the last is the total)
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from flashrl_jax.envs._types import Sample
from flashrl_jax.scheduling import LengthDistribution


class SyntheticTask(enum.Enum):
  REPEAT = "repeat"
  COUNT = "count"
  RUNNING_SUM = "running_sum"


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  task: SyntheticTask = SyntheticTask.RUNNING_SUM
  lengths: LengthDistribution = LengthDistribution()
  max_start: int = 20  # COUNT: first number is drawn from [0, max_start]


def _problem(task: SyntheticTask, n: int, rng: np.random.Generator, max_start: int) -> tuple[str, str]:
  if task is SyntheticTask.REPEAT:
    digit = int(rng.integers(0, 10))
    return f"repeat {digit} x {n} =", str(digit) * n
  if task is SyntheticTask.COUNT:
    start = int(rng.integers(0, max_start + 1))
    return f"count {start} to {start + n - 1} =", " ".join(str(start + i) for i in range(n))
  terms = rng.integers(1, 10, size=n)
  return f"sums {'+'.join(map(str, terms))} =", " ".join(str(int(x)) for x in np.cumsum(terms))


def generate_synthetic(config: SyntheticConfig, num: int, seed: int) -> list[Sample]:
  """`num` problems of `config.task`; the same (config, num, seed) always gives the same list."""
  rng = np.random.default_rng(seed)
  lengths = config.lengths.sample(rng, num)
  samples = []
  for i, n in enumerate(lengths):
    prompt, answer = _problem(config.task, int(n), rng, config.max_start)
    samples.append(Sample(prompt=prompt, answer=answer, id=f"{config.task.value}-{seed}-{i}"))
  return samples


def answer_length(sample: Sample) -> int:
  """The required response length in items (digits for REPEAT, numbers otherwise)."""
  words = sample.answer.split()
  return len(sample.answer) if len(words) == 1 and sample.prompt.startswith("repeat") else len(words)
