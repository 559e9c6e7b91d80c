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

import dataclasses
import enum
import os
import subprocess
import sys
import typing

from absl import app, flags
from absl import logging as absl_logging

from experiments import _children
from experiments._cli import FLAGS as RUN_FLAGS
from experiments._cli import load_config_file
from flashrl_jax.controller import (Mode, OverrideError, ProgressReporter, RunConfig, field_type,
                                    override, parse_assignment, plot_run, read_metrics, run)
from flashrl_jax.trainer import DistributedConfig, initialize_distributed

_CONFIG = flags.DEFINE_string("config", "experiments/configs/demo.py",
                              "Python file with get_config() -> RunConfig (default: the demo).")
_SET = flags.DEFINE_multi_string("set", [], "Any config field: --set=rollout.top_p=0.9 "
                                 "(repeatable; dotted path of the RunConfig field).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes of a multi-process run (default: FLASHRL_NUM_PROCESSES, "
    "else SLURM_NTASKS inside a SLURM step, else 1).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes) "
                                   "(default: FLASHRL_PROCESS_ID or SLURM_PROCID).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of the jax.distributed coordinator (process 0), or 'auto' "
    "where JAX finds it itself (TPU slices). Default: FLASHRL_COORDINATOR or SLURM's first node.")
_PREPARE_ONLY = flags.DEFINE_bool("prepare_only", False, "Make sure the initial model exists "
                                  "(training a project warm start if needed), then exit.")


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
  """Trains and caches a project warm-start model (demo or benchmark) when the config points at one;
  each is warm-started on its own task's training stream."""
  from experiments.warmstart import ensure_project_model
  if not ensure_project_model(config.model_path) and not os.path.exists(
      os.path.join(config.model_path, "config.json")):
    raise app.UsageError(f"--model_path {config.model_path} is not an HF directory.")


def _servers(config: RunConfig) -> str:
  return str(config.rollout.server_count or "per-core")


def describe(config: RunConfig) -> str:
  """What the run will do, printed before anything slow starts."""
  task = config.task
  if task.reasoning_gym is not None:
    rg = task.reasoning_gym
    mix = ", ".join(f"{d.name} (weight {d.weight:g}, {dict(d.params) or 'default difficulty'})"
                    for d in rg.datasets)
    what = (f"reasoning-gym {mix}; reward: reasoning-gym's scorer on the "
            f"{rg.answer_format.value} answer")
  elif task.dataset is not None:
    what = f"dataset file {task.dataset.path} ({task.dataset.layout.value}); reward: math-verify"
  elif task.synthetic is not None:
    what = f"synthetic {task.synthetic.task.value} task (long-tail lengths); reward: exact match"
  elif task.code is not None:
    families = ", ".join(f.value for f in task.code.families)
    what = (f"code: write-a-function tasks ({families}) with hidden tests; reward: the function "
            "run in the sandbox, judged outside it")
  else:
    what = f"multi-turn {task.env.kind.value} environment"
  alpha = f", α = {config.async_ratio}" if config.mode is Mode.ASYNC else ""
  return (f"task: {what}\n"
          f"run: {config.mode.value}{alpha}, {config.steps} steps x {config.batch_size} prompts x "
          f"{config.group_size} responses, loss {config.train.loss.name.value}, "
          f"{_servers(config)} rollout servers, workdir {config.workdir}")


