"""Rollout mechanisms (ROLL Flash §4.1-4.2, Figs. 7-8): generation time with and without queue
scheduling and prompt replication, across batch sizes and response-length distributions.

Measured at the rollout level, against real local servers of our engine, because the controller
always uses both mechanisms (it has no switch to turn them off). One round = B prompt groups of n
responses, each response rewarded (a remote verifier: `--reward_s` latency on `--reward_workers`)
and each group kept or dropped by dynamic filtering (`--filter_rate`, DAPO-style: a dropped group
is replaced by a new prompt until B groups are kept). Generation time = start → B kept groups.

  scheduling  batch: the batch is split over the servers up front (round-robin), every server
              works through its share, a barrier waits for the last response, then all rewards,
              then filtering; replacements form the next round (ROLL before Flash).
              queue: one global queue; a request is sent when a decode slot frees, to the least
              loaded server; each response is rewarded as it finishes and a dropped group's
              replacement is queued at once (Proposition 1's list scheduling).
  placement   replicate: a group's n responses are n independent requests (prompt replication).
              group: the n responses go together to one server (what sending `n` in a single
              request does), so a group waits for n slots on one server.

Response lengths are set exactly (`ignore_eos`, `max_new_tokens` = a draw), so every policy decodes
the same tokens: lognormal per response with within-prompt correlation ρ = 0.5.

  python -m experiments.rollout_mechanisms --out=runs/rollout_mechanisms   # about 4 min here
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import time

import numpy as np
from absl import app, flags

from experiments import _runs, plots

LENGTHS = {  # name: (median tokens, σ of log length, cap)
    "narrow": (24, 0.25, 64),
    "longtail": (16, 1.1, 200),
}

_OUT = flags.DEFINE_string("out", "runs/rollout_mechanisms", "Output directory.")
_MODEL = flags.DEFINE_string("model_path", ".cache/demo_model", "HF directory of the policy.")
_SERVERS = flags.DEFINE_integer("servers", 2, "Rollout servers (one core each when possible).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots per server.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["4", "8", "16"], "Prompt groups per round (B).")
_GROUP = flags.DEFINE_integer("group_size", 8, "Responses per prompt (n).")
_DISTS = flags.DEFINE_list("lengths", list(LENGTHS), f"Length laws: {', '.join(LENGTHS)}.")
_REWARD_S = flags.DEFINE_float("reward_s", 0.05, "Reward latency per response (s).")
_REWARD_WORKERS = flags.DEFINE_integer("reward_workers", 8, "Concurrent reward calls.")
_FILTER = flags.DEFINE_float("filter_rate", 0.25, "Fraction of groups dynamic filtering drops.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Rounds per configuration (different draws).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the configurations and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figure here.")


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  lengths: str
  scheduling: str  # "batch" | "queue"
  placement: str   # "replicate" | "group"


def draw_lengths(rng, groups: int, n: int, law: str, rho: float = 0.5) -> np.ndarray:
  median, sigma, cap = LENGTHS[law]
  z = np.sqrt(rho) * rng.standard_normal((groups, 1)) + np.sqrt(1 - rho) * rng.standard_normal(
      (groups, n))
  return np.clip(np.round(median * np.exp(sigma * z)), 1, cap).astype(int)


class Pool:
  """Per-server clients and in-flight counts; routing is ours, so no policy hides in the client."""

  def __init__(self, clients, slots: int):
    self.clients, self.slots = clients, slots
    self.busy = [0] * len(clients)
    self.tokens = [0] * len(clients)
    self.freed = asyncio.Condition()

  async def generate(self, k: int, prompt, length: int, *, reserved: bool = False):
    """One response on server `k`; its slot was `reserved` by `acquire`, or is taken now."""
    from flashrl_jax.rollout._protocol import SamplingParams
    if not reserved:
      self.busy[k] += 1
    try:
      params = SamplingParams(max_new_tokens=int(length), ignore_eos=True, temperature=1.0)
      result = await self.clients[k].generate(prompt, params)
      self.tokens[k] += len(result.output_ids)
    finally:
      self.busy[k] -= 1
      async with self.freed:
        self.freed.notify_all()

  async def acquire(self, need: int) -> int:
    """Reserves `need` slots on the least loaded server that has them (waits until one has)."""
    async with self.freed:
      while True:
        free = [(self.busy[k], k) for k in range(len(self.clients))
                if self.slots - self.busy[k] >= need]
        if free:
          k = min(free)[1]
          self.busy[k] += need
          return k
        await self.freed.wait()


async def run_round(pool: Pool, case: Case, prompts, lengths_for, rng, reward) -> dict:
  """One round until `case.batch` groups are kept; returns its timings."""
  n = _GROUP.value
  kept, issued = 0, 0
  start = time.perf_counter()
  gen_done = []

  def new_group():
    nonlocal issued
    issued += 1
    return prompts[issued % len(prompts)], lengths_for(issued), rng.random() < _FILTER.value

  async def respond(k, prompt, length, score: bool, reserved: bool = False):
    await pool.generate(k, prompt, length, reserved=reserved)
    if score:
      await reward()

  if case.scheduling == "batch":
    need = case.batch
    while kept < case.batch:
      groups = [new_group() for _ in range(need)]
      tasks = []
      for g, (prompt, lens, _) in enumerate(groups):
        for j, length in enumerate(lens):
          unit = g if case.placement == "group" else g * n + j
          tasks.append(respond(unit % len(pool.clients), prompt, length, False))
      await asyncio.gather(*tasks)                       # barrier: the longest response
      gen_done.append(time.perf_counter() - start)
      await asyncio.gather(*(reward() for _ in range(need * n)))  # then every reward
      dropped = sum(drop for _, _, drop in groups)
      kept += need - dropped
      need = dropped
  else:
    done = asyncio.Event()
    pending: set[asyncio.Task] = set()

    async def group_task():
      nonlocal kept
      prompt, lens, drop = new_group()
      if case.placement == "group":
        k = await pool.acquire(n)
        await asyncio.gather(*(respond(k, prompt, length, True, True) for length in lens))
      else:
        async def one(length):
          k = await pool.acquire(1)
          await respond(k, prompt, length, True, True)
        await asyncio.gather(*(one(length) for length in lens))
      if drop:
        spawn()
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
  wall = time.perf_counter() - start
  return {"generation_s": wall, "groups_issued": issued, "server_tokens": list(pool.tokens)}


async def measure(urls, cases, seeds) -> list[dict]:
  from flashrl_jax.model import load_tokenizer
  from flashrl_jax.rollout._client import RolloutClient
  from flashrl_jax import envs
  from experiments.configs.demo import demo_task
  tokenizer = load_tokenizer(_MODEL.value)
  samples = envs.generate_synthetic(demo_task(), 256, seed=7)
  prompts = [tokenizer.encode(s.prompt) for s in samples]
  clients = [RolloutClient([u], request_timeout_s=600) for u in urls]
  for c in clients:
    await c.start()
  await asyncio.gather(*(c.wait_healthy(timeout_s=300) for c in clients))
  sem = asyncio.Semaphore(_REWARD_WORKERS.value)

  async def reward():
    async with sem:
      await asyncio.sleep(_REWARD_S.value)

  rows = []
  try:
    # Untimed warm-up: every policy once at the largest batch, so each prefill shape the
    # servers will see is compiled before anything is timed.
    biggest = max(case.batch for case in cases)
    for sched, place in itertools.product(("batch", "queue"), ("group", "replicate")):
      await run_round(Pool(clients, _SLOTS.value), Case(biggest, "narrow", sched, place),
                      prompts, lambda i: [4] * _GROUP.value, np.random.default_rng(0), reward)
    for case in cases:
      for seed in seeds:
        draws = draw_lengths(np.random.default_rng(seed), 4 * case.batch + 16, _GROUP.value,
                             case.lengths)
        pool = Pool(clients, _SLOTS.value)
        out = await run_round(pool, case, prompts, lambda i: draws[i % len(draws)],
                              np.random.default_rng(1000 + seed), reward)
        rows.append({**dataclasses.asdict(case), "seed": seed, **out})
        print(json.dumps(rows[-1]), flush=True)
  finally:
    for c in clients:
      await c.close()
  return rows


def cases_from_flags() -> list[Case]:
  return [Case(int(b), law, sched, place)
          for law in _DISTS.value for b in _BATCHES.value
          for sched, place in itertools.product(("batch", "queue"), ("group", "replicate"))]


COLUMNS = [("lengths", "lengths"), ("batch", "B"), ("batch_group", "batch, group"),
           ("batch_replicate", "batch, replicate"), ("queue_group", "queue, group"),
           ("queue_replicate", "queue, replicate"), ("queue_gain", "batch→queue (replicate)"),
           ("replication_gain", "group→replicate (queue)"), ("both_gain", "batch+group → queue+replicate")]


def aggregate(rows: list[dict]) -> list[dict]:
  """One row per (lengths, B): mean generation seconds of the four policies, and the ratios."""
  out = []
  for law in _DISTS.value:
    for b in map(int, _BATCHES.value):
      row = {"lengths": law, "batch": b}
      for sched, place in itertools.product(("batch", "queue"), ("group", "replicate")):
        times = [r["generation_s"] for r in rows if (r["lengths"], r["batch"], r["scheduling"],
                                                      r["placement"]) == (law, b, sched, place)]
        if times:
          row[f"{sched}_{place}"] = float(np.mean(times))
          row[f"{sched}_{place}_std"] = float(np.std(times))
      if all(k in row for k in ("batch_replicate", "queue_replicate", "queue_group",
                                "batch_group")):
        row["queue_gain"] = row["batch_replicate"] / row["queue_replicate"]
        row["replication_gain"] = row["queue_group"] / row["queue_replicate"]
        row["both_gain"] = row["batch_group"] / row["queue_replicate"]
      out.append(row)
  return out


def figure(table: list[dict], path: str) -> str:
  import matplotlib.pyplot as plt
  laws = list(dict.fromkeys(r["lengths"] for r in table))
  fig, axes = plt.subplots(1, len(laws), figsize=(5.5 * len(laws), 3.8), squeeze=False)
  policies = ["batch_group", "batch_replicate", "queue_group", "queue_replicate"]
  for ax, law in zip(axes.flat, laws):
    rows = [r for r in table if r["lengths"] == law]
    x = np.arange(len(rows))
    for i, p in enumerate(policies):
      ax.bar(x + (i - 1.5) * 0.2, [r.get(p, 0) for r in rows], 0.2,
             yerr=[r.get(f"{p}_std", 0) for r in rows], label=p.replace("_", ", "), capsize=2)
    ax.set_xticks(x, [f"{r['batch']}×{_GROUP.value}" for r in rows])
    ax.set_xlabel("prompts × responses per round")
    ax.set_ylabel("generation time (s)")
    ax.set_title(f"{law} lengths {LENGTHS[law][:2]}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  axes.flat[0].legend(fontsize=7)
  return plots._save(fig, path)


def main(argv):
  del argv
  cases = cases_from_flags()
  seeds = list(range(_REPEATS.value))
  if _DRY_RUN.value:
    for case in cases:
      print(case)
    return
  from flashrl_jax.rollout._local import LocalServers, split_cpus
  os.makedirs(_OUT.value, exist_ok=True)
  cores = sorted(os.sched_getaffinity(0))
  cpu_sets = (split_cpus(_SERVERS.value, cores) if _SERVERS.value <= len(cores)
              else [[cores[i % len(cores)]] for i in range(_SERVERS.value)])
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.abspath(_runs.COMPILATION_CACHE))
  start = time.perf_counter()
  with LocalServers.start(_MODEL.value, _SERVERS.value, cpu_sets=cpu_sets, env=env,
                          extra_args=(f"--max_running_requests={_SLOTS.value}",
                                      "--context_length=256"),
                          log_dir=os.path.join(_OUT.value, "server_logs")) as servers:
    rows = asyncio.run(measure(servers.urls, cases, seeds))
  with open(os.path.join(_OUT.value, "rounds.jsonl"), "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  table = aggregate(rows)
  settings = {k: flags.FLAGS[k].value for k in ("servers", "slots", "group_size", "reward_s",
                                                 "reward_workers", "filter_rate", "repeats")}
  settings["wall_s"] = time.perf_counter() - start
  settings["loadavg"] = os.getloadavg()
  md = _runs.write_table(table, COLUMNS, _OUT.value, "summary", {"settings": settings})
  path = figure(table, os.path.join(_OUT.value, "generation_time.png"))
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    shutil.copy(path, os.path.join(_DOCS.value, "rollout_mechanisms.png"))
  print(md)
  print(f"settings: {settings}")


if __name__ == "__main__":
  app.run(main)
