"""Short command-line names of `RunConfig` fields (JAX-free: experiment launchers print commands).

`experiments.train` defines one flag per entry, typed from the field's annotation, and turns the
given ones into dotted-path overrides (`controller.override`); `RunSpec.command()` uses the same
table to print a sweep's runs as `experiments.train` commands. Any field without a short name is
set with `--set=path.to.field=value`.
"""

from __future__ import annotations

import importlib.util
import os

from absl import app

# flag name -> (dotted field path, help).
FLAGS: dict[str, tuple[str, str]] = {
    "mode": ("mode", "sync baseline or async (ROLL Flash)."),
    "async_ratio": ("async_ratio", "α: max policy versions a sample may lag (async)."),
    "loss": ("train.loss.name", "Policy loss."),
    "rollout": ("rollout.backend", "Rollout backend (stub: fake-model protocol servers)."),
    "num_rollout_servers": ("rollout.num_servers", "Local servers (embedded/stub backend)."),
    "sglang_urls": ("rollout.sglang_urls", "SGLang-compatible server URLs (--rollout=sglang)."),
    "router_url": ("rollout.router_url", "An sglang-router in front of --sglang_urls: generation "
                   "goes through it, the weight handoff to the workers."),
    "pause_mode": ("rollout.pause_mode", "How generation is suspended around a weight update."),
    "max_new_tokens": ("rollout.max_new_tokens", "Response length cap."),
    "max_running_requests": ("rollout.max_running_requests", "Decode slots per server."),
    "steps": ("steps", "Training steps."),
    "batch_size": ("batch_size", "Prompt groups per step (B)."),
    "group_size": ("group_size", "Responses per prompt (n)."),
    "learning_rate": ("train.optimizer.learning_rate", "Peak learning rate."),
    "dynamic_filter": ("dynamic_filter", "Drop groups whose rewards are all equal."),
    "rollout_devices": ("resources.rollout_devices", "Cores/GPUs for rollout (async split)."),
    "train_devices": ("resources.train_devices", "Cores/GPUs for the trainer (async split)."),
    "mesh": ("mesh", "Trainer mesh, e.g. data:1,fsdp:1,tensor:1."),
    "model_path": ("model_path", "Initial policy (HF directory)."),
    "workdir": ("workdir", "Run directory (metrics, checkpoints, versions)."),
    "seed": ("seed", "Seed."),
    "checkpoint_every": ("checkpoint_every", "Checkpoint period in steps (0: only at the end)."),
    "plot": ("plot", "Write PNG plots at the end."),
    "eval_every": ("eval_every", "Steps between exact expected-accuracy evaluations."),
    "num_env_groups": ("agentic.num_env_groups", "Agentic: env groups at once (redundant: > B)."),
    "env_group_size": ("agentic.env_group_size", "Agentic: candidates per group (> n: redundant)."),
    "turn_max_new_tokens": ("agentic.turn_max_new_tokens", "Agentic: tokens per model turn."),
    "env_fail_slow_prob": ("task.env.failure.slow_prob",
                           "Agentic: P(an env step takes 10x its latency)."),
    "env_fail_stop_prob": ("task.env.failure.stop_prob", "Agentic: P(an env step raises)."),
}




def flag_of(path: str) -> str | None:
  """The short flag name of a field path, if it has one."""
  return next((flag for flag, (p, _) in FLAGS.items() if p == path), None)


def load_config_file(path: str):
  """`get_config()` of a Python config file (a `RunConfig`)."""
  if not os.path.exists(path):
    raise app.UsageError(f"--config file {path!r} does not exist.")
  spec = importlib.util.spec_from_file_location("_run_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise app.UsageError(f"--config file {path} has no get_config().")
  return module.get_config()
