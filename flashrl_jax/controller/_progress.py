"""A tqdm progress bar fed by per-step metric records."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressReporter:

  def __init__(self, steps: int, *, enabled: bool = True):
    self._bar = tqdm(total=steps, desc="RL steps", unit="step", disable=not enabled,
                     file=sys.stderr, dynamic_ncols=True)

  def update(self, record: dict) -> None:
    self._bar.n = int(record["step"])
    self._bar.set_postfix(reward=f"{record.get('reward_mean', 0):.3f}",
                          stale=record.get("staleness_max", 0),
                          sps=f"{record.get('samples_per_s', 0):.1f}", refresh=False)
    self._bar.refresh()

  def __enter__(self) -> "ProgressReporter":
    return self

  def __exit__(self, *exc) -> None:
    self._bar.close()
