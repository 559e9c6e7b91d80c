"""Paper-scale presets and sweeps: Qwen3-8B-like RLVR on 8 → 128 H100/H800-class GPUs.

Why: the paper's scaling figures compare sync and async *at the same GPU budget*, with the async
train/rollout split tuned per budget. These helpers build that cluster from hardware numbers (a
roofline decode step, 8·P train FLOPs per token) and sweep it, so `experiments/simulate.py` stays a
thin flag parser and the sweeps are testable.

Defaults (stated in docs/simulator.md): lengths lognormal with mean 8k after clipping at 32k
(σ = 0.9, within-prompt correlation 0.5), prompts of 512 tokens, B = 128 prompts × n = 8 responses
per step, 64 decode slots per GPU, training at 40% MFU, weight handoff 10 s (export 4, pause 1, load 4, resume 1),
rewards 0.5 s each on 64 reward workers.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from flashrl_jax.scheduling import LengthDistribution
from flashrl_jax.sim import _costs, _rollout, _training
from flashrl_jax.sim._config import SimConfig
from flashrl_jax.sim._simulate import simulate

TRAIN_FRACTIONS = (0.125, 0.25, 0.375, 0.5)


@dataclasses.dataclass(frozen=True)
class Workload:
  """The knobs the paper varies: response lengths and batch shape."""

  mean_len: float = 8192
  max_len: int = 32768
  sigma: float = 0.9
  prompt_corr: float = 0.5
  prompt_tokens: int = 512
  batch_prompts: int = 128
  group_size: int = 8
  slots: int = 64
  train_mfu: float = 0.4
  steps: int = 6
  warmup_steps: int = 3

  def lengths(self) -> LengthDistribution:
    return LengthDistribution.with_mean(self.mean_len, sigma=self.sigma, max_len=self.max_len,
                                        prompt_corr=self.prompt_corr)

  def cost(self) -> _costs.CostModel:
    return _costs.CostModel(
        decode=_costs.RooflineDecode.qwen3_8b(mean_context=self.prompt_tokens + self.mean_len / 2),
        prefill_s_per_token=2 * 8.19e9 / (989e12 * 0.5),
        train=_costs.TrainModel.qwen3_8b(mfu=self.train_mfu),
        sync=_costs.SyncModel(export_s=4.0, pause_s=1.0, load_s=4.0, resume_s=1.0),
        reward_s=0.5, reward_workers=64)


def qwen3_8b_config(gpus: int, training, workload: Workload = Workload(), **changes) -> SimConfig:
  """A `SimConfig` for `gpus` GPUs running `training` on `workload`."""
  return SimConfig(
      gpus=gpus, slots=workload.slots, batch_prompts=workload.batch_prompts,
      group_size=workload.group_size, steps=workload.steps, warmup_steps=workload.warmup_steps,
      lengths=workload.lengths(), prompt_tokens=workload.prompt_tokens, cost=workload.cost(),
      training=training,
      dispatch=_rollout.QueueScheduling(), placement=_rollout.PromptReplication()).replace(**changes)


def best_async(gpus: int, alpha: int, workload: Workload = Workload(), seed: int = 0,
               fractions: Iterable[float] = TRAIN_FRACTIONS) -> tuple[int, dict]:
  """The train-pool size (from `fractions` of `gpus`) with the highest async throughput."""
  best = None
  for train_gpus in sorted({max(1, round(f * gpus)) for f in fractions}):
    if train_gpus >= gpus:
      continue
    # A deeper pipeline (larger α) needs more steps to reach its steady state.
    config = qwen3_8b_config(gpus, _training.AsyncTraining(alpha, train_gpus), workload,
                             warmup_steps=max(workload.warmup_steps, alpha + 1))
    summary = simulate(config, seed).summary()
    if best is None or summary["samples_per_s"] > best[1]["samples_per_s"]:
      best = (train_gpus, summary)
  return best


def scaling_rows(gpus_list: Iterable[int], alphas: Iterable[int], workload: Workload = Workload(),
                 seed: int = 0) -> list[dict]:
  """One row per (GPUs, policy): throughput, step/generation time, idle fraction, speedup."""
  rows = []
  for gpus in gpus_list:
    sync = simulate(qwen3_8b_config(gpus, _training.SyncTraining(), workload), seed).summary()
    rows.append(_row(gpus, "sync", None, gpus, sync, sync))
    for alpha in alphas:
      train_gpus, summary = best_async(gpus, alpha, workload, seed)
      rows.append(_row(gpus, "async", alpha, train_gpus, summary, sync))
  return rows


def sequence_rows(mean_lens: Iterable[float], gpus: int, alpha: int,
                  workload: Workload = Workload(), seed: int = 0) -> list[dict]:
  """Sync vs best-split async at one GPU budget, across mean response lengths."""
  rows = []
  for mean_len in mean_lens:
    w = dataclasses.replace(workload, mean_len=mean_len)
    sync = simulate(qwen3_8b_config(gpus, _training.SyncTraining(), w), seed).summary()
    train_gpus, summary = best_async(gpus, alpha, w, seed)
    for row in (_row(gpus, "sync", None, gpus, sync, sync),
                _row(gpus, "async", alpha, train_gpus, summary, sync)):
      rows.append({"mean_len": mean_len, **row})
  return rows


def split_rows(gpus: int, alpha: int, train_gpus_list: Iterable[int],
               workload: Workload = Workload(), seed: int = 0) -> list[dict]:
  """Async throughput for each train/rollout split of a fixed budget (paper Fig. 3a)."""
  sync = simulate(qwen3_8b_config(gpus, _training.SyncTraining(), workload), seed).summary()
  rows = [_row(gpus, "sync", None, gpus, sync, sync)]
  for train_gpus in train_gpus_list:
    config = qwen3_8b_config(gpus, _training.AsyncTraining(alpha, train_gpus), workload)
    rows.append(_row(gpus, "async", alpha, train_gpus, simulate(config, seed).summary(), sync))
  return rows


def mechanism_rows(gpus: int, batch_list: Iterable[int], workload: Workload = Workload(),
                   seed: int = 0) -> list[dict]:
  """Sync generation time per step with/without queue scheduling and prompt replication."""
  rows = []
  for batch in batch_list:
    w = dataclasses.replace(workload, batch_prompts=batch)
    for dispatch in (_rollout.BatchRollout(), _rollout.QueueScheduling()):
      for placement in (_rollout.GroupPlacement(), _rollout.PromptReplication()):
        config = qwen3_8b_config(gpus, _training.SyncTraining(), w, dispatch=dispatch,
                                 placement=placement)
        summary = simulate(config, seed).summary()
        rows.append({"gpus": gpus, "batch_prompts": batch, "group_size": w.group_size,
                     "queue_scheduling": isinstance(dispatch, _rollout.QueueScheduling),
                     "prompt_replication": isinstance(placement, _rollout.PromptReplication),
                     "gen_time_s": summary["gen_time_s"], "step_time_s": summary["step_time_s"]})
  return rows


def _row(gpus, mode, alpha, train_gpus, summary, sync) -> dict:
  return {
      "gpus": gpus, "mode": mode, "alpha": alpha, "train_gpus": train_gpus,
      "samples_per_s": summary["samples_per_s"], "tokens_per_s": summary["tokens_per_s"],
      "step_time_s": summary["step_time_s"], "gen_time_s": summary["gen_time_s"],
      "idle_fraction": summary["idle_fraction"], "dropped_samples": summary["dropped_samples"],
      "mean_len_trained": summary["tokens_per_s"] / summary["samples_per_s"],
      "speedup_vs_sync": summary["samples_per_s"] / sync["samples_per_s"],
      "token_speedup_vs_sync": summary["tokens_per_s"] / sync["tokens_per_s"],
  }
