"""sglang-router (PyPI `sglang-router`, SGLang's Rust router) in front of two of our servers.

Real processes over loopback: the router balances `/generate` (with log-probs, and streaming) across
both workers, reads their load from `/get_load`, and passes our responses through unchanged for the
project's own client to validate. The router does not forward pause/continue/weight updates/aborts,
so the weight handoff (`Fleet.publish`, the one implementation) is addressed to the workers while
generation keeps flowing through the router: samples cut by the pause are continued through the
router and finish on the new weights.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from flashrl_jax.fleet import (FinishKind, Fleet, PauseMode, RolloutClient, SamplingParams,
                               free_port)
from tests.api_servers import start_servers, write_hf_checkpoint


LONG = 800  # tokens per sample in the handoff test: still running when the pause lands
# The servers sleep this long after each decode call (4 tokens): a sample lasts >= 4 s whatever the
# machine's speed, so the handoff's pause lands mid-generation even on a loaded machine (without
# it a tiny model's 800 tokens took < 1 s, and a busy CI machine let samples finish first).
DECODE_DELAY_S = 0.02


def get(url, path):
  with urllib.request.urlopen(url + path, timeout=30) as resp:
    return resp.status, json.loads(resp.read() or b"null")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
  root = tmp_path_factory.mktemp("router")
  old, new = str(root / "v0"), str(root / "v1")
  write_hf_checkpoint(old, seed=0)
  write_hf_checkpoint(new, seed=1)
  with start_servers(old, 2, f"--decode_delay_s={DECODE_DELAY_S}",
                     log_dir=str(root / "logs")) as servers:
    port = free_port()
    log = open(root / "router.log", "w")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--worker-urls", *servers.urls, "--policy", "round_robin",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         # The tokenizer is the local model directory: the router must never reach for a hub.
         "--model-path", old, "--tokenizer-path", old, "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    try:
      deadline = time.monotonic() + 120
      while True:
        assert router.poll() is None, open(root / "router.log").read()[-3000:]
        try:
          with urllib.request.urlopen(url + "/health", timeout=5) as resp:  # plain "OK"
            if resp.status == 200:
              break
        except (urllib.error.URLError, ConnectionError):
          pass
        assert time.monotonic() < deadline, open(root / "router.log").read()[-3000:]
        time.sleep(0.5)
      yield url, servers.urls, new
    finally:
      router.terminate()
      try:
        router.wait(30)
      except subprocess.TimeoutExpired:
        router.kill()
      log.close()


def generated_tokens(worker):
  return get(worker, "/server_info")[1]["internal_states"][0]["generated_tokens"]


def test_generation_and_streaming_through_the_router_spread_over_workers(fleet):
  router, workers, _ = fleet
  before = [generated_tokens(w) for w in workers]

  async def run():
    async with RolloutClient(workers, router_url=router, vocab_size=96) as client:
      sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
      results = await asyncio.gather(*(client.generate([5, 6, i], sampling) for i in range(8)))
      chunks = [r async for r in client.stream([7, 8], sampling)]
      return results, chunks, client.stats()

  results, chunks, stats = asyncio.run(run())
  for r in results:  # validated by the client's own protocol parser on the way in
    assert len(r.output_ids) == len(r.output_logprobs) == 6 and r.finish_reason is FinishKind.LENGTH
    assert r.server_url == router and set(r.token_versions) == {"default"}
  assert chunks[-1].finish_reason is FinishKind.LENGTH and len(chunks[-1].output_ids) == 6
  assert all(c.server_url == router for c in chunks)
  grown = [generated_tokens(w) - b for w, b in zip(workers, before)]
  assert all(g >= 12 for g in grown), grown  # round robin: both workers took a share
  assert sum(grown) >= 9 * 6
  assert stats.num_retries == 0
  # The router relays `/get_load` polls' view of each worker (the legacy object form it reads).
  for w in workers:
    status, load = get(w, "/get_load")
    assert status == 200 and load["load"] == 0


@pytest.mark.slow
def test_weight_handoff_to_workers_while_generating_through_the_router(fleet):
  router, workers, new = fleet

  async def run():
    client = RolloutClient(workers, router_url=router, vocab_size=96)
    async with Fleet(client, pause_mode=PauseMode.ABORT) as fleet:
      sampling = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
      tasks = [asyncio.create_task(fleet.generate([9, i], sampling)) for i in range(4)]
      # Hand off once both workers are generating.
      while not all(load[0].num_used_tokens > 8 for load in (await client.loads()).values()):
        assert not any(t.done() for t in tasks), "a sample finished before the handoff"
        await asyncio.sleep(0.005)
      await fleet.publish(new, 1)  # the one handoff: pause -> load -> continue, on the workers
      results = await asyncio.gather(*tasks)
      after = await fleet.generate([3], SamplingParams(max_new_tokens=2))
      return results, after, await client.model_info(), fleet.stats()

  results, after, info, stats = asyncio.run(run())
  for r in results:
    assert len(r.output_ids) == LONG and r.finish_reason is FinishKind.LENGTH
    switch = r.token_versions.index("1") if "1" in r.token_versions else len(r.output_ids)
    assert set(r.token_versions[:switch]) <= {"default"} and set(r.token_versions[switch:]) == {"1"}
  assert sum(r.num_continuations for r in results) >= 1  # cut by the pause, continued via router
  assert any("1" in r.token_versions and "default" in r.token_versions for r in results)
  assert set(after.token_versions) == {"1"}
  assert {w: i.weight_version for w, i in info.items()} == {w: "1" for w in workers}
  assert all(get(w, "/server_info")[1]["decode_delay_s"] == DECODE_DELAY_S for w in workers)
  assert stats.server_failures == 0 and stats.version == 1
