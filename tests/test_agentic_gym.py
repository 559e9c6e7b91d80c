"""gymnasium's FrozenLake through the env-level async loop with a real tiny model.

One real JAX engine server process serves a random tiny model; `EnvGroupRunner` plays a group of
FrozenLake episodes on it (reset, one-token model turns, environment steps). Each episode's recorded
turns are then replayed on gymnasium's own `FrozenLake-v1` (the same generated map and seed): the
moves the model made give the same rewards, boards and end as gymnasium says they should, and the
model tokens carry the engine's behaviour log-probs, equal to a forward pass of the same weights.
"""

from __future__ import annotations

import asyncio
import itertools

import gymnasium
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from flashrl_jax import envs
from flashrl_jax.controller import AgenticConfig, AgenticStats, EnvGroupRunner, EpisodeDeps
from flashrl_jax.controller._agentic import level_seed
from flashrl_jax.controller._agentic_episode import env_factory
from flashrl_jax.fleet import Fleet, LocalServers, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.model import char_tokenizer, load_hf, token_logprobs
from flashrl_jax.testing import tiny_config, write_tiny_checkpoint

TURNS = 8
EPISODES = 24  # ~80 one-token turns: P(no move at all) = (1 - 8/96)^80 < 0.1%
GAME = envs.EnvConfig(kind="frozen_lake", episode=envs.EpisodeConfig(max_turns=TURNS))
GYM_ACTION = {envs.Move.LEFT: 0, envs.Move.DOWN: 1, envs.Move.RIGHT: 2, envs.Move.UP: 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("gym_agentic")
  write_tiny_checkpoint(str(root / "model"), tiny_config(max_position_embeddings=1024), seed=1)
  # No warm-up of every shape: this test needs a few, compiled on first use.
  servers = LocalServers.start(str(root / "model"), 1, extra_args=(
      "--max_running_requests=8", "--max_prefill_batch=2", "--context_length=640",
      "--weight_version=0", "--nowarmup"), log_dir=str(root / "logs"))
  try:
    yield str(root / "model"), servers
  finally:
    servers.stop()


def _play(urls) -> list:
  # One-token turns: a tiny random model then names a move ("u", "L", ...) now and then.
  deps_kwargs = dict(tokenizer=char_tokenizer(), make_env=env_factory(GAME),
                     sampling=SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=(2,)),
                     row_length=640, max_response_length=400, step_timeout_s=60.0)

  async def main():
    client = RolloutClient(urls, request_timeout_s=120.0, vocab_size=96)
    async with Fleet(client, pause_mode=PauseMode.ABORT) as fleet:
      await fleet.wait_healthy(timeout_s=300)
      deps = EpisodeDeps(fleet=fleet, stats=AgenticStats(), **deps_kwargs)
      runner = EnvGroupRunner(deps, AgenticConfig(env_group_size=EPISODES), group_size=EPISODES,
                              concurrent_groups=1, task_seed=3)
      return await runner.run(runner.new_group(0, envs.Sample("", "")))

  return asyncio.run(main())


def test_frozen_lake_episodes_replay_on_gymnasium(model_dir):
  path, servers = model_dir
  group = _play(servers.urls)
  tok = char_tokenizer()
  seed = level_seed(3, 0)
  desc = generate_random_map(4, 0.8, seed=seed)
  assert tok.decode(group.prompt_ids) == envs.make_env(GAME).reset(seed)
  assert tok.decode(group.prompt_ids).endswith("\n".join(["P" + desc[0][1:]] + desc[1:]))
  valid_moves = 0
  for r in group.responses:
    mask = np.asarray(r.response_mask)
    ids = np.asarray(r.output_ids)
    # Turns and observations alternate: (model token, observation tokens) * k, model token last
    # unless the environment ended the episode on the last observation.
    runs = [(m, [int(i) for _, i in chunk])
            for m, chunk in itertools.groupby(zip(mask, ids), key=lambda x: x[0])]
    ref = gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=False)
    state, _ = ref.reset(seed=seed)
    reward, ended = 0.0, False
    for k, (is_model, tokens) in enumerate(runs):
      if not is_model:
        continue
      assert len(tokens) == 1 and not ended
      move = envs.parse_move(tok.decode(tokens))
      if move is None:
        reward += GAME.episode.invalid_action_penalty
      else:
        valid_moves += 1
        state, gym_reward, ended, _, _ = ref.step(GYM_ACTION[move])
        reward += gym_reward
      if k + 1 < len(runs):  # the observation that followed shows gymnasium's board
        board = tok.decode(runs[k + 1][1]).strip().splitlines()[-4:]
        row, col = divmod(int(state), 4)
        assert board[row][col] == "P"
    assert r.reward == pytest.approx(reward)
    turns = sum(m for m, _ in runs)
    assert r.reward_info["turns"] == turns
    # Invalid-action hints are long: an episode may fill its context before its turn budget.
    assert r.finish_reason == ("success" if ended and reward > 0 else "done" if ended else
                               "max_turns" if turns == TURNS else "context_full")
  assert len(group.responses) == EPISODES
  # The behaviour log-probs are the served weights' own: one padded forward pass over all episodes.
  model, prompt = load_hf(path), list(group.prompt_ids)
  seqs = [prompt + list(r.output_ids) for r in group.responses]
  ids = np.zeros((len(seqs), 640), np.int32)
  for i, seq in enumerate(seqs):
    ids[i, :len(seq)] = seq
  logp, _ = token_logprobs(model.hidden_states(jnp.asarray(ids[:, :-1])), model.unembedding(),
                           jnp.asarray(ids[:, 1:]))
  for row, r in zip(np.asarray(logp), group.responses):
    mask = np.asarray(r.response_mask)
    got = row[len(prompt) - 1:len(prompt) - 1 + len(mask)]
    np.testing.assert_allclose(np.asarray(r.behavior_logp)[mask], got[mask], atol=2e-4)
  assert valid_moves > 0, "no turn of the tiny model was a move: the replay checked nothing"
