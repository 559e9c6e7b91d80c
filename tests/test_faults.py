"""The supervisor against real stub processes: a SIGKILLed and a hung server are restarted and
rejoin on the current policy version without losing a request; a weight publish goes on when a
server is dead; a killed controller's orphaned servers are reaped by the next run. One test uses
our JAX server: its engine thread stopped, it is restarted and rejoins on a real export."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

import pytest

from flashrl_jax.fleet import (
    LocalServers, PauseMode, RolloutClient, SamplingParams, Supervisor, SupervisorConfig,
    VersionRefused, reap_orphans, record_pids)
from flashrl_jax.testing import tiny_config, tiny_model, write_tiny_checkpoint
from flashrl_jax.trainer import export_version
from tests.rollout_stubs import VOCAB, configure, expected, start_stubs

FAST = SupervisorConfig(poll_s=0.05, hang_failures=2, unhealthy_grace_s=5.0, rejoin_poll_s=0.1)


def _version(url: str) -> str:
  with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
    return json.load(r)["weight_version"]


def _client(urls, **kw) -> RolloutClient:
  kw = {"request_timeout_s": 10.0, "max_retries": 3, "health_interval_s": 0.1,
        "vocab_size": VOCAB, **kw}
  return RolloutClient(urls, **kw)


async def _until(cond, timeout_s: float = 20.0) -> None:
  for _ in range(int(timeout_s / 0.05)):
    if cond():
      return
    await asyncio.sleep(0.05)
  raise AssertionError("condition not reached")


def _generate_all(client, n: int, tokens: int = 20):
  prompts = [[i % 50 + 1] for i in range(n)]
  return prompts, [asyncio.create_task(client.generate(p, SamplingParams(max_new_tokens=tokens),
                                                      rid=f"r{i}"))
                   for i, p in enumerate(prompts)]


def test_killed_server_is_restarted_and_rejoins_at_current_version(tmp_path):
  weights = tmp_path / "weight_v000003"
  weights.mkdir()
  with start_stubs(3, "stub", "--token_latency_s=0.01", log_dir=str(tmp_path)) as servers:
    victim = servers.urls[1]

    async def main():
      async with _client(servers.urls) as client:
        sup = Supervisor(client, servers=servers, served=(str(weights), 3), config=FAST)
        async with sup:
          prompts, tasks = _generate_all(client, 30)
          await asyncio.sleep(0.08)
          servers.kill(1)
          results = await asyncio.gather(*tasks)
          for prompt, result in zip(prompts, results):  # none lost, each the right tokens
            assert result.output_ids == expected(prompt, 20)[0]
          await _until(lambda: victim in client.urls and not sup.recovering)
          assert _version(victim) == "3"  # loaded the current version before rejoining
          prompts, tasks = _generate_all(client, 12)
          await asyncio.gather(*tasks)
          return client.stats(), sup

    stats, sup = asyncio.run(main())
  assert sup.restarts == 1 and sup.failures == 1
  assert stats.num_retries >= 1
  assert {s.url: s.num_requests for s in stats.servers}[victim] >= 1  # serving again


def test_hung_server_is_restarted(tmp_path):
  """A server that answers /health but never finishes a generation: its requests time out and are
  retried elsewhere; the supervisor restarts it (which clears the hang) and it rejoins."""
  weights = tmp_path / "weight_v000001"
  weights.mkdir()
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:
    victim = servers.urls[0]
    configure(victim, misbehave="hang")

    async def main():
      async with _client(servers.urls, request_timeout_s=0.5) as client:
        sup = Supervisor(client, servers=servers, served=(str(weights), 1), config=FAST)
        async with sup:
          prompts, tasks = _generate_all(client, 8, tokens=5)
          results = await asyncio.gather(*tasks)
          assert [r.output_ids for r in results] == [expected(p, 5)[0] for p in prompts]
          await _until(lambda: sup.restarts >= 1 and not sup.recovering)
          assert _version(victim) == "1"
          prompts, tasks = _generate_all(client, 8, tokens=5)
          await asyncio.gather(*tasks)
          return sup

    assert asyncio.run(main()).restarts >= 1


def test_server_with_a_dead_engine_is_restarted(tmp_path):
  """A server whose process is up but whose engine died (503 on /generate and /health; the stub
  mimics our server's answers) fails its requests over at once and is restarted by the supervisor
  from its failed health probes, then rejoins on the current version."""
  weights = tmp_path / "weight_v000004"
  weights.mkdir()
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:
    victim = servers.urls[0]
    configure(victim, misbehave="dead_engine")

    async def main():
      async with _client(servers.urls) as client:
        sup = Supervisor(client, servers=servers, served=(str(weights), 4),
                         config=SupervisorConfig(poll_s=0.05, unhealthy_grace_s=60.0))
        async with sup:
          prompts, tasks = _generate_all(client, 8, tokens=5)
          results = await asyncio.gather(*tasks)
          assert [r.output_ids for r in results] == [expected(p, 5)[0] for p in prompts]
          await _until(lambda: sup.restarts >= 1 and not sup.recovering and victim in client.urls)
          assert _version(victim) == "4"
          prompts, tasks = _generate_all(client, 8, tokens=5)
          results = await asyncio.gather(*tasks)
          assert any(r.server_url == victim for r in results)  # serving again
          return sup.restarts

    assert asyncio.run(main()) == 1


def test_our_server_whose_engine_died_is_restarted_on_the_served_version(tmp_path):
  """The same with our JAX server: its engine thread stopped (`/debug/kill_engine`), the process
  answers 503 on /health; the client's probes take it out, the supervisor restarts the process and
  it rejoins on the served version (a real export), where it generates again."""
  config = tiny_config(max_position_embeddings=256)
  write_tiny_checkpoint(str(tmp_path / "model"), config, seed=0)
  export_version(tiny_model(config, seed=1), 4, str(tmp_path / "versions"), config=config)
  served = str(tmp_path / "versions" / "weight_v000004")
  servers = LocalServers.start(str(tmp_path / "model"), 1, extra_args=(
      "--max_running_requests=2", "--context_length=64", "--weight_version=0", "--nowarmup",
      "--enable_fault_injection"), env=dict(os.environ, JAX_PLATFORMS="cpu"),
      log_dir=str(tmp_path / "logs"))
  try:
    url, pid = servers.urls[0], servers.pid(0)

    async def main():
      async with _client(servers.urls, vocab_size=config.vocab_size,
                         request_timeout_s=120) as client:
        sup = Supervisor(client, servers=servers, served=(served, 4), config=FAST)
        async with sup:
          req = urllib.request.Request(url + "/debug/kill_engine", data=b"{}", method="POST")
          with urllib.request.urlopen(req, timeout=30) as r:
            assert json.load(r)["engine_alive"] is False
          await _until(lambda: sup.restarts >= 1 and not sup.recovering and url in client.urls,
                       timeout_s=300)
          result = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
          return sup.restarts, result

    restarts, result = asyncio.run(main())
    assert restarts == 1 and servers.pid(0) not in (None, pid)
    assert _version(url) == "4" and set(result.token_versions) == {"4"}
    assert len(result.output_ids) == 4
  finally:
    servers.stop()


def test_publish_goes_on_when_a_server_is_dead(tmp_path):
  weights = tmp_path / "weight_v000002"
  weights.mkdir()
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:
    dead, alive = servers.urls

    async def main():
      async with _client(servers.urls) as client:
        slow_watch = SupervisorConfig(poll_s=30.0)  # the publish, not the watcher, finds it
        sup = Supervisor(client, servers=servers, served=(str(weights), 2), config=slow_watch)
        async with sup:
          servers.kill(0)
          times = await sup.handoff(str(weights), 2, PauseMode.ABORT)
          assert set(times) == {"time/pause_s", "time/load_s", "time/resume_s"}
          assert _version(alive) == "2" and dead not in client.urls
          await _until(lambda: not sup.recovering)  # restarted by the recovery path
          assert _version(dead) == "2" and dead in client.urls
          prompts, tasks = _generate_all(client, 4, tokens=5)  # nobody left paused
          await asyncio.wait_for(asyncio.gather(*tasks), 10)
          return sup

    assert asyncio.run(main()).restarts == 1


def test_orphaned_servers_of_a_killed_controller_are_reaped(tmp_path):
  pid_file = str(tmp_path / "server_pids.json")
  servers = start_stubs(2, "stub", log_dir=str(tmp_path))
  try:
    record_pids(pid_file, servers)
    pids = [servers.pid(i) for i in range(2)]
    with open(pid_file) as f:
      entries = json.load(f)
    entries.append({"pid": os.getpid(), "url": "http://127.0.0.1:1"})  # not a server: spared
    with open(pid_file, "w") as f:
      json.dump(entries, f)
    assert sorted(reap_orphans(pid_file)) == sorted(pids)
    for i in range(2):
      servers._procs[i].wait(5)  # pylint: disable=protected-access
    assert all(servers.pid(i) is None for i in range(2))
    assert not os.path.exists(pid_file) and reap_orphans(pid_file) == []
  finally:
    servers.stop()


def test_external_server_that_comes_back_reloads_before_rejoining(tmp_path):
  """Not ours to restart (SGLang mode): once it answers again it loads the current version first,
  so no request runs on the initial weights it restarted with."""
  weights = tmp_path / "weight_v000004"
  weights.mkdir()
  with start_stubs(2, "stub", "--token_latency_s=0.01", log_dir=str(tmp_path)) as servers:
    victim = servers.urls[1]

    async def main():
      async with _client(servers.urls) as client:
        sup = Supervisor(client, servers=None, served=(str(weights), 4), config=FAST)
        async with sup:
          prompts, tasks = _generate_all(client, 20)
          await asyncio.sleep(0.08)
          servers.kill(1)
          await _until(lambda: victim in sup.recovering)
          await asyncio.to_thread(servers.restart, 1)  # restarted by someone else, on version 0
          results = await asyncio.gather(*tasks)
          assert [r.output_ids for r in results] == [expected(p, 20)[0] for p in prompts]
          await _until(lambda: victim in client.urls and not sup.recovering)
          assert _version(victim) == "4"
          return sup

    sup = asyncio.run(main())
  assert sup.failures == 1 and sup.restarts == 0


def test_refused_version_keeps_servers_in_rotation_on_their_weights(tmp_path):
  """Servers that answer a weight update `success: false` are healthy and keep serving their
  weights: the handoff raises VersionRefused after resuming generation, restarts nobody, and the
  version a rejoining server loads stays the last one every server took."""
  good, bad = tmp_path / "weight_v000001", tmp_path / "weight_v000002"
  good.mkdir()  # the stub refuses a path that is not a directory: `bad` is never created
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:

    async def main():
      async with _client(servers.urls) as client:
        sup = Supervisor(client, servers=servers, config=FAST)
        async with sup:
          await sup.handoff(str(good), 1, PauseMode.ABORT)
          prompts, tasks = _generate_all(client, 6, tokens=30)
          await asyncio.sleep(0.05)
          with pytest.raises(VersionRefused) as refused:
            await sup.handoff(str(bad), 2, PauseMode.ABORT)
          assert set(refused.value.refused) == set(servers.urls) and not refused.value.accepted
          results = await asyncio.wait_for(asyncio.gather(*tasks), 20)  # nobody left paused
          assert [r.output_ids for r in results] == [expected(p, 30)[0] for p in prompts]
          assert sorted(client.urls) == sorted(servers.urls) and not sup.recovering
          assert sup._served == (str(good), 1)
          return sup.restarts, sup.failures

    assert asyncio.run(main()) == (0, 0)
    assert {_version(u) for u in servers.urls} == {"1"}
