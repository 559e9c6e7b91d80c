"""The benchmark's view of what rollout servers did during a run: the pure window arithmetic, and
the sampler against a real rollout server process (its `/server_info` counters over HTTP)."""

import json
import os
import time
import urllib.request

import pytest

from experiments._server_profile import ServerSampler, Snapshot, server_profile
from tests.server_process import server_process

ZERO = dict(decode_steps=0, busy_slot_steps=0, decode_s=0.0, prefill_calls=0, prefill_s=0.0)


def snap(seconds, steps, servers=2, **counters):
  return Snapshot(seconds, steps, {**ZERO, **counters}, servers)


def test_profile_of_the_window_after_warmup_and_before_the_last_step():
  snapshots = [
      snap(0, 3, decode_steps=500, decode_s=9.0),  # warm-up: outside the window
      snap(10, 5, decode_steps=1000, busy_slot_steps=2000, decode_s=10.0, prefill_s=1.0),
      snap(12, 50, servers=1, decode_steps=1100),  # one server not answering: skipped
      snap(20, 99, decode_steps=3000, busy_slot_steps=18000, decode_s=14.0, prefill_s=2.0),
      snap(25, 100, decode_steps=3000, busy_slot_steps=18000, decode_s=14.0, prefill_s=2.0),
  ]
  profile = server_profile(snapshots, warmup=5, steps=100)
  assert profile["iteration_ms"] == pytest.approx(1000 * 4.0 / 2000)
  assert profile["live"] == pytest.approx(16000 / 2000)
  assert profile["busy"] == pytest.approx(5.0 / (10 * 2))
  assert profile["prefill_share"] == pytest.approx(1.0 / 5.0)
  assert profile["servers"] == 2


def test_no_profile_without_a_window_or_across_a_restart():
  assert server_profile([], warmup=5, steps=100) is None
  assert server_profile([snap(0, 6, decode_steps=10)], warmup=5, steps=100) is None
  restarted = [snap(0, 6, decode_steps=900, decode_s=3.0),
               snap(5, 50, decode_steps=40, decode_s=0.1)]
  assert server_profile(restarted, warmup=5, steps=100) is None  # counters started again


def test_sampler_reads_a_real_server(run_model, tmp_path):
  with server_process(f"--model_path={run_model}", "--port=0",
                      "--max_running_requests=4") as url:
    port = url.rsplit(":", 1)[1]
    os.makedirs(tmp_path / "server_logs")
    (tmp_path / "server_logs" / f"server_0_{port}.log").write_text("")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("{}\n")
    with ServerSampler(str(tmp_path), period_s=0.05) as sampler:
      time.sleep(0.3)
      body = json.dumps({"input_ids": [[5, 6, 7], [8, 9]],
                         "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}).encode()
      urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body), timeout=120)
      metrics.write_text("{}\n" * 3)
      time.sleep(0.3)
  steps = [s.steps for s in sampler.snapshots]
  assert steps[0] == 1 and steps[-1] == 3 and all(s.servers == 1 for s in sampler.snapshots)
  first, last = sampler.snapshots[0].counters, sampler.snapshots[-1].counters
  decode_steps = last["decode_steps"] - first["decode_steps"]
  assert 15 <= decode_steps <= 30  # 16 tokens each, the first from prefill; together or apart
  profile = server_profile(sampler.snapshots, warmup=1, steps=4)
  assert profile["live"] == pytest.approx(30 / decode_steps)
  assert 0 < profile["iteration_ms"] < 1000 and 0 < profile["busy"] <= 1
