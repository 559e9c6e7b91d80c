"""RolloutClient under faults, with real stub processes: a server SIGKILLed mid-run (and restarted),
a hanging server, servers that die after K requests or answer malformed responses; and the local
launcher itself (ports, CPU pinning, logs, kill/restart)."""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.error
import urllib.request

import pytest

from flashrl_jax.fleet import FinishKind, LocalServers, RolloutClient, SamplingParams, split_cpus
from tests.rollout_stubs import STUB_COMMAND, VOCAB, configure, expected, run, start_stubs


def _client(urls, **kw) -> RolloutClient:
  kw = dict(dict(request_timeout_s=10.0, max_retries=3, health_interval_s=0.1,
                 vocab_size=VOCAB), **kw)
  return RolloutClient(urls, **kw)


def _healthy(url: str) -> bool:
  try:
    with urllib.request.urlopen(url + "/health", timeout=2) as r:
      return r.status == 200
  except (urllib.error.URLError, OSError):
    return False


async def _wait_until(cond, timeout_s: float = 10.0) -> None:
  for _ in range(int(timeout_s / 0.05)):
    if cond():
      return
    await asyncio.sleep(0.05)
  raise AssertionError("condition not reached")


def test_server_killed_mid_run_loses_no_request(tmp_path):
  """3 servers, one SIGKILLed while 45 requests run: every request completes exactly once with the
  right tokens; the dead server leaves rotation and, once restarted, comes back."""
  with start_stubs(3, "stub", "--token_latency_s=0.01", log_dir=str(tmp_path)) as servers:
    victim = servers.urls[1]

    async def main():
      async with _client(servers.urls) as c:
        rids = [f"req-{i}" for i in range(45)]
        prompts = {rid: [i % 50 + 1] for i, rid in enumerate(rids)}
        tasks = [asyncio.create_task(c.generate(prompts[r], SamplingParams(max_new_tokens=20),
                                                rid=r)) for r in rids]
        await asyncio.sleep(0.08)
        servers.kill(1)
        results = await asyncio.gather(*tasks)
        assert [r.rid for r in results] == rids  # none lost, none duplicated
        for r in results:
          assert r.output_ids == expected(prompts[r.rid], 20)[0]
          assert r.finish_reason is FinishKind.LENGTH and r.server_url != victim
        assert sum(r.num_attempts > 1 for r in results) >= 1
        stats = c.stats()
        assert stats.num_connection_errors >= 1 and stats.num_retries >= 1
        assert not {s.url: s for s in stats.servers}[victim].healthy

        servers.restart(1)
        await _wait_until(lambda: all(s.healthy for s in c.stats().servers))
        again = await asyncio.gather(*(c.generate([3], SamplingParams(max_new_tokens=2))
                                       for _ in range(9)))
        assert sum(r.server_url == victim for r in again) == 3

        servers.kill(1)  # idle now: only the health check can notice
        await _wait_until(lambda: not {s.url: s for s in c.stats().servers}[victim].healthy)
        servers.restart(1)
        await _wait_until(lambda: all(s.healthy for s in c.stats().servers))
    run(main())


def test_hanging_server_times_out_and_retries_elsewhere(tmp_path):
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:
    hung, good = servers.urls
    configure(hung, misbehave="hang")

    async def main():
      async with _client(servers.urls, request_timeout_s=0.5, health_interval_s=60) as c:
        results = await asyncio.gather(*(c.generate([7], SamplingParams(max_new_tokens=3))
                                         for _ in range(4)))
        assert all(r.server_url == good and r.output_ids == (8, 9, 10) for r in results)
        assert max(r.num_attempts for r in results) == 2
        stats = c.stats()
        assert stats.num_timeouts >= 1
        assert not {s.url: s for s in stats.servers}[hung].healthy
    run(main())


@pytest.mark.parametrize("mode", ["wrong_logprob_count", "bad_token_ids", "non_json",
                                  "missing_fields"])
def test_malformed_responses_rejected_logged_and_retried(mode, tmp_path, caplog):
  with start_stubs(2, "stub", f"--misbehave={mode}", log_dir=str(tmp_path)) as servers:
    bad, good = servers.urls
    configure(good, misbehave="none")

    async def main():
      async with _client(servers.urls) as c:
        results = await asyncio.gather(*(c.generate([20], SamplingParams(max_new_tokens=4))
                                         for _ in range(6)))
        assert all(r.server_url == good and r.output_ids == (21, 22, 23, 24) for r in results)
        stats = c.stats()
        assert stats.num_malformed >= 3 and stats.num_retries == stats.num_malformed
        bad_stats = {s.url: s for s in stats.servers}[bad]
        assert bad_stats.healthy and bad_stats.num_malformed == stats.num_malformed

    with caplog.at_level(logging.ERROR, logger="flashrl_jax.fleet._client"):
      run(main())
    assert any("malformed response from " + bad in m for m in caplog.messages)


def test_server_dying_after_k_requests(tmp_path):
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:
    dying, good = servers.urls
    configure(dying, misbehave="die_after=2")

    async def main():
      async with _client(servers.urls, health_interval_s=60) as c:
        results = [await c.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(8)]
        assert all(r.output_ids == (2, 3) for r in results)
        assert sum(r.server_url == dying for r in results) == 2
        assert c.stats().num_connection_errors == 1
    run(main())
    assert servers.pid(0) is None and servers.pid(1) is not None


