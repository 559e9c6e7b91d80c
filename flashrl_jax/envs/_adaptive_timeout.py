"""RollPacker's adaptive timeout for code-execution rewards.

A fixed sandbox limit (say 30 s) is paid in full by every looping or very slow program, yet correct
programs for a prompt usually finish far sooner. RollPacker therefore tracks, per prompt, the
longest execution time among *correct* runs, T_anchor, and uses

    T = min(max(T_min, lambda * T_anchor), T_max)

Runs exceeding T are killed and score 0. Before any correct run of a prompt has been seen, the
dataset's `reference_time` (if any) is the anchor; with neither, T = T_max (the fixed timeout).

`TimeoutStats` reports what this bought. `time_saved_s` assumes a run killed at T would have run
to the fixed limit (RollPacker's premise that runs exceeding T are timeouts anyway), so it is an
upper bound; `false_kills` cannot be observed directly, hence it is not reported.
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class AdaptiveTimeoutConfig:
  """Symbols as in RollPacker: `t_min` = T_min, `lam` = lambda, `t_max` = T_max (the fixed limit)."""

  t_min: float = 2.0
  lam: float = 1.5
  t_max: float = 30.0

  def __post_init__(self):
    if not 0 < self.t_min <= self.t_max or self.lam <= 0:
      raise ValueError(f"need 0 < t_min <= t_max and lam > 0: {self}")

  def timeout(self, anchor: float | None) -> float:
    if anchor is None:
      return self.t_max
    return min(max(self.t_min, self.lam * anchor), self.t_max)


@dataclasses.dataclass(frozen=True)
class TimeoutStats:
  runs: int = 0
  correct: int = 0
  killed: int = 0                # runs stopped at an adaptive T shorter than the fixed limit
  time_spent_s: float = 0.0      # wall time actually spent in the sandbox
  fixed_time_s: float = 0.0      # the same runs under the fixed limit (killed ones at T_max)
  prompts_anchored: int = 0

  @property
  def time_saved_s(self) -> float:
    return self.fixed_time_s - self.time_spent_s


class AdaptiveTimeout:
  """Per-prompt anchors and running stats; thread-safe (rewards may be scored from pool threads)."""

  def __init__(self, config: AdaptiveTimeoutConfig = AdaptiveTimeoutConfig()):
    self.config = config
    self._anchors: dict[str, float] = {}
    self._stats = TimeoutStats()
    self._lock = threading.Lock()

  def anchor(self, prompt_id: str, reference_time: float | None = None) -> float | None:
    with self._lock:
      return self._anchors.get(prompt_id, reference_time)

  def timeout_for(self, prompt_id: str, reference_time: float | None = None) -> float:
    return self.config.timeout(self.anchor(prompt_id, reference_time))

  def record(self, prompt_id: str, elapsed_s: float, *, correct: bool, timed_out: bool,
             timeout_s: float) -> None:
    """Accounts one run; a correct run can only raise the prompt's anchor."""
    with self._lock:
      s = self._stats
      killed_early = timed_out and timeout_s < self.config.t_max
      new_anchor = correct and elapsed_s > self._anchors.get(prompt_id, 0.0)
      if correct and prompt_id not in self._anchors:
        s = dataclasses.replace(s, prompts_anchored=s.prompts_anchored + 1)
      if new_anchor:
        self._anchors[prompt_id] = elapsed_s
      self._stats = dataclasses.replace(
          s, runs=s.runs + 1, correct=s.correct + int(correct), killed=s.killed + int(killed_early),
          time_spent_s=s.time_spent_s + elapsed_s,
          fixed_time_s=s.fixed_time_s + (self.config.t_max if killed_early else elapsed_s))

  @property
  def stats(self) -> TimeoutStats:
    with self._lock:
      return self._stats
