"""Env-level async vs the lock-step agentic loop, on real model servers and the real trainer.

    python -m experiments.benchmarks.agentic_async_vs_sync [--steps=8] [--warmup_steps=2] [--repeats=1]

Headline: real RL runs (`python -m experiments.train --config=experiments/configs/bench_agentic.py`,
our JAX engine serving the demo's tiny model in 2 server processes, the real trainer, the real
weight handoff after every step) in both modes, same cores (sync time-shares both; async gives the
servers and the controller loop one and the trainer the other), same number of environment
instances (B groups of n at once). The task is what the paper's agentic tasks look like
(`bench_agentic.py`): levels whose turn budget follows a long-tail law, environment calls with a
long-tailed latency, fail-slow and fail-stop calls. Throughput = trained episodes per second over
the steps after `--warmup_steps` (which carry the JIT compiles), the runs interleaved per repeat.

Beside it, labelled as such, the same loops with protocol stub servers (a fixed time per token
whatever the batch) and a trainer that sleeps a fixed time: this isolates the scheduling mechanism
(lock-step barriers vs per-episode loops) from CPU contention; it is not the headline.

Last line: `agentic_async_speedup_vs_sync: <async episodes/s / sync episodes/s, real servers>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags

from experiments import _children
from experiments._summary import timed_seconds
from flashrl_jax import envs
from flashrl_jax.controller import (AgenticStats, Counters, EnvGroupRunner, EpisodeDeps,
                                    FixedLevel, Loop, MetricsLogger, Mode, PromptSource)
from flashrl_jax.fleet import Fleet, LocalServers, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.model import char_tokenizer
from flashrl_jax.testing import stub_server_command

CONFIG = "experiments/configs/bench_agentic.py"

_STEPS = flags.DEFINE_integer("steps", 8, "Training steps per real run.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Leading steps excluded (compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Interleaved repeats of the real sync/async pair.")
_STUB = flags.DEFINE_bool("stub_row", True, "Also run the stub-server mechanism row.")
_STUB_STEPS = flags.DEFINE_integer("stub_steps", 4, "Training steps per stub run.")
_STUB_TRAIN_S = flags.DEFINE_float("stub_train_s", 1.0, "Stub row: the sleeping trainer's step.")
_STUB_TOKEN_S = flags.DEFINE_float("stub_token_s", 0.004, "Stub row: seconds per token.")
_OUT = flags.DEFINE_string("out", None, "Directory of the runs (default: a temp dir).")


# --- the headline: real runs ----------------------------------------------------------------------

def real_run(workdir: str, mode: str) -> dict:
  flags_ = ["--mode=sync"] if mode == "sync" else ["--mode=async"]
  cmd = [sys.executable, "-m", "experiments.train", f"--config={CONFIG}", f"--workdir={workdir}",
         f"--steps={_STEPS.value}", "--progress=false", "--plot=false", *flags_]
  load = os.getloadavg()[0]
  start = time.perf_counter()
  proc = _children.run(cmd)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  timed = records[_WARMUP.value:]
  seconds = timed_seconds(records, _WARMUP.value)
  episodes = sum(r["num_samples"] for r in timed)
  return {"episodes_per_s": episodes / seconds, "episodes": episodes, "seconds": seconds,
          "train_s": statistics.median(r["time/train_s"] for r in timed),
          "wait_s": statistics.median(r["time/wait_data_s"] for r in timed),
          "env_steps": sum(r.get("env_step_s/count", 0) for r in timed),
          "loadavg": [load, os.getloadavg()[0]], "wall_s": time.perf_counter() - start}


# --- beside it: the scheduling mechanism alone (stub servers, sleeping trainer) --------------------

class SleepLearner:
  """Stands in for `Learner` in the stub row: a fixed train time per step, the policy version, and
  one weights directory published as every version."""

  num_processes = 1

  def __init__(self, seconds: float, weights: str):
    self.seconds, self.weights, self.policy_version = seconds, weights, 0

  def update(self, trajectories) -> dict[str, float]:
    time.sleep(self.seconds)
    self.policy_version += 1
    return {"num_trajectories": float(len(trajectories))}

  def export(self) -> str:
    return self.weights

  def reexport(self) -> str:
    return self.weights

  def hold(self, version: int) -> None:  # one weights directory, never collected
    del version

  def collect_garbage(self) -> None:
    pass

  def evaluate(self) -> None:
    return None

  def save(self, step, extra) -> None:
    del step, extra


async def stub_run(urls: list[str], mode: Mode, workdir: str, weights: str) -> dict:
  """The benchmark config's loops and environments, with stub servers and a sleeping trainer."""
  from experiments._cli import load_config_file
  base = load_config_file(CONFIG)
  config = base.replace(workdir=workdir, mode=mode, steps=_STUB_STEPS.value,
                        async_ratio=base.async_ratio if mode is Mode.ASYNC else 0)
  agentic, env = config.agentic, config.task.env

  def make_env(level_seed: int, candidate: int) -> envs.AsyncEnvironment:
    del candidate
    return envs.AsyncEnv(FixedLevel(envs.make_env(env), level_seed), env.latency, env.failure)

  learner, counters = SleepLearner(_STUB_TRAIN_S.value, weights), Counters()
  client = RolloutClient(urls, request_timeout_s=60.0, vocab_size=96)
  async with Fleet(client, pause_mode=PauseMode.ABORT) as fleet:
    deps = EpisodeDeps(fleet=fleet, tokenizer=char_tokenizer(),
                       sampling=SamplingParams(max_new_tokens=agentic.turn_max_new_tokens),
                       make_env=make_env, stats=AgenticStats(counters.episodes),
                       row_length=config.train.batch.row_length,
                       max_response_length=config.train.batch.max_response_length,
                       step_timeout_s=agentic.env_step_timeout_s, turn_budget=agentic.turn_budget)
    runner = EnvGroupRunner(deps, agentic, group_size=config.group_size, task_seed=config.task.seed,
                            concurrent_groups=agentic.groups(config.batch_size, config.async_ratio,
                                                             mode is Mode.ASYNC))
    logger = MetricsLogger(workdir, tensorboard=False)
    start = time.perf_counter()
    await Loop(config, fleet=fleet, learner=learner,
               source=PromptSource(envs.SampleListSource([envs.Sample("", "")])), runner=runner,
               counters=counters, logger=logger).run()
    wall = time.perf_counter() - start
    logger.close()
  return {"episodes_per_s": counters.samples_trained / wall, "wall_s": wall,
          "episodes": counters.samples_trained}


