"""Off-policy loss ablation (ROLL Flash Fig. 4): each loss × {sync, α=2, α=8}, same seeds, budgets.

The paper's claim: with PPO, decoupled PPO, TIS, CISPO, TOPR and GRPO, async training at α = 2
and α = 8 reaches the quality of synchronous training. This script runs that grid on the CPU
repeat task (`experiments/configs/repeat.py`: a tiny warm-started Qwen3-layout policy on the long-tail "repeat" task, exact-match reward),
one subprocess per run, and writes per-run directories (metrics.jsonl, TensorBoard, PNGs), the
figures `train_accuracy.png` (one panel per loss, 11-step moving average, shaded band) and
`eval_accuracy.png` (the exact expected accuracy on 256 held-out prompts, every 5 steps), and the
summary table `summary.{md,json}` (final accuracy, steps and seconds to a threshold, wall-clock).

Small scale (1 seed, 40 steps, 18 runs: about 20 min on 2 shared cores):
  python -m experiments.ablate_losses --out=runs/ablate_losses
Full scale (3 seeds, 200 steps; about 5 h here, minutes on a real machine):
  python -m experiments.ablate_losses --seeds=0,1,2 --steps=200 --out=runs/ablate_losses_full

Every loss uses its usual hyper-parameters (`LOSS_PRESETS`), not the repeat config's CISPO clip, so
each loss is the one its paper describes; everything else comes from `--config`.
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags

from experiments import _children, _runs, _summary, plots

LOSS_PRESETS = {
    "ppo": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2},
    "decoupled_ppo": {"name": "decoupled_ppo", "clip_low": 0.2, "clip_high": 0.2},
    "tis": {"name": "tis"},                                          # min(r, C), C = 2
    "cispo": {"name": "cispo", "clip_low": 1.0, "clip_high": 0.28},  # MiniMax-M1: no lower clip
    "topr": {"name": "topr"},                                        # T−: clip(r, 0, 1)
    "grpo": {"name": "grpo", "kl_coef": 0.04},                       # DeepSeekMath's β, k3
}

_OUT = flags.DEFINE_string("out", "runs/ablate_losses", "Directory of the sweep.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/repeat.py", "Base RunConfig file.")
_LOSSES = flags.DEFINE_list("losses", list(LOSS_PRESETS), "Losses to compare.")
_MODES = flags.DEFINE_list("modes", ["sync", "2", "8"], "'sync' and/or async ratios α.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds (trainer and task), the same for every cell.")
_STEPS = flags.DEFINE_integer("steps", 40, "Training steps per run (same budget everywhere).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.6,
                                 "Held-out expected accuracy for 'steps/seconds to threshold'.")
_LR = flags.DEFINE_float("learning_rate", None, "Override the config's learning rate.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Per-run time limit.")
_RERUN = flags.DEFINE_bool("rerun", False, "Re-run cells that already finished.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the runs and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figure here (e.g. docs/results).")


def mode_label(mode: str) -> str:
  return "sync" if mode == "sync" else f"α={int(mode)}"


def mode_tag(mode: str) -> str:
  return "sync" if mode == "sync" else f"a{int(mode)}"


def make_specs(losses, modes, seeds, steps, config, learning_rate=None) -> list[_runs.RunSpec]:
  unknown = [loss for loss in losses if loss not in LOSS_PRESETS]
  if unknown:
    raise app.UsageError(f"unknown loss {unknown[0]!r}; choose from {', '.join(LOSS_PRESETS)}")
  specs = []
  for seed in seeds:  # seed-major: drift in the machine's load hits every cell alike
    for loss in losses:
      for mode in modes:
        o = {"steps": steps, "seed": int(seed), "task.seed": int(seed) + 1,
             "train.loss": dict(LOSS_PRESETS[loss])}  # a whole LossConfig: its own defaults
        o.update({"mode": "sync"} if mode == "sync" else {"mode": "async", "async_ratio": int(mode)})
        if learning_rate is not None:
          o["train.optimizer.learning_rate"] = learning_rate
        specs.append(_runs.RunSpec(f"{loss}_{mode_tag(mode)}_s{seed}", o, config))
  return specs


COLUMNS = [("loss", "loss"), ("label", "mode"), ("seeds", "seeds"),
           ("initial_eval", "eval acc. step 0"), ("final_eval", "eval acc. final"),
           ("final_eval_std", "± seeds"), ("eval_gain", "gain"),
           ("final_accuracy", "train acc. (11-MA, last)"),
           ("steps_to_threshold", "steps to thr."), ("time_to_threshold_s", "s to thr."),
           ("train_wall_s", "Σ step time (s)"), ("wall_s", "wall (s)"),
           ("samples_per_s_median", "samples/s (median)"), ("staleness_mean", "mean staleness"),
           ("dropped_stale", "dropped stale"), ("status", "status")]


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  specs = make_specs(_LOSSES.value, _MODES.value, _SEEDS.value, _STEPS.value, _CONFIG.value,
                     _LR.value)
  results = _runs.run_or_print(specs, _OUT.value, dry_run=_DRY_RUN.value, timeout_s=_TIMEOUT.value,
                               rerun=_RERUN.value)
  if results is None:
    return
  rows = _summary.cell_rows(results, threshold=_THRESHOLD.value)
  table = _summary.write_table(rows, COLUMNS, _OUT.value, "summary",
                               {"threshold": _THRESHOLD.value, "steps": _STEPS.value,
                                "commands": {s.name: s.command() for s in specs}})
  cells = _summary.group_cells(results)
  grid = {loss: {mode_label(mode): [r.records for r in cells.get(f"{loss}_{mode_tag(mode)}", [])
                                    if r.ok]  # a stopped run's records would cut every curve
                 for mode in _MODES.value} for loss in _LOSSES.value}
  figures = [
      plots.ablation_figure(grid, "accuracy", os.path.join(_OUT.value, "train_accuracy.png"),
                            title="training accuracy vs step"),
      plots.ablation_figure(grid, _summary.EVAL, os.path.join(_OUT.value, "eval_accuracy.png"),
                            title="held-out expected accuracy vs step")]
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    for figure in figures:
      shutil.copy(figure, os.path.join(_DOCS.value, "ablate_losses_" + os.path.basename(figure)))
  print(table)
  print("figures: " + ", ".join(figures))


if __name__ == "__main__":
  app.run(main)
