"""reasoning-gym's procedural generators as an RLVR task: prompts, held-out sets, the library's scorer.

reasoning-gym (PyPI `reasoning-gym`) ships ~100 seeded generators (`basic_arithmetic`, `chain_sum`,
`leg_counting`, `propositional_logic`, ...), each with difficulty parameters and its own answer
scorer, and needs nothing downloaded at run time. A task names one or more generators with weights;
this module turns that into

  * a training stream where prompt `i` is a pure function of `(seed, i)` (so a run's data position is
    one integer and resume is exact), drawing a generator by weight and a problem uniformly;
  * one held-out evaluation set per generator, of distinct questions that the training stream never
    yields (questions are compared as text, so a small problem space cannot leak its eval set);
  * the reward: reasoning-gym's `score_answer` on the answer extracted from the response, plus an
    optional format reward.

The library is imported lazily: only runs that use it pay for its import (~1 s).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import re
from typing import Any, Mapping

import numpy as np

from flashrl_jax._enums import parse_enum
from flashrl_jax.envs._types import RewardResult, Sample

_CHUNK = 1024
_EVAL_SALT = 1_000_003  # the held-out generators' seed offset
_RESERVED = ("seed", "size")  # set by the task, never by difficulty parameters


class AnswerFormat(enum.Enum):
  """Where the answer sits in a response."""
  PLAIN = "plain"    # the first line of the response is the answer (tiny models, the CPU demo)
  TAGGED = "tagged"  # the last `<answer>...</answer>`, reasoning-gym's convention


def _registry() -> dict[str, tuple[type, type]]:
  import reasoning_gym  # noqa: F401 - registers every dataset
  from reasoning_gym.factory import DATASETS
  return {name: classes for name, classes in DATASETS.items() if name != "composite"}


def _frozen(value: Any) -> Any:
  """Lists (e.g. `operators`) become tuples, so a config stays immutable and comparable."""
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  return value


@dataclasses.dataclass(frozen=True)
class ReasoningGymDataset:
  """One reasoning-gym generator in a task mix.

  Attributes:
    name: the generator's registered name (`reasoning_gym.create_dataset(name)`).
    weight: relative share of training prompts (> 0).
    params: difficulty parameters: fields of the generator's config class, e.g.
      `{"min_terms": 2, "max_terms": 2}`; anything else fails here, naming the fields it accepts.
  """

  name: str
  weight: float = 1.0
  params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight) \
        or self.weight <= 0:
      raise ValueError(f"reasoning-gym dataset {self.name!r}: weight must be > 0, "
                       f"got {self.weight!r}.")
    items = self.params.items() if isinstance(self.params, Mapping) else tuple(self.params)
    object.__setattr__(self, "params", tuple(sorted((str(k), _frozen(v)) for k, v in items)))
    registry = _registry()
    if self.name not in registry:
      close = difflib.get_close_matches(str(self.name), registry, n=3)
      hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
      raise ValueError(f"unknown reasoning-gym dataset {self.name!r}.{hint} "
                       f"({len(registry)} are registered: reasoning_gym.factory.DATASETS.)")
    fields = {f.name for f in dataclasses.fields(registry[self.name][1])} - set(_RESERVED)
    unknown = [k for k, _ in self.params if k not in fields]
    if unknown:
      raise ValueError(f"reasoning-gym dataset {self.name!r} has no parameter(s) {unknown}; its "
                       f"parameters are {sorted(fields)} (seed and size are set by the task).")
    try:
      self.generator(seed=0, size=1)  # the library's own validation of the values
    except (AssertionError, ValueError, TypeError) as error:
      raise ValueError(f"reasoning-gym dataset {self.name!r} rejects params "
                       f"{dict(self.params)}: {error or type(error).__name__}") from None

  def generator(self, *, seed: int, size: int):
    import reasoning_gym
    return reasoning_gym.create_dataset(self.name, seed=seed, size=size, **dict(self.params))


@dataclasses.dataclass(frozen=True)
class ReasoningGymConfig:
  """An RLVR task made of reasoning-gym generators.

  Attributes:
    datasets: the generators and their weights (names must be distinct).
    size: problems per generator that the training stream draws from (reasoning-gym's virtual
      dataset size; each problem is generated on demand from `seed + index`).
    seed: seeds the generators and the order of the stream.
    answer_format: PLAIN or TAGGED (see `AnswerFormat`).
    instruction: text put before every question (e.g. one of `reasoning_gym.utils.SYSTEM_PROMPTS`
      for a model that reads instructions; empty for the tiny demo model).
    format_reward: added to the score when the response has the requested format (TAGGED: an
      `<answer>` tag; PLAIN: a non-empty first line), as RLVR recipes add a format term.
  """

  datasets: tuple[ReasoningGymDataset, ...]
  size: int = 100_000
  seed: int = 0
  answer_format: AnswerFormat = AnswerFormat.PLAIN
  instruction: str = ""
  format_reward: float = 0.0

  def __post_init__(self):
    datasets = tuple(self.datasets)
    if not datasets:
      raise ValueError("ReasoningGymConfig needs at least one dataset.")
    if not all(isinstance(d, ReasoningGymDataset) for d in datasets):
      raise ValueError("ReasoningGymConfig.datasets must be ReasoningGymDataset values.")
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
      raise ValueError(f"ReasoningGymConfig lists a dataset twice: {names}.")
    object.__setattr__(self, "datasets", datasets)
    object.__setattr__(self, "answer_format",
                       parse_enum(AnswerFormat, self.answer_format, "answer_format"))
    if self.size < 1:
      raise ValueError(f"ReasoningGymConfig.size must be >= 1, got {self.size}.")
    if not math.isfinite(self.format_reward) or self.format_reward < 0:
      raise ValueError(f"format_reward must be >= 0, got {self.format_reward}.")

  def render(self, question: str) -> str:
    """The prompt text for `question` (before any chat template)."""
    question = question.strip()
    if self.answer_format is AnswerFormat.PLAIN:
      question += "\n"  # the answer starts on its own line
    return f"{self.instruction.strip()}\n{question}" if self.instruction.strip() else question

  def reference(self, answer: str) -> str:
    """The canonical correct response (supervised warm start, exact evaluation)."""
    return answer if self.answer_format is AnswerFormat.PLAIN else f"<answer>{answer}</answer>"


_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract(response: str, answer_format: AnswerFormat) -> str | None:
  """The answer part of `response`, or None if it does not have the format."""
  if answer_format is AnswerFormat.TAGGED:
    # reasoning_gym.utils.extract_answer's rule: the last tag, stripped.
    matches = _TAG.findall(response)
    return matches[-1].strip() if matches else None
  stripped = response.strip()
  return stripped.split("\n", 1)[0].strip() if stripped else None


class ReasoningGymReward:
  """reasoning-gym's own `score_answer` on the extracted answer (a sync `RewardFn`).

  reward = score + format_reward * format_ok. info: `score` (the library's, in [0, 1]), `correct`
  (score == 1), `format_ok`, `extracted`. Scorers may read the entry's metadata, so `Sample.metadata`
  must be what the generator produced (as `ReasoningGymSource` makes it). Picklable: generators are
  rebuilt lazily in whichever process scores.
  """

  def __init__(self, config: ReasoningGymConfig):
    self.config = config
    self._specs = {d.name: d for d in config.datasets}

  def __getstate__(self):
    return {"config": self.config}

  def __setstate__(self, state):
    self.__init__(state["config"])

  @functools.lru_cache(maxsize=None)
  def _scorer(self, name: str):
    if name not in self._specs:
      raise ValueError(f"sample from dataset {name!r}, which this task does not have "
                       f"({sorted(self._specs)}).")
    return self._specs[name].generator(seed=self.config.seed, size=self.config.size)

  def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    del prompt
    extracted = extract(response, self.config.answer_format)
    entry = {"question": "", "answer": sample.answer or None,  # "" stands for no oracle answer
             "metadata": dict(sample.metadata or {})}
    try:
      score = float(self._scorer(sample.task).score_answer(extracted, entry))
    except Exception:  # noqa: BLE001 - a scorer choking on adversarial text scores 0, never crashes
      score = 0.0
    score = min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0
    format_ok = extracted is not None and bool(extracted)
    return RewardResult(score + self.config.format_reward * format_ok,
                        {"score": score, "correct": score == 1.0, "format_ok": format_ok,
                         "extracted": extracted})


class ReasoningGymSource:
  """The training stream and held-out sets of a `ReasoningGymConfig` (a `TaskSource`).

  `eval_size` distinct questions per generator are drawn from generators seeded `seed + 1000003`;
  the training stream skips every problem whose question is among them.
  """

  def __init__(self, config: ReasoningGymConfig, eval_size: int = 64):
    if eval_size < 0:
      raise ValueError(f"eval_size must be >= 0, got {eval_size}.")
    self.config = config
    specs = config.datasets
    self._train = [d.generator(seed=config.seed, size=config.size) for d in specs]
    weights = np.asarray([d.weight for d in specs], np.float64)
    self._p = weights / weights.sum()
    self._eval = {d.name: self._draw_eval(d, eval_size) for d in specs}
    self._held_out = [{s.prompt for s in self._eval[d.name]} for d in specs]

  def _to_sample(self, index: int, spec: ReasoningGymDataset, entry: dict, tag: str) -> Sample:
    # A few generators have no single oracle answer (None; their scorer reads the metadata).
    answer = "" if entry["answer"] is None else str(entry["answer"])
    return Sample(prompt=self.config.render(entry["question"]), answer=answer,
                  id=f"{spec.name}-{tag}{index}", task=spec.name,
                  metadata=entry.get("metadata", {}))

  def _draw_eval(self, spec: ReasoningGymDataset, size: int) -> list[Sample]:
    generator = spec.generator(seed=self.config.seed + _EVAL_SALT, size=max(50 * size, 1))
    samples, seen = [], set()
    for j in range(len(generator)):
      if len(samples) == size:
        break
      sample = self._to_sample(j, spec, generator[j], "eval")
      if sample.prompt not in seen:
        seen.add(sample.prompt)
        samples.append(sample)
    if len(samples) < size:
      raise ValueError(f"reasoning-gym dataset {spec.name!r} with params {dict(spec.params)} gave "
                       f"only {len(samples)} distinct questions in {len(generator)} draws; lower "
                       f"the eval set size ({size}) or widen the difficulty parameters.")
    return samples

  @functools.lru_cache(maxsize=4)
  def _chunk(self, chunk: int) -> list[Sample]:
    rng = np.random.default_rng([self.config.seed, chunk, 0x7A5C])
    picks = rng.choice(len(self._train), size=_CHUNK, p=self._p)
    rows = rng.integers(0, self.config.size, size=_CHUNK)
    out = []
    for d, j in zip(picks.tolist(), rows.tolist()):
      spec, generator = self.config.datasets[d], self._train[d]
      for probe in range(self.config.size):  # held-out questions are skipped, deterministically
        row = (j + probe) % self.config.size
        sample = self._to_sample(row, spec, generator[row], "")
        if sample.prompt not in self._held_out[d]:
          break
      else:
        raise ValueError(f"every training problem of {spec.name!r} is in its held-out set; "
                         "widen the difficulty parameters or lower the eval set size.")
      out.append(sample)
    return out

  def sample(self, index: int) -> Sample:
    return self._chunk(index // _CHUNK)[index % _CHUNK]

  def eval_sets(self) -> dict[str, list[Sample]]:
    """Held-out sets of the generators with one oracle answer per problem (the exact evaluation
    scores that answer; e.g. `propositional_logic` accepts many and has none)."""
    return {name: list(samples) for name, samples in self._eval.items()
            if samples and all(s.answer for s in samples)}

  def reference(self, sample: Sample) -> str:
    return self.config.reference(sample.answer)

