"""Awaiting synchronous rewards: CPU-heavy ones off the event loop, cheap ones on it.

Math verification (sympy under `math_verify`) can take tens of milliseconds per response and holds
the GIL; run inline it would stall token streaming and every other coroutine. `PooledReward` hands
each call to an executor: a process pool for CPU-bound verifiers (true parallelism, no GIL), or a
thread pool for work that mostly waits. The executor is owned by the caller so one pool can serve
many rewards and is shut down exactly once.

A reward that costs microseconds (`ExactMatchReward`: a string comparison bounded by the response's
length) is called on the loop instead (`InlineReward`): a thread hop costs 20–50 µs of CPU per
call (hand-off, wake-up, result posted back; `run_in_executor` against a direct call, 32 at a time,
this 2-core machine, busy and idle: docs/async_cpu_levers.md has the script), four to eight times
the comparison itself.

Workers are started with the `spawn` method: forking a process that already runs JAX's threads can
deadlock the child. Arguments cross the process boundary as plain strings and frozen dataclasses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing

from flashrl_jax.envs._types import RewardFn, RewardResult, Sample


def make_process_pool(workers: int = 2) -> concurrent.futures.ProcessPoolExecutor:
  return concurrent.futures.ProcessPoolExecutor(
      max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


@dataclasses.dataclass
class PooledReward:
  """Adapts a sync `RewardFn` to an awaitable one. `executor=None` uses the loop's default threads."""

  fn: RewardFn
  executor: concurrent.futures.Executor | None = None

  async def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(self.executor, self.fn, prompt, response, sample)


@dataclasses.dataclass
class InlineReward:
  """Adapts a sync `RewardFn` that costs microseconds to an awaitable one, called on the loop."""

  fn: RewardFn

  async def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    return self.fn(prompt, response, sample)
