"""How fast this shared machine runs the regime's own engine this minute: a probe between runs.

Why: the simulator's calibration and the runs it predicts are minutes apart on a 2-core machine
whose speed drifts by 10-25% over minutes (2026-11-28: the same long-tail async run made 228 and
264 samples/s twenty minutes apart; a calibration taken after the runs measured its decode 11-19%
slower than the one before, while the runs between them were not slower). The kernel's
contention (`experiments._cpu_time`) sees other processes taking our cores, not cores that run
slower, and the pure-Python load probe (cache-resident work) moved by 1-5% when runs moved by 20%.

So one idle engine server per core, started once per regime with the runs' own model and server
flags, is sent the same small decode batch just before and just after each calibration and each run:
the wall time of `concurrent` requests of `tokens` tokens (`ignore_eos`, greedy), the median of
`reps`, per core (15 batches of 8 x 64 tokens: 0.8 s a probe; ten probes in a row on an idle machine
within 5% of one another). The servers wait on a condition variable between probes (no CPU: they do
not disturb what is measured beside them). Beside each server, one idle learner process per core
(the regime's model and train config, learning rate 0 so its weights and so its arithmetic never
change) times the same train step on a fixed batch, the median of `train_reps`: the train probe. A
run's servers' costs were rescaled by the decode probe of their cores over its calibration's
(`Sides.SERVERS`, the rule from pass AO until BF). The trainer's were not: a decode batch measures
decode, and a train step did not follow it; `Sides.TRAIN` rescales them by the train probe instead,
printed beside the rule, not applied: in its first pass (AS, 2026-11-28, on a machine 2-3x slower
whose speed flipped between two modes within minutes) it read the trainer's core x0.79-1.09 of its
calibrations', moved with neither the runs' train steps nor the decode probe, and raised the
largest error from 0.281 to 0.337 (docs/simulator.md). In pass AN (2026-11-28) the trainer's core
probed 9-12% faster around the balanced async runs than around their calibrations, the runs' train
steps were not faster, and rescaling the train cost by it caused most of that pass's error.
Re-predicting passes AI-AN offline with the probe on the servers' side only put all six within 15%
(largest errors 0.142, 0.100, 0.144, 0.140, 0.067, 0.091; on both sides: 0.139, 0.114, 0.150,
0.154, 0.092, 0.149; without it: 0.214, 0.090, 0.147, 0.130, 0.126, 0.042). That rule was chosen
on those passes, so the passes after it were its test (docs/simulator.md), and in the machine's
slow mode it failed it: in passes BC-BF (2026-11-29, probes 45-75 ms against ~20 in the normal
mode) it rescaled a run's servers by x0.68-1.31 while their decode iterations ran x0.85-1.35 of
the calibrated step, not with it (BF's long-tail α = 1 run: x0.68 by the probe, its decode x1.35),
and the largest errors were 0.313, 0.442, 0.146, 0.468 with it against 0.188, 0.188, 0.113, 0.162
without it. Since pass BF the rule rescales neither side (`Sides.NONE`); the probes are still
taken, and their predictions printed beside the rule.

The same servers are also probed *during* each calibration and each run (`MachineProbe.during`):
a small batch every few seconds on a core that the measurement is using, timed by the server's
seconds on a CPU rather than its wall time. sim_vs_measured prints the prediction it gives beside
the rule (since pass AU), not applied: probes before and after a run did not follow the runs in
passes AS and AT. Since 2026-11-29 the idle learner of the trainer's cores also takes a train step
during each (`during(train_cores=...)`), printed likewise: in its first pass (AW) it read the
trainer's core x0.87-1.01 of the calibrations' while the runs' train steps took x1.08-1.27 of the
predicted step, so it did not follow them either (docs/simulator.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import json
import os
import statistics
import threading
import time
import urllib.request
from typing import Any, Iterator, Sequence

import numpy as np
import psutil

from experiments import _cpu_time
from flashrl_jax.controller import (
    LearnerProcess, LearnerProcessError, RunConfig, engine_server_args)
from flashrl_jax.fleet import LocalServers
from flashrl_jax.model import read_config
from flashrl_jax.trainer import Trajectory, random_trajectories

_PROBES = ("machine_probe", "train_probe")  # the decode probe's keys and the train probe's


def pinned_learner(config: RunConfig, core: int, workdir: str) -> LearnerProcess:
  """A learner process of `config` on `core` alone, whose updates leave its weights unchanged
  (learning rate 0: every probe steps the same weights through the same arithmetic)."""
  train = config.train
  config = config.replace(eval_every=0, precompile=False, train=train.replace(
      optimizer=dataclasses.replace(train.optimizer, learning_rate=0.0)))
  mask = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {core})  # the child inherits this thread's mask
  try:
    return LearnerProcess.start(config, workdir)
  finally:
    os.sched_setaffinity(0, mask)


@functools.cache
def _vocab_size(model_path: str) -> int:
  return read_config(model_path).vocab_size  # read once, not at every probe step


def probe_batch(config: RunConfig, version: int) -> list[Trajectory]:
  """The train probe's batch: one step's samples of random tokens, prompts of 8-24 tokens and
  responses of 1-48 (the same batch every time: seeded), at the learner's `version`."""
  return random_trajectories(np.random.default_rng(0), config.samples_per_step,
                             vocab_size=_vocab_size(config.model_path),
                             prompt_lengths=(8, 24), response_lengths=(1, 48),
                             group_size=config.group_size, version=version)


