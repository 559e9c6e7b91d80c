"""Standalone microbenchmarks that calibrate the simulator for one run configuration.

Why: a simulator is worth what its predictions of runs it never saw are worth, so every cost it
charges is measured here on the real parts, outside any RL run — the runs it predicts only supply
their measured throughput, to compare against. One calibration process per core layout places
everything as `controller.run` does (the process, and the learner process it starts, on the
trainer's cores with the event loop; the run's server processes pinned to theirs; a trainer in
this process instead puts the async event loop on the rollout cores), and measures:

- rollout, through the real client and reward function: the decode step time by live requests per
  rollout core (`a` concurrent requests of L1 and L2 tokens with `ignore_eos`: step = ΔW/ΔL) and
  its growth with context (the same with prompts as long as a training row allows), the
  per-request cost that blocks a core (prefill, HTTP, client work: the slope of the intercept in
  `a`) and the per-request latency that does not (the intercept's intercept);
- async layout only, decode as an async run meets it: a steady stream of groups at four lane
  counts (`_Bench.stream`): the servers' CPU time per decode step at each mean live count, a table
  that holds the arriving and leaving requests' work (on the long-tail server a request arriving
  alone while others decode cost 4.5x what one of a batch admitted at once does, 1.17 against
  0.26 ms), with the servers' CPU contention over it;
- response lengths: the initial policy on prompts of the task that the runs never draw (same
  sampling), kept as groups (`scheduling.EmpiricalLengths`);
- the weight handoff (`Fleet.publish`, the run's pause mode), with idle servers (what a sync
  run's publish meets) and with every slot decoding (an async run's);
- the train step and the HF export (the learner's `update` and `export`, in the run's learner
  process unless the config trains in-process) on batches drawn from those lengths (each batch's
  faster of two runs), as a function of trained tokens, with the servers idle;
- async layout only, the interference of trainer and rollout client: the train step while the
  client keeps half the slots decoding, and the async stream while the trainer trains half the
  time, as runs do (each against the same work alone: medians of paired ratios). They meet
  where the run makes them meet: with a learner process (`RunConfig.learner_process`, the default)
  the trainer is one, started as the run starts it, and the event loop shares its core (1+1) or a
  server does too (2+1); without one, trainer and client share this process and its interpreter
  lock (measured: each about 1.5-2x slower on this machine; see docs/simulator_history.md).

The CPU contention the servers met while the decode was timed, and the trainer while its step was
(the kernel's per-thread time on a CPU and time waiting for one, `experiments._cpu_time`), is
recorded, so a run that meets another contention is predicted with the costs rescaled
(sim_vs_measured.py); in the async layout also beside the other side (the trainer's step beside a
busy rollout, the servers' rollout beside training), which holds the core the trainer shares with
a server as a run does. A load probe (pure-Python work on each core) is timed around it too.

  python -m experiments._calibration --config=experiments/configs/bench_rlvr.py --layout=async \\
      --out=calibration.json
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from experiments import _children
from experiments._calibration_arrivals import Arrivals
from experiments._calibration_fits import fit_train, median, nondecreasing, paired_factor
from experiments._cpu_time import contention, cpu_times, probe, probe_pair, processes
from experiments._server_profile import server_counters
from experiments._sim_config import round_latency_s
from flashrl_jax.controller import Learner, LearnerProcess, RunConfig, engine_server_args

# Passes over the train batches, each batch's fastest time kept (`_Bench.train`).
_TRAIN_PASSES = 3


def load_config(path: str, **changes) -> RunConfig:
  """`get_config()` of a config file (as `experiments.train` reads it), with `changes` applied."""
  from experiments._cli import load_config_file
  return load_config_file(path).replace(**changes)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a run's processes go: `controller.plan_placement`'s CPU plan, and the workers it makes."""

  server_cpus: tuple[tuple[int, ...], ...]  # per server
  client_cpus: tuple[int, ...] | None       # the controller's event loop (None: with the trainer)
  train_cpus: tuple[int, ...]

  @property
  def workers(self) -> tuple[tuple[int, ...], ...]:
    """Distinct core sets serving rollout: the simulator's workers (servers on one set share it)."""
    return tuple(dict.fromkeys(self.server_cpus))


