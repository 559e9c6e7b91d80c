"""What the kernel says a measurement's processes spent: CPU time and time waiting for a CPU.

Why a module of its own: the simulator's calibration (`experiments._calibration`) and the runs it
predicts (`experiments.benchmarks.sim_vs_measured`) are timed on a shared 2-core machine minutes
apart, so both record the CPU contention their processes met (`cpu_times`, `contention`, per side:
`processes` tells a run's learner process from its servers) and a load probe around them (`probe`,
`probe_pair`); a calibrated cost is rescaled to a run's contention by their ratio.
`async_vs_sync` prices each run's timed steps in CPU time per role (`CpuSampler`, `cpu_profile`):
how much of the machine a mode kept busy, and how much CPU work a sample cost it, are the two
factors of any speedup on the same cores.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, NamedTuple

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


# --- where a run's CPU went, by role (async_vs_sync) ----------------------------------------------

ROLES = ("controller", "learner", "servers", "other")
_ROLE_MARKS = (("learner", LEARNER_MARK), ("servers", "flashrl_jax.rollout.server"),
               ("controller", "experiments.train"))


def role_of(cmdline: list[str]) -> str:
  """A run's process by its command line: its learner process, a rollout server, the run's own
  process (the controller, and the trainer where the learner has no process of its own), or other
  (a sandbox, a router)."""
  for role, mark in _ROLE_MARKS:
    if any(mark in part for part in cmdline):
      return role
  return "other"


class CpuSnapshot(NamedTuple):
  seconds: float  # time.monotonic()
  steps: int  # step records the run had written
  cpu_s: dict[int, tuple[str, float]]  # pid -> (role, seconds on a CPU so far)


class CpuSampler:
  """Reads the CPU time of a run's process `root` and every process it started (recursively: its
  learner, its servers) as the run writes its step records, so a window of its steps can be priced
  in CPU seconds per role (`cpu_profile`).

  A reading follows a new record within `poll_s` (a step of the long-tail benchmark is ~60 ms),
  at most one per `period_s`: read on a timer instead, a window's last reading could land in the
  last step's held-out evaluation, which the run's throughput leaves out. Each reading is one
  `/proc/<pid>/stat` per process (~3 ms in all for a run's processes)."""

  def __init__(self, workdir: str, root: int, period_s: float = 0.25, poll_s: float = 0.02):
    self.metrics, self.root, self.snapshots = os.path.join(workdir, "metrics.jsonl"), root, []
    self._steps, self._offset = 0, 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, args=(period_s, poll_s), daemon=True)

  def _count_records(self) -> int | None:
    """Records written so far (None before the file exists), reading only what is new."""
    try:
      with open(self.metrics, "rb") as f:
        if os.fstat(f.fileno()).st_size < self._offset:  # rewritten (a resume truncates it)
          self._offset = self._steps = 0
        f.seek(self._offset)
        new = f.read()
    except OSError:
      return None
    self._offset += len(new)
    self._steps += new.count(b"\n")
    return self._steps

  def snapshot(self) -> CpuSnapshot | None:
    import psutil
    steps = self._count_records()
    if steps is None:  # the run has not written a step yet
      return None
    cpu_s = {}
    try:
      root = psutil.Process(self.root)
      processes = [root, *root.children(recursive=True)]
    except psutil.Error:  # the run has ended
      return CpuSnapshot(time.monotonic(), steps, cpu_s)
    for process in processes:
      try:
        role = role_of(process.cmdline())
        times = process.cpu_times()
      except psutil.Error:  # gone: it counts nothing either way
        continue
      cpu_s[process.pid] = (role, times.user + times.system)
    return CpuSnapshot(time.monotonic(), steps, cpu_s)

  def _loop(self, period_s: float, poll_s: float) -> None:
    last = -period_s
    while not self._stop.wait(poll_s):
      if time.monotonic() - last < period_s:
        continue
      seen = self._steps
      try:
        grown = os.path.getsize(self.metrics) != self._offset
      except OSError:
        continue
      if grown:
        snapshot = self.snapshot()
        if snapshot is not None and snapshot.steps != seen:
          self.snapshots.append(snapshot)
          last = snapshot.seconds

  def __enter__(self) -> "CpuSampler":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()


def cpu_profile(snapshots: list[CpuSnapshot], warmup: int, steps: int,
                cores: int) -> dict | None:
  """Where the CPU went between the first snapshot after step `warmup` and the last one before the
  run's last two steps (a pure function of `CpuSampler`'s snapshots): the last step is followed by
  the run's held-out evaluation, outside its timed steps.

  cores_busy: the run's CPU seconds / (wall seconds × `cores`), the fraction of the machine's
  cores it kept busy (a schedule of the same CPU work on the same cores is at most 1 / cores_busy
  times faster); ms_per_step: CPU milliseconds a step per role. A process that ended inside the
  window loses its CPU time: `complete` says whether none did. None without two snapshots in the
  window or a step between them."""
  window = [s for s in snapshots if warmup <= s.steps <= steps - 2]
  if len(window) < 2 or window[-1].steps == window[0].steps:
    return None
  first, last = window[0], window[-1]
  per_role = dict.fromkeys(ROLES, 0.0)
  for pid, (role, seconds) in last.cpu_s.items():
    before = first.cpu_s.get(pid)
    per_role[role] += seconds - (before[1] if before is not None else 0.0)  # new: all of it
  wall, n = last.seconds - first.seconds, last.steps - first.steps
  return {"cores_busy": sum(per_role.values()) / (wall * cores),
          "ms_per_step": {role: 1000 * s / n for role, s in per_role.items()},
          "steps": n, "complete": set(first.cpu_s) <= set(last.cpu_s)}


def cpu_ms_per_sample(info: dict) -> float:
  """A run's CPU milliseconds per trained sample over its timed steps, from its `cpu_profile`
  (`info["cpu"]`) and its step time and throughput (nan without CPU readings)."""
  c = info.get("cpu")
  if not c:
    return float("nan")
  return sum(c["ms_per_step"].values()) / (info["samples_per_s"] * info["step_s"])


def cpu_us_per_token(info: dict) -> float:
  """A run's CPU microseconds per trained response token over its timed steps: its CPU per sample
  without the policy's answer lengths, which drift between runs."""
  return 1000 * cpu_ms_per_sample(info) / info["mean_response_length"]


def speedup_factors(pairs: list[tuple[dict, dict]]) -> tuple[float, float, float]:
  """Medians over (run, its sync baseline) pairs of the run's cores busy / sync's, of sync's CPU per
  sample / the run's and of sync's CPU per response token / the run's: the first times the second
  is (to the edges of the readings' windows) the run's samples/s ratio to sync, the first times the
  third its response tokens/s ratio. nans without a pair that has CPU readings on both sides."""
  pairs = [(run, sync) for run, sync in pairs if run.get("cpu") and sync.get("cpu")]
  if not pairs:
    return float("nan"), float("nan"), float("nan")
  return (statistics.median(run["cpu"]["cores_busy"] / sync["cpu"]["cores_busy"]
                            for run, sync in pairs),
          statistics.median(cpu_ms_per_sample(sync) / cpu_ms_per_sample(run)
                            for run, sync in pairs),
          statistics.median(cpu_us_per_token(sync) / cpu_us_per_token(run)
                            for run, sync in pairs))
