"""Figures of the experiments, in the paper's presentation (ROLL Flash, Fig. 4).

The paper smooths every curve with an 11-step moving average and shades mean ± k·std. Across
seeds (our default when a sweep has several) the band is the spread between seeds of the smoothed
curves; with one seed it is the oscillation inside the 11-step window, which is what the paper's
caption describes ("a visual representation of the oscillation amplitude"). Each figure says
which one it shows. Only matplotlib and NumPy: the inputs are `metrics.jsonl` records.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments._summary import EVAL, eval_curve, moving_average  # noqa: E402

WINDOW = 11


def rolling_std(values, window: int = WINDOW) -> np.ndarray:
  values = np.asarray(values, np.float64)
  return np.array([values[max(0, i - window + 1):i + 1].std() for i in range(len(values))])


def band(curves: list, window: int = WINDOW, std_multiplier: float = 1.0):
  """(mean, low, high, kind) of the smoothed curves; curves are truncated to the shortest.

  Several curves: mean of their moving averages ± k·std across them ("seeds"). One curve: its
  moving average ± k·(std inside the window) ("window").
  """
  n = min(len(c) for c in curves)
  smooth = np.stack([moving_average(np.asarray(c[:n], np.float64), window) for c in curves])
  mean = smooth.mean(0)
  if len(curves) > 1:
    spread, kind = smooth.std(0), "seeds"
  else:
    spread, kind = rolling_std(curves[0][:n], window), "window"
  return mean, mean - std_multiplier * spread, mean + std_multiplier * spread, kind


def _series(records: list[dict], metric: str) -> tuple[np.ndarray, list[float]]:
  """(steps, values): every step for per-step metrics, the evaluations (step 0 = initial) for
  `eval/expected_accuracy`."""
  if metric == EVAL:
    steps, values = eval_curve(records)
    return np.asarray(steps), values
  return np.arange(1, len(records) + 1), [float(r[metric]) for r in records]


def plot_bands(ax, labelled: dict[str, list[list[dict]]], metric: str, *, window: int = WINDOW,
               baseline: str | None = None) -> str:
  """One smoothed line + band per label (`labelled[label]` = one record list per seed).
  `baseline`'s final smoothed value is drawn as a dashed line (the paper's sync reference).
  Evaluations (every few steps, exact) are not smoothed: window 1, band across seeds only."""
  kind = "window"
  if metric == EVAL:
    window = 1
  for i, (label, runs) in enumerate(labelled.items()):
    runs = [r for r in runs if r]
    if not runs:
      continue
    series = [_series(r, metric) for r in runs]
    n = min(len(values) for _, values in series)
    if n == 0:
      continue
    mean, lo, hi, kind = band([values for _, values in series], window)
    steps = series[0][0][:n]
    color = f"C{i}"
    ax.plot(steps, mean, color=color, label=label, marker="o" if metric == EVAL else None,
            markersize=3)
    ax.fill_between(steps, lo, hi, color=color, alpha=0.18, linewidth=0)
    if label == baseline:
      ax.axhline(mean[-1], color=color, linestyle="--", linewidth=0.8)
  ax.set_xlabel("training step")
  ax.set_ylabel(metric)
  return kind


def ablation_figure(grid: dict[str, dict[str, list[list[dict]]]], metric: str, path: str, *,
                    title: str = "", baseline: str = "sync") -> str:
  """Paper Fig. 4 layout: one panel per loss, one curve per mode (sync, α=2, α=8)."""
  names = list(grid)
  cols = min(3, len(names))
  rows = (len(names) + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False,
                           sharey=True)
  kind = "window"
  for ax, name in zip(axes.flat, names):
    kind = plot_bands(ax, grid[name], metric, baseline=baseline)
    ax.set_title(name)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(names):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8)
  fig.suptitle(f"{title} ({_band_text(metric, kind)})", fontsize=10)
  return _save(fig, path)


def curves_figure(labelled: dict[str, list[list[dict]]], metric: str, path: str, *,
                  title: str = "", baseline: str | None = None) -> str:
  fig, ax = plt.subplots(figsize=(6, 4))
  kind = plot_bands(ax, labelled, metric, baseline=baseline)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title(f"{title}\n({_band_text(metric, kind)})", fontsize=9)
  return _save(fig, path)


def bars_figure(labels: list[str], series: dict[str, list[float]], path: str, *, ylabel: str,
                title: str = "", line: dict[str, list[float]] | None = None,
                line_label: str = "") -> str:
  """Grouped bars (e.g. throughput per α), optionally a line on a second axis (e.g. accuracy)."""
  fig, ax = plt.subplots(figsize=(6.5, 4))
  x = np.arange(len(labels))
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
  ax.set_xticks(x, labels)
  ax.set_ylabel(ylabel)
  ax.grid(axis="y", alpha=0.3)
  if line:
    ax2 = ax.twinx()
    for i, (name, values) in enumerate(line.items()):
      ax2.plot(x, values, "o-", color=f"C{len(series) + i}", label=name)
    ax2.set_ylabel(line_label)
    ax2.legend(loc="upper right", fontsize=8)
  ax.legend(loc="upper left", fontsize=8)
  ax.set_title(title, fontsize=10)
  return _save(fig, path)


def _band_text(metric: str, kind: str) -> str:
  if metric == EVAL:
    return "exact held-out evaluation; band ±std across seeds" if kind == "seeds" else \
        "exact held-out evaluation, 1 seed"
  spread = "±std across seeds" if kind == "seeds" else "±std inside the window (1 seed)"
  return f"{WINDOW}-step moving average, band {spread}"


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path
