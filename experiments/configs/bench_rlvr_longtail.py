"""The async-vs-sync benchmark in the paper's regime: a rollout-bound step set by a heavy tail.

ROLL Flash's synchronous steps spend >= 70% of their time in rollout, and a step's longest response
is 20-30x its median (RollPacker measures the same kind of runs: rollout 66-72% of the step, longest
25-32x median). Both numbers are measured by `experiments.benchmarks.async_vs_sync` on this
config's sync run; this docstring says why the config produces them on a 2-core CPU.

Why this shape:
- The model is the demo's tiny Qwen3 (hidden 64, 2 layers). Its decode step is dominated by fixed
  per-step cost: a step serving 1-4 requests costs ~0.35 ms of CPU, one serving 32 ~0.9 ms, so a
  server left with the last long responses of a sync batch does a few percent of the work it could.
  A bigger model is *less* rollout-bound on a CPU: its decode is compute-bound (a step of 32 costs
  ~4x a step of 1 at hidden 256) while one training token costs the same as a fraction of a decode
  step at every size, so training would dominate the sync step.
- Training cost grows with the tokens of the batch; sync rollout time with the *longest* response.
  One tail decode step costs about as much as training 10-15 tokens, so the step is rollout-bound
  only when the longest response is several times longer than a batch's tokens divided by ~10:
  a heavy tail (lognormal, median 8, log-std 2.0, clipped at 360) and 32 samples per step from
  16 prompts x 2 responses. A step's longest response is the longest of its *prompts'* lengths
  (responses to one prompt have about the same length), so the prompts per step set the regime:
  with 4 prompts x 4 responses the sync step's longest was 11-13x its median (measured), with
  16 x 2 it is 21-29x.
- The policy is warm-started on that distribution (as the balanced bench's is on its own), so the
  lengths are the policy's own: real generation, real training on every sample, an exact-match
  reward it can learn (short and medium answers are often right; long ones rarely are).
- One rollout server per rollout core (`num_servers=0`): sync runs two (one per core), async on the
  headline 1 + 1 split one (the learner process has the other core to itself: a server sharing the
  trainer's core, even at the idle scheduling class, made its step about twice as long), on a
  2 + 1 split two. Two servers sharing a core would give the same tokens/s
  but double the time a long response spends generating, which at α = 2 decides whether it meets
  its deadline.
- 16 decode slots per server: a sync batch puts all its 16 requests per server in flight at once
  (with 8, half of them queued behind the first wave and the sync step took twice as long: that
  would flatter async).
- RL on few samples per step is noisy: per-sequence loss averaging (`seq-mean-token-mean`, so the
  many tokens of a long wrong answer do not outweigh short right ones) and a learning rate of 1e-4
  keep the policy's length distribution, and so the regime, stable over the run (with the demo's
  token-mean and 3e-4 it collapsed to empty answers within 30 steps).
- Training shapes: rows of 384 tokens (the longest prompt + response), 2 rows per micro-batch; a
  step with more tokens than 768 uses 2, 3, 4, 6 or 8 micro-batches, so the trainer pays for the
  tokens it gets, not for the worst step's; every count is compiled before step 1 (`precompile`).
"""

import dataclasses

from experiments.configs import repeat
from flashrl_jax import envs
from flashrl_jax.losses import Aggregation
from flashrl_jax.trainer import BatchConfig

LONGTAIL_MODEL_DIR = ".cache/bench_longtail_model"
LONGTAIL_WARMSTART_STEPS = 400
MAX_ANSWER = 360


def longtail_task() -> envs.SyntheticConfig:
  return envs.SyntheticConfig(
      task=envs.SyntheticTask.REPEAT,
      lengths=envs.LengthDistribution(law=envs.LengthLaw.LOGNORMAL, median=8, sigma=2.0,
                                      min_len=1, max_len=MAX_ANSWER))


def get_config():
  config = repeat.get_config()
  train = config.train
  return dataclasses.replace(
      config, model_path=LONGTAIL_MODEL_DIR, workdir="runs/bench_rlvr_longtail", batch_size=16,
      group_size=2, steps=100, eval_every=0, precompile=True, checkpoint_every=50,
      task=dataclasses.replace(config.task, synthetic=longtail_task()),
      train=train.replace(
          loss=dataclasses.replace(train.loss, aggregation=Aggregation.SEQ_MEAN_TOKEN_MEAN),
          optimizer=dataclasses.replace(train.optimizer, learning_rate=1e-4),
          batch=BatchConfig(row_length=384, rows=2, sequences_per_row=16,
                            max_response_length=MAX_ANSWER + 8)),
      rollout=dataclasses.replace(config.rollout, num_servers=0, pause_mode="in_place",
                                  max_running_requests=16, max_new_tokens=MAX_ANSWER + 8))
