"""Absl front end of an RL run: `python -m experiments.train [--config=...] [--mode=async] ...`.

The config file is Python with `get_config() -> RunConfig` (default: the CPU demo). A flag given on
the command line overrides the config's field; flags not given leave it alone. Everything is
validated before a process starts: an unknown flag, a bad value or a contradictory combination
(`--mode=sync --async_ratio=2`, `--rollout=sglang` without URLs) exits with a clear message.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import sys

from absl import app, flags
from absl import logging as absl_logging

from flashrl_jax.controller import Mode, RunConfig

_CONFIG = flags.DEFINE_string("config", "experiments/configs/demo.py",
                              "Python file with get_config() -> RunConfig.")
flags.DEFINE_enum("mode", None, ["sync", "async"], "sync baseline or async (ROLL Flash).")
flags.DEFINE_integer("async_ratio", None, "α: max policy versions a sample may lag (async).")
flags.DEFINE_enum("loss", None, ["ppo", "decoupled_ppo", "tis", "cispo", "topr", "grpo"],
                  "Policy loss.")
flags.DEFINE_enum("rollout", None, ["embedded", "sglang", "stub"],
                  "Rollout backend (stub: fake-model protocol servers, for fault drills).")
flags.DEFINE_integer("num_rollout_servers", None, "Local servers (embedded backend).")
flags.DEFINE_list("sglang_urls", None, "SGLang-compatible server URLs (--rollout=sglang).")
flags.DEFINE_enum("pause_mode", None, ["abort", "in_place", "retract"],
                  "How generation is suspended around a weight update.")
flags.DEFINE_integer("steps", None, "Training steps.")
flags.DEFINE_integer("batch_size", None, "Prompt groups per step (B).")
flags.DEFINE_integer("group_size", None, "Responses per prompt (n).")
flags.DEFINE_integer("max_new_tokens", None, "Response length cap.")
flags.DEFINE_integer("max_running_requests", None, "Decode slots per server.")
flags.DEFINE_float("learning_rate", None, "Peak learning rate.")
flags.DEFINE_bool("dynamic_filter", None, "Drop groups whose rewards are all equal.")
flags.DEFINE_integer("rollout_devices", None, "Cores/GPUs for rollout (async split).")
flags.DEFINE_integer("train_devices", None, "Cores/GPUs for the trainer (async split).")
flags.DEFINE_string("mesh", None, "Trainer mesh, e.g. data:1,fsdp:1,tensor:1.")
flags.DEFINE_string("model_path", None, "Initial policy (HF directory).")
flags.DEFINE_string("workdir", None, "Run directory (metrics, checkpoints, versions).")
flags.DEFINE_integer("seed", None, "Seed.")
flags.DEFINE_integer("checkpoint_every", None, "Checkpoint period in steps (0: at the end).")
flags.DEFINE_bool("plot", None, "Write PNG plots at the end.")
flags.DEFINE_integer("eval_every", None, "Steps between exact expected-accuracy evaluations.")
flags.DEFINE_integer("num_env_groups", None, "Agentic: env groups at once (redundant: > B).")
flags.DEFINE_integer("env_group_size", None, "Agentic: candidates per group (> n: redundant).")
flags.DEFINE_integer("turn_max_new_tokens", None, "Agentic: tokens per model turn.")
flags.DEFINE_float("env_fail_slow_prob", None, "Agentic: P(an env step takes 10x its latency).")
flags.DEFINE_float("env_fail_stop_prob", None, "Agentic: P(an env step raises).")
flags.DEFINE_bool("progress", True, "Show a progress bar.")

FLAGS = flags.FLAGS


def load_config_file(path: str) -> RunConfig:
  if not os.path.exists(path):
    raise app.UsageError(f"--config file {path!r} does not exist.")
  spec = importlib.util.spec_from_file_location("_run_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise app.UsageError(f"--config file {path} has no get_config().")
  return module.get_config()


def _given(name: str) -> bool:
  return FLAGS[name].present and FLAGS[name].value is not None


def apply_flags(config: RunConfig) -> RunConfig:
  """The config with every flag given on the command line applied (validated on construction)."""
  top, rollout, resources, train, agentic, failure = {}, {}, {}, {}, {}, {}
  for name in ("mode", "async_ratio", "steps", "batch_size", "group_size", "dynamic_filter",
               "mesh", "model_path", "workdir", "seed", "checkpoint_every", "plot", "eval_every"):
    if _given(name):
      top[name] = FLAGS[name].value
  if _given("mode") and FLAGS.mode == "sync" and not _given("async_ratio"):
    top["async_ratio"] = 0  # the config's α belongs to its async mode
  if _given("rollout"):
    rollout["backend"] = FLAGS.rollout
  for flag, field in (("num_rollout_servers", "num_servers"), ("sglang_urls", "sglang_urls"),
                      ("pause_mode", "pause_mode"), ("max_new_tokens", "max_new_tokens"),
                      ("max_running_requests", "max_running_requests")):
    if _given(flag):
      rollout[field] = tuple(FLAGS[flag].value) if flag == "sglang_urls" else FLAGS[flag].value
  for flag in ("rollout_devices", "train_devices"):
    if _given(flag):
      resources[flag] = FLAGS[flag].value
  if _given("loss"):
    train["loss"] = dataclasses.replace(config.train.loss, name=FLAGS.loss)
  for flag in ("num_env_groups", "env_group_size", "turn_max_new_tokens"):
    if _given(flag):
      agentic[flag] = FLAGS[flag].value
  for flag, field in (("env_fail_slow_prob", "slow_prob"), ("env_fail_stop_prob", "stop_prob")):
    if _given(flag):
      failure[field] = FLAGS[flag].value
  if failure and config.task.env is None:
    raise app.UsageError("--env_fail_* flags need an environment task (e.g. configs/agentic.py).")
  if _given("learning_rate"):
    train["optimizer"] = dataclasses.replace(config.train.optimizer,
                                             learning_rate=FLAGS.learning_rate)
  try:
    if rollout:
      top["rollout"] = dataclasses.replace(config.rollout, **rollout)
    if resources:
      top["resources"] = dataclasses.replace(config.resources, **resources)
    if train:
      top["train"] = dataclasses.replace(config.train, **train)
    if agentic:
      top["agentic"] = dataclasses.replace(config.agentic, **agentic)
    if failure:
      env = config.task.env
      env = dataclasses.replace(env, failure=dataclasses.replace(env.failure, **failure))
      top["task"] = dataclasses.replace(config.task, env=env)
    return dataclasses.replace(config, **top)
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
  from flashrl_jax.controller import run
  from flashrl_jax.controller import ProgressReporter
  with ProgressReporter(config.steps, enabled=FLAGS.progress) as progress:
    summary = run(config, on_step=progress.update)
  print(f"run finished: {summary.samples_trained} samples in {summary.wall_s:.1f}s "
        f"({summary.samples_per_s:.2f} samples/s), policy version {summary.final_policy_version}, "
        f"workdir {summary.workdir}")
  from flashrl_jax.controller import read_metrics
  records = read_metrics(summary.workdir)
  first = [r["eval/initial_expected_accuracy"] for r in records
           if "eval/initial_expected_accuracy" in r]
  last = [r["eval/expected_accuracy"] for r in records if "eval/expected_accuracy" in r]
  if first and last:
    print(f"held-out P(exact answer): {first[0]:.3f} -> {last[-1]:.3f}")
  if config.plot:
    from flashrl_jax.controller import plot_run
    for path in plot_run(summary.workdir):
      print(f"plot: {path}")


if __name__ == "__main__":
  app.run(main)
