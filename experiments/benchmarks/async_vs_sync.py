"""Async (α = 1, 2, 4) vs sync RL throughput on the real system, in two regimes, one invocation.

Every run is a real `python -m experiments.train` (rollout server processes running our JAX engine,
the real trainer, real weight handoffs) on a warm-started policy, so response lengths are the
policy's own. Two regimes, each a config file:
- `longtail` (`experiments/configs/bench_rlvr_longtail.py`): the paper's regime. Its sync run must
  be rollout-bound (rollout >= 70% of the step) with a heavy tail (longest >= 20x median); both are
  measured on the sync run itself and printed.
- `balanced` (`experiments/configs/bench_rlvr.py`): training about half of the sync step, the
  regime where async has little to win; shown so users see both.
Sync time-shares all cores between generation and training; async splits the same cores (rollout
cores + trainer cores, `--async_splits`). Runs are interleaved (each repeat runs every mode of a
regime back to back, the order reversed on odd repeats) and each row carries the load average
measured during its run: other jobs share the machine.

Throughput is over the steps after `--warmup_steps` (start-up and compilation excluded), on the
wall clock from the end of the last warm-up step to the end of the last step (the runs' logging
and checkpoints count): trained samples/s and trained response tokens/s (they differ when async
trains a different length mix). The rollout share is of that wall time too.
The profile columns say where each step's time went: waiting for data (`due`: the part of it spent
with a full batch buffered, waiting for an in-flight group that must be trained by this step or the
next ones to stay within α), training, export, and the handoff (pause + load + resume; in async
mode it runs behind the next training step, and `hwait` is what the trainer waited for the
previous one). With `--repeats > 1`, a mode's speedup is the median of its per-repeat ratios to
the sync run of the same repeat.
The CPU columns price the timed steps in CPU time of every process of the run (`CpuSampler`), by
role: a mode's samples/s ratio to sync is the ratio of the cores they kept busy times the inverse
ratio of their CPU per sample, so a sync run that keeps a fraction f of the cores busy bounds what
any schedule of its work on the same cores can win at 1 / f.

  python -m experiments.benchmarks.async_vs_sync [--repeats=1] [--regimes=longtail,balanced]
      [--async_ratios=1,2,4] [--async_splits=1+1] [--platform=cpu|gpu]

`--platform=gpu` runs the same benchmark on one GPU: one server (32 decode slots) and the trainer
share it in both modes, so the resources are equal. There a decode iteration of the tiny model
costs nearly the same whatever the batch (on an H200: 1.5-1.75 ms at 4 live requests, 2.2 ms at
16), so a sync batch's tail idles the GPU as it does in the paper (`docs/benchmarks.md`).

Last lines (paper regime, α = 2 the headline): `sync_rollout_share`, `longest_over_median`,
`async_speedup_vs_sync_tokens`, `async_speedup_vs_sync`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from experiments import _children
from experiments._cpu_time import (CpuSampler, cpu_ms_per_sample, cpu_profile, cpu_us_per_token,
                                   speedup_factors)
from experiments._server_profile import ServerSampler, server_profile
from experiments._summary import timed_seconds

_REGIMES = {  # name -> (config module, steps, warm-up steps)
    "longtail": ("bench_rlvr_longtail", 100, 10),
    "balanced": ("bench_rlvr", 24, 6),
}
HEADLINE_REGIME, HEADLINE_RATIO = "longtail", 2

_REGIME_FLAG = flags.DEFINE_list("regimes", list(_REGIMES), f"Regimes to run, of {list(_REGIMES)}.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Interleaved repeats of every run (noise).")
_RATIOS = flags.DEFINE_list("async_ratios", ["1", "2", "4"], "α values to measure.")
_SPLITS = flags.DEFINE_list("async_splits", ["1+1"],
                            "rollout+trainer cores for async (1+1: a server alone on one core, "
                            "the learner process and the controller on the other; 2+1: a server on "
                            "each core, the one on the trainer's core at the idle scheduling "
                            "class; the first split is the headline's).")
_STEPS = flags.DEFINE_integer("steps", None, "Steps per run (default: the regime's).")
_WARMUP = flags.DEFINE_integer("warmup_steps", None, "Steps excluded from throughput (default: "
                               "the regime's).")
_PLATFORM = flags.DEFINE_enum(
    "platform", "cpu", ["cpu", "gpu"],
    "cpu: cores split as --async_splits says. gpu: one GPU and one server with 32 decode slots in "
    "both modes (a sync batch's 32 requests in flight at once), the trainer beside the server on "
    "the same GPU in async mode (share_accelerators): the same resources as sync.")
_EXTRA = flags.DEFINE_list("train_flags", [], "Extra flags for every run (e.g. --seed=1).")
_OUT = flags.DEFINE_string("out", None, "Directory for the runs (default: a temp dir).")


@dataclasses.dataclass
class RunResult:
  regime: str
  mode: str  # "sync" or "async α=2 2+1"
  repeat: int
  samples_per_s: float
  tokens_per_s: float
  load: float  # mean 1-minute load average sampled during the run
  info: dict


class _LoadSampler:
  """Samples the 1-minute load average every few seconds while a run is going."""

  def __init__(self, period_s: float = 5.0):
    self.samples: list[float] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)

  def _loop(self, period_s: float) -> None:
    while True:
      self.samples.append(os.getloadavg()[0])
      if self._stop.wait(period_s):
        return

  def __enter__(self) -> "_LoadSampler":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  @property
  def mean(self) -> float:
    return statistics.fmean(self.samples) if self.samples else float("nan")


def summarize(records: list[dict], warmup: int) -> dict:
  """Throughput and profile over the steps after `warmup` (per-step means, seconds)."""
  timed = records[warmup:]
  if not timed:
    raise ValueError(f"only {len(records)} steps: nothing after {warmup} warm-up steps.")
  seconds = timed_seconds(records, warmup)
  samples = sum(r["num_samples"] for r in timed)
  tokens = sum(r["response_length_mean"] * r["num_samples"] for r in timed)
  mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in timed)
  stale = [int(k) for r in timed for k, n in r["staleness_hist"].items() for _ in range(n)]
  evals = [r["eval/expected_accuracy"] for r in records if "eval/expected_accuracy" in r]
  initial = [r["eval/initial_expected_accuracy"] for r in records
             if "eval/initial_expected_accuracy" in r]
  rollout = sum(r.get("time/generate_s", 0.0) + r.get("time/reward_s", 0.0) for r in timed)
  return {
      "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
      "steps": len(timed), "step_s": seconds / len(timed),
      "mean_response_length": tokens / samples,
      "longest_over_median": statistics.fmean(
          r["response_length_max"] / max(r.get("response_length_median", 0.0), 1.0) for r in timed),
      "rollout_share": rollout / seconds,
      "wait_data_s": mean("time/wait_data_s"), "wait_due_s": mean("time/wait_due_group_s"),
      "train_s": mean("time/train_s"),
      "export_s": mean("time/export_s"),
      "handoff_s": mean("time/pause_s") + mean("time/load_s") + mean("time/resume_s"),
      "handoff_wait_s": mean("time/handoff_wait_s"),
      "dropped_stale_groups": sum(r.get("dropped_stale", 0) for r in timed),
      "staleness_max": max(stale) if stale else 0,
      "reward_mean": mean("reward_mean"),
      "eval_initial": initial[0] if initial else None, "eval_final": evals[-1] if evals else None,
  }


def run_one(out: str, regime: str, mode: str, repeat: int, flags_: list[str]) -> RunResult:
  module, default_steps, default_warmup = _REGIMES[regime]
  config = f"experiments/configs/{module}.py"
  steps = _STEPS.value or default_steps
  warmup = default_warmup if _WARMUP.value is None else _WARMUP.value
  name = f"{regime}_{mode.replace(' ', '_').replace('α=', 'a')}_r{repeat}"
  workdir = os.path.join(out, name)
  if os.path.exists(workdir):  # a run would resume from its checkpoint and time nothing
    raise RuntimeError(f"{workdir} exists: give a new --out.")
  cmd = [sys.executable, "-m", "experiments.train", f"--config={config}", f"--workdir={workdir}",
         f"--steps={steps}", f"--eval_every={steps}", "--progress=false", "--plot=false",
         *flags_, *platform_flags(), *_EXTRA.value]
  env = dict(os.environ)
  if _PLATFORM.value == "gpu":  # the server and the trainer processes share the GPU's memory
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  start = time.time()
  with (_LoadSampler() as load, ServerSampler(workdir) as servers,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env) as popen,
        _children.stopped_on_exit(popen) as proc, CpuSampler(workdir, proc.pid) as cpu):
    _, stderr = proc.communicate()
  if proc.returncode != 0:
    raise RuntimeError(f"{name} failed ({' '.join(cmd)}):\n{stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    info = summarize([json.loads(line) for line in f if line.strip()], warmup)
  info["servers"] = server_profile(servers.snapshots, warmup, steps)
  info["cpu"] = cpu_profile(cpu.snapshots, warmup, steps, len(os.sched_getaffinity(0)))
  print(f"  {name}: {time.time() - start:.0f}s, {info['samples_per_s']:.1f} samples/s, "
        f"load {load.mean:.1f}", flush=True)
  return RunResult(regime, mode, repeat, info["samples_per_s"], info["tokens_per_s"], load.mean,
                   info)


def platform_flags() -> list[str]:
  if _PLATFORM.value == "cpu":
    return []
  return ["--set=resources.platform=gpu", "--set=resources.share_accelerators=true",
          "--max_running_requests=32"]


def modes() -> list[tuple[str, list[str]]]:
  out = [("sync", ["--mode=sync", "--async_ratio=0"])]
  splits = _SPLITS.value if _PLATFORM.value == "cpu" else ["1+1"]  # 1 GPU, shared
  for split in splits:
    rollout, train = split.split("+")
    for ratio in _RATIOS.value:
      out.append((f"async α={ratio} {split}", ["--mode=async", f"--async_ratio={ratio}",
                                                f"--rollout_devices={rollout}",
                                                f"--train_devices={train}"]))
  return out


def _ratio(results: list[RunResult], regime: str, mode: str, attr: str) -> float:
  """Median over repeats of (mode / sync of the same repeat)."""
  by_repeat = {r.repeat: r for r in results if r.regime == regime and r.mode == "sync"}
  ratios = [getattr(r, attr) / getattr(by_repeat[r.repeat], attr) for r in results
            if r.regime == regime and r.mode == mode and r.repeat in by_repeat]
  return statistics.median(ratios) if ratios else float("nan")


def _label(r: RunResult) -> str:
  return f"{r.regime:<9} {r.mode:<16} {r.repeat:>3}"


def print_tables(results: list[RunResult]) -> None:
  print(f"\n{'regime':<9} {'mode':<16} {'rep':>3} {'load':>5} {'samples/s':>9} {'x sync':>6} "
        f"{'tok/s':>7} {'x sync':>6} {'len':>5} {'step s':>6} {'wait':>6} {'due':>6} "
        f"{'train':>6} {'export':>6} {'handoff':>7} {'hwait':>6} {'drop':>4} {'stale':>5} "
        f"{'acc0':>5} {'acc':>5}")
  for r in results:
    i = r.info
    sync = next(s for s in results if s.regime == r.regime and s.mode == "sync"
                and s.repeat == r.repeat)
    acc = lambda v: f"{v:5.3f}" if v is not None else "    -"
    print(f"{r.regime:<9} {r.mode:<16} {r.repeat:>3} {r.load:>5.1f} {r.samples_per_s:>9.1f} "
          f"{r.samples_per_s / sync.samples_per_s:>6.2f} {r.tokens_per_s:>7.0f} "
          f"{r.tokens_per_s / sync.tokens_per_s:>6.2f} {i['mean_response_length']:>5.1f} "
          f"{i['step_s']:>6.3f} {i['wait_data_s']:>6.3f} {i['wait_due_s']:>6.3f} "
          f"{i['train_s']:>6.3f} "
          f"{i['export_s']:>6.3f} {i['handoff_s']:>7.3f} {i['handoff_wait_s']:>6.3f} "
          f"{i['dropped_stale_groups']:>4d} "
          f"{i['staleness_max']:>5d} {acc(i['eval_initial'])} {acc(i['eval_final'])}")
  print("\nrollout servers over the timed steps (decode iteration wall time, requests per "
        "iteration, time inside decode/prefill calls):")
  for r in results:
    s = r.info.get("servers")
    if s is None:
      print(f"  {_label(r)}  (no complete server snapshots)")
      continue
    print(f"  {_label(r)}  {s['servers']} servers  "
          f"iteration {s['iteration_ms']:.2f} ms at {s['live']:.1f} live  "
          f"busy {s['busy']:.2f} (prefill {s['prefill_share']:.2f} of it)")
  print("\nCPU over the timed steps (every process of the run; cores busy = CPU seconds / (wall "
        "seconds x cores)):")
  for r in results:
    c = r.info.get("cpu")
    if c is None:
      print(f"  {_label(r)}  (too few CPU readings)")
      continue
    ms = c["ms_per_step"]
    print(f"  {_label(r)}  cores busy {c['cores_busy']:.2f}  "
          f"CPU ms a step: controller {ms['controller']:.1f}, learner {ms['learner']:.1f}, "
          f"servers {ms['servers']:.1f}, other {ms['other']:.1f}; "
          f"{cpu_ms_per_sample(r.info):.2f} ms a sample, {cpu_us_per_token(r.info):.0f} us a "
          f"response token"
          + ("" if c["complete"] else "  (a process ended inside the window: undercounted)"))
  print("\nsync runs (regime numbers):")
  for r in results:
    if r.mode == "sync":
      # On a GPU the work that bounds a step is the accelerator's, not the host cores'.
      busy = (r.info.get("cpu") or {}).get("cores_busy") if _PLATFORM.value == "cpu" else None
      bound = (f"; cores busy {busy:.2f}: its CPU work on these cores, however scheduled, is at "
               f"most {1 / busy:.2f}x as fast" if busy else "")
      print(f"  {r.regime:<9} repeat {r.repeat}: rollout share {r.info['rollout_share']:.2f}, "
            f"longest / median {r.info['longest_over_median']:.1f}, "
            f"mean response {r.info['mean_response_length']:.1f} tokens{bound}")
  print("\nspeedup vs sync (median over repeats of per-repeat ratios; samples/s = (cores busy "
        "vs sync) x (sync's CPU a sample / the mode's); tokens/s the same with CPU a token):")
  for regime in dict.fromkeys(r.regime for r in results):
    for mode in dict.fromkeys(r.mode for r in results if r.regime == regime and r.mode != "sync"):
      busy, per_sample, per_token = _cpu_factors(results, regime, mode)
      samples, tokens = (_ratio(results, regime, mode, attr)
                         for attr in ("samples_per_s", "tokens_per_s"))
      print(f"  {regime:<9} {mode:<16} samples/s {samples:.2f}x  response tokens/s {tokens:.2f}x  "
            f"(cores busy {busy:.2f}x, CPU a sample {per_sample:.2f}x, a token {per_token:.2f}x)")


def _cpu_factors(results: list[RunResult], regime: str, mode: str) -> tuple[float, float, float]:
  """`speedup_factors` of the mode's runs against the sync run of the same repeat."""
  by_repeat = {r.repeat: r for r in results if r.regime == regime and r.mode == "sync"}
  return speedup_factors([(r.info, by_repeat[r.repeat].info) for r in results
                          if r.regime == regime and r.mode == mode and r.repeat in by_repeat])


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  from experiments.warmstart import ensure_project_model
  regimes = _REGIME_FLAG.value
  for regime in regimes:
    if regime not in _REGIMES:
      raise app.UsageError(f"unknown regime {regime!r}; choose from {list(_REGIMES)}.")
    module = importlib.import_module(f"experiments.configs.{_REGIMES[regime][0]}")
    ensure_project_model(module.get_config().model_path)
  out = _OUT.value or tempfile.mkdtemp(prefix="async_vs_sync_")
  print(f"runs in {out} ({os.cpu_count()} cores, load now {os.getloadavg()[0]:.1f})", flush=True)
  results: list[RunResult] = []
  for repeat in range(_REPEATS.value):
    for regime in regimes:
      order = modes() if repeat % 2 == 0 else list(reversed(modes()))
      for mode, mode_flags in order:
        results.append(run_one(out, regime, mode, repeat, mode_flags))
  results.sort(key=lambda r: (regimes.index(r.regime), r.repeat, r.mode != "sync", r.mode))
  print_tables(results)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
  if HEADLINE_REGIME in regimes:
    syncs = [r for r in results if r.regime == HEADLINE_REGIME and r.mode == "sync"]
    headline = next((m for m, _ in modes() if m.startswith(f"async α={HEADLINE_RATIO} ")), None)
    print(f"sync_rollout_share: {statistics.median(r.info['rollout_share'] for r in syncs):.2f}")
    print(f"longest_over_median: "
          f"{statistics.median(r.info['longest_over_median'] for r in syncs):.1f}")
    if headline is not None:
      print(f"async_speedup_vs_sync_tokens: "
            f"{_ratio(results, HEADLINE_REGIME, headline, 'tokens_per_s'):.2f}")
      print(f"async_speedup_vs_sync: "
            f"{_ratio(results, HEADLINE_REGIME, headline, 'samples_per_s'):.2f}")


if __name__ == "__main__":
  app.run(main)
