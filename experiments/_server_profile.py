"""What a run's rollout servers did while it trained: their `/server_info` counters, sampled from
outside the run (benchmarks), and the profile of a window of its steps (a pure function).

Why from outside: the benchmark compares runs of the real system, so nothing in them is changed to
measure them; the servers already count their decode steps, busy slots and the wall time inside
decode and prefill calls, which is what prices a decode iteration at the live requests a mode
keeps (sync's tail vs async's continuous batch).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from typing import NamedTuple

_SERVER_COUNTERS = ("decode_steps", "busy_slot_steps", "decode_s", "prefill_calls", "prefill_s")


def server_counters(url: str, timeout_s: float = 5.0,
                    keys: tuple[str, ...] = _SERVER_COUNTERS) -> dict[str, float]:
  """One rollout server's counters `keys` (the decode counters by default), from its
  `/server_info`."""
  with urllib.request.urlopen(f"{url}/server_info", timeout=timeout_s) as resp:
    state = json.load(resp)["internal_states"][0]
  return {key: float(state.get(key, 0)) for key in keys}


class Snapshot(NamedTuple):
  seconds: float  # time.monotonic()
  steps: int  # steps the run had recorded
  counters: dict[str, float]  # `_SERVER_COUNTERS`, summed over the servers that answered
  servers: int  # how many answered


class ServerSampler:
  """Reads every rollout server's `/server_info` counters twice a second while a run is going,
  with the number of steps the run has recorded by then (its `metrics.jsonl` lines).

  The servers' ports come from their log files' names (`server_logs/server_<i>_<port>.log`), so
  nothing in the run is changed to measure it."""

  def __init__(self, workdir: str, period_s: float = 0.5):
    self.workdir, self.snapshots = workdir, []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)

  def snapshot(self) -> Snapshot | None:
    """The servers' counters now (None before the run writes its metrics and server logs)."""
    try:
      with open(os.path.join(self.workdir, "metrics.jsonl"), "rb") as f:
        steps = sum(1 for _ in f)
      logs = os.listdir(os.path.join(self.workdir, "server_logs"))
    except OSError:  # the run has not started writing yet
      return None
    totals, answered = dict.fromkeys(_SERVER_COUNTERS, 0.0), 0
    for name in logs:
      port = name.rsplit("_", 1)[-1].removesuffix(".log")
      try:
        counters = server_counters(f"http://127.0.0.1:{port}", timeout_s=1)
      except (OSError, ValueError, KeyError, IndexError):
        continue  # starting, stopping or restarting: this snapshot lacks it
      answered += 1
      for key in _SERVER_COUNTERS:
        totals[key] += counters[key]
    return Snapshot(time.monotonic(), steps, totals, answered)

  def _loop(self, period_s: float) -> None:
    while not self._stop.wait(period_s):
      snapshot = self.snapshot()
      if snapshot is not None:
        self.snapshots.append(snapshot)

  def __enter__(self) -> "ServerSampler":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()


def server_profile(snapshots: list[Snapshot], warmup: int, steps: int) -> dict | None:
  """What the rollout servers did between the end of step `warmup` and the last snapshot before
  the run's last step (a pure function of the sampler's snapshots).

  iteration_ms: wall time of one decode iteration (results on the host included); live: requests
  per iteration; busy: fraction of the servers' wall time inside decode or prefill calls. None when
  the window holds no decode work or a server restarted (its counters started again)."""
  servers = max((s.servers for s in snapshots), default=0)
  window = [s for s in snapshots if warmup <= s.steps < steps and s.servers == servers]
  if len(window) < 2:
    return None
  first, last = window[0], window[-1]
  delta = {key: last.counters[key] - first.counters[key] for key in _SERVER_COUNTERS}
  server_seconds = (last.seconds - first.seconds) * servers
  if delta["decode_steps"] <= 0 or min(delta.values()) < 0:
    return None
  return {"iteration_ms": 1000 * delta["decode_s"] / delta["decode_steps"],
          "live": delta["busy_slot_steps"] / delta["decode_steps"],
          "busy": (delta["decode_s"] + delta["prefill_s"]) / server_seconds,
          "prefill_share": delta["prefill_s"] / max(delta["decode_s"] + delta["prefill_s"], 1e-9),
          "servers": servers}


def server_window(reads: dict[int, tuple], metrics: str) -> dict | None:
  """The servers' CPU seconds, decode counters and the samples trained between the first and the
  last of `reads` (record count -> (servers' CPU seconds, `Snapshot`)) whose servers all
  answered; None without two such reads."""
  full = max((snap.servers for _, snap in reads.values() if snap is not None), default=0)
  counts = [count for count, (_, snap) in sorted(reads.items())
            if snap is not None and snap.servers == full]
  if full == 0 or len(counts) < 2:
    return None
  (cpu0, first), (cpu1, last) = reads[counts[0]], reads[counts[-1]]
  with open(metrics) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {"server_cpu_s": cpu1 - cpu0, "servers": full,
          "requests": sum(r["num_samples"] for r in records[counts[0]:counts[-1]]),
          "before": first.counters, "after": last.counters}
