"""A simulated run from a calibration alone: the simulator's configuration for one run's policy
knobs, its costs taken from `experiments._calibration`'s microbenchmarks (and rescaled by the
slowdowns `experiments.benchmarks.sim_vs_measured` derives), and the calibrated numbers a
prediction is printed beside.
"""

from __future__ import annotations

import numpy as np

from flashrl_jax import sim
from flashrl_jax.scheduling import EmpiricalLengths, PauseMode


def sim_config(calibration: dict, mode: str, alpha: int, batch_size: int, group_size: int,
               pause_mode, steps: int, warmup: int, rollout_slowdown: float = 1.0,
               train_slowdown: float = 1.0) -> sim.SimConfig:
  """The simulated run, from a calibration (and the run's policy knobs) only. The slowdowns
  rescale the costs measured on the servers and on the trainer (CPU contention ratios)."""
  ro, tr = calibration["rollout"], calibration["trainer"]["alone"]
  r, t = rollout_slowdown, train_slowdown
  handoff = {k: v * r for k, v in ro["handoff"]["idle" if mode == "sync" else "busy"].items()}
  stream = ro.get("stream", {})
  if mode != "sync" and "bursts" not in ro and "step_s" in stream:
    # (Calibrations of 2026-11-26 to -27, before the bursts: the lanes stream's table, which holds
    # its requests' arrivals and departures, with no request cost added.)
    decode = sim.TabulatedDecode(stream["active"], [s * r for s in stream["step_s"]])
    request_s = 0.0
  else:
    decode = sim.TabulatedDecode(ro["decode_active"], [s * r for s in ro["decode_step_s"]],
                                 context_ref=ro.get("decode_context_ref", 0.0),
                                 context_slope=ro.get("decode_context_slope", 0.0),
                                 # Our engine pads a step's requests to the longest one's span.
                                 context_of=sim.Context.LONGEST)
    # Async: the servers' work per request as a run sends them, a batch's groups after each
    # handoff (sync: the batch admitted at once).
    request_s = ro["bursts"]["request_s"] if mode != "sync" and "bursts" in ro else ro["request_s"]
  cost = sim.CostModel(
      **calibration["interference"], decode=decode,
      request_s=request_s * r, reward_s=(ro["reward_s"] + ro["latency_s"]) * r,
      train=sim.TabulatedTrain(tr["train_tokens"], [s * t for s in tr["train_s"]]),
      sync=sim.SyncModel(export_s=tr["export_s"] * t, **handoff))
  workers = ro["workers"]
  training = (sim.SyncTraining() if mode == "sync"
              else sim.AsyncTraining(alpha=alpha, train_gpus=1))  # hands over as the controller
  return sim.SimConfig(
      gpus=workers + (0 if mode == "sync" else 1), slots=ro["slots"], batch_prompts=batch_size,
      group_size=group_size, steps=steps - warmup, warmup_steps=warmup,
      lengths=EmpiricalLengths(ro["length_groups"]), prompt_tokens=round(ro["prompt_tokens"]),
      cost=cost, training=training, pause=pause_mode)


def round_latency_s(rollout: dict, batch_size: int, group_size: int, seeds: int = 8) -> float:
  """The latency a sync round pays beyond what the simulator prices from the calibrated costs:
  the median over the calibration's sync rounds (`rollout["rounds"]["round_walls"]`: handoff and
  rollout seconds and longest response of each) of the round's rollout wall minus the simulated
  rollout wall at its longest response (a line fitted to simulated sync steps priced from the same
  calibration without latency), at least 0. `sim_vs_measured` prints the sync prediction with it
  in place of the decode batches' fitted intercept (`latency_s`); not applied (docs/simulator.md).

  Why: that intercept came out 0-18 ms over the slow-mode passes' calibrations, and the sync runs
  of passes AS-AZ waited 27-52 ms a step longer than simulated at the same longest response, at the
  same slope per token; in its first pass (BB) the rounds' latency put the balanced sync run
  within 5.4% (the intercept: 24.6%) and the long-tail one 22.3% low (10.5%)."""
  walls = np.asarray(rollout["rounds"]["round_walls"], dtype=np.float64)
  no_latency = {**rollout, "latency_s": 0.0,
                "handoff": {"idle": {"pause_s": 0.0, "load_s": 0.0, "resume_s": 0.0}}}
  calibration = {"rollout": no_latency,
                 "trainer": {"alone": {"train_tokens": [1], "train_s": [0.0], "export_s": 0.0}},
                 "interference": {"train_beside_rollout": 1.0, "rollout_beside_train": 1.0}}
  steps, warmup = 64, 4
  config = sim_config(calibration, "sync", 0, batch_size, group_size, PauseMode.IN_PLACE, steps,
                      warmup)  # (a sync run has nothing in flight at a handoff)
  simulated = [(r.wait_data_s, max(r.response_lengths))
               for seed in range(seeds) for r in sim.simulate(config, seed=seed).records[warmup:]]
  wait, longest = np.asarray(simulated).T
  slope, intercept = np.polyfit(longest, wait, 1)
  return max(float(np.median(walls[:, 1] - (intercept + slope * walls[:, 2]))), 0.0)


def calibrated_step_s(calibration: dict, live: float, servers: int) -> float:
  """The calibrated decode step (ΔW/ΔL of the microbenchmark, at its mean context) of a worker
  whose servers together hold `live` requests per server each iteration, as the simulator prices
  it before any rescaling: beside a run's measured decode iteration, it says whether a miss is in
  the step's cost or elsewhere (how many requests the servers get, how long they sit idle)."""
  ro = calibration["rollout"]
  decode = sim.TabulatedDecode(ro["decode_active"], ro["decode_step_s"])
  return decode.step_time(live * servers / ro["workers"])


def calibrated_mean_response(calibration: dict) -> float:
  """Mean response length of the policy the calibration sampled (its length law's groups)."""
  return float(np.mean([n for group in calibration["rollout"]["length_groups"] for n in group]))
