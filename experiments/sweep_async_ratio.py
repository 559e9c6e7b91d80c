"""Async-ratio sweep (ROLL Flash §5, Table 1, "α = 2 is enough"): α → throughput and final quality.

Runs the demo task with the sync baseline and async α ∈ {0, 1, 2, 4, 8} at the same budget, and
reports steady-state samples/s (after start-up and the batches pre-generated during compilation),
the speedup over sync, final accuracy, staleness and dropped-stale samples, and where throughput
saturates (the smallest α within 5% of the best). With `--validate_sim` each run is also replayed
in `flashrl_jax.sim` (calibrated on this machine) and the prediction error is reported.

Small scale (1 seed, 40 steps, 6 runs: about 6 min on 2 shared cores):
  python -m experiments.sweep_async_ratio --out=runs/sweep_async_ratio
Full scale:
  python -m experiments.sweep_async_ratio --seeds=0,1,2 --steps=200
"""

from __future__ import annotations

import collections
import json
import os
import shutil

import numpy as np
from absl import app, flags

from experiments import _runs, _simcheck, _summary, plots

_OUT = flags.DEFINE_string("out", "runs/sweep_async_ratio", "Directory of the sweep.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/demo.py", "Base RunConfig file.")
_RATIOS = flags.DEFINE_list("ratios", ["0", "1", "2", "4", "8"], "Async ratios α.")
_SYNC = flags.DEFINE_bool("sync", True, "Also run the sync baseline.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_STEPS = flags.DEFINE_integer("steps", 40, "Training steps per run.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.6, "Held-out expected accuracy for 'steps to'.")
_SATURATION = flags.DEFINE_float("saturation", 0.95, "Fraction of the best throughput.")
_VALIDATE = flags.DEFINE_bool("validate_sim", True, "Replay every run in the simulator.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Per-run time limit.")
_RERUN = flags.DEFINE_bool("rerun", False, "Re-run finished runs.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the runs and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figures here.")


def make_specs(ratios, sync, seeds, steps, config) -> list[_runs.RunSpec]:
  modes = (["sync"] if sync else []) + [str(int(a)) for a in ratios]
  specs = []
  for seed in seeds:  # seed-major: drift in the machine's load hits every α alike
    for mode in modes:
      o = {"steps": steps, "seed": int(seed), "task": {"seed": int(seed) + 1}}
      o.update({"mode": "sync"} if mode == "sync" else {"mode": "async", "async_ratio": int(mode)})
      specs.append(_runs.RunSpec(f"{'sync' if mode == 'sync' else 'a' + mode}_s{seed}", o, config))
  return specs


def saturation_point(rows: list[dict], key: str, fraction: float):
  """The smallest α whose throughput is within `fraction` of the best async throughput."""
  rows = [r for r in rows if r["mode"] != "sync" and r.get(key) is not None]
  if not rows:
    return None
  best = max(r[key] for r in rows)
  return min(r["alpha"] for r in rows if r[key] >= fraction * best)


COLUMNS = [("mode", "mode"), ("alpha", "α"), ("seeds", "seeds"),
           ("samples_per_s_steady", "samples/s (steady mean)"),
           ("samples_per_s_median", "samples/s (median step)"), ("speedup", "speedup vs sync"),
           ("tokens_per_s_median", "tokens/s (median)"), ("token_speedup", "token speedup"),
           ("pause_s_mean", "pause s/step"), ("final_eval", "eval acc. final"),
           ("eval_gain", "eval gain"), ("final_accuracy", "train acc. (11-MA)"),
           ("staleness_mean", "mean staleness"), ("dropped_stale", "dropped stale"),
           ("response_length_mean", "mean length"), ("sim_measured", "samples/s (sim's measure)"),
           ("sim_predicted", "sim: standalone decode"), ("sim_error", "error"),
           ("simfit_predicted", "sim: decode fitted on sync"), ("simfit_error", "error "),
           ("status", "status")]


