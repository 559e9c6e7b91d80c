"""Multi-turn text games (gymnasium's FrozenLake and Taxi, our Sokoban) and the async wrapper's latency
and failure injection."""

import asyncio
import time

import pytest

import gymnasium
import numpy as np

from flashrl_jax.envs import (AsyncEnv, EnvConfig, EnvironmentFailure, EnvKind, EpisodeConfig,
                              FailureConfig, FrozenLakeConfig, FrozenLakeEnv, LatencyConfig,
                              LatencyKind, Move, SokobanConfig, SokobanEnv, TaxiEnv, format_action,
                              make_async_env, make_env, parse_move)

KINDS = list(EnvKind)


@pytest.mark.parametrize("text, move", [
    ("<action>Left</action>", Move.LEFT), ("I think <action> up </action>", Move.UP),
    ("<action>left</action> no wait <action>Right</action>", Move.RIGHT), ("down", Move.DOWN),
    ("Right.", Move.RIGHT), ("L", Move.LEFT), ("<action>jump</action>", None),
    ("I won't go left, I'll go right", None), ("", None),
])
def test_parse_move(text, move):
  assert parse_move(text) is move


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_seeded_reset_is_deterministic(kind):
  a, b = make_env(EnvConfig(kind=kind)), make_env(EnvConfig(kind=kind))
  assert a.reset(3) == b.reset(3)
  assert len({a.reset(s) for s in range(10)}) > 5  # and seeds differ


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("seed", range(12))
def test_optimal_solution_succeeds(kind, seed):
  env = make_env(EnvConfig(kind=kind, episode=EpisodeConfig(max_turns=50)))
  env.reset(seed)
  plan = env.shortest_solution()
  assert plan, "every generated level must be solvable and not already solved"
  for i, action in enumerate(plan):
    result = env.step(format_action(action))
    assert result.done == (i == len(plan) - 1)
  assert result.reward == (20.0 if kind is EnvKind.TAXI else 1.0)  # Taxi keeps gymnasium's reward
  assert result.info["success"] and not result.info["truncated"]
  with pytest.raises(RuntimeError):
    env.step("up")


def test_sokoban_multi_box_levels_are_solvable():
  env = SokobanEnv(SokobanConfig(width=7, height=7, num_boxes=2, num_pulls=40))
  for seed in range(4):
    env.reset(seed)
    assert len(env.boxes) == 2 and env.boxes != env.targets
    assert env.shortest_solution() is not None


def test_sokoban_push_rules():
  env = SokobanEnv(SokobanConfig())
  env.reset(0)
  env.walls[:] = True
  env.walls[1:-1, 1:-1] = False
  env.player, env.boxes, env.targets = (2, 1), frozenset({(2, 2)}), frozenset({(2, 4)})
  assert env.step("right").info["pushed"] and env.boxes == {(2, 3)}
  result = env.step("right")
  assert result.done and result.reward == 1.0 and "*" in result.observation
  env.reset(0)
  env.walls[:] = True
  env.walls[1:-1, 1:-1] = False
  env.player, env.boxes = (2, 2), frozenset({(2, 3), (2, 4)})
  assert not env.step("right").info["moved"]  # two boxes in a row do not move


def test_invalid_action_is_penalised_and_flagged():
  env = FrozenLakeEnv(episode=EpisodeConfig(invalid_action_penalty=-0.25))
  board = env.reset(1).splitlines()[-4:]
  result = env.step("let me think about it")
  assert result.reward == -0.25 and not result.done
  assert result.info["action_valid"] is False
  assert "Invalid action" in result.observation and result.observation.splitlines()[-4:] == board


def _gym_frozen_lake(seed: int, size: int = 4, hole_prob: float = 0.2):
  from gymnasium.envs.toy_text.frozen_lake import generate_random_map
  ref = gymnasium.make("FrozenLake-v1", desc=generate_random_map(size, 1 - hole_prob, seed=seed),
                       is_slippery=False)
  ref.reset(seed=seed)
  return ref


@pytest.mark.parametrize("seed", range(4))
def test_frozen_lake_is_gymnasium_frozen_lake(seed):
  """Same map, same transitions and rewards as gymnasium driven directly; the board shows its state."""
  env, ref = FrozenLakeEnv(episode=EpisodeConfig(max_turns=100)), _gym_frozen_lake(seed)
  board = env.reset(seed).splitlines()[-4:]
  desc = ["".join(c.decode() for c in row) for row in ref.unwrapped.desc]
  assert board == ["P" + desc[0][1:]] + desc[1:]
  rng = np.random.default_rng(seed)
  gym_ids = {"Left": 0, "Down": 1, "Right": 2, "Up": 3}
  for _ in range(30):
    name = ["Left", "Down", "Right", "Up"][int(rng.integers(4))]
    state, reward, terminated, _, _ = ref.step(gym_ids[name])
    result = env.step(name.lower())
    assert (env.state, result.reward, result.done) == (int(state), reward, terminated)
    row, col = divmod(int(state), 4)
    assert result.observation.splitlines()[row][col] == "P"
    if terminated:
      assert result.info["fell"] == (desc[row][col] == "H")
      assert result.info["success"] == (desc[row][col] == "G")
      break


def test_frozen_lake_hole_ends_episode_without_reward():
  for seed in range(20):
    env = FrozenLakeEnv(FrozenLakeConfig(size=4, hole_prob=0.3))
    env.reset(seed)
    desc = env.env.unwrapped.desc
    if desc[0, 1] == b"H":
      result = env.step("right")
      assert result.done and result.reward == 0.0 and result.info["fell"]
      assert not result.info["success"]
      return
  pytest.fail("no level with a hole right of the start in 20 seeds")