def stub_row(out: str) -> dict[str, dict]:
  weights = tempfile.mkdtemp(prefix="weights_", dir=out)
  servers = LocalServers.start(
      "stub", 2, command=stub_server_command(), log_dir=out,
      extra_args=("--vocab_size=96", "--max_running_requests=512", "--latency_s=0.02",
                  f"--token_latency_s={_STUB_TOKEN_S.value}"))
  results = {}
  with servers:
    for mode in (Mode.SYNC, Mode.ASYNC):
      results[mode.value] = asyncio.run(stub_run(servers.urls, mode, f"{out}/stub_{mode.value}",
                                                 weights))
  return results


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  out = _OUT.value or tempfile.mkdtemp(prefix="agentic_bench_")
  os.makedirs(out, exist_ok=True)
  from experiments._cli import load_config_file
  config = load_config_file(CONFIG)
  env, agentic = config.task.env, config.agentic
  budget = agentic.turn_budget
  print(f"runs in {out}; {config.task.env.kind.value}, turn budget per level {budget.law.value} "
        f"median {budget.median:g} (log-std {budget.sigma:g}, {budget.min_len}-{budget.max_len}), "
        f"env step {env.latency.kind.value} median {env.latency.mean_s:g}s ({env.latency.tail_prob:.0%}"
        f" x{env.latency.tail_factor:g}), fail-slow {env.failure.slow_prob:.0%} "
        f"x{env.failure.slow_factor:g}, fail-stop {env.failure.stop_prob:.0%}; B={config.batch_size}"
        f" groups x n={config.group_size}, {agentic.num_env_groups or config.batch_size} groups at "
        f"once; {config.rollout.num_servers} JAX servers, real trainer; {_STEPS.value} steps "
        f"({_WARMUP.value} warm-up), async α={config.async_ratio}", flush=True)
  real: dict[str, list[dict]] = {"sync": [], "async": []}
  for repeat in range(_REPEATS.value):
    for mode in ("sync", "async"):
      r = real_run(os.path.join(out, f"real_{mode}_{repeat}"), mode)
      real[mode].append(r)
      print(f"  real {mode:>5} #{repeat}: {r['episodes_per_s']:6.3f} episodes/s ({r['episodes']} "
            f"in {r['seconds']:.1f}s; train step {r['train_s']:.2f}s, wait for data "
            f"{r['wait_s']:.2f}s; load {r['loadavg'][0]:.1f}-{r['loadavg'][1]:.1f})", flush=True)
  per_repeat = [a["episodes_per_s"] / s["episodes_per_s"]
                for s, a in zip(real["sync"], real["async"])]
  headline = statistics.median(per_repeat)
  rows = {m: statistics.median(r["episodes_per_s"] for r in runs) for m, runs in real.items()}
  print(f"\n{'setup':<46} {'sync ep/s':>9} {'async ep/s':>10} {'async/sync':>10}")
  print(f"{'real JAX servers + trainer (headline)':<46} {rows['sync']:>9.3f} {rows['async']:>10.3f} "
        f"{headline:>10.2f}")
  if _STUB.value:
    stub = stub_row(out)
    ratio = stub["async"]["episodes_per_s"] / stub["sync"]["episodes_per_s"]
    print(f"{'stub servers + sleeping trainer (mechanism only)':<46} "
          f"{stub['sync']['episodes_per_s']:>9.3f} {stub['async']['episodes_per_s']:>10.3f} "
          f"{ratio:>10.2f}")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"real": real, "per_repeat": per_repeat}, f, indent=1)
  print(f"agentic_async_speedup_vs_sync: {headline:.2f}")


if __name__ == "__main__":
  app.run(main)