def validate(results) -> tuple[dict, dict, float | None]:
  """Each run replayed in the simulator twice: with the standalone decode measurement, and with
  decode rescaled so that the sync run's generation time is reproduced (fitted on sync, then a
  prediction for every async run)."""
  done = [r for r in results if r.ok]
  if not done:
    return {}, {}, None
  with open(os.path.join(done[0].workdir, "config.json")) as f:
    config = json.load(f)
  decode = _simcheck.measure_decode(os.path.join(_OUT.value, "decode.json"),
                                    slots=config["rollout"]["max_running_requests"],
                                    context_length=config["train"]["batch"]["row_length"])

  def warm(r):
    return _summary.warmup_steps(r.records, r.spec.overrides.get("async_ratio", 0))

  raw = {r.spec.name: _simcheck.compare(r.workdir, decode, warm(r)) for r in done}
  sync = next((r for r in done if r.spec.overrides.get("mode") == "sync"), None)
  scale = _simcheck.fitted_scale(raw[sync.spec.name]) if sync else None
  if not scale:
    return raw, {}, None
  for _ in range(2):  # generation time is not exactly linear in the decode step: refine
    report = _simcheck.compare(sync.workdir, decode, warm(sync), scale=scale, tag="_fitted")
    scale *= _simcheck.fitted_scale(report) or 1.0
  fitted = {r.spec.name: _simcheck.compare(r.workdir, decode, warm(r), scale=scale,
                                           tag="_fitted") for r in done}
  return raw, fitted, scale


def aggregate(results, threshold: float, sims: dict[str, dict],
              fitted: dict[str, dict]) -> list[dict]:
  cells = collections.defaultdict(list)
  for result in results:
    cells[result.spec.name.rsplit("_", 1)[0]].append(result)
  rows = []
  for tag, runs in cells.items():
    row = {"mode": "sync" if tag == "sync" else "async",
           "alpha": 0 if tag == "sync" else int(tag[1:]),
           **_summary.mean_over_seeds([_summary.summarize(r, threshold=threshold) for r in runs])}
    if not row["seeds"]:
      continue
    for prefix, source in (("sim", sims), ("simfit", fitted)):
      checks = [source[r.spec.name] for r in runs if "error" in source.get(r.spec.name, {})]
      if checks:
        row[f"{prefix}_predicted"] = float(np.mean([c["predicted"] for c in checks]))
        row[f"{prefix}_measured"] = float(np.mean([c["measured"] for c in checks]))
        row[f"{prefix}_error"] = float(np.mean([c["error"] for c in checks]))
    rows.append(row)
  sync = next((r for r in rows if r["mode"] == "sync"), None)
  for row in rows:
    if sync and sync.get("samples_per_s_median") and row.get("samples_per_s_median"):
      row["speedup"] = row["samples_per_s_median"] / sync["samples_per_s_median"]
      row["token_speedup"] = row["tokens_per_s_median"] / sync["tokens_per_s_median"]
  return rows


def main(argv):
  del argv
  specs = make_specs(_RATIOS.value, _SYNC.value, _SEEDS.value, _STEPS.value, _CONFIG.value)
  if _DRY_RUN.value:
    for spec in specs:
      print(f"{spec.name}: {spec.command()}")
    return
  results = _runs.run_all(specs, _OUT.value, timeout_s=_TIMEOUT.value, rerun=_RERUN.value)
  sims, fitted, scale = validate(results) if _VALIDATE.value else ({}, {}, None)
  rows = aggregate(results, _THRESHOLD.value, sims, fitted)
  done = [r for r in rows if r["seeds"]]
  saturates = {key: saturation_point(done, key, _SATURATION.value)
               for key in ("samples_per_s_median", "samples_per_s_steady")}
  table = _summary.write_table(rows, COLUMNS, _OUT.value, "summary",
                            {"saturation_alpha": saturates, "sims": sims, "sims_fitted": fitted,
                             "decode_scale_fitted_on_sync": scale,
                             "commands": {s.name: s.command() for s in specs}})
  labels = [("sync" if r["mode"] == "sync" else f"α={r['alpha']}") for r in done]
  bars = plots.bars_figure(
      labels, {"steady mean": [r["samples_per_s_steady"] for r in done],
               "median step": [r["samples_per_s_median"] for r in done]},
      os.path.join(_OUT.value, "throughput.png"), ylabel="samples / s",
      title="throughput and final accuracy vs async ratio",
      line={"final held-out accuracy": [r.get("final_eval") for r in done]},
      line_label="expected accuracy")
  curves = plots.curves_figure(
      {label: [r.records for r in results if r.spec.name.rsplit("_", 1)[0] ==
               ("sync" if label == "sync" else "a" + label[2:])] for label in labels},
      _summary.EVAL, os.path.join(_OUT.value, "accuracy.png"),
      title="held-out expected accuracy vs step", baseline="sync")
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    shutil.copy(bars, os.path.join(_DOCS.value, "sweep_async_ratio_throughput.png"))
    shutil.copy(curves, os.path.join(_DOCS.value, "sweep_async_ratio_accuracy.png"))
  print(table)
  print(f"throughput within {_SATURATION.value:.0%} of the best from α = {saturates}")
  print(f"decode step scale fitted on the sync run: {scale}")


if __name__ == "__main__":
  app.run(main)
