"""Predicted vs measured throughput: does the simulator reproduce a real run on this machine?

    python -m experiments.benchmarks.sim_vs_measured --metrics=runs/demo/metrics.jsonl \\
        --calibration=calibration.json

Reads a measured run's `metrics.jsonl` (written by `flashrl_jax.controller`, one JSON object per
training step) and a small calibration JSON, builds the same configuration in `flashrl_jax.sim`,
simulates it with a few seeds and prints predicted vs measured throughput and the relative error.
Last line: `sim_error_vs_measured: <fraction>` (|predicted − measured| / measured samples/s).

metrics.jsonl, per line (keys the controller writes; `?` = optional):
  step, policy_version, num_samples (responses trained that step), samples_per_s,
  time/step_s (wall of the step incl. publish), time/train_s, time/wait_data_s,
  time/export_s?, time/pause_s?, time/load_s?, time/resume_s?  (weight handoff phases),
  response_lengths? (list of token counts; else response_length_mean + response_length_max),
  staleness_hist?, reward_mean? (reported, not needed).

calibration.json (only `run` and `decode` are required):
  {"run": {"mode": "async" | "sync", "async_ratio": 2, "batch_size": 8,   # B prompts per step
           "group_size": 4, "rollout_servers": 2, "slots": 8, "train_devices": 1,
           "prompt_tokens": 32, "max_len": 256, "pause_mode": "in_place" | "abort",
           "queue_scheduling": true, "prompt_replication": true},
   "decode": {"active": [1, 2, 4, 8], "step_s": [...]}       # measured decode step times, or
             {"t_base_s": 0.01, "t_per_active_s": 0.001},   # a fitted linear model
   "prefill_s_per_token": 0.0,
   "train": {"fixed_s": .., "per_token_s": ..},   # else fitted: time/train_s vs tokens per step
   "sync": {"export_s": .., "pause_s": .., "load_s": .., "resume_s": ..},  # else metric means
   "reward_s": 0.0, "reward_workers": null, "warmup_steps": 1}
`per_token_s` is device-seconds per trained token (prompt + response). On CPU a "device" is the
process's core slice; sync runs on separate rollout and trainer processes, as the controller does.

To measure the `decode` block and `prefill_s_per_token` on this machine with the project's own
engine (static-shape slots, so the step time barely depends on how many are active; pin it like
the servers, e.g. `taskset -c 0`, and merge the printed JSON into the calibration file):

    python -m experiments.benchmarks.sim_vs_measured --measure_decode=.cache/demo_model \\
        --slots=16 --context_length=128
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
from absl import app, flags
from scipy import special

from flashrl_jax import sim
from flashrl_jax.scheduling import LengthDistribution, LengthLaw, fit_lengths


def load_metrics(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def lengths_from_metrics(records: list[dict], run: dict) -> LengthDistribution:
  """Fit the length law: from the logged lengths, else from per-step mean and max (lognormal)."""
  max_len = run.get("max_len")
  if all("response_lengths" in r for r in records):
    lengths = [x for r in records for x in r["response_lengths"]]
    return fit_lengths(np.maximum(lengths, 1), max_len=max_len or max(lengths))
  # Lognormal from moments: mean m = e^{μ+σ²/2}; the typical maximum of N draws is about
  # e^{μ+σ·z_N}, z_N = Φ⁻¹(1 − 1/(N+1)); so ln(max/m) = σ·z_N − σ²/2, solved for σ.
  mean = float(np.mean([r["response_length_mean"] for r in records]))
  peak = float(np.median([r["response_length_max"] for r in records]))
  n = float(np.median([r.get("num_samples", 1) for r in records]))
  z = float(special.ndtri(1.0 - 1.0 / (n + 1.0)))
  gap = max(math.log(max(peak, mean) / mean), 1e-6)
  sigma = z - math.sqrt(max(z * z - 2.0 * gap, 0.0))
  return LengthDistribution(LengthLaw.LOGNORMAL, median=math.exp(math.log(mean) - sigma**2 / 2),
                            sigma=max(sigma, 1e-3), max_len=int(max_len or 4 * peak))


def train_from_metrics(records: list[dict], prompt_tokens: int, devices: int) -> sim.TrainModel:
  """`time/train_s ≈ fixed + per_token_s · tokens / devices`, preserving the measured mean.

  The slope is fitted on the steps without one-off costs (JIT compiles of new shapes: steps over
  3× the median are left out of the fit); the intercept is then set so that the model's mean over
  *all* steps equals the measured mean, because a real run pays those compiles too.
  """
  tokens = np.array([r["num_samples"] * (prompt_tokens + r.get("response_length_mean", 0.0))
                     for r in records])
  seconds = np.array([r["time/train_s"] for r in records])
  typical = seconds <= 3.0 * np.median(seconds)
  slope = 0.0
  if typical.sum() > 2 and np.ptp(tokens[typical]) > 0:
    slope = max(float(np.polyfit(tokens[typical], seconds[typical], 1)[0]), 0.0)
  fixed = float(seconds.mean() - slope * tokens.mean())
  if fixed < 0:  # all of the time is per token
    slope, fixed = float(seconds.sum() / tokens.sum()), 0.0
  return sim.TrainModel(fixed_s=fixed, per_token_s=slope * devices)


def build_config(records: list[dict], calibration: dict) -> sim.SimConfig:
  """The `SimConfig` of the measured run: policies from `run`, costs calibrated."""
  run = calibration["run"]
  decode = calibration["decode"]
  if "active" in decode:
    decode_model = sim.fit_linear_decode(decode["active"], decode["step_s"])
  else:
    decode_model = sim.LinearDecode(decode["t_base_s"], decode.get("t_per_active_s", 0.0))
  devices = int(run.get("train_devices", 1))
  warmup = int(calibration.get("warmup_steps", 1))
  measured = records[warmup:] or records
  lengths = lengths_from_metrics(measured, run)
  prompt_tokens = int(run.get("prompt_tokens", 0))
  if "train" in calibration:
    train = sim.TrainModel(**calibration["train"])
  else:
    train = train_from_metrics(measured, prompt_tokens, devices)
  phases = ("export_s", "pause_s", "load_s", "resume_s")
  sync = calibration.get("sync") or {
      p: float(np.mean([r.get(f"time/{p}", 0.0) for r in measured])) for p in phases}
  alpha = int(run.get("async_ratio", 0))
  training = (sim.AsyncTraining(alpha=alpha, train_gpus=devices) if run["mode"] == "async"
              else sim.SyncTraining(train_gpus=devices))
  cost = sim.CostModel(decode=decode_model,
                       prefill_s_per_token=float(calibration.get("prefill_s_per_token", 0.0)),
                       train=train, sync=sim.SyncModel(**sync),
                       reward_s=float(calibration.get("reward_s", 0.0)),
                       reward_workers=calibration.get("reward_workers"))
  return sim.SimConfig(
      gpus=int(run["rollout_servers"]) + devices, slots=int(run["slots"]),
      batch_prompts=int(run["batch_size"]), group_size=int(run["group_size"]),
      steps=max(len(records) - warmup, 1), warmup_steps=warmup, lengths=lengths,
      prompt_tokens=prompt_tokens, cost=cost,
      training=training,
      dispatch=sim.QueueScheduling() if run.get("queue_scheduling", True) else sim.BatchRollout(),
      placement=(sim.PromptReplication() if run.get("prompt_replication", True)
                 else sim.GroupPlacement()),
      pause=run.get("pause_mode", "in_place"))


def measured_throughput(records: list[dict], warmup: int) -> float:
  measured = records[warmup:] or records
  if all("time/step_s" in r and "num_samples" in r for r in measured):
    return sum(r["num_samples"] for r in measured) / sum(r["time/step_s"] for r in measured)
  return float(np.mean([r["samples_per_s"] for r in measured]))


def compare(records: list[dict], calibration: dict, seeds: int = 3) -> dict:
  """Predicted vs measured samples/s (and step/train/wait times), with the relative error."""
  config = build_config(records, calibration)
  results = [sim.simulate(config, seed=s) for s in range(seeds)]
  warmup = config.warmup_steps
  measured = records[warmup:] or records
  predicted = float(np.mean([r.samples_per_s for r in results]))
  actual = measured_throughput(records, warmup)
  return {
      "config": config,
      "predicted_samples_per_s": predicted, "measured_samples_per_s": actual,
      "predicted_train_s": float(np.mean([r.train_time_s for r in results])),
      "measured_train_s": float(np.mean([r["time/train_s"] for r in measured])),
      "predicted_wait_data_s": float(np.mean([r.wait_data_s for r in results])),
      "measured_wait_data_s": float(np.mean([r["time/wait_data_s"] for r in measured])),
      "predicted_staleness_mean": float(np.mean([_hist_mean(r.staleness_hist) for r in results])),
      "measured_staleness_mean": float(np.mean([_hist_mean(r.get("staleness_hist", {}))
                                                for r in measured])),
      "error": abs(predicted - actual) / actual,
  }


def _hist_mean(hist: dict) -> float:
  total = sum(hist.values())
  return sum(int(k) * v for k, v in hist.items()) / total if total else 0.0


def measure_decode(model_path: str, slots: int, context_length: int | None = None,
                   tokens: int = 32) -> dict:
  """Decode step seconds vs active requests, and prefill seconds per prompt token, on one
  `flashrl_jax.rollout.Engine`: the `decode` and `prefill_s_per_token` calibration entries."""
  from flashrl_jax.rollout import Engine, EngineConfig, Sampling  # JAX only when asked for
  prompt = list(range(3, 11))
  sampling = Sampling(max_new_tokens=tokens, ignore_eos=True)
  active = sorted({1, max(slots // 4, 1), max(slots // 2, 1), slots})
  step_s = []
  config = EngineConfig(model_path=model_path, max_running_requests=slots,
                        context_length=context_length)
  with Engine(config) as engine:
    for count in active:
      for _ in range(2):  # the first pass compiles this prefill shape
        before = dataclasses.replace(engine.stats)
        start = time.perf_counter()
        engine.generate([prompt] * count, sampling)
        wall = time.perf_counter() - start
      step_s.append(wall / max(engine.stats.decode_steps - before.decode_steps, 1))
    # Prefill: long prompts, one new token each, charged per prompt token (request overhead in).
    long_prompt = list(range(3, 3 + min(64, engine.context_length // 2)))
    one = Sampling(max_new_tokens=1, ignore_eos=True)
    for _ in range(2):
      start = time.perf_counter()
      engine.generate([long_prompt] * slots, one)
      prefill = (time.perf_counter() - start) / (slots * len(long_prompt))
  return {"decode": {"active": active, "step_s": step_s}, "prefill_s_per_token": prefill}


_METRICS = flags.DEFINE_string("metrics", None, "A run's metrics.jsonl.")
_CALIBRATION = flags.DEFINE_string("calibration", None, "Calibration JSON.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Simulation seeds to average.")
_MEASURE_DECODE = flags.DEFINE_string(
    "measure_decode", None, "Model directory: print measured `decode` and `prefill_s_per_token`.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Engine slots for --measure_decode.")
_CONTEXT = flags.DEFINE_integer("context_length", None, "Engine context for --measure_decode "
                                "(the controller passes the trainer's row length).")


def main(argv):
  del argv
  if _MEASURE_DECODE.value:
    print(json.dumps(measure_decode(_MEASURE_DECODE.value, _SLOTS.value, _CONTEXT.value)))
    return
  if not (_METRICS.value and _CALIBRATION.value):
    raise app.UsageError("--metrics and --calibration are required (or --measure_decode).")
  with open(_CALIBRATION.value) as f:
    calibration = json.load(f)
  report = compare(load_metrics(_METRICS.value), calibration, _SEEDS.value)
  config = report.pop("config")
  print(f"simulated: {config.workers} rollout workers × {config.slots} slots, "
        f"{config.train_gpus} train devices, {type(config.training).__name__}, "
        f"B={config.batch_prompts}×n={config.group_size}, lengths {config.lengths}")
  for what in ("samples_per_s", "train_s", "wait_data_s", "staleness_mean"):
    p, m = report[f"predicted_{what}"], report[f"measured_{what}"]
    print(f"{what:>15}: predicted {p:10.4g}   measured {m:10.4g}")
  print(f"sim_error_vs_measured: {report['error']:.4f}")


if __name__ == "__main__":
  app.run(main)
