"""Absl front end of an RL run: `python -m experiments.train [--config=...] [--mode=async] ...`.

The config file is Python with `get_config() -> RunConfig` (default: the CPU demo). Flags change its
fields through the one override mechanism (`flashrl_jax.controller.override`, dotted field paths,
locked): the short flags are the names in `experiments/_cli.py` (`--steps=4` is `steps`,
`--loss=ppo` is `train.loss.name`), and `--set=path.to.field=value` (repeatable) reaches any other
field. Flags not given leave the config alone. Everything is validated before a process starts: an
unknown flag or field, a bad value or a contradictory combination (`--mode=sync --async_ratio=2`,
`--rollout=sglang` without URLs) exits with a clear message.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import typing

from absl import app, flags
from absl import logging as absl_logging

from experiments._cli import FLAGS as RUN_FLAGS
from experiments._cli import load_config_file
from flashrl_jax.controller import (OverrideError, ProgressReporter, RunConfig, field_type,
                                    override, parse_assignment, plot_run, read_metrics, run)

_CONFIG = flags.DEFINE_string("config", "experiments/configs/demo.py",
                              "Python file with get_config() -> RunConfig.")
_SET = flags.DEFINE_multi_string("set", [], "Any config field: --set=rollout.top_p=0.9 "
                                 "(repeatable; dotted path of the RunConfig field).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def _define(name: str, path: str, help_text: str) -> None:
  tp = field_type(path)
  if tp is bool:
    flags.DEFINE_bool(name, None, help_text)
  elif tp is int:
    flags.DEFINE_integer(name, None, help_text)
  elif tp is float:
    flags.DEFINE_float(name, None, help_text)
  elif isinstance(tp, type) and issubclass(tp, enum.Enum):
    flags.DEFINE_enum(name, None, [m.value for m in tp], help_text)
  elif typing.get_origin(tp) is tuple:
    flags.DEFINE_list(name, None, help_text)
  else:
    flags.DEFINE_string(name, None, help_text)


for _name, (_path, _help) in RUN_FLAGS.items():
  _define(_name, _path, f"{_help} [{_path}]")

FLAGS = flags.FLAGS


def flag_overrides() -> dict[str, object]:
  """Dotted field path -> value of every flag given on the command line (short flags and --set)."""
  out: dict[str, object] = {}
  for name, (path, _) in RUN_FLAGS.items():
    if FLAGS[name].present and FLAGS[name].value is not None:
      out[path] = FLAGS[name].value
  for text in _SET.value:
    path, value = parse_assignment(text)
    if path in out:
      raise OverrideError(f"{path} is given twice on the command line.")
    out[path] = value
  return out


def apply_flags(config: RunConfig) -> RunConfig:
  """The config with every flag given on the command line applied (validated on construction)."""
  try:
    return override(config, flag_overrides())
  except ValueError as error:
    raise app.UsageError(str(error)) from None


def ensure_model(config: RunConfig) -> None:
  """Trains and caches a project warm-start model (demo or benchmark) when the config points at it."""
  from experiments.configs.bench_rlvr import BENCH_MODEL_DIR, BENCH_WARMSTART_STEPS, bench_task
  from experiments.configs.demo import DEMO_MODEL_DIR
  from experiments.warmstart import ensure_warmstart
  if os.path.normpath(config.model_path) == os.path.normpath(DEMO_MODEL_DIR):
    ensure_warmstart(DEMO_MODEL_DIR)
  elif os.path.normpath(config.model_path) == os.path.normpath(BENCH_MODEL_DIR):
    ensure_warmstart(BENCH_MODEL_DIR, steps=BENCH_WARMSTART_STEPS, task=bench_task())
  elif not os.path.exists(os.path.join(config.model_path, "config.json")):
    raise app.UsageError(f"--model_path {config.model_path} is not an HF directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = apply_flags(load_config_file(_CONFIG.value))
  # SIGTERM unwinds like Ctrl-C, so `run` stops its server processes instead of orphaning them.
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  if not FLAGS["verbosity"].present:  # a progress bar, warnings and errors; --verbosity=0 for INFO
    absl_logging.set_verbosity(absl_logging.WARNING)
  ensure_model(config)
  with ProgressReporter(config.steps, enabled=_PROGRESS.value) as progress:
    summary = run(config, on_step=progress.update)
  print(f"run finished: {summary.samples_trained} samples in {summary.wall_s:.1f}s "
        f"({summary.samples_per_s:.2f} samples/s), policy version {summary.final_policy_version}, "
        f"workdir {summary.workdir}")
  records = read_metrics(summary.workdir)
  first = [r["eval/initial_expected_accuracy"] for r in records
           if "eval/initial_expected_accuracy" in r]
  last = [r["eval/expected_accuracy"] for r in records if "eval/expected_accuracy" in r]
  if first and last:
    print(f"held-out P(exact answer): {first[0]:.3f} -> {last[-1]:.3f}")
  if config.plot:
    for path in plot_run(summary.workdir):
      print(f"plot: {path}")


if __name__ == "__main__":
  app.run(main)
