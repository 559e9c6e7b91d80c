"""The run's weight handoff (`Learner.export` then `Fleet.publish`, the one implementation) mid-
generation, with a real server process loading real exported versions and a real trainer: every
token and behaviour log-prob survives the publish in both pause modes, tokens carry the version that
produced them, and (abort mode) each token's log-prob is what that version's weights give."""

import asyncio
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashrl_jax.controller import Learner
from flashrl_jax.fleet import Fleet, LocalServers, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.model import load_hf, token_logprobs, verify_version
from flashrl_jax.testing import tiny_config, write_tiny_checkpoint
from flashrl_jax.trainer import (BatchConfig, CheckpointConfig, Checkpointer, MeshConfig,
                                 OptimizerConfig, TrainConfig, Trainer, VersionStore, make_mesh,
                                 random_trajectories)

NEW_TOKENS = 600


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("handoff")
  config = tiny_config(eos_token_ids=(), max_position_embeddings=1024)  # no eos: run to the cap
  write_tiny_checkpoint(str(root / "init"), config, seed=0)
  train_config = TrainConfig(optimizer=OptimizerConfig(learning_rate=3e-2),
                             batch=BatchConfig(row_length=640, rows=2, sequences_per_row=4,
                                               max_response_length=600))
  trainer = Trainer(config, train_config, make_mesh(MeshConfig.parse("data:1,fsdp:1,tensor:1")),
                    init_params=str(root / "init"))
  servers = LocalServers.start(str(root / "init"), 1, extra_args=(
      "--max_running_requests=4", "--context_length=640", "--weight_version=0"),
      log_dir=str(root / "logs"))
  yield trainer, servers, root, config
  servers.stop()


def _recomputed_logp(path, prompt, output):
  model = load_hf(path)
  ids = jnp.asarray([prompt + output[:-1]], jnp.int32)
  targets = jnp.asarray([prompt[1:] + output], jnp.int32)
  logp, _ = token_logprobs(model.hidden_states(ids), model.unembedding(), targets)
  return np.asarray(logp)[0, len(prompt) - 1:]


@pytest.mark.parametrize("mode", [PauseMode.ABORT, PauseMode.IN_PLACE])
def test_publish_mid_generation_keeps_every_token(setup, mode):
  trainer, servers, root, config = setup
  store = VersionStore(str(root / f"versions_{mode.value}"))
  learner = Learner(trainer, store, Checkpointer(CheckpointConfig(str(root / "ckpt"))),
                    keep_versions=4)
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
  sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3, ignore_eos=True)

  async def scenario():
    client = RolloutClient(servers.urls, request_timeout_s=120)
    async with Fleet(client, pause_mode=mode, servers=servers) as fleet:
      base = learner.policy_version
      await fleet.publish(learner.export(), base)
      # Train first (compiling takes longer than a generation), publish while generating.
      rng = np.random.default_rng(0)
      trainer.update(random_trajectories(rng, 8, vocab_size=config.vocab_size,
                                         prompt_lengths=(2, 8), response_lengths=(4, 16)))
      path = learner.export()  # written ahead, so the publish below is only the handoff
      for _ in range(2):  # warm up, then time a warm round
        start = asyncio.get_running_loop().time()
        await asyncio.gather(*(fleet.generate(p, sampling) for p in prompts))
        duration = asyncio.get_running_loop().time() - start
      for _ in range(3):  # a loaded machine can run a round faster than the timed one: retry
        start = asyncio.get_running_loop().time()
        tasks = [asyncio.create_task(fleet.generate(p, sampling)) for p in prompts]
        await asyncio.sleep(0.3 * duration)  # publish about a third of the way through
        if not any(t.done() for t in tasks):
          timings = await fleet.publish(path, learner.policy_version)
          assert fleet.stats().version == learner.policy_version
          return base, await asyncio.gather(*tasks), timings
        await asyncio.gather(*tasks)
        duration = asyncio.get_running_loop().time() - start
      raise AssertionError("generation kept finishing before the publish")

  base, results, timings = asyncio.run(scenario())
  new = base + 1
  assert set(timings) == {"time/pause_s", "time/load_s", "time/resume_s"}
  spanning = 0
  for prompt, result in zip(prompts, results):
    # Nothing lost: every token, with one log-prob and one version each.
    assert len(result.output_ids) == NEW_TOKENS
    assert len(result.output_logprobs) == len(result.token_versions) == NEW_TOKENS
    versions = [int(v) for v in result.token_versions]
    assert versions == sorted(versions) and set(versions) <= {base, new}
    spanning += len(set(versions)) == 2
    old = np.array([v == base for v in versions])
    behaviour = np.asarray(result.output_logprobs)
    ref_old = _recomputed_logp(store.path(base), prompt, list(result.output_ids))
    np.testing.assert_allclose(behaviour[old], ref_old[old], atol=2e-3)
    if mode is PauseMode.ABORT:
      # The continuation was re-prefilled under the new weights: exact under version `new`.
      ref_new = _recomputed_logp(store.path(new), prompt, list(result.output_ids))
      np.testing.assert_allclose(behaviour[~old], ref_new[~old], atol=2e-3)
      assert result.num_continuations >= (1 if (~old).any() and old.any() else 0)
  assert spanning >= 1, ("the publish should land while requests are running: "
                         f"{[sorted(set(r.token_versions)) for r in results]}")


def test_export_writes_a_damaged_leftover_version_again(setup, tmp_path):
  """An export torn by a crash (exports are not fsynced) is re-exported, never served or fatal."""
  trainer, _, _, _ = setup
  learner = Learner(trainer, VersionStore(str(tmp_path / "versions")),
                    Checkpointer(CheckpointConfig(str(tmp_path / "ckpt"))), keep_versions=4)
  path = learner.export()
  files = verify_version(path)["files"]
  with open(os.path.join(path, "model.safetensors"), "r+b") as f:
    f.truncate(100)
  assert learner.export() == path
  assert verify_version(path)["files"] == files