def report(records: list[dict]) -> None:
  """Before/after held-out accuracy (overall and per dataset) and the sampled training accuracy."""
  first = next((r for r in records if "eval/initial_expected_accuracy" in r), None)
  last = next((r for r in reversed(records) if "eval/expected_accuracy" in r), None)
  if first and last:
    print(f"held-out P(exact answer): {first['eval/initial_expected_accuracy']:.3f} -> "
          f"{last['eval/expected_accuracy']:.3f}")
    for key in sorted(k for k in last if k.startswith("eval/expected_accuracy/")):
      name = key.rsplit("/", 1)[1]
      before = first.get(f"eval/initial_expected_accuracy/{name}")
      if before is not None:
        print(f"  {name}: {before:.3f} -> {last[key]:.3f}")
  window = max(1, min(10, len(records) // 4))
  if records and "accuracy" in records[0]:
    start = sum(r["accuracy"] for r in records[:window]) / window
    end = sum(r["accuracy"] for r in records[-window:]) / window
    print(f"accuracy of sampled responses ({window}-step average): {start:.3f} -> {end:.3f}")


def distributed_config() -> DistributedConfig:
  """This process's place in the run: flags, else FLASHRL_* variables, else SLURM's, else alone."""
  given = {k: v for k, v in dict(num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
                                 coordinator=_COORDINATOR.value).items() if v is not None}
  try:
    return dataclasses.replace(DistributedConfig.from_env(), **given)
  except ValueError as error:
    raise app.UsageError(str(error)) from None


def prepare_in_subprocess() -> None:
  """Process 0 of a multi-process run: a warm start trains with JAX, which must not start in this
  process before `jax.distributed` does, so it runs (once) in a single-process child."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "SLURM_"))}
  command = [sys.executable, "-m", "experiments.train", *sys.argv[1:], "--prepare_only",
             "--num_processes=1", "--process_id=0", "--coordinator="]
  if subprocess.run(command, env=env).returncode:
    raise app.UsageError("preparing the initial model failed (see above).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = apply_flags(load_config_file(_CONFIG.value))
  distributed = distributed_config()
  leader = distributed.process_id == 0
  if leader and not _PREPARE_ONLY.value:
    print(describe(config), flush=True)
  if not FLAGS["verbosity"].present:  # a progress bar, warnings and errors; --verbosity=0 for INFO
    absl_logging.set_verbosity(absl_logging.WARNING)
  if _PREPARE_ONLY.value or not distributed.is_multiprocess:
    ensure_model(config)
    if _PREPARE_ONLY.value:
      return
  elif leader:  # the others read it once process 0 reaches jax.distributed
    prepare_in_subprocess()
  distributed = initialize_distributed(distributed)
  # The trainer's programs go to the persistent compilation cache the rollout servers use, so a
  # second run of the same shapes loads them instead of compiling (minutes on a busy 2-core machine).
  from flashrl_jax.rollout import DEFAULT_CACHE_DIR, enable_compilation_cache
  enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_CACHE_DIR)
  # SIGTERM unwinds like Ctrl-C, so `run` stops its server processes instead of orphaning them
  # (set after jax.distributed, whose preemption notifier would otherwise swallow it).
  _children.unwind_on_sigterm()
  if leader:
    print(f"starting {_servers(config)} rollout servers and the trainer (the first step "
          "includes JAX compilation)", flush=True)
  with ProgressReporter(config.steps, enabled=_PROGRESS.value and leader) as progress:
    summary = run(config, on_step=progress.update, distributed=distributed)
  if summary is None:  # a trainer-only process of a multi-process run
    return
  print(f"run finished: {summary.samples_trained} samples in {summary.wall_s:.1f}s "
        f"({summary.samples_per_s:.2f} samples/s), policy version {summary.final_policy_version}, "
        f"workdir {summary.workdir}")
  c = summary.counters  # every prompt not trained is accounted for here (and in summary.json)
  print(f"prompts rejected by a server as invalid (dropped): {c['rejected_prompts']}; groups "
        f"re-issued after a failed generation: {c['failed_groups']}, after the staleness bound "
        f"dropped them: {c['dropped_stale']}; filtered (equal rewards): {c['filtered_groups']}; "
        f"versions refused by servers: {c['versions_refused']}; server failures / restarts: "
        f"{c['server_failures']} / {c['server_restarts']}")
  report(read_metrics(summary.workdir))
  if config.plot:
    for path in plot_run(summary.workdir):
      print(f"plot: {path}")


if __name__ == "__main__":
  app.run(main)
