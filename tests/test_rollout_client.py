"""RolloutClient against stub server processes over loopback: balancing, continuation of aborted
outputs across a weight update, controller fan-out, and every route; plus protocol unit tests."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashrl_jax.fleet import _protocol as proto
from flashrl_jax.fleet import (
    FinishKind, GenerationResult, PauseMode, RequestRejected, RolloutClient, SamplingParams,
    ServerOpError, free_port)
from tests.rollout_stubs import VOCAB, configure, expected, run, start_stubs

PROMPT = [5, 6, 7]


# --- protocol units ------------------------------------------------------------------------------

def test_sampling_params_to_json_and_validation():
  sp = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, stop_token_ids=[2, 3],
                      stop=["\n\n"], seed=11)
  body = proto.generate_request([1, 2], sp, "r1")
  assert body["return_logprob"] is True and body["sampling_params"]["no_stop_trim"] is True
  assert body["sampling_params"]["stop_token_ids"] == [2, 3]
  assert body["sampling_params"]["sampling_seed"] == 11 and "seed" not in body["sampling_params"]
  assert body["sampling_params"]["stop"] == ["\n\n"] and sp.stop_token_ids == (2, 3)
  assert "stream" not in body and proto.generate_request([1], sp, "r", stream=True)["stream"]
  for bad in [dict(max_new_tokens=-1), dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=0),
              dict(min_p=1.5)]:
    with pytest.raises(ValueError):
      SamplingParams(**bad)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 4)), max_size=6))
def test_expand_versions_tiles_spans(parts):
  spans, start = [], 0
  for version, length in parts:
    spans.append(proto.VersionSpan(version, start, start + length))
    start += length
  out = proto.expand_versions(spans, start)
  assert out == tuple(v for v, n in parts for _ in range(n))
  with pytest.raises(proto.MalformedResponse):
    proto.expand_versions(spans, start + 1)
  if spans and spans[0].end > 0:
    with pytest.raises(proto.MalformedResponse):
      proto.expand_versions([proto.VersionSpan("a", 1, start + 1)] + spans[1:], start + 1)


def test_versions_fall_back_to_weight_version():
  obj = {"output_ids": [3, 4], "meta_info": {
      "id": "x", "finish_reason": {"type": "length", "length": 2}, "weight_version": "7",
      "output_token_logprobs": [[-0.1, 3, None], [-0.2, 4, None]]}}
  assert proto.parse_generate_output(obj).token_versions == ("7", "7")
  del obj["meta_info"]["weight_version"]
  assert proto.parse_generate_output(obj).token_versions == (proto.UNKNOWN_VERSION,) * 2
  del obj["output_ids"]  # tokens may come from output_token_logprobs alone
  assert proto.parse_generate_output(obj, vocab_size=5).output_ids == (3, 4)
  with pytest.raises(proto.MalformedResponse):
    proto.parse_generate_output(obj, vocab_size=4)


def test_an_answer_saying_the_engine_is_down_is_told_apart_from_a_bad_request():
  """Whatever its status, an answer whose whole message says the engine stopped is the server's
  failure (retried elsewhere); a 400 that merely quotes those words (a prompt echoed back) is not."""
  for down in ['{"error": {"message": "the engine is shut down."}}', '{"message": "Engine is '
               'shutting down"}', "The server is shut down.", '{"error": "engine has stopped"}']:
    assert proto.says_engine_down(down), down
  for bad in ['{"error": {"message": "stop string \'the engine is shut down.\' is too long"}}',
              '{"error": {"message": "input_ids must be a list"}}', "", "null", "[]",
              '{"error": {"message": 5}}', '{"success": false, "message": "Failed to update"}']:
    assert not proto.says_engine_down(bad), bad


# --- live stubs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
  """Two stubs (8 ms per token) whose model_path is a real directory, so weight updates work."""
  root = tmp_path_factory.mktemp("stubs")
  (root / "weights").mkdir()
  with start_stubs(2, str(root / "weights"), "--token_latency_s=0.008",
                   log_dir=str(root / "logs")) as servers:
    yield servers, root


def _client(urls, **kw) -> RolloutClient:
  kw = dict(dict(request_timeout_s=20.0, max_retries=3, health_interval_s=0.1,
                 vocab_size=VOCAB), **kw)
  return RolloutClient(urls, **kw)


def _check_output(r: GenerationResult, prompt: list[int], n: int) -> None:
  ids, lps = expected(prompt, n)
  assert r.output_ids == ids and r.output_logprobs == pytest.approx(lps)
  assert len(r.token_versions) == n


def test_every_route_through_the_client(stubs):
  servers, root = stubs

  async def main():
    async with _client(servers.urls) as c:
      await c.wait_healthy(10)
      r = await c.generate(PROMPT, SamplingParams(max_new_tokens=5), rid="route-gen")
      _check_output(r, PROMPT, 5)
      assert r.rid == "route-gen" and r.finish_reason is FinishKind.LENGTH
      assert r.num_attempts == 1 and r.num_continuations == 0 and r.server_url in servers.urls
      stop = await c.generate([10], SamplingParams(max_new_tokens=9, stop_token_ids=(13,)))
      assert stop.output_ids == (11, 12, 13) and stop.finish_reason is FinishKind.STOP
      chunks = [x async for x in c.stream(PROMPT, SamplingParams(max_new_tokens=4))]
      assert [len(x.output_ids) for x in chunks] == [1, 2, 3, 4, 4]
      assert chunks[-1].finish_reason is FinishKind.LENGTH and chunks[0].finish_reason is None
      with pytest.raises(RequestRejected):  # a bad request is not retried elsewhere
        await c.generate([VOCAB + 5], SamplingParams(max_new_tokens=2))
      assert c.stats().num_retries == 0
      loads = await c.loads()
      assert set(loads) == set(servers.urls) and loads[servers.urls[0]][0].num_running_reqs == 0
      info = await c.model_info()
      assert info[servers.urls[0]].model_path == str(root / "weights")
      assert all(si["version"] for si in (await c.server_info()).values())
      assert set(await c.flush_cache()) == set(servers.urls)
      await c.abort_all()
      await c.wait_idle(5)
      assert await c.abort("not-running") is False
  run(main())


def test_abort_one_and_resume_from_partial(stubs):
  servers, _ = stubs

  async def main():
    async with _client(servers.urls) as c:
      sp = SamplingParams(max_new_tokens=40)
      task = asyncio.create_task(c.generate(PROMPT, sp, rid="to-abort"))
      await asyncio.sleep(0.1)
      assert await c.abort("to-abort")
      part = await task
      assert part.finish_reason is FinishKind.ABORT and 0 < len(part.output_ids) < 40
      assert part.num_continuations == 0  # an explicit abort is not continued
      full = await c.generate(PROMPT, sp, resume_from=part)
      _check_output(full, PROMPT, 40)
      assert full.rid == "to-abort" and full.num_continuations == 1
      # abort_all stops every request the same way.
      tasks = [asyncio.create_task(c.generate(PROMPT, sp)) for _ in range(4)]
      await asyncio.sleep(0.1)
      await c.abort_all()
      parts = await asyncio.gather(*tasks)
      assert all(p.finish_reason is FinishKind.ABORT for p in parts)
  run(main())


def test_pause_abort_update_continue_keeps_prefix_and_versions(stubs):
  """The ROLL Flash weight-sync path: abort-mode pause, disk update, continue; partial outputs are
  continued with the earlier tokens/log-probs kept and later tokens carrying the new version."""
  servers, root = stubs
  n = 40

  async def main():
    async with _client(servers.urls) as c:
      before = (await c.model_info())[servers.urls[0]].weight_version
      tasks = [asyncio.create_task(c.generate([i + 1, i + 2], SamplingParams(max_new_tokens=n)))
               for i in range(6)]
      await asyncio.sleep(0.12)
      paused = await c.pause(PauseMode.ABORT)
      assert set(paused) == set(servers.urls) and all(s.status == "ok" for s in paused.values())
      await asyncio.sleep(0.1)  # continuations are re-submitted and wait on the paused servers
      assert not any(t.done() for t in tasks)
      updated = await c.update_weights_from_disk(str(root / "weights"), "v-next")
      assert all(u.success for u in updated.values())
      await c.continue_generation()
      results = await asyncio.gather(*tasks)
      for i, r in enumerate(results):
        _check_output(r, [i + 1, i + 2], n)
        assert r.finish_reason is FinishKind.LENGTH and r.num_continuations == 1
        k = r.token_versions.index("v-next")
        assert 0 < k < n and r.token_versions == (before,) * k + ("v-next",) * (n - k)
      assert c.stats().num_continuations == 6
  run(main())


def test_fan_out_pause_update_continue_and_failures(stubs, tmp_path):
  servers, root = stubs
  dead = f"http://127.0.0.1:{free_port()}"

  async def main():
    async with _client(servers.urls, op_timeout_s=5) as c:
      for mode in PauseMode:
        assert set(await c.pause(mode)) == set(servers.urls)
      res = await c.update_weights_from_disk(str(root / "weights"), 12)
      assert all(r.success for r in res.values())
      assert {i.weight_version for i in (await c.model_info()).values()} == {"12"}
      await c.continue_generation()
      with pytest.raises(ServerOpError, match="update_weights_from_disk failed on 2/2") as e:
        await c.update_weights_from_disk(str(tmp_path / "missing"), 13)
      assert set(e.value.failures) == set(servers.urls)
      assert {i.weight_version for i in (await c.model_info()).values()} == {"12"}
    async with _client(servers.urls + [dead], op_timeout_s=5) as c:
      with pytest.raises(ServerOpError) as e:
        await c.pause(PauseMode.IN_PLACE)
      assert set(e.value.failures) == {dead} and set(e.value.results) == set(servers.urls)
      await c.continue_generation(urls=servers.urls)
  run(main())


def test_least_outstanding_requests_balancing(stubs):
  """A slow server holds its requests longer, so it gets fewer; equal servers get equal shares."""
  servers, _ = stubs
  slow, fast = servers.urls
  configure(slow, latency_s=0.3)
  try:
    async def main():
      async with _client(servers.urls) as c:
        burst = await asyncio.gather(*(c.generate(PROMPT, SamplingParams(max_new_tokens=1))
                                       for _ in range(10)))
        assert sorted(sum(r.server_url == u for r in burst) for u in servers.urls) == [5, 5]
        gate = asyncio.Semaphore(4)

        async def one():
          async with gate:
            return await c.generate(PROMPT, SamplingParams(max_new_tokens=1))
        results = await asyncio.gather(*(one() for _ in range(40)))
        on_slow = sum(r.server_url == slow for r in results)
        assert on_slow <= 12, on_slow  # round robin would send 20
        stats = {s.url: s for s in c.stats().servers}
        assert stats[slow].busy_s > stats[fast].busy_s and stats[slow].in_flight == 0
    run(main())
  finally:
    configure(slow, latency_s=0.0)


def test_a_group_is_one_request_and_its_samples_are_continued_across_a_handoff(stubs):
  """`generate_group`: n samples of a prompt in one `/generate` (the batch form), each the stub's
  deterministic output; an abort-mode handoff mid-generation continues every sample on its own,
  keeping its prefix, with the later tokens on the new version."""
  servers, root = stubs
  n = 40

  async def main():
    async with _client(servers.urls) as c:
      group = await c.generate_group(PROMPT, SamplingParams(max_new_tokens=5), 3, rid="g")
      assert [r.rid for r in group] == ["g-0", "g-1", "g-2"]
      for r in group:
        _check_output(r, PROMPT, 5)
        assert r.finish_reason is FinishKind.LENGTH and r.num_attempts == 1
      assert len({r.server_url for r in group}) == 1 and c.stats().num_generate_calls == 1
      before = (await c.model_info())[servers.urls[0]].weight_version
      tasks = [asyncio.create_task(c.generate_group([i + 1, i + 2], SamplingParams(
          max_new_tokens=n), 2, rid=f"h{i}")) for i in range(3)]
      await asyncio.sleep(0.12)
      await c.pause(PauseMode.ABORT)
      await asyncio.sleep(0.1)
      assert not any(t.done() for t in tasks)
      await c.update_weights_from_disk(str(root / "weights"), "g-next")
      await c.continue_generation()
      for i, results in enumerate(await asyncio.gather(*tasks)):
        assert [r.rid for r in results] == [f"h{i}-0", f"h{i}-1"]
        for r in results:
          _check_output(r, [i + 1, i + 2], n)
          assert r.finish_reason is FinishKind.LENGTH and r.num_continuations == 1
          k = r.token_versions.index("g-next")
          assert 0 < k < n and r.token_versions == (before,) * k + ("g-next",) * (n - k)
      assert c.stats().num_continuations == 6
      # An explicit abort of one sample ends it without a continuation; its sibling goes on.
      task = asyncio.create_task(c.generate_group(PROMPT, SamplingParams(max_new_tokens=n), 2,
                                                  rid="cut"))
      await asyncio.sleep(0.1)
      assert await c.abort("cut-1")
      kept, cut = await task
      _check_output(kept, PROMPT, n)
      assert cut.finish_reason is FinishKind.ABORT and 0 < len(cut.output_ids) < n
  run(main())


@pytest.mark.parametrize("fault", ["dead_engine", "wrong_logprob_count", "non_json"])
def test_a_group_a_server_fails_is_retried_whole_on_another(stubs, fault):
  """What is tried: the first server answers the batch with a 503 (its engine dead), with a sample
  whose log-probs do not match its tokens, or with a 200 that is not JSON. The group is sent again
  to the other server and comes back complete; nothing of the bad answer is kept."""
  servers, _ = stubs
  bad, good = servers.urls
  configure(bad, misbehave=fault)
  try:
    async def main():
      async with _client(servers.urls) as c:
        for i in range(4):  # whichever server the client tries first
          group = await c.generate_group(PROMPT, SamplingParams(max_new_tokens=6), 3)
          for r in group:
            _check_output(r, PROMPT, 6)
            assert r.server_url == good
        assert c.stats().num_retries >= 1
    run(main())
  finally:
    configure(bad, misbehave="none")
