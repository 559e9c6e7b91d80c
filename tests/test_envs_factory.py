"""Factories and the async reward adapters (process pool for CPU-bound verifiers)."""

import asyncio
import concurrent.futures

import pytest

from flashrl_jax import envs
from flashrl_jax.envs import (AsyncEnvironment, AsyncRewardFn, EnvConfig, EnvKind, Environment,
                              RewardConfig, RewardFn, RewardKind, Sample, SandboxConfig)


def test_factories_build_the_right_things():
  assert isinstance(envs.make_env(EnvConfig(kind=EnvKind.SOKOBAN)), envs.SokobanEnv)
  assert isinstance(envs.make_env(EnvConfig(kind="taxi")), envs.TaxiEnv)
  env = envs.make_env(EnvConfig(kind=EnvKind.FROZEN_LAKE))
  assert isinstance(env, envs.FrozenLakeEnv) and isinstance(env, Environment)
  assert isinstance(envs.make_async_env(EnvConfig()), AsyncEnvironment)
  assert isinstance(envs.MathReward(), RewardFn)
  code = envs.make_reward_fn(RewardConfig(kind=RewardKind.CODE, sandbox=SandboxConfig(timeout_s=3)))
  assert isinstance(code, envs.CodeReward) and code.adaptive is not None
  fixed = envs.make_reward_fn(RewardConfig(kind=RewardKind.CODE, adaptive_timeout=None))
  assert fixed.adaptive is None
  rg = envs.ReasoningGymConfig(datasets=(envs.ReasoningGymDataset("chain_sum"),))
  for kind in RewardKind:
    config = RewardConfig(kind=kind, reasoning_gym=rg if kind is RewardKind.REASONING_GYM else None)
    assert isinstance(envs.make_reward_fn(config), AsyncRewardFn)
  with pytest.raises(ValueError, match="reasoning_gym reward"):
    RewardConfig(kind=RewardKind.REASONING_GYM)


def test_invalid_configs_are_rejected():
  with pytest.raises(ValueError):
    envs.AdaptiveTimeoutConfig(t_min=5, t_max=1)
  with pytest.raises(ValueError):
    envs.SokobanConfig(width=3)
  with pytest.raises(ValueError, match="kind='cliff' is not one of"):
    envs.EnvConfig(kind="cliff")
  with pytest.raises(ValueError):
    envs.FailureConfig(stop_prob=1.5)
  with pytest.raises(ValueError):
    envs.SandboxConfig(memory_mb=1)


def test_exact_match_reward_runs_on_the_loop_not_in_an_executor():
  """Exact match costs less than a thread hop: the factory's reward never touches an executor."""

  class RefusingExecutor(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
      raise AssertionError("exact match went to an executor")

  fn = envs.make_reward_fn(RewardConfig(kind=RewardKind.EXACT_MATCH))
  sample = envs.generate_synthetic(envs.SyntheticConfig(), num=1, seed=0)[0]

  async def score():
    asyncio.get_running_loop().set_default_executor(RefusingExecutor())
    right = await fn("", f"  {sample.answer} \nmore text", sample)
    wrong = await fn("", sample.answer + "x", sample)
    return right, wrong

  right, wrong = asyncio.run(score())
  assert (right.reward, wrong.reward) == (1.0, 0.0)
  assert right.info == {"format_ok": True, "correct": True}


def test_math_reward_in_process_pool_keeps_loop_free():
  """Spawned workers run the verifier; the loop ticks while they work."""
  samples = [Sample(f"{i}+{i}", str(2 * i)) for i in range(16)]
  with envs.make_process_pool(2) as pool:
    fn = envs.make_reward_fn(RewardConfig(kind=RewardKind.MATH), executor=pool)
    ticks = 0

    async def ticker(stop):
      nonlocal ticks
      while not stop.is_set():
        ticks += 1
        await asyncio.sleep(0.005)

    async def main():
      stop = asyncio.Event()
      tick = asyncio.ensure_future(ticker(stop))
      results = await asyncio.gather(*[
          fn(s.prompt, rf"so \boxed{{{2 * i + (i % 2)}}}", s) for i, s in enumerate(samples)])
      stop.set()
      await tick
      return results

    results = asyncio.run(main())
  assert [r.reward for r in results] == [float(i % 2 == 0) for i in range(16)]
  assert ticks > 5


def test_pooled_reward_with_explicit_thread_pool():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    fn = envs.PooledReward(envs.MathReward(envs.VerifierBackend.BUILTIN), pool)
    result = asyncio.run(fn("", r"\boxed{\frac{3}{6}}", Sample("", "0.5")))
  assert result.reward == 1.0 and result.info["backend"] == "builtin"
