"""The async-vs-sync throughput benchmark's RLVR setting: a long-tail "repeat" task.

The paper's regime is a rollout-bound step whose length is set by the longest response: most
answers are short, a few are 10-20x longer, and a synchronous step waits for the longest one while
its decode batch drains. Here the required answer length is lognormal (median 8 digits, log-std
1.1, clipped at 192: mean ~14, a step's longest ~100), and the policy is warm-started on that
distribution long enough that its response lengths follow it. A step's tokens usually fit one
micro-batch, but not always: in a 96-step run (the simulator's validation) a policy whose answers
had grown needed two at step 94, and with the count compiled there and then that step took 7.6 s
(0.15 s before it); so every count is compiled before step 1 (`precompile`), as in
`bench_rlvr_longtail.py`. Pausing is in place (an update never forces a re-prefill of in-flight
requests). One rollout server per rollout core (`num_servers=0`), as in
`bench_rlvr_longtail.py` (whose docstring says why): until 2026-11-26 this config kept the
default two servers, so its async 1+1 runs had both on the one rollout core (a decode iteration
of 1.1-1.75 ms at 7-8 live requests against 0.38-0.40 ms in sync).
"""

import dataclasses

from experiments.configs import repeat
from flashrl_jax import envs
from flashrl_jax.trainer import BatchConfig

BENCH_MODEL_DIR = ".cache/bench_model"
BENCH_WARMSTART_STEPS = 400
MAX_ANSWER = 192


def bench_task() -> envs.SyntheticConfig:
  return envs.SyntheticConfig(
      task=envs.SyntheticTask.REPEAT,
      lengths=envs.LengthDistribution(law=envs.LengthLaw.LOGNORMAL, median=8, sigma=1.1,
                                      min_len=1, max_len=MAX_ANSWER))


def get_config():
  config = repeat.get_config()
  return dataclasses.replace(
      config, model_path=BENCH_MODEL_DIR, workdir="runs/bench_rlvr", batch_size=8, group_size=8,
      steps=24, eval_every=0, precompile=True, checkpoint_every=50,  # as bench_rlvr_longtail's
      task=dataclasses.replace(config.task, synthetic=bench_task()),
      train=config.train.replace(batch=BatchConfig(row_length=256, rows=16, sequences_per_row=16,
                                                   max_response_length=MAX_ANSWER + 8)),
      rollout=dataclasses.replace(config.rollout, num_servers=0, pause_mode="in_place",
                                  max_running_requests=32,
                                  max_new_tokens=MAX_ANSWER + 8))
