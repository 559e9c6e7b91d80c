"""Async-ratio sweep (ROLL Flash §5, Table 1, "α = 2 is enough"): α → throughput and final quality.

Runs the repeat task (`experiments/configs/repeat.py`) with the sync baseline and async α ∈ {0, 1, 2, 4, 8} at the same budget, and
reports steady-state samples/s (after start-up and the batches pre-generated during compilation),
the speedup over sync, final accuracy, staleness and dropped-stale samples, and where throughput
saturates (the smallest α within 5% of the best). (The simulator is checked against real runs it
never saw by `experiments.benchmarks.sim_vs_measured`.)

Small scale (1 seed, 40 steps, 6 runs: about 6 min on 2 shared cores):
  python -m experiments.sweep_async_ratio --out=runs/sweep_async_ratio
Full scale:
  python -m experiments.sweep_async_ratio --seeds=0,1,2 --steps=200
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags

from experiments import _children, _runs, _summary, plots

_OUT = flags.DEFINE_string("out", "runs/sweep_async_ratio", "Directory of the sweep.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/repeat.py", "Base RunConfig file.")
_RATIOS = flags.DEFINE_list("ratios", ["0", "1", "2", "4", "8"], "Async ratios α.")
_SYNC = flags.DEFINE_bool("sync", True, "Also run the sync baseline.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_STEPS = flags.DEFINE_integer("steps", 40, "Training steps per run.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.6, "Held-out expected accuracy for 'steps to'.")
_SATURATION = flags.DEFINE_float("saturation", 0.95, "Fraction of the best throughput.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Per-run time limit.")
_RERUN = flags.DEFINE_bool("rerun", False, "Re-run finished runs.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the runs and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figures here.")


def make_specs(ratios, sync, seeds, steps, config) -> list[_runs.RunSpec]:
  modes = (["sync"] if sync else []) + [str(int(a)) for a in ratios]
  specs = []
  for seed in seeds:  # seed-major: drift in the machine's load hits every α alike
    for mode in modes:
      o = {"steps": steps, "seed": int(seed), "task.seed": int(seed) + 1}
      o.update({"mode": "sync"} if mode == "sync" else {"mode": "async", "async_ratio": int(mode)})
      specs.append(_runs.RunSpec(f"{'sync' if mode == 'sync' else 'a' + mode}_s{seed}", o, config))
  return specs


COLUMNS = [("mode", "mode"), ("alpha", "α"), ("seeds", "seeds"),
           ("samples_per_s_steady", "samples/s (steady mean)"),
           ("samples_per_s_median", "samples/s (median step)"), ("speedup", "speedup vs sync"),
           ("tokens_per_s_median", "tokens/s (median)"), ("token_speedup", "token speedup"),
           ("pause_s_mean", "pause s/step"), ("train_s_mean", "train s/step"),
           ("wait_data_s_mean", "wait s/step"), ("final_eval", "eval acc. final"),
           ("final_eval_std", "± seeds"), ("eval_gain", "eval gain"),
           ("final_accuracy", "train acc. (11-MA)"), ("staleness_mean", "mean staleness"),
           ("dropped_stale", "dropped stale"), ("response_length_mean", "mean length"),
           ("loadavg", "load avg (1 min, at start)"), ("status", "status")]


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  specs = make_specs(_RATIOS.value, _SYNC.value, _SEEDS.value, _STEPS.value, _CONFIG.value)
  results = _runs.run_or_print(specs, _OUT.value, dry_run=_DRY_RUN.value, timeout_s=_TIMEOUT.value,
                               rerun=_RERUN.value)
  if results is None:
    return
  rows = _summary.cell_rows(results, threshold=_THRESHOLD.value)
  _summary.add_speedups(rows)
  saturates = {key: _summary.saturation_point(rows, key, _SATURATION.value)
               for key in ("samples_per_s_median", "samples_per_s_steady")}
  table = _summary.write_table(rows, COLUMNS, _OUT.value, "summary",
                               {"saturation_alpha": saturates,
                                "commands": {s.name: s.command() for s in specs}})
  done = [r for r in rows if r["seeds"]]
  bars = plots.bars_figure(
      [r["label"] for r in done], {"steady mean": [r["samples_per_s_steady"] for r in done],
                                   "median step": [r["samples_per_s_median"] for r in done]},
      os.path.join(_OUT.value, "throughput.png"), ylabel="samples / s",
      title="throughput and final accuracy vs async ratio",
      line={"final held-out accuracy": [r.get("final_eval") for r in done]},
      line_label="expected accuracy")
  cells = _summary.group_cells(results)
  curves = plots.curves_figure(
      {r["label"]: [run.records for run in cells[r["cell"]] if run.ok] for r in done},
      _summary.EVAL, os.path.join(_OUT.value, "accuracy.png"),
      title="held-out expected accuracy vs step", baseline="sync")
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    shutil.copy(bars, os.path.join(_DOCS.value, "sweep_async_ratio_throughput.png"))
    shutil.copy(curves, os.path.join(_DOCS.value, "sweep_async_ratio_accuracy.png"))
  print(table)
  print(f"throughput within {_SATURATION.value:.0%} of the best from α = {saturates}")


if __name__ == "__main__":
  app.run(main)