def train_step_s(learner: LearnerProcess, config: RunConfig) -> float:
  """Seconds of one update of `learner` on the probe's batch (`probe_batch`)."""
  batch = probe_batch(config, learner.policy_version)
  start = time.perf_counter()
  learner.update(batch)
  return time.perf_counter() - start


class MachineProbe:
  """Idle engine servers and idle learners, one of each pinned to each core, probed on demand (a
  context manager)."""

  def __init__(self, config: RunConfig, log_dir: str, cores: Sequence[int] | None = None,
               concurrent: int = 8, tokens: int = 64, reps: int = 15, train_reps: int = 9):
    self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    self.concurrent, self.tokens, self.reps, self.train_reps = concurrent, tokens, reps, train_reps
    self._config = config
    os.makedirs(log_dir, exist_ok=True)
    self._learners: list[LearnerProcess] = []
    self._servers = LocalServers.start(
        config.model_path, len(self.cores), cpu_sets=[[c] for c in self.cores], log_dir=log_dir,
        extra_args=engine_server_args(config))
    try:
      for core in self.cores:
        self._learners.append(
            pinned_learner(config, core, os.path.join(log_dir, f"learner_{core}")))
      # Untimed: the first requests compile nothing (warmed up) but touch every page, and each
      # learner's first update compiles the probe batch's step.
      self.measure()
    except BaseException:
      self.__exit__()
      raise

  def __enter__(self) -> MachineProbe:
    return self

  def __exit__(self, *exc) -> None:
    try:
      for learner in self._learners:
        learner.close()
    finally:
      self._servers.stop()

  def pids(self, core: int) -> tuple[int | None, int]:
    """(core `core`'s probe server's pid, None once it has exited; its probe learner's pid)."""
    i = self.cores.index(core)
    return self._servers.pid(i), self._learners[i].pid

  def _generate(self, url: str, tokens: int) -> None:
    body = json.dumps({"input_ids": list(range(3, 19)),
                       "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True,
                                           "temperature": 0.0}}).encode()
    request = urllib.request.Request(f"{url}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
      response.read()

  def _batch_s(self, i: int, pool: concurrent.futures.Executor, tokens: int
               ) -> tuple[float, float]:
    """(seconds server `i` spent on a CPU serving one probe batch of `tokens` tokens a request,
    the batch's wall seconds): the kernel's count over the server's threads, in which time it
    waited for the CPU is not."""
    pid = self._servers.pid(i)
    before, start = _cpu_time.cpu_times([pid])[0], time.perf_counter()
    list(pool.map(self._generate, [self._servers.urls[i]] * self.concurrent,
                  [tokens] * self.concurrent))
    return _cpu_time.cpu_times([pid])[0] - before, time.perf_counter() - start

  def _train_s(self, core: int) -> tuple[float, float]:
    """(seconds core `core`'s learner process spent on a CPU in one train probe step, the step's
    wall seconds)."""
    learner = self._learners[self.cores.index(core)]
    before = _cpu_time.cpu_times([learner.pid])[0]
    wall = train_step_s(learner, self._config)
    return _cpu_time.cpu_times([learner.pid])[0] - before, wall

  @contextlib.contextmanager
  def during(self, period_s: float = 5.0, tokens: int = 32, train_cores: Sequence[int] = (),
             train_period_s: float = 15.0) -> Iterator[dict[str, Any]]:
    """Probes the machine *while* the body runs: every `period_s` seconds one core's server (in
    turn) serves a probe batch of `tokens` tokens a request beside whatever that core is running,
    and its seconds on a CPU are read, not its wall time, so the core's sharing with the
    measurement does not count and its speed does. The dict yielded is filled on exit with
    `during_probe_per_core` (the per-core median; keyed as `speed_ratio` reads it), `during_probe_s`
    (their mean), `during_probe_wall_per_core` (the batches' median wall seconds: how much the
    core was shared) and `during_probe_count` (batches per core), or none of these if a core got
    no batch or a probe server failed (then `during_probe_error` says which and why, and the
    body's measurement is kept); and `steal_per_core`, the fraction of each core's time the
    hypervisor gave to another machine (/proc/stat; this machine is a VM whose neighbours may
    take its cores).

    Why: on a machine whose speed flips between two modes within minutes (2026-11-28, passes AS
    and AT) the probes just before and after a run did not follow it (pass AT: one run's probes
    read its servers' core x1.22 slower than at calibration while the run decoded at x0.65 of the
    calibrated step). A batch every 10 s per core on 2 cores costs ~0.5% of a core. Its seconds on
    a CPU still depend on whether the core idled just before: a batch every 0.2 s on an otherwise
    idle core took 60 ms on a CPU, batches back to back 38 ms (beside a CPU hog: 39 ms on a CPU,
    66 ms of wall time; tests/test_machine_probe.py, 2026-11-28); during a calibration or a run
    the core is busy, as it is back to back. On this machine's slow mode sharing a core costs CPU
    time too: alone 71 ms on a CPU, beside the hog 110 (2026-11-29), so there a probe batch beside
    a run's server reads its core slower than the server alone would find it.

    With `train_cores`, every `train_period_s` seconds one of those cores' idle learner (in turn)
    also takes the train probe's step (`probe_batch`), timed by its process's seconds on a CPU:
    `during_train_probe_per_core`, `_s`, `_wall_per_core` and `_count` likewise (or
    `during_train_probe_error`). One probe at a time (one thread), so a decode batch and a train
    step never share a core with each other. Why: in the slow mode the balanced async runs' train
    steps took x0.98-1.43 of the predicted step while their trainer's core was less contended than
    at calibration (pass AV, docs/simulator.md), and neither the decode probe on that core nor the
    train probe around the run followed (nor, in its first pass, did this one: module doc). A train step of the probe batch costs about
    what an async run's step does (one micro-batch: 0.21-0.34 s around pass AV's balanced runs,
    whose async steps took 0.26-0.40 s), so one every 15 s takes ~2% of the trainer's core."""
    if not set(train_cores) <= set(self.cores):
      raise ValueError(f"train cores {list(train_cores)} are not all probed cores {self.cores}")
    result: dict[str, Any] = {}
    kinds = {"during_probe": (self.cores, period_s), "during_train_probe": (
        list(train_cores), train_period_s)}
    samples = {kind: {core: [] for core in cores} for kind, (cores, _) in kinds.items()}
    stop = threading.Event()

    def loop() -> None:
      with concurrent.futures.ThreadPoolExecutor(self.concurrent) as pool:
        now = time.monotonic()
        due = {kind: now + period if cores else float("inf")
               for kind, (cores, period) in kinds.items()}
        turns = dict.fromkeys(kinds, 0)
        while min(due.values()) < float("inf"):
          kind = min(due, key=due.get)  # ties: decode first, then the train probe
          if stop.wait(max(0.0, due[kind] - time.monotonic())):
            return
          cores, period = kinds[kind]
          core = cores[turns[kind] % len(cores)]
          try:
            samples[kind][core].append(
                self._batch_s(self.cores.index(core), pool, tokens) if kind == "during_probe"
                else self._train_s(core))
          except (OSError, LearnerProcessError) as exc:  # the server or learner died: say so
            what = "probe server" if kind == "during_probe" else "probe learner"
            result[f"{kind}_error"] = f"core {core}'s {what}: {exc!r}"
            due[kind] = float("inf")  # that probe stops; the other goes on
            continue
          turns[kind] += 1
          due[kind] = time.monotonic() + period

    thread = threading.Thread(target=loop, name="machine-probe-during", daemon=True)
    ticks = psutil.cpu_times(percpu=True)
    thread.start()
    try:
      yield result
    finally:
      stop.set()
      thread.join()
      after = psutil.cpu_times(percpu=True)
      # user, nice, system, idle, iowait, irq, softirq, steal (guest time is inside user's)
      spent = {c: [b - a for a, b in zip(ticks[c][:8], after[c][:8])] for c in self.cores}
      result["steal_per_core"] = {str(c): d[7] / max(sum(d), 1e-9) for c, d in spent.items()}
      for kind, per_core_samples in samples.items():
        if (per_core_samples and all(per_core_samples.values())
            and f"{kind}_error" not in result):
          per_core = {str(c): statistics.median(cpu for cpu, _ in s)
                      for c, s in per_core_samples.items()}
          result.update({
              f"{kind}_per_core": per_core, f"{kind}_s": statistics.mean(per_core.values()),
              f"{kind}_wall_per_core": {str(c): statistics.median(w for _, w in s)
                                        for c, s in per_core_samples.items()},
              f"{kind}_count": min(len(s) for s in per_core_samples.values())})

  def measure(self) -> dict[str, Any]:
    """Median seconds of the decode probe batch on each core's server and of the train probe's
    step on each core's learner (one core and one probe at a time, so no probe slows another),
    and their means over the cores."""
    decode, train = {}, {}
    with concurrent.futures.ThreadPoolExecutor(self.concurrent) as pool:
      for i, core in enumerate(self.cores):
        decode[core] = statistics.median(self._batch_s(i, pool, self.tokens)[1]
                                         for _ in range(self.reps))
    for core, learner in zip(self.cores, self._learners):
      train[core] = statistics.median(train_step_s(learner, self._config)
                                      for _ in range(self.train_reps))
    return {"machine_probe_s": statistics.mean(decode.values()),
            "machine_probe_per_core": {str(c): s for c, s in decode.items()},
            "train_probe_s": statistics.mean(train.values()),
            "train_probe_per_core": {str(c): s for c, s in train.items()}}


def around(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
  """Two probes around one measurement, averaged (per core too), for each probe both took. Each
  is kept as well, to tell drift during the measurement from a bias of probing right after its
  processes exit."""
  out = {}
  for name in _PROBES:
    if f"{name}_s" not in before or f"{name}_s" not in after:
      continue
    first, last = before[f"{name}_per_core"], after[f"{name}_per_core"]
    out.update({f"{name}_s": (before[f"{name}_s"] + after[f"{name}_s"]) / 2,
                f"{name}_before_s": before[f"{name}_s"], f"{name}_after_s": after[f"{name}_s"],
                f"{name}_per_core": {c: (first[c] + last[c]) / 2 for c in first}})
  return out


def speed_ratio(run: dict[str, Any], calibration: dict[str, Any], cores: Sequence[int],
                probe: str = "machine_probe") -> float:
  """How much slower the machine ran `cores` around a run than around its calibration by `probe`
  (the decode probe, "train_probe", or "during_probe" / "during_train_probe", taken while each ran:
  `MachineProbe.during`):
  the mean of the cores' probe ratios (1 without that probe on either side)."""
  key = f"{probe}_per_core"
  if key not in run or key not in calibration:
    return 1.0
  return statistics.mean(run[key][str(c)] / calibration[key][str(c)] for c in cores)


def pooled(probed: Sequence[dict[str, Any]], probe: str = "machine_probe") -> dict[str, Any]:
  """`probe`'s per-core median over several measurements' probes (a regime's runs, or its
  calibrations), keyed as one measurement's (`{probe}_per_core`); empty if none was probed.
  sim_vs_measured prints a prediction rescaled by pooled probes beside the rule (since ed3fcef;
  pass AT: 0.373 against the rule's 0.376, docs/simulator.md)."""
  have = [p[f"{probe}_per_core"] for p in probed if f"{probe}_per_core" in p]
  if not have:
    return {}
  return {f"{probe}_per_core": {core: statistics.median(h[core] for h in have)
                                for core in have[0]}}


class Sides(enum.Enum):
  """Which side's costs a run's probe rescales."""

  NONE = "none"  # neither: the calibration's costs as measured (the rule since pass BF)
  SERVERS = "servers"  # the servers' costs, by their cores' probes (the rule AO-BE: module doc)
  BOTH = "both"  # the trainer's too, by its cores' decode probes (the rule before 2026-11-28)
  TRAIN = "train"  # the servers' by their decode probes, the trainer's by its cores' train probes
  # The servers' by their decode probes, the trainer's by its cores' train probe taken during the
  # run against the one during the calibration (`MachineProbe.during`; since 2026-11-29).
  TRAIN_DURING = "train_during"


def machine_speed(run: dict[str, Any], calibration: dict[str, Any], server_cores: Sequence[int],
                  train_cores: Sequence[int], sides: Sides) -> tuple[float, float]:
  """(servers', trainer's) cost factors of a run against its calibration under `sides`: each
  side that is rescaled gets `speed_ratio` of its cores by its probe, the other 1."""
  servers = speed_ratio(run, calibration, server_cores) if sides != Sides.NONE else 1.0
  trainer = {Sides.BOTH: lambda: speed_ratio(run, calibration, train_cores),
             Sides.TRAIN: lambda: speed_ratio(run, calibration, train_cores, "train_probe"),
             Sides.TRAIN_DURING: lambda: speed_ratio(run, calibration, train_cores,
                                                     "during_train_probe"),
             }.get(sides, lambda: 1.0)()
  return servers, trainer
