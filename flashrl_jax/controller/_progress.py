"""A tqdm progress bar fed by per-step metric records (held-out evaluations printed above it)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressReporter:

  def __init__(self, steps: int, *, enabled: bool = True):
    self._bar = tqdm(total=steps, desc="RL steps", unit="step", disable=not enabled,
                     file=sys.stderr, dynamic_ncols=True)

  def update(self, record: dict) -> None:
    self._bar.n = int(record["step"])
    if "eval/initial_expected_accuracy" in record:
      self._bar.write(f"held-out P(exact answer) before RL: "
                      f"{record['eval/initial_expected_accuracy']:.3f}")
    if "eval/expected_accuracy" in record:
      self._bar.write(f"step {record['step']}: held-out P(exact answer) "
                      f"{record['eval/expected_accuracy']:.3f}")
    self._bar.set_postfix(reward=f"{record.get('reward_mean', 0):.3f}",
                          acc=f"{record.get('accuracy', 0):.2f}",
                          stale=record.get("staleness_max", 0),
                          sps=f"{record.get('samples_per_s', 0):.1f}", refresh=False)
    self._bar.refresh()

  def __enter__(self) -> "ProgressReporter":
    return self

  def __exit__(self, *exc) -> None:
    self._bar.close()
