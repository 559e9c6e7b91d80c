"""What the kernel says a measurement's processes spent: CPU time and time waiting for a CPU.

Why a module of its own: the simulator's calibration (`experiments._calibration`) and the runs it
predicts (`experiments.benchmarks.sim_vs_measured`) are timed on a shared 2-core machine minutes
apart, so both record the CPU contention their processes met (`cpu_times`, `contention`, per side:
`processes` tells a run's learner process from its servers) and a load probe around them (`probe`,
`probe_pair`); a calibrated cost is rescaled to a run's contention by their ratio.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from flashrl_jax.controller import LearnerProcess

_PROBE_N = 300_000  # ~20-40 ms of pure-Python work on an idle core of this machine


def probe(reps: int = 5) -> dict[str, Any]:
  """Median wall seconds of fixed pure-Python work on each core (this thread pinned in turn)."""
  cores = sorted(os.sched_getaffinity(0))
  per_core = {}
  try:
    for core in cores:
      os.sched_setaffinity(0, [core])
      times = []
      for _ in range(reps):
        start = time.perf_counter()
        sum(i * i for i in range(_PROBE_N))
        times.append(time.perf_counter() - start)
      per_core[core] = statistics.median(times)
  finally:
    os.sched_setaffinity(0, cores)
  return {"probe_s": float(np.mean(list(per_core.values()))), "per_core": per_core,
          "loadavg": os.getloadavg()[0]}


def cpu_times(pids) -> tuple[float, float]:
  """Seconds on a CPU and seconds runnable but waiting for one, summed over every thread of
  `pids` (the kernel's schedstat; processes that are gone count nothing)."""
  run = wait = 0
  for pid in pids:
    try:
      tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
      continue
    for tid in tids:
      try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
          fields = f.read().split()
      except OSError:
        continue
      run, wait = run + int(fields[0]), wait + int(fields[1])
  return run / 1e9, wait / 1e9


LEARNER_MARK = LearnerProcess.__module__  # the learner process's command line names it


def processes(root: int) -> tuple[list[int], list[int]]:
  """(the trainer's process, the servers): a run's learner process (`LearnerProcess`, where its
  trainer runs) if it has one, else `root` itself (a calibration, or a run training in-process);
  and `root`'s other descendants. The controller's own process is on neither side when the learner
  has its own: what its event loop takes from the learner's core shows in the learner's wait."""
  import psutil
  learners, servers = [], []
  try:
    children = psutil.Process(root).children(recursive=True)
  except psutil.Error:
    return [root], servers
  for child in children:
    try:
      is_learner = any(LEARNER_MARK in part for part in child.cmdline())
    except psutil.Error:  # gone: it counts nothing either way
      continue
    (learners if is_learner else servers).append(child.pid)
  return learners or [root], servers


def contention(before: tuple[float, float], after: tuple[float, float]) -> float:
  """(time on a CPU + time waiting for one) / time on a CPU between two `cpu_times`: how much
  longer the threads' CPU work took than on cores of their own (1 on an idle machine). A
  CPU-bound thread's wall time is its CPU time times this factor (checked: 2.79 vs 2.81 at load 11),
  so a cost measured at one factor is rescaled to another by their ratio."""
  run, wait = after[0] - before[0], after[1] - before[1]
  return (run + wait) / run if run > 1e-3 else 1.0


def probe_pair(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
  """The probes around a calibration or a run, averaged (per core too)."""
  cores = sorted(before["per_core"])
  return {"probe_s": (before["probe_s"] + after["probe_s"]) / 2,
          "probe_per_core": {str(c): (before["per_core"][c] + after["per_core"][c]) / 2
                             for c in cores},
          "loadavg": [before["loadavg"], after["loadavg"]]}
