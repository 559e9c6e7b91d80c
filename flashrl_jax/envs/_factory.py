"""Build environments and rewards from typed configs: enums chosen once, at the edge.

No global registry: adding a task means adding an enum member and a branch here, which keeps the
set of tasks greppable and the construction of each one explicit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum

from flashrl_jax._enums import parse_enum
from flashrl_jax.envs._adaptive_timeout import AdaptiveTimeout, AdaptiveTimeoutConfig
from flashrl_jax.envs._code_reward import CodeReward
from flashrl_jax.envs._episode import EpisodeConfig
from flashrl_jax.envs._gym import FrozenLakeConfig, FrozenLakeEnv, TaxiConfig, TaxiEnv
from flashrl_jax.envs._latency import AsyncEnv, FailureConfig, LatencyConfig
from flashrl_jax.envs._math_reward import ExactMatchReward, MathReward, VerifierBackend
from flashrl_jax.envs._pool import InlineReward, PooledReward
from flashrl_jax.envs._reasoning_gym import ReasoningGymConfig, ReasoningGymReward
from flashrl_jax.envs._sandbox import Sandbox, SandboxConfig
from flashrl_jax.envs._sokoban import SokobanConfig, SokobanEnv
from flashrl_jax.envs._types import AsyncRewardFn, Environment


class EnvKind(enum.Enum):
  FROZEN_LAKE = "frozen_lake"  # gymnasium's FrozenLake-v1
  TAXI = "taxi"                # gymnasium's Taxi-v4
  SOKOBAN = "sokoban"          # ours (gymnasium has none)


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """One multi-turn environment: the game, its episode rules, and its simulated latency/failures."""

  kind: EnvKind = EnvKind.FROZEN_LAKE
  episode: EpisodeConfig = EpisodeConfig()
  frozen_lake: FrozenLakeConfig = FrozenLakeConfig()
  taxi: TaxiConfig = TaxiConfig()
  sokoban: SokobanConfig = SokobanConfig()
  latency: LatencyConfig = LatencyConfig()
  failure: FailureConfig = FailureConfig()

  def __post_init__(self):
    object.__setattr__(self, "kind", parse_enum(EnvKind, self.kind, "kind"))


def make_env(config: EnvConfig) -> Environment:
  """The bare synchronous game (no latency, no failures)."""
  if config.kind is EnvKind.FROZEN_LAKE:
    return FrozenLakeEnv(config.frozen_lake, config.episode)
  if config.kind is EnvKind.TAXI:
    return TaxiEnv(config.taxi, config.episode)
  if config.kind is EnvKind.SOKOBAN:
    return SokobanEnv(config.sokoban, config.episode)
  raise ValueError(f"unknown env kind {config.kind}")


def make_async_env(config: EnvConfig, seed: int = 0) -> AsyncEnv:
  """The game as the rollout loop drives it: awaitable, with the configured latency and failures."""
  return AsyncEnv(make_env(config), config.latency, config.failure, seed=seed)


class RewardKind(enum.Enum):
  MATH = "math"              # boxed / "answer is" / last number vs `answer`, 0/1
  EXACT_MATCH = "exact"      # whitespace-normalised string equality (synthetic tasks)
  CODE = "code"              # the response's function run in the sandbox, judged on `tests`, 0/1
  REASONING_GYM = "reasoning_gym"  # the generator's own scorer (needs `reasoning_gym`)


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  kind: RewardKind = RewardKind.MATH
  verifier: VerifierBackend = VerifierBackend.AUTO
  sandbox: SandboxConfig = SandboxConfig()
  adaptive_timeout: AdaptiveTimeoutConfig | None = AdaptiveTimeoutConfig()  # None: fixed limit
  reasoning_gym: ReasoningGymConfig | None = None  # REASONING_GYM: the task's generators

  def __post_init__(self):
    object.__setattr__(self, "kind", parse_enum(RewardKind, self.kind, "kind"))
    if (self.kind is RewardKind.REASONING_GYM) != (self.reasoning_gym is not None):
      raise ValueError("the reasoning_gym reward goes with (and only with) a ReasoningGymConfig.")


def make_reward_fn(config: RewardConfig,
                   executor: concurrent.futures.Executor | None = None) -> AsyncRewardFn:
  """An awaitable reward. Sync rewards run on `executor` (pass a process pool for CPU-heavy math),
  except exact match, which costs less than the hop to an executor and runs on the caller's loop.

  CODE probes the sandbox (`Sandbox.check`): raises `SandboxUnavailable` when it would refuse.
  """
  if config.kind is RewardKind.MATH:
    return PooledReward(MathReward(config.verifier), executor)
  if config.kind is RewardKind.EXACT_MATCH:
    return InlineReward(ExactMatchReward())
  if config.kind is RewardKind.REASONING_GYM:
    return PooledReward(ReasoningGymReward(config.reasoning_gym), executor)
  if config.kind is RewardKind.CODE:
    adaptive = AdaptiveTimeout(config.adaptive_timeout) if config.adaptive_timeout else None
    sandbox = Sandbox(config.sandbox)
    # One probe now: weak isolation is logged loudly at start, and a machine that cannot isolate
    # code (without the opt-in) fails here rather than at the first sample.
    sandbox.check()
    return CodeReward(sandbox, adaptive)
  raise ValueError(f"unknown reward kind {config.kind}")
