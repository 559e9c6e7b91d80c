"""Run observability: one JSON object per training step in `metrics.jsonl`, plus TensorBoard.

The JSONL file is the source of truth that plots, the simulator's calibration and the experiment
tables read; TensorBoard (and Weights & Biases, when installed and asked for) mirror its scalars.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from typing import Any

import numpy as np

from flashrl_jax.controller._samples import Group


def step_sample_metrics(groups: list[Group], trainer_version: int) -> dict[str, Any]:
  """Staleness, reward and length statistics of the groups consumed by one training step."""
  responses = [r for g in groups for r in g.responses]
  staleness = [trainer_version - r.start_version for r in responses]
  hist = collections.Counter(staleness)
  lengths = [len(r.output_ids) for r in responses]
  rewards = [r.reward for r in responses]
  per_task = _per_task(groups)
  return {
      "staleness_max": max(staleness) if staleness else 0,
      "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
      "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
      "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
      "accuracy": float(np.mean([_correct(r) for r in responses])) if rewards else 0.0,
      "response_length_mean": float(np.mean(lengths)) if lengths else 0.0,
      "response_length_max": max(lengths) if lengths else 0,
      "response_length_median": float(np.median(lengths)) if lengths else 0.0,
      "num_samples": len(responses),
      "num_groups": len(groups),
      "aborted_continuations": sum(len(set(r.token_versions)) > 1 for r in responses),
      **_reward_diagnostics([r.reward_info for r in responses]),
      **per_task,
  }


def _reward_diagnostics(infos: list[dict[str, Any]]) -> dict[str, Any]:
  """What a reward reported beside its number, for rewards that report it (the code reward: each
  verdict, the sandbox's isolation mode, the time limit each program ran under)."""
  out: dict[str, Any] = {}
  for key in ("status", "isolation"):
    counts = collections.Counter(str(i[key]) for i in infos if key in i)
    if counts:
      out[f"reward_{key}"] = dict(sorted(counts.items()))
  timeouts = [float(i["timeout_s"]) for i in infos if "timeout_s" in i]
  if timeouts:
    out["reward_timeout_s_min"] = min(timeouts)
    out["reward_timeout_s_mean"] = float(np.mean(timeouts))
  return out


def _correct(response) -> bool:
  """The reward's own verdict when it gives one (partial credit is not correct), else reward > 0."""
  return bool(response.reward_info.get("correct", response.reward > 0))


def _per_task(groups: list[Group]) -> dict[str, float]:
  """`reward_mean/<task>` and `accuracy/<task>` for samples that name their dataset."""
  by_task: dict[str, list] = collections.defaultdict(list)
  for g in groups:
    if g.sample.task:
      by_task[g.sample.task].extend(g.responses)
  out = {}
  for task, responses in sorted(by_task.items()):
    out[f"reward_mean/{task}"] = float(np.mean([r.reward for r in responses]))
    out[f"accuracy/{task}"] = float(np.mean([_correct(r) for r in responses]))
  return out


def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.floating, np.integer)):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class MetricsLogger:
  """Appends step records to `<workdir>/metrics.jsonl` and mirrors scalars to TensorBoard."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, wandb_project: str | None = None,
               resume_step: int = 0):
    """`resume_step`: the last step kept by a resumed run; TensorBoard then discards the earlier
    run's events after it (a purge marker), as `metrics.jsonl` is truncated there by the caller."""
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      self._tb = _tensorboard_writer(os.path.join(workdir, "tensorboard"), resume_step)
    self._wandb = None
    if wandb_project:
      try:
        import wandb  # optional
        self._wandb = wandb.init(project=wandb_project, dir=workdir)
      except ImportError:
        pass

  def log(self, record: dict[str, Any]) -> None:
    record = _jsonable(record)
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()
    step = int(record["step"])
    scalars = {k: v for k, v in record.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if self._tb is not None:
      self._tb.add_summary(_step_summary(scalars), step)
    if self._wandb is not None:
      self._wandb.log(scalars, step=step)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def _step_summary(scalars: dict[str, float]):
  """One TensorBoard summary holding every scalar of a step, tags as `add_scalar` writes them.

  One event per step, not one per scalar: `add_scalar` per key cost ~4 ms per step of the
  controller's event loop (which shares a core with the trainer in CPU async runs), this 0.7 ms
  (a 90-key record of the long-tail benchmark, 200 writes)."""
  from tensorboardX.proto.summary_pb2 import Summary
  from tensorboardX.summary import scalar
  return Summary(value=[v for key, value in scalars.items() for v in scalar(key, value).value])


def _tensorboard_writer(logdir: str, resume_step: int):
  """A TensorBoard event file of its own (the suffix keeps a quick restart, same second and host,
  from reusing the previous file). After a resume it starts with the purge marker TensorBoard
  honours by dropping the earlier run's events from the first new step on (what `SummaryWriter`
  writes for `purge_step`)."""
  from tensorboardX import FileWriter
  from tensorboardX.proto.event_pb2 import Event, SessionLog
  writer = FileWriter(logdir, filename_suffix=f".{time.time_ns()}")
  if resume_step:
    writer.add_event(Event(step=resume_step + 1, file_version="brain.Event:2"))
    writer.add_event(Event(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START)))
  return writer


def read_metrics(workdir_or_file: str) -> list[dict[str, Any]]:
  path = workdir_or_file
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
