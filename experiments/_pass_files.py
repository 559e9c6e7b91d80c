"""Where a `sim_vs_measured` pass keeps its runs and calibrations, and reading them back.

A pass writes each run's `metrics.jsonl` and `run.json` (what was read of it while it ran, with
its wall-clock start and end) under `run_dir`, and each calibration as JSON beside its servers'
logs (`calibration_stem`); `--repredict` reads a finished pass back from these alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

# The core layouts a regime is calibrated in: sync's, and the async split's.
LAYOUTS = ("sync", "async")


def mode_layout(mode: str) -> str:
  """The core layout a `--modes` entry runs in."""
  return "sync" if mode == "sync" else "async"


def mode_alpha(mode: str) -> int:
  """A `--modes` entry's async ratio (0 for sync)."""
  return 0 if mode == "sync" else int(mode)


def mode_name(mode: str) -> str:
  """A `--modes` entry ("sync" or α) as rows print it."""
  return "sync" if mode == "sync" else f"async α={int(mode)}"


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
  """One mode of a regime run for real: where it ran, what `run` read of it, and when (wall-clock
  seconds, to place it between the calibrations that bracket it)."""

  regime: str
  mode: str  # a `--modes` entry: "sync" or α
  repeat: int
  workdir: str
  info: dict
  start: float
  end: float

  @property
  def layout(self) -> str:
    return mode_layout(self.mode)

  @property
  def alpha(self) -> int:
    return mode_alpha(self.mode)


def run_dir(out: str, regime: str, mode: str, repeat: int) -> str:
  """Where a pass keeps one run (its `metrics.jsonl`, and `run.json`: what `run` read of it)."""
  return os.path.join(out, f"{regime}_{'sync' if mode == 'sync' else f'async_a{mode_alpha(mode)}'}"
                           + (f"_r{repeat}" if repeat else ""))


def calibration_stem(out: str, regime: str, layout: str, suffix: str) -> str:
  """Where a pass keeps a calibration of `layout` (`suffix` "" before the runs, "_after" after):
  its servers' logs in this directory, its numbers in this path + ".json"."""
  return os.path.join(out, f"{regime}_calibration_{layout}{suffix}")


def saved_runs(out: str, regime: str, modes: list[str]) -> list[MeasuredRun]:
  """The runs of `modes` a pass kept in `out` (every repeat, in the order they ran); a run without
  its `run.json` (cut off, or from before the file was kept) is left out."""
  found = []
  for repeat in itertools.count():
    paths = {mode: os.path.join(run_dir(out, regime, mode, repeat), "run.json") for mode in modes}
    kept = {mode: path for mode, path in paths.items() if os.path.exists(path)}
    if not kept and not any(os.path.isdir(os.path.dirname(path)) for path in paths.values()):
      break
    for mode, path in kept.items():
      with open(path) as f:
        info = json.load(f)
      found.append(MeasuredRun(regime, mode, repeat, os.path.dirname(path), info, info["start"],
                               info["end"]))
  return sorted(found, key=lambda r: r.start)


def saved_calibrations(out: str, regime: str, suffix: str) -> dict[str, dict]:
  """A pass's calibrations of `regime` by layout (`suffix` "" before the runs, "_after" after),
  those it kept."""
  found = {}
  for layout in LAYOUTS:
    path = calibration_stem(out, regime, layout, suffix) + ".json"
    if os.path.exists(path):
      with open(path) as f:
        found[layout] = json.load(f)
  return found
