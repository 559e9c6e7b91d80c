"""The calibration's measurements of requests arriving as async runs send them (a mixin of
`experiments._calibration._Bench`): a steady stream of groups in lanes, and bursts of a batch's
groups at once. Both price the servers' per-request work (HTTP, parsing, admission, one-prompt
prefills) beyond the static decode table, which on a CPU is a large part of a short response's
cost and depends on how the requests arrive."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Awaitable, NamedTuple

import numpy as np

from experiments._calibration_fits import median, nondecreasing, stream_point, stream_request_s
from experiments._cpu_time import contention, cpu_times, processes
from experiments._server_profile import server_counters


class Window(NamedTuple):
  """The servers over one awaited piece of work: CPU seconds, counters before and after."""

  server_s: float
  before: list[dict[str, float]]
  after: list[dict[str, float]]
  result: Any  # the work's
  wall_s: float  # the work's own


async def _window(urls: list[str], servers: list[int], work: Awaitable) -> Window:
  before, on_cpu = [server_counters(u) for u in urls], cpu_times(servers)[0]
  start = time.perf_counter()
  result = await work
  wall_s = time.perf_counter() - start
  server_s = cpu_times(servers)[0] - on_cpu
  return Window(server_s, before, [server_counters(u) for u in urls], result, wall_s)


class Arrivals:
  """Needs `config`, `fleet`, `prompts`, `reps`, `slots`, `workers`, `_count` and `one`
  (`_Bench`'s)."""

  async def stream(self, urls: list[str], groups: list[list[int]], decode: dict[str, Any],
                   seconds: float = 4.0) -> dict[str, Any]:
    """A steady stream of groups (n requests of one prompt, lengths drawn from the initial
    policy's groups, `ignore_eos`), each lane sending its next group as soon as its last one is
    scored, at 1/8 to all of the slots' worth of lanes: the servers' CPU time per decode step at
    the step's mean live requests (`stream_point`; the table async runs were priced by until
    2026-11-27, kept for comparison), the per-request cost beyond the static table at half the
    lanes (`request_s`) and the requests/s each lane count made (which `bursts` paces itself by).
    Measured (2026-11-26, long-tail model, one server, 8 live requests): a stream's server made
    14,000 tokens/s against a static batch's 24,000."""
    rng = np.random.default_rng(0)
    full = self.stream_lanes()
    lane_counts = sorted({max(1, full // d) for d in (8, 4, 2, 1)})
    half = self.half_stream_lanes()
    table = (decode["decode_active"], decode["decode_step_s"])
    servers = processes(os.getpid())[1]
    cpu_before = cpu_times(servers)
    points, per_request, walls, rates = {}, [], [], {}
    for lanes in lane_counts:
      await self._stream_for(lanes, 1.0, groups, rng)  # warm
      lives, steps = [], []
      for _ in range(self.reps):
        w = await _window(urls, servers, self._stream_for(lanes, seconds, groups, rng))
        walls.append(w.wall_s)
        rates.setdefault(lanes, []).append(w.result / w.wall_s)
        live, step = stream_point(w.server_s, w.before, w.after, len(urls) // self.workers)
        lives.append(live)
        steps.append(step)
        if lanes == half:
          per_request.append(stream_request_s(w.server_s, w.before, w.after, *table, w.result))
      points[lanes] = (median(lives), median(steps))
    kept = []  # by live requests, each more than the last (a table's points)
    for lanes, (live, step) in sorted(points.items(), key=lambda kv: kv[1][0]):
      if not kept or live > kept[-1][1]:
        kept.append((lanes, live, step))
    # A step never gets cheaper with more live requests: a dip is the shared machine's noise.
    step_s = nondecreasing([step for _, _, step in kept])
    # The servers' threads (HTTP, engine, XLA) wait for one another on their core in a stream as
    # they do in a run: the contention a run's is compared with (sim_vs_measured).
    return {"active": [live for _, live, _ in kept], "step_s": step_s,
            "lanes": [lanes for lanes, _, _ in kept],
            "request_s": median(per_request) if per_request else 0.0, "seconds": walls,
            "raw_request_s": per_request,
            "requests_per_s": {str(k): median(v) for k, v in rates.items()},
            "contention": contention(cpu_before, cpu_times(servers))}

  async def bursts(self, urls: list[str], groups: list[list[int]], decode: dict[str, Any],
                   full_rate: float, train_half_the_time, seconds: float = 3.0) -> dict[str, Any]:
    """The requests as an async run makes them: each period, a handoff of new weights to the
    servers in the run's pause mode (`Fleet.publish`, with requests in flight), then B groups
    released together (the controller dispatches a batch's worth when a handoff opens room), at
    half and three quarters of the request rate the full lanes stream made (`full_rate`), beside a
    trainer training half the time (`train_half_the_time(stop)`: a run's client shares the
    learner's core). Per window the servers' CPU time beyond the static table's decode steps, per
    request (`stream_request_s`), handoffs included, as `sim_vs_measured` measures a run's.

    Bursts without handoffs cost 0.49-0.53 ms a request on the long-tail server where runs' cost
    0.77-1.09 (docs/simulator_history.md; measured at a pace ~8x too slow, before the lanes' count was
    fixed in e44976e); a run's servers also load a version every step."""
    rng = np.random.default_rng(1)
    table = (decode["decode_active"], decode["decode_step_s"])
    servers = processes(os.getpid())[1]
    burst = self.config.batch_size * self.config.group_size
    periods = [burst / (load * full_rate) for load in (0.5, 0.75)]
    cpu_before = cpu_times(servers)
    per_request = []
    for period in periods:
      await self._bursts_for(period, 1.0, groups, rng)  # warm
      for _ in range(self.reps):
        stop = asyncio.Event()
        trainer = asyncio.create_task(train_half_the_time(stop))
        w = await _window(urls, servers,
                          self._bursts_for(period, seconds, groups, rng, handoffs=True))
        stop.set()
        await trainer
        per_request.append(stream_request_s(w.server_s, w.before, w.after, *table, w.result))
    return {"request_s": median(per_request), "raw_request_s": per_request, "periods": periods,
            "contention": contention(cpu_before, cpu_times(servers))}

  async def rounds(self, urls: list[str], groups: list[list[int]], decode: dict[str, Any],
                   seconds: float = 3.0) -> dict[str, Any]:
    """The requests as a sync run makes them: each round, a handoff to idle servers
    (`Fleet.publish(idle=True)`, as a sync step's), then B groups released together and all of
    them awaited before the next round. Per window the servers' CPU time beyond the static table's
    decode steps, per request (`stream_request_s`), as `sim_vs_measured` measures a run's, and the
    servers' CPU contention over the rounds (the client's loop scores and tokenizes on the
    servers' cores as a sync run's controller does).

    Why not the decode batches' fitted intercept: that slope of wall times came out 0.49-0.97 ms
    a request on the long-tail servers and 0.73-1.17 ms on the balanced ones over the six passes
    of 2026-11-27 since 21:00, where the runs' servers spent 0.67-1.87 and 0.65-0.89 ms (all twelve
    balanced sync runs under-predicted, by 3.8-16.5%)."""
    rng = np.random.default_rng(2)
    table = (decode["decode_active"], decode["decode_step_s"])
    servers = processes(os.getpid())[1]
    await self._rounds_for(0.5, groups, rng)  # warm
    cpu_before = cpu_times(servers)
    per_request = []
    walls: list[tuple[float, float, int]] = []
    for _ in range(self.reps):
      w = await _window(urls, servers, self._rounds_for(seconds, groups, rng, walls))
      per_request.append(stream_request_s(w.server_s, w.before, w.after, *table, w.result))
    return {"request_s": median(per_request), "raw_request_s": per_request,
            "contention": contention(cpu_before, cpu_times(servers)),
            # Per round: the handoff's and the rollout's wall seconds and the round's longest
            # response (a diagnostic beside a sync run's wait per step by its longest response).
            "round_walls": walls}

  def stream_lanes(self) -> int:
    """Lanes (groups in flight) that fill every slot of the servers."""
    return max(1, self.slots * self.workers // self.config.group_size)

  def half_stream_lanes(self) -> int:
    """Half the lanes: the stream whose per-request cost and interference the calibration keeps
    (a run's async rollout holds a third to a half of the slots live)."""
    return max(1, self.stream_lanes() // 2)

  async def _stream_for(self, lanes: int, seconds: float, groups, rng) -> int:
    """`lanes` lanes, each sending a group (n requests of one prompt, lengths drawn from the
    initial policy's groups, `ignore_eos`) as soon as its last one is scored, for `seconds`;
    returns the requests made."""
    end, requests = time.perf_counter() + seconds, 0

    async def lane() -> None:
      nonlocal requests
      while time.perf_counter() < end:
        # Not `requests += await ...`: that reads the count before awaiting and writes it back
        # after, losing what the other lanes added meanwhile.
        made = await self._group(groups, rng)
        requests += made

    await asyncio.gather(*(lane() for _ in range(lanes)))
    return requests

  async def _group(self, groups, rng) -> int:
    """One group as a run's runner sends it (lengths from the initial policy's groups); returns
    the requests made."""
    return len(await self._group_lengths(groups, rng))

  async def _group_lengths(self, groups, rng) -> list[int]:
    """`_group`, returning the group's response lengths."""
    from flashrl_jax.fleet import SamplingParams
    group = groups[int(rng.integers(len(groups)))][:self.config.group_size]
    lengths = [max(int(n), 1) for n in group]
    sample = self.prompts[self._count % len(self.prompts)]
    self._count += 1
    await asyncio.gather(*(self.one(SamplingParams(
        max_new_tokens=length, ignore_eos=True,
        temperature=self.config.rollout.temperature), sample) for length in lengths))
    return lengths

  async def _rounds_for(self, seconds: float, groups, rng,
                        walls: list[tuple[float, float, int]] | None = None) -> int:
    """Sync rounds for `seconds` (the last one finished): a handoff to idle servers, then B
    groups at once, all awaited; returns the requests made (and appends each round's handoff and
    rollout seconds and longest response to `walls`)."""
    end, requests = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
      start = time.perf_counter()
      await self.fleet.publish(self.config.model_path, self.fleet.version + 1, idle=True)
      published = time.perf_counter()
      made = await asyncio.gather(*(self._group_lengths(groups, rng)
                                    for _ in range(self.config.batch_size)))
      if walls is not None:
        walls.append((published - start, time.perf_counter() - published,
                      max(n for lengths in made for n in lengths)))
      requests += sum(len(lengths) for lengths in made)
    return requests

  async def _bursts_for(self, period: float, seconds: float, groups, rng, *,
                        handoffs: bool = False) -> int:
    """B groups at once every `period` for `seconds` (each after a handoff of the initial weights
    as a new version, with `handoffs`), then until they are all back; returns the requests made."""
    end, tasks = time.perf_counter() + seconds, []
    while time.perf_counter() < end:
      released = time.perf_counter()
      if handoffs:
        # The same weights under the next version number: a real pause, load and resume.
        await self.fleet.publish(self.config.model_path, self.fleet.version + 1)
      tasks += [asyncio.ensure_future(self._group(groups, rng))
                for _ in range(self.config.batch_size)]
      await asyncio.sleep(max(0.0, period - (time.perf_counter() - released)))
    return sum(await asyncio.gather(*tasks))