def layout(config: RunConfig, cores: list[int]) -> Layout:
  from flashrl_jax.controller import plan_placement
  plan = plan_placement(config, cores)
  if plan.server_cpus is None or plan.trainer_cpus is None:
    raise ValueError("calibration needs local rollout servers on CPU")
  return Layout(tuple(plan.server_cpus), plan.controller_cpus, tuple(plan.trainer_cpus))


def start_learner(config: RunConfig, workdir: str) -> Learner | LearnerProcess:
  """The learner a run of `config` has — its learner process (`LearnerProcess`), or a `Learner` in
  this process when the config trains in-process — started from this process where the run starts
  it (pinned to the trainer's cores, which a learner process inherits), compiling every
  micro-batch count first; its exports and checkpoints go to `workdir`."""
  config = config.replace(precompile=True)
  if config.learner_process:
    return LearnerProcess.start(config, workdir)
  return Learner.create(config, workdir)


def learner_pid(learner: Learner | LearnerProcess) -> int:
  """The process whose threads' CPU time is the trainer's (in-process: the client's too)."""
  return learner.pid if isinstance(learner, LearnerProcess) else os.getpid()


class _Bench(Arrivals):
  """The measurements, inside the calibration process's event loop."""

  def __init__(self, config: RunConfig, place: Layout, fleet, tokenizer,
               learner: Learner | LearnerProcess, reps: int, vocab_size: int):
    from flashrl_jax import envs
    self.config, self.place, self.fleet, self.reps = config, place, fleet, reps
    self.tokenizer, self.learner, self.vocab_size = tokenizer, learner, vocab_size
    self.reward_fn = envs.make_reward_fn(config.task.reward_config())
    if config.task.synthetic is None:
      raise ValueError("the calibration samples a synthetic task's prompts (config.task.synthetic)")
    # Prompts the runs never draw: another seed of the same task.
    unseen = envs.SyntheticSource(config.task.synthetic, seed=config.task.seed + 7_777)
    self.prompts = [unseen.sample(i) for i in range(2048)]
    self.workers = len(place.workers)
    servers = len(place.server_cpus)  # the placement's count (a config may leave it to the cores)
    self.slots = config.rollout.max_running_requests * servers // self.workers
    self._count = 0

  async def one(self, sampling, sample=None, prompt_tokens: int | None = None) -> int:
    """One request as `GroupRunner` makes it: generate, decode, reward (`prompt_tokens`: the
    prompt padded with other prompts' text to that many tokens, for long contexts)."""
    if sample is None:
      sample = self.prompts[self._count % len(self.prompts)]
      self._count += 1
    ids = self.tokenizer.encode(sample.prompt)
    if prompt_tokens is not None:
      filler = self.tokenizer.encode(" ".join(p.prompt for p in self.prompts[:64]))
      ids = (filler + ids)[-prompt_tokens:]
    result = await self.fleet.generate(ids, sampling)
    await self.reward_fn(sample.prompt, self.tokenizer.decode(result.output_ids), sample)
    return len(result.output_ids)

  async def batch(self, a: int, tokens: int, prompt_tokens: int | None = None) -> float:
    from flashrl_jax.fleet import SamplingParams
    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True,
                              temperature=self.config.rollout.temperature)
    start = time.perf_counter()
    await asyncio.gather(*(self.one(sampling, prompt_tokens=prompt_tokens) for _ in range(a)))
    return time.perf_counter() - start

  async def lengths(self, eos: tuple[int, ...], prompts: int = 1024) -> list[list[int]]:
    """The initial policy's responses to `prompts` prompts, in groups of n; all queued at once, so
    the servers' continuous batching gets through them quickly. The mean of a heavy tail is slow
    to settle, and it settles with the prompts, not the responses (a prompt's n responses share
    its length): with 256 prompts of 2 the long-tail calibration's mean length came out 40.4
    tokens where its four runs trained 33-37, which alone put the async predictions ~15% low; with
    256 prompts of 8 (2048 responses) the balanced calibration's came out 16.7, its prompts'
    answers 17.5 characters on average where the task's law gives 14.6 over 2048 prompts."""
    from flashrl_jax.fleet import SamplingParams
    r = self.config.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, stop_token_ids=eos)
    n = self.config.group_size
    count = min(len(self.prompts), max(4 * self.config.batch_size, prompts))
    groups = await asyncio.gather(*(  # one prompt per group: its n responses are correlated
        asyncio.gather(*(self.one(sampling, sample) for _ in range(n)))
        for sample in self.prompts[:count]))
    return [list(g) for g in groups]

  async def decode(self, median_len: float) -> dict[str, Any]:
    # L1 long enough that every request of a batch is admitted before the first ones finish (the
    # model below assumes `a` requests decoding together), L2 as long as a row allows: a decode
    # step is a fraction of a millisecond, and the difference must stand well above the
    # scheduler's noise on a shared machine.
    del median_len
    room = min(self.config.rollout.max_new_tokens,
               self.config.train.batch.row_length - max(len(p.prompt) for p in self.prompts) - 2)
    l1 = min(32, room // 4)
    l2 = int(room)
    per_worker = sorted({1, 2, 4, 8, 16, 32, 64, 128, self.slots} & set(range(1, self.slots + 1)))
    active = [a * self.workers for a in per_worker]
    for a in active:  # compiles every decode bucket and prefill group once
      await self.batch(a, l1)
    walls: dict[tuple[int, int], list[float]] = {}
    for _ in range(self.reps):  # interleaved, so a change of load hits every point alike
      for a in active:
        for tokens in (l1, l2):
          walls.setdefault((a, tokens), []).append(await self.batch(a, tokens))
    step = nondecreasing([(median(walls[(a, l2)]) - median(walls[(a, l1)])) / (l2 - l1)
                           for a in active])
    fixed = [median(walls[(a, l1)]) - l1 * s for a, s in zip(active, step)]
    # fixed(a) = latency + (a / workers) * request_s: a worker admits its a/workers requests one
    # after another (blocking), while the round trip is paid once.
    slope, intercept = np.polyfit(per_worker, fixed, 1)
    # Context: the same decode after prompts of half a row (contexts P..P + L2c instead of
    # p..p + L2), at two live counts; the relative growth per token of mean context.
    prompt = float(np.mean([len(self.tokenizer.encode(p.prompt)) for p in self.prompts]))
    context_ref = prompt + (l1 + l2) / 2
    long_prompt = self.config.train.batch.row_length // 2
    l2c = self.config.train.batch.row_length - long_prompt - 2
    slopes = []
    if long_prompt > prompt + 32 and l2c - l1 >= 32:
      probes = sorted({active[0], active[len(active) // 2]})
      long: dict[tuple[int, int], list[float]] = {}
      for a in probes:
        await self.batch(a, l1, long_prompt)  # compiles the long prefill bucket
      for _ in range(self.reps):
        for a in probes:
          for tokens in (l1, l2c):
            long.setdefault((a, tokens), []).append(await self.batch(a, tokens, long_prompt))
      for a in probes:
        step_long = (median(long[(a, l2c)]) - median(long[(a, l1)])) / (l2c - l1)
        ratio = step_long / step[active.index(a)]
        slopes.append((ratio - 1.0) / (long_prompt + (l1 + l2c) / 2 - context_ref))
    return {"decode_active": per_worker, "decode_step_s": step,
            "decode_context_ref": context_ref,
            "decode_context_slope": max(float(np.median(slopes)), 0.0) if slopes else 0.0,
            "request_s": max(float(slope), 0.0), "latency_s": max(float(intercept), 0.0),
            "decode_tokens": [l1, l2], "raw": {f"{a}x{t}": v for (a, t), v in walls.items()}}

  async def handoff(self) -> dict[str, dict[str, float]]:
    """`Fleet.publish` (the run's pause mode) of the initial weights as new versions."""
    path = self.config.model_path
    busy, idle = [], []
    for version in range(1, self.reps + 2):
      idle.append(await self.fleet.publish(path, 2 * version, idle=True))  # as a sync step
      load = asyncio.create_task(self.batch(self.slots * self.workers,
                                            self.config.rollout.max_new_tokens))
      await asyncio.sleep(0.2)
      busy.append(await self.fleet.publish(path, 2 * version + 1))
      await load
    return {name: {k.split("/")[1]: median([h[k] for h in hs[1:]]) for k in hs[0]}
            for name, hs in (("busy", busy), ("idle", idle))}

  async def reward(self, count: int = 200) -> float:
    start = time.perf_counter()
    for sample in self.prompts[:count]:
      await self.reward_fn(sample.prompt, sample.answer, sample)
    return (time.perf_counter() - start) / count

  def _trajectories(self, rng, groups: list[list[int]], prompt_tokens: float):
    from flashrl_jax.trainer import Trajectory
    vocab, version = self.vocab_size, self.learner.policy_version
    out = []
    for g in range(self.config.batch_size):
      row = groups[int(rng.integers(len(groups)))]
      for j in range(self.config.group_size):
        length = int(rng.choice(row))
        out.append(Trajectory(
            sample_id=g * self.config.group_size + j,
            prompt_ids=rng.integers(3, vocab, size=round(prompt_tokens)).astype(np.int32),
            response_ids=rng.integers(3, vocab, size=length).astype(np.int32),
            behavior_logp=np.full(length, -1.0, np.float32), reward=float(rng.integers(2)),
            group_id=g, behavior_version=version, start_version=version))
    return out

  async def train_half_the_time(self, stop: asyncio.Event, groups, prompt_tokens: float,
                                rng=None) -> None:
    """Trains from a worker thread as a run's step is, idling after each step as long as it
    took, until `stop`."""
    rng = rng if rng is not None else np.random.default_rng(3)
    while not stop.is_set():
      batch = self._trajectories(rng, groups, prompt_tokens)
      start = time.perf_counter()
      await asyncio.to_thread(self.learner.update, batch)
      await asyncio.sleep(time.perf_counter() - start)

  async def rollout_beside_train(self, urls: list[str], groups, prompt_tokens: float,
                                 seconds: float = 2.0) -> dict[str, float]:
    """How much slower the servers generate while the trainer trains: seconds per generated token
    of the stream an async run makes (`_stream_for`, half the slots' lanes) alone and beside a
    trainer driven from a worker thread as a run's step is, paired (alternating), with the CPU
    contention the servers met in each half. In the 2+1 split a server shares its core with the
    trainer, so its contention beside training holds that sharing, which the factor already
    charges (sim_vs_measured); on 1+1 the stream is slowed only by the client's loop sharing the
    learner process's core.

    The trainer idles after each step for as long as the step took (half its time training): the
    long-tail async runs trained 46-63% of their steps, and the client's deferred work (answers,
    scoring, the next group) catches up in those gaps. A trainer training back to back slowed the
    stream x1.03-1.19 (five pairs), one at half duty x0.94-1.15 (median 1.00), and the factor
    from back-to-back training on a static batch (x1.17-1.32 in three calibrations) put the
    async predictions 4-21% low (docs/simulator_history.md)."""
    stop = asyncio.Event()
    rng = np.random.default_rng(2)
    servers = processes(os.getpid())[1]

    def generated() -> float:
      return sum(server_counters(u, keys=("generated_tokens",))["generated_tokens"] for u in urls)

    async def timed(phase: str) -> float:
      before, tokens_before = cpu_times(servers), generated()
      start = time.perf_counter()
      await self._stream_for(lanes, seconds, groups, rng)
      wall = time.perf_counter() - start
      tokens = generated() - tokens_before
      cpu[phase] = tuple(x + b - f for x, b, f in zip(cpu[phase], cpu_times(servers), before))
      return wall / max(tokens, 1.0)

    lanes = self.half_stream_lanes()
    alone, beside = [], []
    cpu = {"alone": (0.0, 0.0), "beside": (0.0, 0.0)}  # servers' (run, wait) seconds per phase
    await self._stream_for(lanes, 1.0, groups, rng)  # warm
    for _ in range(self.reps + 1):
      alone.append(await timed("alone"))
      stop.clear()
      trainer = asyncio.create_task(self.train_half_the_time(stop, groups, prompt_tokens, rng))
      await asyncio.sleep(0.2)
      beside.append(await timed("beside"))
      stop.set()
      await trainer
    return {"factor": paired_factor(beside, alone), "lanes": lanes,
            "raw_alone_s_per_token": alone, "raw_beside_s_per_token": beside,
            **{f"contention_{phase}": contention((0.0, 0.0), cpu[phase]) for phase in cpu}}

  async def compile_train(self, groups, prompt_tokens: float) -> None:
    """Compiles every micro-batch count a step can need (batches of equal lengths up to the
    longest measured response), so no timed step below pays a compilation; a run that meets a
    new count mid-run pays it there, which is a cost of that run, not of the step."""
    # Every micro-batch count was compiled as the learner started (`RunConfig.precompile`).
    longest = max(max(g) for g in groups)
    for length in sorted({max(1, int(longest * f)) for f in (0.02, 0.1, 0.25, 0.5, 0.75, 1.0)}):
      await asyncio.to_thread(self.learner.update, self._trajectories(
          np.random.default_rng(length), [[length]], prompt_tokens))
    await self.train(groups, prompt_tokens, 2, busy=False)  # and the realistic mix once

  def _export(self) -> None:
    self.learner.export()
    self.learner.collect_garbage()

  async def train(self, groups, prompt_tokens: float, batches: int, *, busy: bool
                  ) -> dict[str, Any]:
    """`trainer.update` then the export, as `_train_and_publish` runs them (worker threads);
    with `busy`, the client keeps half the slots decoding meanwhile (a run's async rollout keeps
    a third to a half of them live: 5-9 of 16 in the long-tail runs). The batches are the same
    with and without `busy` (one seed), so the factor is a ratio of paired steps
    (`paired_factor`): two draws of twelve random batches had put it at 1.12 and 1.86 in two
    calibrations of one config. Each batch runs once in each of `_TRAIN_PASSES` passes over them
    and keeps its fastest time: beside the calibration's idle servers, steps slow ~1.6x for about a
    second at a time (0.12-0.14 s among 0.07-0.09, balanced, with or without a gap between steps;
    not with no servers started) where a run's do not (0.070-0.085 s); a batch run twice in a row
    sat both times in one such second (7 of 12 batches slow in one calibration of 2026-11-28), a
    pass apart they seldom do."""
    rng, stop = np.random.default_rng(0), asyncio.Event()
    lengths = [x for g in groups for x in g]

    async def saturate() -> None:
      # Responses of the policy's own lengths (each exactly as long as a measured one): the
      # client's work is per request (HTTP, parsing, the reward), so it must meet a run's mix of
      # short and long responses, not only long ones.
      async def lane(seed: int):
        draw = np.random.default_rng(seed)
        while not stop.is_set():
          await self.batch(1, max(1, int(draw.choice(lengths))))
      await asyncio.gather(*(lane(i) for i in range(max(1, self.slots * self.workers // 2))))

    load = asyncio.create_task(saturate()) if busy else None
    draws = []  # each batch's random state, to draw it again (at the learner's new version)
    for _ in range(batches):
      draws.append(rng.bit_generator.state)
      self._trajectories(rng, groups, prompt_tokens)
    tokens, timed = [0] * batches, [[] for _ in range(batches)]
    try:
      if busy:
        await asyncio.sleep(1.0)
      for _ in range(_TRAIN_PASSES):  # every batch once per pass: its times a pass apart
        for i, drawn in enumerate(draws):
          rng.bit_generator.state = drawn
          batch = self._trajectories(rng, groups, prompt_tokens)
          start = time.perf_counter()
          await asyncio.to_thread(self.learner.update, batch)
          middle = time.perf_counter()
          await asyncio.to_thread(self._export)  # as the loop's handoff exports
          timed[i].append((middle - start, time.perf_counter() - middle))
          tokens[i] = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    finally:
      stop.set()
      if load is not None:
        await load
    seconds = [min(s for s, _ in t) for t in timed]
    exports = [min(e for _, e in t) for t in timed]
    (lo, hi), fit = fit_train(tokens, seconds)
    return {"train_tokens": [lo, hi], "train_s": fit, "export_s": median(exports),
            "raw_tokens": tokens, "raw_seconds": seconds}


async def _measure(config: RunConfig, place: Layout, urls: list[str],
                   learner: Learner | LearnerProcess, reps: int, *, is_async: bool
                   ) -> dict[str, Any]:
  from flashrl_jax.fleet import Fleet, RolloutClient
  from flashrl_jax.model import load_tokenizer
  if place.client_cpus is not None:  # as `controller.run`: worker threads on the trainer's cores
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
        thread_name_prefix="trainer", initializer=os.sched_setaffinity,
        initargs=(0, place.train_cpus)))
    os.sched_setaffinity(0, place.client_cpus)  # this thread: the event loop
  from flashrl_jax.model import read_config
  tokenizer = load_tokenizer(config.model_path)
  model = read_config(config.model_path)
  eos = tuple(sorted({i for i in [tokenizer.eos_token_id, *model.eos_token_ids] if i is not None}))
  client = RolloutClient(urls, vocab_size=model.vocab_size, request_timeout_s=600)
  async with Fleet(client, pause_mode=config.rollout.pause_mode) as fleet:
    await fleet.wait_healthy(timeout_s=300)
    bench = _Bench(config, place, fleet, tokenizer, learner, reps, model.vocab_size)
    groups = await bench.lengths(eos)
    median_len = float(np.median([x for g in groups for x in g]))
    prompt_tokens = float(np.mean([len(tokenizer.encode(p.prompt)) for p in bench.prompts]))
    # The CPU contention the servers met while their decode was timed, and the trainer while its
    # step was: a run met at another factor is predicted with the costs rescaled by the ratio.
    servers = processes(os.getpid())[1]
    before = cpu_times(servers)
    decode = await bench.decode(median_len)
    decode["contention"] = contention(before, cpu_times(servers))
    if is_async:  # requests arrive as a stream, not as a batch (`_Bench.stream`)
      stream = await bench.stream(urls, groups, decode)
      decode = {**decode, "request_batch_s": decode["request_s"],
                "request_s": stream["request_s"], "stream": stream}
    else:  # as a sync run's steps admit them: a batch after each idle handoff (`_Bench.rounds`)
      rounds = await bench.rounds(urls, groups, decode)
      decode = {**decode, "request_batch_s": decode["request_s"],
                "request_s": rounds["request_s"], "rounds": rounds}
    rollout = {"workers": bench.workers, "slots": bench.slots, "length_groups": groups,
               "prompt_tokens": prompt_tokens, **decode,
               "handoff": await bench.handoff(), "reward_s": await bench.reward()}
    if not is_async:  # what a sync round waits beyond the simulated costs (`round_latency_s`)
      rollout["rounds"]["latency_s"] = round_latency_s(rollout, config.batch_size,
                                                       config.group_size)
    batches = 6 + 2 * reps
    await bench.compile_train(groups, prompt_tokens)
    before = cpu_times([learner_pid(learner)])
    trainer_cal = {"alone": await bench.train(groups, prompt_tokens, batches, busy=False)}
    trainer_cal["alone"]["contention"] = contention(before, cpu_times([learner_pid(learner)]))
    interference = {"train_beside_rollout": 1.0, "rollout_beside_train": 1.0}
    if is_async:  # the trainer shares a process or a core with the client (and 2+1 a server)
      # The contention beside a busy rollout holds the core the trainer shares with the client's
      # loop (1+1) or a server (2+1), as an async run's does: sim_vs_measured rescales async runs
      # against it.
      before = cpu_times([learner_pid(learner)])
      beside = await bench.train(groups, prompt_tokens, batches, busy=True)
      beside["contention"] = contention(before, cpu_times([learner_pid(learner)]))
      trainer_cal["beside_rollout"] = beside
      rollout["beside_train"] = await bench.rollout_beside_train(urls, groups, prompt_tokens)
      # After the train step is compiled: the bursts are measured beside training too.
      stream = rollout["stream"]
      rollout["bursts"] = await bench.bursts(
          urls, groups, decode, stream["requests_per_s"][str(max(stream["lanes"]))],
          lambda stop: bench.train_half_the_time(stop, groups, prompt_tokens))
      interference = {
          "train_beside_rollout": paired_factor(beside["raw_seconds"],
                                                trainer_cal["alone"]["raw_seconds"]),
          "rollout_beside_train": rollout["beside_train"]["factor"]}
  return {"rollout": rollout, "trainer": trainer_cal, "interference": interference}


def layout_config(config_path: str, layout_name: str, split: tuple[int, int] | None = None
                  ) -> RunConfig:
  """The config a run in the `sync` or `async` layout has (`split`: the async layout's (rollout,
  trainer) cores, `--rollout_devices` and `--train_devices`); `layout(...)` places it."""
  config = load_config(config_path, mode=layout_name,
                       async_ratio=0 if layout_name == "sync" else 1)
  if split is not None:
    config = config.replace(resources=dataclasses.replace(
        config.resources, rollout_devices=split[0], train_devices=split[1]))
  return config


def train_cores(config_path: str, layout_name: str, split: tuple[int, int] | None = None
                ) -> list[int]:
  """The cores of this process's that a run or calibration in `layout_name` trains on (`split`:
  the async layout's, ignored in sync)."""
  config = layout_config(config_path, layout_name, split if layout_name == "async" else None)
  return list(layout(config, sorted(os.sched_getaffinity(0))).train_cpus)


def measure(config_path: str, layout_name: str, reps: int, log_dir: str,
            split: tuple[int, int] | None = None) -> dict[str, Any]:
  """Runs in its own process: places itself like `controller.run`, then measures. `split`: the
  async layout's (rollout, trainer) cores (`--rollout_devices`, `--train_devices`)."""
  config = layout_config(config_path, layout_name, split)
  cores = sorted(os.sched_getaffinity(0))
  place = layout(config, cores)
  from flashrl_jax.fleet import LocalServers
  servers = LocalServers.start(
      config.model_path, len(place.server_cpus), cpu_sets=place.server_cpus, log_dir=log_dir,
      extra_args=engine_server_args(config))
  with servers:
    # Before JAX starts its thread pool (or the learner process inherits it), as the run pins.
    os.sched_setaffinity(0, place.train_cpus)
    learner = start_learner(config, os.path.join(log_dir, "learner"))
    try:
      result = asyncio.run(_measure(config, place, servers.urls, learner, reps,
                                    is_async=layout_name == "async"))
    finally:
      learner.close()
  os.sched_setaffinity(0, cores)
  return {"config": config_path, "layout": layout_name, "placement": dataclasses.asdict(place),
          **result}


def calibrate(config_path: str, layout_name: str, *, reps: int = 3,
              log_dir: str | None = None, split: tuple[int, int] | None = None) -> dict[str, Any]:
  """The calibration of `config_path` in the `sync` or `async` layout, measured in a fresh
  process (as a run is one), with the load probe around it; JSON-ready."""
  log_dir = log_dir or tempfile.mkdtemp(prefix="calib_")
  os.makedirs(log_dir, exist_ok=True)
  out = os.path.join(log_dir, "calibration.json")
  cmd = [sys.executable, "-m", "experiments._calibration", f"--config={config_path}",
         f"--layout={layout_name}", f"--reps={reps}", f"--out={out}", f"--server_logs={log_dir}"]
  if split is not None:
    cmd.append(f"--split={split[0]}+{split[1]}")
  before = probe()
  start = time.perf_counter()
  proc = _children.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  wall = time.perf_counter() - start
  after = probe()
  if proc.returncode:
    raise RuntimeError(f"calibration failed:\n{proc.stderr[-3000:]}")
  with open(out) as f:
    result = json.load(f)
  return {**result, **probe_pair(before, after), "wall_s": wall}


def describe(cal: dict[str, Any]) -> str:
  """A calibration's numbers on one line, after its layout: its wall time, load and probes, then
  each measured cost."""
  ro, tr, inter = cal["rollout"], cal["trainer"]["alone"], cal["interference"]
  return (f"{cal['wall_s']:.0f}s, load {cal['loadavg'][0]:.1f}-{cal['loadavg'][1]:.1f}, "
          f"probe {cal['probe_s'] * 1e3:.1f}ms"
          + (f", machine probe {cal['machine_probe_s'] * 1e3:.1f}ms" if "machine_probe_s" in cal
             else "")
          + (f", {cal['during_probe_s'] * 1e3:.1f}ms on a CPU during it" if "during_probe_s" in cal
             else "") + "): "
          f"{ro['workers']} worker(s) x {ro['slots']} slots, decode step "
          + ", ".join(f"{a}:{s * 1e3:.2f}ms" for a, s in zip(ro["decode_active"],
                                                            ro["decode_step_s"]))
          + f" (+{ro.get('decode_context_slope', 0.0) * 100:.2f}%/context token)"
          + f"; request {ro['request_s'] * 1e3:.2f}ms"
          + (f" (in a stream; {ro['request_batch_s'] * 1e3:.2f}ms admitted as a batch)"
             if "stream" in ro else "")
          + (f" (servers' CPU in sync rounds, contention x{ro['rounds']['contention']:.2f} against "
             f"the decode's x{ro['contention']:.2f}; "
             f"{ro['request_batch_s'] * 1e3:.2f}ms fitted to the batches' wall times)"
             if "rounds" in ro else "")
          + (f"; request {ro['bursts']['request_s'] * 1e3:.2f}ms in bursts after handoffs "
             "(async)" if "bursts" in ro else "")
          + ("; stream step (async) " + ", ".join(
              f"{a:.1f}:{s * 1e3:.2f}ms" for a, s in zip(ro["stream"]["active"],
                                                        ro["stream"]["step_s"]))
             if "step_s" in ro.get("stream", {}) else "")
          + f" + latency {ro['latency_s'] * 1e3:.1f}ms"
          + (f" ({ro['rounds']['latency_s'] * 1e3:.1f}ms from the sync rounds' walls)"
             if "latency_s" in ro.get("rounds", {}) else "") + "; "
          f"train {tr['train_s'][0]:.3f}-{tr['train_s'][1]:.3f}s for {tr['train_tokens'][0]}-"
          f"{tr['train_tokens'][1]} tokens, export {tr['export_s']:.3f}s; train "
          f"x{inter['train_beside_rollout']:.2f} beside rollout, rollout "
          f"x{inter['rollout_beside_train']:.2f} beside training; handoff busy "
          f"{sum(ro['handoff']['busy'].values()):.3f}s idle "
          f"{sum(ro['handoff']['idle'].values()):.3f}s")


def main() -> None:
  from absl import app, flags
  flags.DEFINE_string("config", None, "Run config file.", required=True)
  flags.DEFINE_enum("layout", "async", ["sync", "async"], "Core layout of the run to calibrate.")
  flags.DEFINE_integer("reps", 3, "Repetitions of each microbenchmark point (medians).")
  flags.DEFINE_string("split", None, "Async layout: rollout+trainer cores (e.g. 2+1; default: "
                      "the config's).")
  flags.DEFINE_string("out", None, "Output JSON.", required=True)
  flags.DEFINE_string("server_logs", None, "Server logs directory (default: a temp dir).")

  def run(argv):
    del argv
    _children.unwind_on_sigterm()  # stops its servers when the pass measuring it is stopped
    f = flags.FLAGS
    split = tuple(int(x) for x in f.split.split("+")) if f.split else None
    result = measure(f.config, f.layout, f.reps, f.server_logs or tempfile.mkdtemp(prefix="calib_"),
                     split)
    with open(f.out, "w") as out:
      json.dump(result, out, indent=1)
  app.run(run)


if __name__ == "__main__":
  main()
