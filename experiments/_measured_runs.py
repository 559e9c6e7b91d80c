"""One real run as `sim_vs_measured` predicts it: the run itself (`experiments.train` in a child
process, its processes' CPU time and its servers' counters read while it runs) and what it measured
over its timed steps (`metrics.jsonl`, as `async_vs_sync` measures it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments import _calibration_fits, _children, _cpu_time
from experiments._server_profile import ServerSampler, server_profile, server_window
from experiments._summary import timed_seconds

COMPILE_S = 1.0  # a timed step's training over this: a compile (its steps train in 0.05-0.3 s)


def measured(workdir: str, warmup: int) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    every = [json.loads(line) for line in f if line.strip()]
  records, seconds = every[warmup:], timed_seconds(every, warmup)
  samples = sum(r["num_samples"] for r in records)
  return {"samples_per_s": samples / seconds,
          # The policy's own lengths over the timed steps: a throughput prediction assumes the
          # calibration's (the initial policy's), and a run whose policy drifts shorter is faster.
          "mean_response": sum(r["response_length_mean"] * r["num_samples"]
                               for r in records) / samples,
          "train_s": float(np.mean([r["time/train_s"] for r in records])),
          # Timed steps that trained for over a second: a compile at a shape first met mid-run
          # (pass BI: 7.6 s at step 94), which no calibrated step time predicts.
          "compile_steps": [r.get("step", i + 1) for i, r in enumerate(every)
                            if i >= warmup and r["time/train_s"] > COMPILE_S],
          "wait_s": float(np.mean([r["time/wait_data_s"] for r in records])),
          "step_s": seconds / len(records),
          "longest_over_median": float(np.median([r["response_length_max"] for r in records])
                                       / max(np.median([r["response_length_mean"]
                                                        for r in records]), 1e-9))}


def _lines(path: str) -> int:
  try:
    with open(path, "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return 0


def run(config_path: str, workdir: str, mode: str, alpha: int, steps: int, warmup: int,
        split: tuple[int, int]) -> dict:
  """Runs one mode for real (async: on `split`, its rollout and trainer cores). While it runs,
  the CPU times of its processes are read at every step record: the contention its servers and
  its trainer process met over the timed steps (after `warmup`) rescales the calibrated costs."""
  rollout, train = split
  flags_ = (["--mode=sync"] if mode == "sync" else
            ["--mode=async", f"--async_ratio={alpha}", f"--rollout_devices={rollout}",
             f"--train_devices={train}"])
  cmd = [sys.executable, "-m", "experiments.train", f"--config={config_path}",
         f"--workdir={workdir}", f"--steps={steps}", "--progress=false", "--plot=false",
         "--eval_every=0", *flags_]
  os.makedirs(workdir, exist_ok=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  before = _cpu_time.probe()
  start = time.perf_counter()
  with (open(os.path.join(workdir, "train.log"), "w") as log,
        ServerSampler(workdir) as sampler,  # what the servers did: where an error is
        _children.stopped_on_exit(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        as proc):
    snapshots: dict[int, tuple] = {}  # step records written -> (trainer, servers) CPU times
    # Every 5th record also the servers' counters, read at the same moment as their CPU time (the
    # run's cost per request beyond the static table, printed beside the calibration's).
    reads: dict[int, tuple] = {}
    seen = 0
    while proc.poll() is None:
      count = _lines(metrics)
      if count != seen and count >= warmup:
        trainer, servers = _cpu_time.processes(proc.pid)
        snapshots[count] = (_cpu_time.cpu_times(trainer), _cpu_time.cpu_times(servers))
        if (count - warmup) % 5 == 0:
          reads[count] = (snapshots[count][1][0], sampler.snapshot())
      seen = count
      time.sleep(0.05)
  wall = time.perf_counter() - start
  after = _cpu_time.probe()
  if proc.returncode:
    with open(os.path.join(workdir, "train.log")) as f:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{f.read()[-3000:]}")
  if len(snapshots) < 2:
    raise RuntimeError(f"too few CPU time readings over the timed steps: {sorted(snapshots)}")
  # From the first record at or after the warm-up to the last one read (the servers stop soon after).
  first, last = snapshots[min(snapshots)], snapshots[max(snapshots)]
  return {**_cpu_time.probe_pair(before, after), "wall_s": wall,
          "servers": server_profile(sampler.snapshots, warmup, steps),
          "server_window": server_window(reads, metrics),
          "contention": {"trainer": _cpu_time.contention(first[0], last[0]),
                         "rollout": _cpu_time.contention(first[1], last[1])}}


def run_request_s(calibration: dict, window: dict | None) -> float | None:
  """A run's servers' CPU seconds per request beyond its decode steps priced by the calibration's
  static table (`stream_request_s`, as the calibration prices its stream): what a request cost the
  servers as the run sent it, a diagnostic beside the calibrated costs, never a prediction's
  input."""
  if window is None or window["requests"] < 1:
    return None
  ro = calibration["rollout"]
  servers = window["servers"]
  per_server = [{k: v / servers for k, v in c.items()} for c in (window["before"], window["after"])]
  return _calibration_fits.stream_request_s(
      window["server_cpu_s"] / servers, per_server[:1], per_server[1:], ro["decode_active"],
      ro["decode_step_s"], window["requests"] / servers)
