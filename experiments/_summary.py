"""What the experiments report about a run: steady-state throughput, quality, staleness, tables.

Kept apart from the launcher (`_runs.py`) because it is pure arithmetic on `metrics.jsonl`
records, and that arithmetic is where an experiment can silently lie: warm-up steps that leak
into steady-state throughput, a threshold read from the noisy training accuracy, seeds averaged
into the wrong cell. `tests/test_experiments.py` checks it on synthetic records.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def moving_average(values, window: int = 11) -> np.ndarray:
  """Trailing moving average, the paper's 11-step smoothing (shorter at the start)."""
  values = np.asarray(values, np.float64)
  return np.array([values[max(0, i - window + 1):i + 1].mean() for i in range(len(values))])


def timed_seconds(records: list[dict], warmup: int) -> float:
  """Wall seconds of the steps `records[warmup:]`, each from the end of the step before it to its
  own end (the loop's `time/clock_s` stamps), so the logging, checkpoints and evaluations between
  steps count: `time/step_s` is a step's own span and leaves them out (with a checkpoint every 5
  steps and TensorBoard written a scalar at a time, ~9% of a 0.09 s async step of the long-tail
  benchmark). Where there is no usable stamp — the run's first step, records written before the
  stamps existed, a resume (its clock starts again) — the step's own span stands in."""
  seconds = 0.0
  for i in range(warmup, len(records)):
    own = records[i]["time/step_s"]
    end = records[i].get("time/clock_s")
    previous_end = records[i - 1].get("time/clock_s") if i > 0 else None
    gap = end - previous_end if end is not None and previous_end is not None else None
    seconds += gap if gap is not None and gap >= own else own
  return seconds


def steady_throughput(records: list[dict], warmup: int) -> float:
  """Samples/s over the steps after `warmup` (start-up, compilation and the pre-filled buffer of
  an async run are excluded): trained samples / wall of those steps (`timed_seconds`)."""
  if warmup >= len(records):
    warmup = 0
  wall = timed_seconds(records, warmup)
  return sum(r["num_samples"] for r in records[warmup:]) / wall if wall > 0 else float("nan")


def warmup_steps(records: list[dict], async_ratio: int) -> int:
  """Step 1 compiles; an async run then eats the α batches generated during compilation."""
  return min(async_ratio + 2, max(len(records) - 3, 0))


EVAL = "eval/expected_accuracy"


def eval_curve(records: list[dict]) -> tuple[list[int], list[float]]:
  """(steps, values) of the exact held-out evaluation; step 0 is the initial policy."""
  steps, values = [], []
  if records and "eval/initial_expected_accuracy" in records[0]:
    steps.append(0)
    values.append(float(records[0]["eval/initial_expected_accuracy"]))
  for r in records:
    if EVAL in r:
      steps.append(int(r["step"]))
      values.append(float(r[EVAL]))
  return steps, values


def summarize(result, *, threshold: float, window: int = 11) -> dict[str, Any]:
  """One table row. Quality: the exact expected accuracy on held-out prompts (`eval/...`, every
  few steps; noise-free) and the 11-step moving average of the training accuracy (noisy, and in
  async mode measured on samples of older policies). `steps_to_threshold`: first evaluation at or
  above `threshold`. Throughput: steady state (see `steady_throughput`) and median-step based."""
  r = result.records
  spec = result.spec.overrides
  alpha = int(spec.get("async_ratio", 0)) if spec.get("mode") != "sync" else 0
  row: dict[str, Any] = {"run": result.spec.name, "ok": result.ok, "steps": len(r)}
  if not r:
    return row
  acc = moving_average([x["accuracy"] for x in r], window)
  cumulative = np.cumsum([x["time/step_s"] for x in r])
  eval_steps, eval_values = eval_curve(r)
  hit = next((s for s, v in zip(eval_steps, eval_values) if s > 0 and v >= threshold), None)
  warm = warmup_steps(r, alpha)
  rest = r[warm:] or r
  row.update({
      "final_accuracy": float(acc[-1]),
      "initial_eval": eval_values[0] if eval_steps and eval_steps[0] == 0 else None,
      "final_eval": eval_values[-1] if eval_values else None,
      "best_eval": max(eval_values) if eval_values else None,
      "steps_to_threshold": hit,
      "time_to_threshold_s": None if hit is None else float(cumulative[hit - 1]),
      "wall_s": float(result.summary.get("wall_s", cumulative[-1])),
      "train_wall_s": float(cumulative[-1]),
      "samples_per_s_e2e": float(result.summary.get("samples_per_s", float("nan"))),
      "samples_per_s_steady": steady_throughput(r, warm),
      # Robust to the other tenants of this machine: a 10 s stall of a neighbour's job lands in
      # one step's wall time and moves the mean, not the median.
      "samples_per_s_median": float(np.median([x["num_samples"] for x in rest]) /
                                    np.median([x["time/step_s"] for x in rest])),
      "warmup_steps": warm,
      "step_s_median": float(np.median([x["time/step_s"] for x in rest])),
      "pause_s_mean": float(np.mean([x.get("time/pause_s", 0.0) for x in rest])),
      "train_s_mean": float(np.mean([x["time/train_s"] for x in rest])),
      "wait_data_s_mean": float(np.mean([x.get("time/wait_data_s", 0.0) for x in rest])),
      "staleness_mean": float(np.mean([x.get("staleness_mean", 0.0) for x in r])),
      "staleness_max": int(max(x.get("staleness_max", 0) for x in r)),
      "dropped_stale": int(result.summary.get("counters", {}).get("dropped_stale", 0)),
      "response_length_mean": float(np.mean([x["response_length_mean"] for x in r])),
      # Response tokens trained per second: samples/s can rise just by training shorter samples.
      "tokens_per_s_median": float(np.median([x["num_samples"] * x["response_length_mean"]
                                              for x in rest]) /
                                   np.median([x["time/step_s"] for x in rest])),
      "loadavg": result.info.get("loadavg_before", [None])[0],
  })
  if row["final_eval"] is not None and row["initial_eval"] is not None:
    row["eval_gain"] = row["final_eval"] - row["initial_eval"]
  return row


