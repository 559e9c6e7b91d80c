"""Rollout mechanisms (ROLL Flash §4.1-4.2, Figs. 7-8): generation time with and without queue
scheduling and prompt replication, across batch sizes and response-length distributions.

Measured at the rollout level against real local servers of our engine, because the controller
always uses both mechanisms and has no switch to turn either off. The policies and the workload
are in `experiments/_mechanisms.py`. Response lengths are set exactly (`ignore_eos`,
`max_new_tokens` = a draw), so every policy decodes the same tokens; rewards are a remote
verifier's latency (`--reward_s` on `--reward_workers`), dynamic filtering drops `--filter_rate`
of the groups. Every policy runs once at the largest batch before anything is timed (compiles).

  python -m experiments.rollout_mechanisms --out=runs/rollout_mechanisms   # about 5 min here
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time

import numpy as np
from absl import app, flags

from experiments import _mechanisms as mech
from experiments import _children, _runs, _summary, plots

_OUT = flags.DEFINE_string("out", "runs/rollout_mechanisms", "Output directory.")
_MODEL = flags.DEFINE_string("model_path", ".cache/repeat_model", "HF directory of the policy.")
_SERVERS = flags.DEFINE_integer("servers", 2, "Rollout servers (one core each when possible).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots per server.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["4", "8", "16"], "Prompt groups per round (B).")
_GROUP = flags.DEFINE_integer("group_size", 8, "Responses per prompt (n).")
_DISTS = flags.DEFINE_list("lengths", list(mech.LENGTHS), "Length laws (see _mechanisms).")
_REWARD_S = flags.DEFINE_float("reward_s", 0.05, "Reward latency per response (s).")
_REWARD_WORKERS = flags.DEFINE_integer("reward_workers", 8, "Concurrent reward calls.")
_FILTER = flags.DEFINE_float("filter_rate", 0.25, "Fraction of groups dynamic filtering drops.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Rounds per configuration (different draws).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the configurations and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figure here.")


class ServerHandle:
  """One server behind its own client: `generate(prompt, length)` -> tokens decoded."""

  def __init__(self, client):
    self.client = client

  async def generate(self, prompt, length: int) -> int:
    from flashrl_jax.fleet import SamplingParams
    params = SamplingParams(max_new_tokens=length, ignore_eos=True, temperature=1.0)
    return len((await self.client.generate(prompt, params)).output_ids)


async def measure(urls, cases, repeats: int) -> list[dict]:
  from experiments.configs.repeat import repeat_task
  from flashrl_jax import envs
  from flashrl_jax.model import load_tokenizer
  from flashrl_jax.fleet import RolloutClient
  tokenizer = load_tokenizer(_MODEL.value)
  prompts = [tokenizer.encode(s.prompt) for s in envs.generate_synthetic(repeat_task(), 256, seed=7)]
  clients = [RolloutClient([u], request_timeout_s=600) for u in urls]
  for c in clients:
    await c.start()
  await asyncio.gather(*(c.wait_healthy(timeout_s=300) for c in clients))
  servers = [ServerHandle(c) for c in clients]
  workers = asyncio.Semaphore(_REWARD_WORKERS.value)
  n = _GROUP.value

  async def reward():
    async with workers:
      await asyncio.sleep(_REWARD_S.value)

  def round_(case, lengths_for, seed):
    return mech.run_round(mech.Pool(servers, _SLOTS.value), case, prompts, lengths_for, n=n,
                          filter_rate=_FILTER.value, rng=np.random.default_rng(seed),
                          reward=reward)

  rows = []
  try:
    biggest = max(case.batch for case in cases)
    for sched, place in mech.POLICIES:  # untimed: compiles every prefill shape first
      await round_(mech.Case(biggest, "narrow", sched, place), lambda i: [4] * n, 0)
    for case in cases:
      for seed in range(repeats):
        draws = mech.draw_lengths(np.random.default_rng(seed), 4 * case.batch + 16, n,
                                  case.lengths)
        out = await round_(case, lambda i: draws[i % len(draws)], 1000 + seed)
        rows.append({**dataclasses.asdict(case), "seed": seed, **out})
        print(json.dumps(rows[-1]), flush=True)
  finally:
    for c in clients:
      await c.close()
  return rows


def figure(table: list[dict], path: str) -> str:
  import matplotlib.pyplot as plt
  laws = list(dict.fromkeys(r["lengths"] for r in table))
  fig, axes = plt.subplots(1, len(laws), figsize=(5.5 * len(laws), 3.8), squeeze=False)
  for ax, law in zip(axes.flat, laws):
    rows = [r for r in table if r["lengths"] == law]
    x = np.arange(len(rows))
    for i, (sched, place) in enumerate(mech.POLICIES):
      key = f"{sched}_{place}"
      ax.bar(x + (i - 1.5) * 0.2, [r.get(key, 0) for r in rows], 0.2,
             yerr=[r.get(f"{key}_std", 0) for r in rows], label=f"{sched}, {place}", capsize=2)
    ax.set_xticks(x, [f"{r['batch']}×{_GROUP.value}" for r in rows])
    ax.set_xlabel("prompts × responses per round")
    ax.set_ylabel("generation time (s)")
    median, sigma, cap = mech.LENGTHS[law]
    ax.set_title(f"{law}: lognormal median {median}, σ {sigma}, cap {cap}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  axes.flat[0].legend(fontsize=7)
  return plots._save(fig, path)  # pylint: disable=protected-access


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  cases = [mech.Case(int(b), law, sched, place) for law in _DISTS.value
           for b in _BATCHES.value for sched, place in mech.POLICIES]
  if _DRY_RUN.value:
    for case in cases:
      print(case)
    return
  from flashrl_jax.fleet import LocalServers, split_cpus
  os.makedirs(_OUT.value, exist_ok=True)
  cores = sorted(os.sched_getaffinity(0))
  cpu_sets = (split_cpus(_SERVERS.value, cores) if _SERVERS.value <= len(cores)
              else [[cores[i % len(cores)]] for i in range(_SERVERS.value)])
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.abspath(_runs.COMPILATION_CACHE),
             JAX_PLATFORMS="cpu")
  start, load = time.perf_counter(), os.getloadavg()
  with LocalServers.start(_MODEL.value, _SERVERS.value, cpu_sets=cpu_sets, env=env,
                          extra_args=(f"--max_running_requests={_SLOTS.value}",
                                      "--context_length=256"),
                          log_dir=os.path.join(_OUT.value, "server_logs")) as servers:
    rows = asyncio.run(measure(servers.urls, cases, _REPEATS.value))
  with open(os.path.join(_OUT.value, "rounds.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  table = mech.aggregate(rows, _DISTS.value, [int(b) for b in _BATCHES.value])
  settings = {k: flags.FLAGS[k].value for k in ("servers", "slots", "group_size", "reward_s",
                                                 "reward_workers", "filter_rate", "repeats")}
  settings.update(wall_s=time.perf_counter() - start, loadavg_before=load,
                  loadavg_after=os.getloadavg())
  md = _summary.write_table(table, mech.COLUMNS, _OUT.value, "summary", {"settings": settings})
  path = figure(table, os.path.join(_OUT.value, "generation_time.png"))
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    shutil.copy(path, os.path.join(_DOCS.value, "rollout_mechanisms.png"))
  print(md)
  print(f"settings: {settings}")


if __name__ == "__main__":
  app.run(main)
