"""What a simulated run reports: per-step records and the summary the experiments tabulate.

Why: the simulator's output must be comparable with a measured run, so each step record can be
written in the controller's `metrics.jsonl` format (`to_metrics`): the same keys a real run logs
(`step`, `policy_version`, `samples_per_s`, `staleness_hist`, `time/*`, response lengths).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class StepRecord:
  """One training step as the trainer saw it (times in simulated seconds)."""

  step: int
  policy_version: int
  start_time: float
  end_time: float = 0.0
  train_s: float = 0.0
  wait_data_s: float = 0.0
  gen_s: float = 0.0
  first_start: float = 0.0  # earliest generation start among the batch's responses
  samples: int = 0
  response_tokens: int = 0
  train_tokens: int = 0
  staleness: list[int] = dataclasses.field(default_factory=list)
  response_lengths: list[int] = dataclasses.field(default_factory=list)
  dropped_samples: int = 0


@dataclasses.dataclass(frozen=True)
class SimResult:
  """Summary of a run; throughput and means cover the steps after warm-up.

  Attributes:
    samples_per_s, tokens_per_s: consumed responses (and their response tokens) per second.
    step_time_s: mean time between consecutive train-step ends.
    gen_time_s: mean generation span of a consumed batch (first start to last reward; for sync,
      the rollout phase of the step).
    train_time_s, wait_data_s: mean train-step time and mean time the trainer waited for data.
    idle_fraction: 1 − busy GPU-seconds / (GPUs × wall time), over the whole run.
    staleness_hist: consumed samples per staleness t − v (measured steps).
    dropped_samples, wasted_tokens: samples dropped as too stale and the tokens they had decoded.
    train_beside_rollout: fraction of the training time (after warm-up) during which the rollout
      was busy, and
    rollout_beside_train: fraction of the rollout's busy time during which a step trained: where
      `CostModel`'s interference factors applied (sim_vs_measured weighs the calibration's CPU
      contention alone and beside by them).
  """

  records: tuple[StepRecord, ...]
  warmup_steps: int
  wall_s: float
  samples_per_s: float
  tokens_per_s: float
  step_time_s: float
  gen_time_s: float
  train_time_s: float
  wait_data_s: float
  idle_fraction: float
  rollout_busy_fraction: float
  staleness_hist: dict[int, int]
  dropped_samples: int
  wasted_tokens: int
  events: int
  train_beside_rollout: float
  rollout_beside_train: float

  @classmethod
  def from_records(cls, records: list[StepRecord], warmup: int, gpus: int, busy_gpu_s: float,
                   rollout_busy_fraction: float, wasted_tokens: int, events: int,
                   train_beside_rollout: float, rollout_beside_train: float) -> SimResult:
    measured = records[warmup:]
    t0 = records[warmup - 1].end_time if warmup else 0.0
    t1 = records[-1].end_time
    span = max(t1 - t0, 1e-12)
    hist = collections.Counter(s for r in measured for s in r.staleness)
    steps = np.diff([t0] + [r.end_time for r in measured])
    return cls(
        records=tuple(records), warmup_steps=warmup, wall_s=t1,
        samples_per_s=sum(r.samples for r in measured) / span,
        tokens_per_s=sum(r.response_tokens for r in measured) / span,
        step_time_s=float(np.mean(steps)),
        gen_time_s=float(np.mean([r.gen_s for r in measured])),
        train_time_s=float(np.mean([r.train_s for r in measured])),
        wait_data_s=float(np.mean([r.wait_data_s for r in measured])),
        idle_fraction=float(1.0 - busy_gpu_s / (gpus * t1)) if t1 > 0 else 0.0,
        rollout_busy_fraction=rollout_busy_fraction,
        staleness_hist=dict(sorted(hist.items())),
        dropped_samples=sum(r.dropped_samples for r in records),
        wasted_tokens=wasted_tokens, events=events, train_beside_rollout=train_beside_rollout,
        rollout_beside_train=rollout_beside_train)

  def summary(self) -> dict[str, Any]:
    """The scalar metrics (plus the staleness histogram), JSON-ready."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if f.name not in ("records", "staleness_hist")}
    out["staleness_hist"] = {str(k): v for k, v in self.staleness_hist.items()}
    return out

  def to_metrics(self, handoff: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Per-step dicts in the controller's `metrics.jsonl` format (see sim_vs_measured.py).

    `handoff` adds constant `time/export_s`, `time/pause_s`, ... entries (the simulated costs).
    """
    lines, prev_end = [], 0.0
    for r in self.records:
      step_s = r.end_time - prev_end
      prev_end = r.end_time
      hist = collections.Counter(r.staleness)
      lengths = np.asarray(r.response_lengths, dtype=np.float64)
      lines.append({
          "step": r.step, "policy_version": r.policy_version,
          "samples_per_s": r.samples / step_s if step_s > 0 else 0.0,
          "staleness_max": max(r.staleness, default=0),
          "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
          "dropped_stale": r.dropped_samples, "reward_mean": 0.0, "num_samples": r.samples,
          "time/step_s": step_s, "time/train_s": r.train_s, "time/wait_data_s": r.wait_data_s,
          **(handoff or {}),
          "response_length_mean": float(lengths.mean()) if lengths.size else 0.0,
          "response_length_max": int(lengths.max()) if lengths.size else 0,
          "response_lengths": [int(x) for x in r.response_lengths],
      })
    return lines