def mean_over_seeds(summaries: list[dict]) -> dict[str, Any]:
  """One row from the seeds of a cell: numeric means, `<key>_std` for the quality metrics, and
  for steps/time to threshold the median over the seeds that reached it (None if half did not)."""
  ok = [s for s in summaries if s.get("ok") and "samples_per_s_steady" in s]
  row: dict[str, Any] = {"seeds": len(ok)}
  if not ok:
    return row
  for key, value in ok[0].items():
    if key in ("steps_to_threshold", "time_to_threshold_s"):
      hits = sorted(s[key] for s in ok if s.get(key) is not None)
      row[key] = hits[len(hits) // 2] if 2 * len(hits) > len(ok) else None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      values = [s[key] for s in ok if isinstance(s.get(key), (int, float))]
      row[key] = float(np.mean(values))
      if key in ("final_eval", "final_accuracy", "eval_gain") and len(values) > 1:
        row[f"{key}_std"] = float(np.std(values))
  return row


def cell_of(run_name: str) -> str:
  """A run's cell: its name without the seed suffix (`ppo_a2_s1` -> `ppo_a2`)."""
  return run_name.rsplit("_", 1)[0]


def group_cells(results) -> dict[str, list]:
  """Runs grouped by cell, cells in the order their first run was specified."""
  cells: dict[str, list] = {}
  for result in results:
    cells.setdefault(cell_of(result.spec.name), []).append(result)
  return cells


def cell_rows(results, *, threshold: float) -> list[dict]:
  """One row per cell: what the cell varied (`mode`, `alpha`, `label` such as "sync" / "α=2",
  `loss`), `mean_over_seeds` of its finished runs, and `status` — "ok", or which seeds did not
  finish and why. Unfinished cells are listed (seeds = 0), never silently dropped or averaged."""
  rows = []
  for cell, runs in group_cells(results).items():
    o = runs[0].spec.overrides
    alpha = 0 if o.get("mode") == "sync" else int(o.get("async_ratio", 0))
    row: dict[str, Any] = {
        "cell": cell, "mode": o.get("mode"), "alpha": alpha,
        "label": "sync" if o.get("mode") == "sync" else f"α={alpha}",
        "loss": o.get("train.loss", {}).get("name"),
        **mean_over_seeds([summarize(r, threshold=threshold) for r in runs])}
    failed = [f"{r.spec.name}: {r.status}" for r in runs if not r.ok]
    row["status"] = ("ok" if not failed else
                     f"{len(runs) - len(failed)}/{len(runs)} finished ({'; '.join(failed)})")
    rows.append(row)
  return rows


def add_speedups(rows: list[dict], baseline: str = "sync") -> None:
  """`speedup` (median-step samples/s) and `token_speedup` over the row labelled `baseline`."""
  base = next((r for r in rows if r.get("label") == baseline and r.get("seeds")), None)
  if not base or not base.get("samples_per_s_median"):
    return
  for row in rows:
    if row.get("samples_per_s_median"):
      row["speedup"] = row["samples_per_s_median"] / base["samples_per_s_median"]
      row["token_speedup"] = row["tokens_per_s_median"] / base["tokens_per_s_median"]


def saturation_point(rows: list[dict], key: str, fraction: float) -> int | None:
  """The smallest α whose `key` (a throughput) is within `fraction` of the best async row's."""
  rows = [r for r in rows if r.get("mode") == "async" and r.get("seeds") and
          r.get(key) is not None]
  if not rows:
    return None
  best = max(r[key] for r in rows)
  return min(r["alpha"] for r in rows if r[key] >= fraction * best)


def fmt(value: Any, digits: int = 3) -> str:
  if value is None:
    return "—"
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    return "nan" if math.isnan(value) else f"{value:.{digits}g}"
  return str(value)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
  """`columns`: (key, header) pairs; missing keys print as —."""
  lines = ["| " + " | ".join(h for _, h in columns) + " |",
           "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |")
  return "\n".join(lines)


def write_table(rows: list[dict], columns: list[tuple[str, str]], out_dir: str, name: str,
                extra: dict | None = None) -> str:
  """Writes `name.md` and `name.json` under `out_dir`; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  table = markdown_table(rows, columns)
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump({"rows": rows, **(extra or {})}, f, indent=1, default=str)
  return table
