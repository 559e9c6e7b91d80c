"""The async-vs-sync throughput benchmark's RLVR setting: the demo task and model, with batch shapes
that never spill into a second micro-batch (so no recompilation mid-run) and in-place pausing (an
update never forces a re-prefill of in-flight requests)."""

import dataclasses

from experiments.configs import demo
from flashrl_jax.trainer import BatchConfig

# A longer warm start than the demo's: the model answers long problems at length, so response
# lengths really follow the task's long tail (the demo model stops early on them).
BENCH_MODEL_DIR = ".cache/bench_model"
BENCH_WARMSTART_STEPS = 400


def get_config():
  config = demo.get_config()
  return dataclasses.replace(
      config, model_path=BENCH_MODEL_DIR, workdir="runs/bench_rlvr", batch_size=8, group_size=8, steps=24, eval_every=0,
      train=config.train.replace(batch=BatchConfig(row_length=256, rows=8, sequences_per_row=8,
                                                   max_response_length=64)),
      rollout=dataclasses.replace(config.rollout, pause_mode="in_place", max_running_requests=16))
