"""Agent code through the OpenAI API, trained by the controller.

1. The recording proxy against a real server: ordinary agent code (`chat_agent`, the `openai`
   client) plays multi-turn episodes; the assembled trajectory's tokens are exactly the turns'
   outputs plus what the conversation added between them, its behaviour log-probs are the server's
   (checked against a native `/generate` re-scoring), and a weight publish in the middle of an
   episode shows in the per-token versions.
2. `experiments/configs/agentic_openai.py` end to end (`python -m experiments.train`, real server
   processes, real trainer): steps train on agent-code episodes within the staleness bound.
"""

import asyncio
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from flashrl_jax import envs
from flashrl_jax.controller import (AgentEpisode, AgentProxy, AgenticStats, EpisodeDeps, Group,
                                    chat_agent)
from flashrl_jax.controller._agentic_episode import env_factory
from flashrl_jax.fleet import Fleet, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.model import char_tokenizer
from flashrl_jax.rollout import ChatTemplate
from flashrl_jax.testing import tiny_config, write_tiny_checkpoint
from tests.api_servers import start_servers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GAME = envs.EnvConfig(episode=envs.EpisodeConfig(max_turns=3))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("agent_model"))
  write_tiny_checkpoint(path, tiny_config(max_position_embeddings=1024))
  write_tiny_checkpoint(path + "_v1", tiny_config(max_position_embeddings=1024), seed=1)
  return path


def rescore(url, prompt, response):
  """Log-probs of `response` after `prompt` under the server's weights (native prompt scoring)."""
  body = {"input_ids": list(prompt) + list(response), "return_logprob": True,
          "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 0}}
  req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode())
  with urllib.request.urlopen(req, timeout=120) as resp:
    entries = json.loads(resp.read())["meta_info"]["input_token_logprobs"]
  return [e[0] for e in entries[1:]]


def test_agent_code_turns_are_recorded_and_assembled(model, tmp_path):
  tokenizer = char_tokenizer()

  async def run():
    with start_servers(model, 1, log_dir=str(tmp_path / "logs")) as servers:
      client = RolloutClient(servers.urls, vocab_size=96)
      async with Fleet(client, pause_mode=PauseMode.ABORT) as fleet:
        sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(2,))
        proxy = AgentProxy(fleet, tokenizer, ChatTemplate.from_model_dir(model), sampling)
        async with proxy:
          deps = EpisodeDeps(fleet=fleet, tokenizer=tokenizer, sampling=sampling,
                             make_env=env_factory(GAME), stats=AgenticStats(), row_length=1000,
                             max_response_length=700, step_timeout_s=30)
          group = Group(prompt_index=3, sample=None, prompt_ids=[], n=2, dispatched_version=0)
          agent = lambda url, env, seed: chat_agent(url, env, seed, max_tokens=8)
          episodes = [AgentEpisode(deps, group, c, 11, proxy, agent) for c in range(2)]
          first = await episodes[0].play()
          rescored = await asyncio.to_thread(rescore, servers.urls[0], group.prompt_ids,
                                             first.output_ids)

          # A weight handoff while agent code is mid-episode: after its first turn, before its
          # second (held until the handoff is done, so neither can finish first under load).
          handed_off, turns_started = asyncio.Event(), 0
          generate = fleet.generate

          async def gated_generate(*args, **kwargs):
            nonlocal turns_started
            turns_started += 1
            if turns_started == 2:
              await handed_off.wait()
            return await generate(*args, **kwargs)

          fleet.generate = gated_generate

          async def publish_mid_episode():
            while not any(r.turns for r in proxy._episodes.values()):
              await asyncio.sleep(0.001)
            await fleet.publish(model + "_v1", 1)
            handed_off.set()

          second, _ = await asyncio.gather(episodes[1].play(), publish_mid_episode())
          return first, second, group, rescored

  first, second, group, rescored = asyncio.run(run())
  for r in (first, second):
    assert r.reward_info["turns"] == r.reward_info["agent_calls"] >= 2  # multi-turn, all chained
    assert len(r.output_ids) == len(r.behavior_logp) == len(r.token_versions) == \
        len(r.response_mask)
    trained = [t for t, m in zip(r.output_ids, r.response_mask) if m]
    assert 0 < len(trained) < len(r.output_ids)  # observations between turns are not trained
    assert all(lp == 0.0 for lp, m in zip(r.behavior_logp, r.response_mask) if not m)
  assert set(first.token_versions) == {0}
  assert second.start_version == 0 and max(second.token_versions) == 1
  # Behaviour log-probs (T = 1) are the served policy's: the server re-scores the whole trajectory.
  for lp, again, m in zip(first.behavior_logp, rescored, first.response_mask):
    if m:
      assert lp == pytest.approx(again, abs=2e-4)
  # The trajectory is the conversation the agent had, turn markers included.
  text = char_tokenizer().decode(group.prompt_ids + first.output_ids, skip_special_tokens=False)
  assert text.startswith("<user>") and text.count("<assistant>") == first.reward_info["turns"]


@pytest.mark.slow  # a whole run: server start-up (every shape compiled) + trainer
def test_agentic_openai_config_trains(tmp_path, model):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "experiments.train",
         "--config=experiments/configs/agentic_openai.py", f"--model_path={model}",
         f"--workdir={workdir}", "--steps=3", "--batch_size=2", "--group_size=2",
         "--num_rollout_servers=1", "--noplot", "--noprogress", "--eval_every=0",
         # Small shapes (the server compiles each one at start-up): 2 turns in a 512-token row.
         "--set=rollout.max_running_requests=4", "--set=train.batch.row_length=512",
         "--set=train.batch.max_response_length=256", "--set=task.env.episode.max_turns=2"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert [r["policy_version"] for r in records] == [1, 2, 3]
  for r in records:
    assert r["num_samples"] == 4 and max(int(k) for k in r["staleness_hist"]) <= 1
  ids = [i for r in records for i in r["sample_ids"]]
  assert len(ids) == len(set(ids)) == 12
  assert records[-1]["total/episodes_finished"] >= 12
