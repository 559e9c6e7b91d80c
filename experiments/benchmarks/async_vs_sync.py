"""Async (α = 1, 2, 4) vs sync RL throughput on a long-tail RLVR task, same CPU, one run.

Each mode is a real `python -m experiments.train` run (rollout server processes + trainer) on the
benchmark's "repeat" task (`experiments/configs/bench_rlvr.py`: answer lengths lognormal, median 8,
a step's longest ~100-200 tokens) with a policy warm-started on it, so response lengths follow the
task. Sync time-shares all cores between generation and training; async splits them (rollout
cores | trainer core). Throughput is over the steps after `--warmup_steps` (which include
compilation): trained samples per second (the headline) and trained response tokens per second,
which differ when async drops long groups for staleness and so trains a shorter mix.

  python -m experiments.benchmarks.async_vs_sync [--steps=24] [--warmup_steps=6]

Last line: `async_speedup_vs_sync: <best samples/s ratio over α>`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "experiments/configs/bench_rlvr.py", "Run config file.")
_STEPS = flags.DEFINE_integer("steps", 24, "Training steps per run.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 6, "Steps excluded from the throughput.")
_RATIOS = flags.DEFINE_list("async_ratios", ["1", "2", "4"], "α values to measure.")
_SPLITS = flags.DEFINE_list("async_splits", ["1+1"],
                            "rollout+trainer cores for async (2+1 time-shares one core).")
_OUT = flags.DEFINE_string("out", None, "Directory for the runs (default: a temp dir).")


def measured_throughput(workdir: str, warmup: int) -> tuple[float, dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  timed = records[warmup:]
  samples = sum(r["num_samples"] for r in timed)
  seconds = sum(r["time/step_s"] for r in timed)
  tokens = sum(r["response_length_mean"] * r["num_samples"] for r in timed)
  stale = [int(k) for r in timed for k, n in r["staleness_hist"].items() for _ in range(n)]
  return samples / seconds, {"samples": samples, "seconds": seconds,
                             "response_tokens_per_s": tokens / seconds,
                             "mean_response_length": tokens / samples,
                             "dropped_stale_groups": sum(r["dropped_stale"] for r in timed),
                             "reward_mean": sum(r["reward_mean"] for r in timed) / len(timed),
                             "staleness_max": max(stale) if stale else 0}


def run_mode(out: str, name: str, flags_: list[str]) -> str:
  workdir = os.path.join(out, name)
  cmd = [sys.executable, "-m", "experiments.train", f"--config={_CONFIG.value}",
         f"--workdir={workdir}", f"--steps={_STEPS.value}", "--progress=false", "--plot=false",
         *flags_]
  start = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
  print(f"  {name}: finished in {time.time() - start:.0f}s", flush=True)
  return workdir


def main(argv):
  del argv
  from experiments.configs.bench_rlvr import BENCH_MODEL_DIR, BENCH_WARMSTART_STEPS, bench_task
  from experiments.warmstart import ensure_warmstart
  ensure_warmstart(BENCH_MODEL_DIR, steps=BENCH_WARMSTART_STEPS, task=bench_task())
  out = _OUT.value or tempfile.mkdtemp(prefix="async_vs_sync_")
  print(f"runs in {out} ({os.cpu_count()} cores)", flush=True)
  results = {}
  sync_dir = run_mode(out, "sync", ["--mode=sync"])
  results["sync"] = measured_throughput(sync_dir, _WARMUP.value)
  for split in _SPLITS.value:
    rollout, train = split.split("+")
    for ratio in _RATIOS.value:
      name = f"async α={ratio} {split}"
      workdir = run_mode(out, f"async_a{ratio}_{rollout}r{train}t", [
          "--mode=async", f"--async_ratio={ratio}", f"--rollout_devices={rollout}",
          f"--train_devices={train}"])
      results[name] = measured_throughput(workdir, _WARMUP.value)
  base = results["sync"][0]
  base_tokens = results["sync"][1]["response_tokens_per_s"]
  print(f"\n{'mode':<18} {'samples/s':>10} {'speedup':>8} {'resp tok/s':>10} {'speedup':>8} "
        f"{'mean len':>8} {'dropped':>7} {'reward':>7} {'max stale':>9}")
  for name, (sps, info) in results.items():
    tps = info["response_tokens_per_s"]
    print(f"{name:<18} {sps:>10.2f} {sps / base:>8.2f} {tps:>10.0f} {tps / base_tokens:>8.2f} "
          f"{info['mean_response_length']:>8.1f} {info['dropped_stale_groups']:>7d} "
          f"{info['reward_mean']:>7.3f} {info['staleness_max']:>9d}")
  best = max(sps for name, (sps, _) in results.items() if name != "sync")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({k: {"samples_per_s": v[0], **v[1]} for k, v in results.items()}, f, indent=1)
  print(f"async_speedup_vs_sync: {best / base:.2f}")


if __name__ == "__main__":
  app.run(main)
