"""Turns a run directory's `metrics.jsonl` into PNG curves (reward, staleness, time, throughput)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flashrl_jax.controller._metrics import read_metrics  # noqa: E402


def moving_average(values, window: int = 11) -> np.ndarray:
  """Trailing moving average (the paper smooths its curves over 11 steps)."""
  values = np.asarray(values, np.float64)
  out = np.empty_like(values)
  for i in range(len(values)):
    out[i] = values[max(0, i - window + 1):i + 1].mean()
  return out


def plot_run(workdir: str, window: int = 11) -> list[str]:
  records = read_metrics(workdir)
  if not records:
    raise ValueError(f"{workdir}/metrics.jsonl has no records.")
  evals = [(0, r["eval/initial_expected_accuracy"]) for r in records
           if "eval/initial_expected_accuracy" in r]
  evals += [(r["step"], r["eval/expected_accuracy"]) for r in records
            if "eval/expected_accuracy" in r]
  steps = [r["step"] for r in records]
  paths = []

  def save(fig, name):
    path = os.path.join(workdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

  fig, ax = plt.subplots(figsize=(6, 4))
  reward = [r["reward_mean"] for r in records]
  ax.plot(steps, reward, alpha=0.35, label="reward (per step)")
  ax.plot(steps, moving_average(reward, window), label=f"reward ({window}-step avg)")
  if evals:
    ax.plot(*zip(*evals), "o-", label="P(correct) on held-out prompts (exact)")
  ax.set_xlabel("training step")
  ax.set_ylabel("mean reward")
  ax.set_title(f"{records[-1].get('mode', '')} α={records[-1].get('async_ratio', '')}")
  ax.legend()
  save(fig, "reward.png")

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(steps, [r["staleness_max"] for r in records], label="max staleness")
  ax.plot(steps, [r.get("staleness_mean", 0) for r in records], label="mean staleness")
  ax.set_xlabel("training step")
  ax.set_ylabel("policy versions")
  ax.legend()
  save(fig, "staleness.png")

  keys = [k for k in ("time/wait_data_s", "time/train_s", "time/export_s", "time/pause_s",
                      "time/load_s", "time/resume_s") if k in records[0]]
  fig, ax = plt.subplots(figsize=(6, 4))
  bottom = np.zeros(len(records))
  for key in keys:
    values = np.array([r.get(key, 0.0) for r in records])
    ax.bar(steps, values, bottom=bottom, label=key.removeprefix("time/"))
    bottom += values
  ax.set_xlabel("training step")
  ax.set_ylabel("seconds")
  ax.legend(fontsize=7)
  save(fig, "time_breakdown.png")

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(steps, [r["samples_per_s"] for r in records])
  ax.set_xlabel("training step")
  ax.set_ylabel("samples / s")
  save(fig, "throughput.png")
  return paths