def test_taxi_is_gymnasium_taxi():
  env = TaxiEnv(episode=EpisodeConfig(max_turns=200))
  ref = gymnasium.make("Taxi-v4")
  env.reset(11)
  state, _ = ref.reset(seed=11)
  assert env.state == state
  rng = np.random.default_rng(0)
  names = ["Down", "Up", "Right", "Left", "Pickup", "Dropoff"]  # gymnasium's action order
  for _ in range(60):
    action = int(rng.integers(6))
    state, reward, terminated, _, _ = ref.step(action)
    result = env.step(f"<action>{names[action]}</action>")
    assert (env.state, result.reward, result.done) == (int(state), reward, terminated)
    row, col, passenger, destination = ref.unwrapped.decode(state)
    assert result.observation.splitlines()[1 + row][2 * col + 1] == "T"
    assert f"Destination: {'RGYB'[destination]}." in result.observation
    assert ("in the taxi" in result.observation) == (passenger == 4)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_turn_budget_ends_episode(kind):
  env = make_env(EnvConfig(kind=kind, episode=EpisodeConfig(max_turns=3)))
  env.reset(0)
  results = [env.step("nonsense") for _ in range(3)]
  assert [r.done for r in results] == [False, False, True]
  assert results[-1].info["truncated"] and results[-1].info["turn"] == 3


def _run_episode(env, seed, actions):
  async def main():
    await env.areset(seed)
    return [await env.astep(a) for a in actions]
  return asyncio.run(main())


def test_latency_is_awaited_not_blocking():
  """Eight episodes with 0.1 s steps overlap: 8 x 3 steps finish in far less than 2.4 s."""
  cfg = EnvConfig(latency=LatencyConfig(LatencyKind.CONSTANT, mean_s=0.1))

  async def episode(seed):
    env = make_async_env(cfg, seed)
    await env.areset(seed)
    return [await env.astep("wait") for _ in range(3)]

  async def main():
    return await asyncio.gather(*[episode(s) for s in range(8)])

  start = time.monotonic()
  results = asyncio.run(main())
  elapsed = time.monotonic() - start
  assert 0.4 <= elapsed < 1.5
  assert all(r.info["latency_s"] == pytest.approx(0.1) for steps in results for r in steps)


def test_latency_distributions_are_seeded_and_long_tailed():
  import numpy as np
  cfg = LatencyConfig(LatencyKind.LONG_TAIL, mean_s=0.01, sigma=0.3, tail_prob=0.1, tail_factor=20)
  a = [cfg.sample(np.random.default_rng(5)) for _ in range(3)]
  assert a == [cfg.sample(np.random.default_rng(5)) for _ in range(3)]
  draws = np.array([cfg.sample(r) for r in [np.random.default_rng(0)] for _ in range(4000)])
  assert np.mean(draws > 0.01 * 5) == pytest.approx(0.1, abs=0.03)  # the injected tail
  assert LatencyConfig().sample(np.random.default_rng(0)) == 0.0


def test_fail_slow_takes_ten_times_longer():
  env = AsyncEnv(FrozenLakeEnv(), LatencyConfig(LatencyKind.CONSTANT, mean_s=0.02),
                 FailureConfig(slow_prob=1.0))
  start = time.monotonic()
  (result,) = _run_episode(env, 0, ["up"])
  elapsed = time.monotonic() - start
  assert result.info["fail_slow"] and result.info["latency_s"] == pytest.approx(0.2)
  assert 0.2 <= elapsed < 0.6


def test_fail_stop_raises_environment_failure_that_a_controller_can_count():
  cfg = EnvConfig(failure=FailureConfig(stop_prob=0.3), episode=EpisodeConfig(max_turns=100))

  async def controller():
    failures = completed = 0
    for seed in range(20):
      env = make_async_env(cfg, seed)
      await env.areset(seed)
      try:
        for _ in range(5):
          await env.astep("nonsense")
        completed += 1
      except EnvironmentFailure:
        failures += 1
    return failures, completed

  failures, completed = asyncio.run(controller())
  assert failures + completed == 20 and 10 <= failures <= 20  # 1 - 0.7**5 = 83% of episodes
  env = make_async_env(EnvConfig(failure=FailureConfig(stop_prob=1.0)))
  with pytest.raises(EnvironmentFailure):
    _run_episode(env, 0, ["up"])
  assert env.failures == 1


def test_crashed_env_stays_down_until_reset():
  env = AsyncEnv(FrozenLakeEnv(), failure=FailureConfig(stop_prob=0.5))

  async def main():
    await env.areset(0)
    for _ in range(50):  # until the first injected crash
      try:
        await env.astep("wait")
      except EnvironmentFailure:
        break
    with pytest.raises(EnvironmentFailure, match="areset"):
      await env.astep("wait")
    await env.areset(1)
    env.failure = FailureConfig()
    return await env.astep("wait")

  assert asyncio.run(main()).info["action_valid"] is False


def test_async_env_is_reproducible_per_seed():
  cfg = EnvConfig(latency=LatencyConfig(LatencyKind.LOGNORMAL, mean_s=0.001),
                  failure=FailureConfig(slow_prob=0.5))
  runs = [[(r.observation, r.info["latency_s"], r.info["fail_slow"])
           for r in _run_episode(make_async_env(cfg, seed=i), 4, ["up", "left", "down"])]
          for i in range(2)]
  assert runs[0] == runs[1]
