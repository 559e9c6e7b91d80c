"""Warm-up covers every shape a server can meet, with real server processes and the real client.

A short async-style run: 24 long-tail samples stream through one `flashrl_jax.rollout.server` (4
slots) while the weights are handed off three times in abort mode (pause(abort) -> update ->
continue), so the client re-submits aborted samples as `prompt + partial output` continuations:
longer prompts, in prefill buckets the first prefills never used. The server must report that it
built no program after its warm-up. Then a restart on the same persistent compilation cache loads
every program instead of compiling it.
"""

import asyncio
import json
import os
import urllib.request

import numpy as np
import pytest

from flashrl_jax.fleet import LocalServers, PauseMode, RolloutClient, SamplingParams
from flashrl_jax.testing import tiny_config, write_tiny_checkpoint

CONTEXT = 128


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("warmup_ckpts")
  config = tiny_config(max_position_embeddings=CONTEXT)
  paths = [str(root / name) for name in ("v0", "v1")]
  for seed, path in enumerate(paths):
    write_tiny_checkpoint(path, config, seed=seed)
  return paths


def _internal(url: str) -> dict:
  with urllib.request.urlopen(url + "/server_info", timeout=60) as r:
    return json.load(r)["internal_states"][0]


async def _run_with_abort_handoffs(url: str, ckpts: list[str], lengths: list[int]):
  rng = np.random.default_rng(0)
  async with RolloutClient([url]) as client:
    async def sample(i, n):
      prompt = rng.integers(3, 90, size=int(rng.integers(2, 12))).tolist()
      return await client.generate(prompt, SamplingParams(max_new_tokens=n, temperature=1.0,
                                                          seed=i, ignore_eos=True))
    tasks = [asyncio.create_task(sample(i, n)) for i, n in enumerate(lengths)]
    for version in range(1, 4):
      while True:  # hand off while samples are mid-generation, as the async controller does
        load = (await client.loads())[url][0]
        if load.num_used_tokens > 16 or all(t.done() for t in tasks):
          break
        await asyncio.sleep(0.01)
      await client.pause(PauseMode.ABORT)
      await client.update_weights_from_disk(ckpts[version % 2], str(version))
      await client.continue_generation()
      await asyncio.sleep(0.05)
    results = await asyncio.gather(*tasks)
    return results, client.stats()


def test_no_program_is_built_after_warmup_and_a_restart_loads_them_all(ckpts, tmp_path):
  cache = str(tmp_path / "xla_cache")
  args = ("--max_running_requests=4", f"--context_length={CONTEXT}", "--max_prefill_batch=2",
          "--min_prefill_len=32",
          f"--compilation_cache_dir={cache}")
  with LocalServers.start(ckpts[0], 1, extra_args=args, log_dir=str(tmp_path / "logs"),
                          env=dict(os.environ, JAX_PLATFORMS="cpu")) as servers:
    url = servers.urls[0]
    first = _internal(url)
    # decode: one program per batch bucket 1, 2, 3, 4 (each holds both spans, 64 and 128);
    # prefill: lengths 32, 64, 128 x groups 1, 2.
    assert first["warmup_shapes"] == 4 + 3 * 2
    assert first["warmup_s"] > 0 and first["num_compiles"] > 0
    assert first["num_compiles_after_warmup"] == 0

    rng = np.random.default_rng(1)
    lengths = np.minimum(110, (20 * (1 + rng.pareto(1.1, 24))).astype(int)).tolist()
    results, stats = asyncio.run(_run_with_abort_handoffs(url, ckpts, lengths))
    assert stats.num_continuations > 0, "no sample was aborted mid-generation and continued"
    # ignore_eos: every sample runs to its own max_new_tokens across its continuations.
    assert [len(r.output_ids) for r in results] == lengths
    after = _internal(url)
    assert after["num_compiles_after_warmup"] == 0, after
    assert after["num_compiles"] == first["num_compiles"]

    servers.restart(0)
    again = _internal(url)
    assert again["num_compiles"] == first["num_compiles"]
    assert again["num_compile_cache_hits"] == again["num_compiles"], again
