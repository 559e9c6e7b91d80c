"""How fast this shared machine runs the regime's own engine this minute: a probe between runs.

Why: the simulator's calibration and the runs it predicts are minutes apart on a 2-core machine
whose speed drifts by 10-25% over minutes (2026-11-28: the same long-tail async run made 228 and
264 samples/s twenty minutes apart; a calibration taken after the runs measured its decode 11-19%
slower than the one before, while the runs between them were not slower). The kernel's
contention (`experiments._cpu_time`) sees other processes taking our cores, not cores that run
slower, and the pure-Python load probe (cache-resident work) moved by 1-5% when runs moved by 20%.

So one idle engine server per core, started once per regime with the runs' own model and server
flags, is sent the same small decode batch just before and just after each calibration and each
run: the wall time of `concurrent` requests of `tokens` tokens (`ignore_eos`, greedy), the median
of `reps`, per core (15 batches of 8 x 64 tokens: 0.8 s a probe; ten probes in a row on an idle
machine within 5% of one another). The servers wait on a condition variable between probes (no
CPU: they do not disturb what is measured beside them). A run's servers' costs are rescaled by the
probe of their cores over its calibration's (`Sides.SERVERS`, the default). The trainer's are not:
a decode batch measures decode, and a train step did not follow it. In pass AN (2026-11-28) the
trainer's core probed 9-12% faster around the balanced async runs than around their calibrations,
the runs' train steps were not faster, and rescaling the train cost by it caused most of that
pass's error. Re-predicting passes AI-AN offline with the probe on the servers' side only put all
six within 15% (largest errors 0.142, 0.100, 0.144, 0.140, 0.067, 0.091; on both sides: 0.139,
0.114, 0.150, 0.154, 0.092, 0.149; without it: 0.214, 0.090, 0.147, 0.130, 0.126, 0.042). That
rule was chosen on those passes, so the passes after it are its test (docs/simulator.md).
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import os
import statistics
import time
import urllib.request
from typing import Any, Sequence

from flashrl_jax.controller import RunConfig, engine_server_args
from flashrl_jax.fleet import LocalServers


class MachineProbe:
  """Idle engine servers, one pinned to each core, probed on demand (a context manager)."""

  def __init__(self, config: RunConfig, log_dir: str, cores: Sequence[int] | None = None,
               concurrent: int = 8, tokens: int = 64, reps: int = 15):
    self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    self.concurrent, self.tokens, self.reps = concurrent, tokens, reps
    os.makedirs(log_dir, exist_ok=True)
    self._servers = LocalServers.start(
        config.model_path, len(self.cores), cpu_sets=[[c] for c in self.cores], log_dir=log_dir,
        extra_args=engine_server_args(config))
    self.measure()  # the first requests compile nothing (warmed up) but touch every page

  def __enter__(self) -> MachineProbe:
    return self

  def __exit__(self, *exc) -> None:
    self._servers.stop()

  def _generate(self, url: str) -> None:
    body = json.dumps({"input_ids": list(range(3, 19)),
                       "sampling_params": {"max_new_tokens": self.tokens, "ignore_eos": True,
                                           "temperature": 0.0}}).encode()
    request = urllib.request.Request(f"{url}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
      response.read()

  def _batch_s(self, url: str, pool: concurrent.futures.Executor) -> float:
    start = time.perf_counter()
    list(pool.map(self._generate, [url] * self.concurrent))
    return time.perf_counter() - start

  def measure(self) -> dict[str, Any]:
    """Median seconds of the probe batch on each core's server (cores in turn, so one core's
    probe does not slow the other's), and their mean."""
    per_core = {}
    with concurrent.futures.ThreadPoolExecutor(self.concurrent) as pool:
      for core, url in zip(self.cores, self._servers.urls):
        per_core[core] = statistics.median(self._batch_s(url, pool) for _ in range(self.reps))
    return {"machine_probe_s": statistics.mean(per_core.values()),
            "machine_probe_per_core": {str(c): s for c, s in per_core.items()}}


def around(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
  """Two probes around one measurement, averaged (per core too). Each is kept as well, to tell
  drift during the measurement from a bias of probing right after its processes exit."""
  return {"machine_probe_s": (before["machine_probe_s"] + after["machine_probe_s"]) / 2,
          "machine_probe_before_s": before["machine_probe_s"],
          "machine_probe_after_s": after["machine_probe_s"],
          "machine_probe_per_core": {
              c: (before["machine_probe_per_core"][c] + after["machine_probe_per_core"][c]) / 2
              for c in before["machine_probe_per_core"]}}


def speed_ratio(run: dict[str, Any], calibration: dict[str, Any], cores: Sequence[int]) -> float:
  """How much slower the machine ran `cores` around a run than around its calibration: the mean
  of the cores' probe ratios (1 without probes on either side)."""
  if "machine_probe_per_core" not in run or "machine_probe_per_core" not in calibration:
    return 1.0
  ratios = [run["machine_probe_per_core"][str(c)] / calibration["machine_probe_per_core"][str(c)]
            for c in cores]
  return statistics.mean(ratios)


class Sides(enum.Enum):
  """Which side's costs a run's probe rescales."""

  NONE = "none"  # neither: the calibration's costs as measured
  SERVERS = "servers"  # the servers' costs, by their cores' probes (the default: module doc)
  BOTH = "both"  # the trainer's too, by its cores' decode probes (the rule before 2026-11-28)


def machine_speed(run: dict[str, Any], calibration: dict[str, Any], server_cores: Sequence[int],
                  train_cores: Sequence[int], sides: Sides = Sides.SERVERS
                  ) -> tuple[float, float]:
  """(servers', trainer's) cost factors of a run against its calibration under `sides`: each
  side that is rescaled gets `speed_ratio` of its cores, the other 1."""
  servers = speed_ratio(run, calibration, server_cores) if sides != Sides.NONE else 1.0
  trainer = speed_ratio(run, calibration, train_cores) if sides == Sides.BOTH else 1.0
  return servers, trainer
