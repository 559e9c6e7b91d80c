"""The rollout-level policies behind `experiments/rollout_mechanisms.py`, without flags (testable
with a fake server pool): batch rollout vs queue scheduling, group placement vs prompt replication.

One round = `workload.batch` prompt groups of `workload.n` responses. Each response is rewarded
(`reward()`: a remote verifier's latency) and each group kept or dropped by dynamic filtering
(probability `filter_rate`, DAPO-style: a dropped group is replaced by a new prompt until B groups
are kept). The round's generation time runs from its start to the B-th kept, fully rewarded group.

  scheduling  "batch": the batch is split over the servers up front (round-robin), every server
              works through its share with its own continuous batching, a barrier waits for the
              last response, then all rewards, then filtering; replacements form the next round
              (ROLL before Flash).
              "queue": one global queue; a request is sent when a decode slot frees, to the least
              loaded server; each response is rewarded as it finishes and a dropped group's
              replacement is queued at once (Proposition 1's list scheduling).
  placement   "replicate": a group's n responses are n independent requests (prompt replication).
              "group": the n responses go together to one server (what sending `n` in a single
              request does), so a group waits for n free slots on one server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Awaitable, Callable, Sequence

import numpy as np

LENGTHS = {  # name: (median tokens, σ of the log length, cap)
    "narrow": (24, 0.25, 64),
    "longtail": (16, 1.1, 200),
}
POLICIES = tuple(itertools.product(("batch", "queue"), ("group", "replicate")))


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  lengths: str
  scheduling: str  # "batch" | "queue"
  placement: str   # "replicate" | "group"


def draw_lengths(rng, groups: int, n: int, law: str, rho: float = 0.5) -> np.ndarray:
  """`[groups, n]` response lengths: lognormal with within-prompt correlation ρ, clipped."""
  median, sigma, cap = LENGTHS[law]
  z = (np.sqrt(rho) * rng.standard_normal((groups, 1)) +
       np.sqrt(1 - rho) * rng.standard_normal((groups, n)))
  return np.clip(np.round(median * np.exp(sigma * z)), 1, cap).astype(int)


class Pool:
  """Servers (anything with `async generate(prompt, length) -> tokens`) and their in-flight
  counts; all routing is here, so no policy hides in the client."""

  def __init__(self, servers: Sequence, slots: int):
    self.servers, self.slots = list(servers), slots
    self.busy = [0] * len(self.servers)
    self.tokens = [0] * len(self.servers)
    self.peak = [0] * len(self.servers)
    self.freed = asyncio.Condition()

  async def generate(self, k: int, prompt, length: int, *, reserved: bool = False) -> None:
    """One response on server `k`; its slot was `reserved` by `acquire`, or is taken now."""
    if not reserved:
      self.busy[k] += 1
    self.peak[k] = max(self.peak[k], self.busy[k])
    try:
      decoded = await self.servers[k].generate(prompt, int(length))
      self.tokens[k] += decoded  # not `+= await`: that reads the count before awaiting
    finally:
      self.busy[k] -= 1
      async with self.freed:
        self.freed.notify_all()

  async def acquire(self, need: int) -> int:
    """Reserves `need` slots on the least loaded server that has them (waits until one has)."""
    async with self.freed:
      while True:
        free = [(self.busy[k], k) for k in range(len(self.servers))
                if self.slots - self.busy[k] >= need]
        if free:
          k = min(free)[1]
          self.busy[k] += need
          return k
        await self.freed.wait()


async def run_round(pool: Pool, case: Case, prompts: Sequence, lengths_for: Callable[[int], list],
                    *, n: int, filter_rate: float, rng,
                    reward: Callable[[], Awaitable[None]]) -> dict:
  """One round until `case.batch` groups are kept; returns its timings and bookkeeping."""
  kept = issued = 0
  start = time.perf_counter()

  def new_group():
    nonlocal issued
    index = issued
    issued += 1
    return prompts[index % len(prompts)], lengths_for(index), rng.random() < filter_rate

  async def respond(k, prompt, length, score: bool, reserved: bool = False):
    await pool.generate(k, prompt, length, reserved=reserved)
    if score:
      await reward()

  if case.scheduling == "batch":
    need = case.batch
    while kept < case.batch:
      groups = [new_group() for _ in range(need)]
      tasks = []
      for g, (prompt, lengths, _) in enumerate(groups):
        for j, length in enumerate(lengths):
          unit = g if case.placement == "group" else g * n + j
          tasks.append(respond(unit % len(pool.servers), prompt, length, False))
      await asyncio.gather(*tasks)                                # barrier: the longest response
      await asyncio.gather(*(reward() for _ in range(need * n)))  # then every reward
      dropped = sum(drop for _, _, drop in groups)
      kept += need - dropped
      need = dropped
  else:
    done = asyncio.Event()
    pending: set[asyncio.Task] = set()

    async def one(prompt, length):
      k = await pool.acquire(1)
      await respond(k, prompt, length, True, True)

    async def group_task():
      nonlocal kept
      prompt, lengths, drop = new_group()
      if case.placement == "group":
        k = await pool.acquire(n)
        await asyncio.gather(*(respond(k, prompt, length, True, True) for length in lengths))
      else:
        await asyncio.gather(*(one(prompt, length) for length in lengths))
      if drop:
        spawn()  # in flight + kept stays B, so nothing is left running when B are kept
      else:
        kept += 1
        if kept >= case.batch:
          done.set()

    def spawn():
      task = asyncio.create_task(group_task())
      pending.add(task)
      task.add_done_callback(pending.discard)

    for _ in range(case.batch):
      spawn()
    await done.wait()
  return {"generation_s": time.perf_counter() - start, "groups_issued": issued,
          "server_tokens": list(pool.tokens), "peak_busy": list(pool.peak)}


RATIOS = {  # name: (slower policy, faster policy)
    "queue_gain": ("batch_replicate", "queue_replicate"),
    "queue_gain_group": ("batch_group", "queue_group"),
    "replication_gain": ("queue_group", "queue_replicate"),
    "replication_gain_batch": ("batch_group", "batch_replicate"),
    "both_gain": ("batch_group", "queue_replicate"),
}


def aggregate(rows: list[dict], laws: Sequence[str], batches: Sequence[int]) -> list[dict]:
  """One row per (lengths, B): mean ± std generation seconds of the four policies, and each
  ratio as the geometric mean over seeds of the paired per-seed ratios (a seed is the same length
  draws and filtering decisions for every policy, so pairing removes the workload's variance)."""
  out = []
  for law in laws:
    for b in batches:
      row = {"lengths": law, "batch": b}
      by_seed: dict[str, dict[int, float]] = {}
      for sched, place in POLICIES:
        key = f"{sched}_{place}"
        cell = [r for r in rows if (r["lengths"], r["batch"], r["scheduling"], r["placement"]) ==
                (law, b, sched, place)]
        if cell:
          times = [r["generation_s"] for r in cell]
          row[key], row[f"{key}_std"] = float(np.mean(times)), float(np.std(times))
          by_seed[key] = {r.get("seed", i): r["generation_s"] for i, r in enumerate(cell)}
      for name, (slow, fast) in RATIOS.items():
        seeds = sorted(set(by_seed.get(slow, {})) & set(by_seed.get(fast, {})))
        if seeds:
          logs = [np.log(by_seed[slow][s] / by_seed[fast][s]) for s in seeds]
          row[name] = float(np.exp(np.mean(logs)))
      out.append(row)
  return out


COLUMNS = [("lengths", "lengths"), ("batch", "B"), ("batch_group", "batch, group"),
           ("batch_replicate", "batch, replicate"), ("queue_group", "queue, group"),
           ("queue_replicate", "queue, replicate"), ("queue_gain", "queue gain (replicate)"),
           ("queue_gain_group", "queue gain (group)"),
           ("replication_gain", "replication gain (queue)"),
           ("replication_gain_batch", "replication gain (batch)"), ("both_gain", "both")]
