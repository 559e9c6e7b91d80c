"""`GroupRunner` over two stub servers (real HTTP over loopback): a prompt's responses as n requests
(prompt replication) or as one request per group, with the same samples, ids, versions and rewards
either way."""

from __future__ import annotations

import asyncio

import pytest

from flashrl_jax import envs
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.fleet import Fleet, RolloutClient, SamplingParams
from tests.rollout_stubs import VOCAB, expected, run, start_stubs


class _Ids:
  """A tokenizer over token ids written as space-separated numbers."""

  def encode(self, text: str) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids) -> str:
    return " ".join(str(i) for i in ids)


async def _length_reward(prompt: str, text: str, sample: envs.Sample) -> envs.RewardResult:
  return envs.RewardResult(reward=float(len(text.split())), info={"seen": text})


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
  root = tmp_path_factory.mktemp("group_runner")
  (root / "weights").mkdir()
  with start_stubs(2, str(root / "weights"), "--token_latency_s=0.002",
                   log_dir=str(root / "logs")) as servers:
    yield servers


@pytest.mark.parametrize("replication", [True, False])
def test_a_group_has_its_n_responses_each_rewarded_with_or_without_replication(stubs, replication):
  async def main():
    client = RolloutClient(stubs.urls, request_timeout_s=20, health_interval_s=0.1,
                           vocab_size=VOCAB)
    async with Fleet(client) as fleet:
      await fleet.wait_healthy(10)
      runner = GroupRunner(fleet, _length_reward, _Ids(), SamplingParams(max_new_tokens=7), 3,
                           prompt_replication=replication)
      groups = [runner.new_group(i, envs.Sample(prompt=f"{10 + i} {20 + i}", answer=""))
                for i in range(4)]
      await asyncio.gather(*(runner.run(g) for g in groups))
      for i, group in enumerate(groups):
        assert group.complete
        assert sorted(int(r.sample_id) for r in group.responses) == [3 * i + j for j in range(3)]
        ids, lps = expected([10 + i, 20 + i], 7)
        for response in group.responses:
          assert tuple(response.output_ids) == ids
          assert response.behavior_logp == pytest.approx(lps)
          assert response.token_versions == [0] * 7 and response.start_version == 0
          assert response.reward == 7.0 and response.reward_info["seen"] == " ".join(map(str, ids))
      calls = fleet.stats().client.num_generate_calls
      assert calls == (12 if replication else 4)  # a request per response, or one per group
  run(main())