def test_all_servers_down_raises_after_retries(tmp_path):
  with start_stubs(1, "stub", log_dir=str(tmp_path)) as servers:
    servers.kill(0)

    async def main():
      async with _client(servers.urls, max_retries=1, no_server_wait_s=0.3) as c:
        with pytest.raises(Exception, match="failed"):
          await c.generate([1], SamplingParams(max_new_tokens=2))
    run(main())


def test_local_servers_pin_log_kill_restart(tmp_path):
  cpus = sorted(os.sched_getaffinity(0))
  sets = split_cpus(2, cpus) if len(cpus) >= 2 else [cpus, cpus]
  with LocalServers.start("stub", 2, command=STUB_COMMAND, cpu_sets=sets,
                          extra_args=["--misbehave=non_json"], log_dir=str(tmp_path),
                          background=[False, True], startup_timeout_s=60) as servers:
    assert len(set(servers.urls)) == 2 and all(_healthy(u) for u in servers.urls)
    for i in range(2):
      assert os.sched_getaffinity(servers.pid(i)) == set(sets[i])
      with open(servers.log_path(i)) as f:
        assert "--misbehave=non_json" in f.read()
    assert [os.sched_getscheduler(servers.pid(i)) for i in range(2)] == [os.SCHED_OTHER,
                                                                          os.SCHED_IDLE]
    pid0 = servers.pid(0)
    servers.kill(0)
    assert servers.pid(0) is None and not _healthy(servers.urls[0])
    servers.restart(0)
    assert servers.pid(0) not in (None, pid0) and _healthy(servers.urls[0])
    assert os.sched_getaffinity(servers.pid(0)) == set(sets[0])
    servers.kill(1)
    servers.restart(1)  # a restarted server keeps its place and its scheduling class
    assert os.sched_getscheduler(servers.pid(1)) == os.SCHED_IDLE
  assert all(servers.pid(i) is None for i in range(2)) and not _healthy(servers.urls[1])


def test_local_servers_report_startup_failure(tmp_path):
  with pytest.raises(RuntimeError, match="exited during startup"):
    LocalServers.start("stub", 1, command=STUB_COMMAND, extra_args=["--misbehave=bogus"],
                       log_dir=str(tmp_path), startup_timeout_s=30)
  assert split_cpus(3, range(7)) == [[0, 1], [2, 3], [4, 5]]
  with pytest.raises(ValueError):
    split_cpus(3, [0, 1])


@pytest.mark.parametrize("misbehave", ["dead_engine", "dead_engine_400"])
def test_dead_engine_is_a_server_failure_never_a_rejected_prompt(tmp_path, misbehave):
  """A server whose engine thread died answers every /generate at once with 503 (the stub mimics
  our server's answer; tests/test_rollout_robust.py kills a real engine), or with a 400 saying "the
  engine is shut down" (as ours once did): its requests are retried on the other server, none is
  rejected or lost, and it leaves rotation (its /health fails too)."""
  with start_stubs(2, "stub", log_dir=str(tmp_path)) as servers:
    dead, alive = servers.urls
    configure(dead, misbehave=misbehave)

    async def wave(c, n):
      prompts = [[i % 50 + 1] for i in range(n)]
      results = await asyncio.gather(*(c.generate(p, SamplingParams(max_new_tokens=5))
                                       for p in prompts))
      assert [r.output_ids for r in results] == [expected(p, 5)[0] for p in prompts]
      assert all(r.server_url == alive for r in results)
      return {s.url: s for s in c.stats().servers}[dead]

    async def main():
      async with _client(servers.urls, health_interval_s=0.05) as c:
        first = await wave(c, 10)
        assert first.num_failures == first.num_requests >= 1 and not first.healthy
        await asyncio.sleep(0.3)  # health probes run: it stays out
        return first, await wave(c, 40)

    first, later = run(main())
  assert later.num_requests == first.num_requests and later.failed_probes >= 2


def test_failing_server_is_never_preferred_by_least_loaded_routing(tmp_path):
  """A server that fails fast (here: malformed answers, which keep it in rotation) has nothing in
  flight, so least-loaded routing would send it everything; it comes after every server whose last
  request succeeded, however loaded."""
  with start_stubs(2, "stub", "--token_latency_s=0.005", log_dir=str(tmp_path)) as servers:
    bad, good = servers.urls
    configure(bad, misbehave="non_json")

    async def main():
      async with _client(servers.urls, health_interval_s=3600) as c:
        counts = []
        for _ in range(2):
          prompts = [[i % 50 + 1] for i in range(20)]
          results = await asyncio.gather(*(c.generate(p, SamplingParams(max_new_tokens=5))
                                           for p in prompts))
          assert [r.output_ids for r in results] == [expected(p, 5)[0] for p in prompts]
          counts.append({s.url: s for s in c.stats().servers}[bad].num_requests)
        return counts

    first, second = run(main())
  assert first >= 1 and second == first  # tried once per wave at most: never again after failing
