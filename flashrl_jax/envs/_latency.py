"""Make environment steps take real, variable time, and sometimes fail, without blocking the loop.

Agentic environments call tools, APIs and sandboxes; their step latency is what ROLL Flash's
environment-level asynchrony hides, and their failures are what redundant environment rollouts
(more env groups / larger groups than needed) guard against. `AsyncEnv` wraps any `Environment`
and, per step, sleeps a seeded random latency with `asyncio.sleep` (other episodes keep running),
then applies failure injection:

  * fail-slow: with probability `slow_prob` the step takes `slow_factor` (10x) its latency;
  * fail-stop: with probability `stop_prob` the step raises `EnvironmentFailure` after its latency
    (a crash is usually noticed only after the call has hung for a while); the environment then
    stays down, raising on every step, until `areset`.

All randomness comes from one generator seeded by `areset(seed)`, so an episode's latencies and
failures are reproducible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum

import numpy as np

from flashrl_jax.envs._types import Environment, EnvironmentFailure, StepResult


class LatencyKind(enum.Enum):
  NONE = "none"
  CONSTANT = "constant"    # always `mean_s`
  LOGNORMAL = "lognormal"  # median `mean_s`, log-std `sigma`
  LONG_TAIL = "long_tail"  # lognormal body; with prob `tail_prob` multiplied by `tail_factor`


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
  kind: LatencyKind = LatencyKind.NONE
  mean_s: float = 0.0
  sigma: float = 0.5
  tail_prob: float = 0.05
  tail_factor: float = 10.0

  def __post_init__(self):
    if self.mean_s < 0 or self.sigma < 0 or not 0 <= self.tail_prob <= 1 or self.tail_factor < 1:
      raise ValueError(f"invalid latency config: {self}")

  def sample(self, rng: np.random.Generator) -> float:
    if self.kind is LatencyKind.NONE:
      return 0.0
    if self.kind is LatencyKind.CONSTANT:
      return self.mean_s
    base = float(self.mean_s * np.exp(self.sigma * rng.standard_normal()))
    if self.kind is LatencyKind.LONG_TAIL and rng.random() < self.tail_prob:
      base *= self.tail_factor
    return base


@dataclasses.dataclass(frozen=True)
class FailureConfig:
  slow_prob: float = 0.0
  slow_factor: float = 10.0
  stop_prob: float = 0.0

  def __post_init__(self):
    if not (0 <= self.slow_prob <= 1 and 0 <= self.stop_prob <= 1 and self.slow_factor >= 1):
      raise ValueError(f"invalid failure config: {self}")


class AsyncEnv:
  """`Environment` -> `AsyncEnvironment` with simulated latency and failure injection.

  `info` of each step gains `latency_s` and `fail_slow`. Reset also pays a latency (environment
  creation is a remote call too) but never fails, so a failure always belongs to an episode.
  """

  def __init__(self, env: Environment, latency: LatencyConfig = LatencyConfig(),
               failure: FailureConfig = FailureConfig(), seed: int = 0):
    self.env = env
    self.latency = latency
    self.failure = failure
    self._rng = np.random.default_rng(seed)
    self.steps = 0
    self.failures = 0
    self._crashed = False

  async def areset(self, seed: int) -> str:
    # Salted so the latency stream is not the same numbers the level generator drew from `seed`.
    self._rng = np.random.default_rng([seed, 0x1A7E])
    self._crashed = False
    await asyncio.sleep(self.latency.sample(self._rng))
    return self.env.reset(seed)

  async def astep(self, action_text: str) -> StepResult:
    if self._crashed:  # a crashed environment stays down until the controller resets it
      raise EnvironmentFailure("environment crashed earlier in this episode; call areset()")
    latency = self.latency.sample(self._rng)
    slow = self._rng.random() < self.failure.slow_prob
    stop = self._rng.random() < self.failure.stop_prob
    if slow:
      latency *= self.failure.slow_factor
    await asyncio.sleep(latency)
    self.steps += 1
    if stop:
      self.failures += 1
      self._crashed = True
      raise EnvironmentFailure(f"injected fail-stop at step {self.steps}")
    result = self.env.step(action_text)
    info = {**result.info, "latency_s": latency, "fail_slow": slow}
    return dataclasses.replace(result, info=info)
