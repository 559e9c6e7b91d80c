"""A sync round's latency beyond the simulated costs: recorded by the calibration's sync rounds,
measured against the simulator's own sync step, and printed beside the sync prediction."""

import asyncio
import pathlib

import numpy as np
import pytest

from experiments import _calibration
from experiments._sim_config import round_latency_s, sim_config
from flashrl_jax import sim
from flashrl_jax.scheduling import PauseMode
from tests.test_sim_vs_measured import _calibration_of

REPO = pathlib.Path(__file__).resolve().parents[1]


def _sync_calibration(lengths: tuple[int, ...] = (10, 50, 90)) -> dict:
  """`_calibration_of`'s calibration (4 ms a decode step at any live count, no per-request cost, a
  10 ms reward, a 20 ms decode-batch intercept `latency_s`, a 0.5 s train step) with groups of each
  of `lengths` and the sync rounds' numbers."""
  cal = _calibration_of(length=lengths[0], step_s=0.004, train_s=0.5)
  cal["rollout"]["length_groups"] = [[n] * 4 for n in lengths]
  cal["rollout"]["rounds"] = {"request_s": 0.0, "contention": 1.4}
  return cal


def test_the_rounds_record_each_rounds_handoff_rollout_and_longest_response():
  bench = object.__new__(_calibration._Bench)
  bench.config = _calibration.load_config(str(REPO / "experiments/configs/bench_rlvr.py"))
  bench.prompts, bench._count = [object()] * 5, 0
  sent: list[list[int]] = []  # each round's requested lengths

  async def one(sampling, sample=None, prompt_tokens=None):
    sent[-1].append(sampling.max_new_tokens)
    await asyncio.sleep(0.002 * sampling.max_new_tokens)  # a long response takes longer
    return sampling.max_new_tokens

  class Fleet:
    version = 3

    async def publish(self, path, version, idle=False):
      await asyncio.sleep(0.2)
      sent.append([])
      self.version = version

  bench.one, bench.fleet = one, Fleet()
  walls = []
  requests = asyncio.run(bench._rounds_for(0.5, [[3, 9], [1, 4], [40, 44]],
                                           np.random.default_rng(0), walls))
  assert len(walls) == len(sent) >= 2 and requests == sum(len(s) for s in sent)
  for (handoff, rollout, longest), lengths in zip(walls, sent):
    assert longest == max(lengths)  # the longest response the round asked for
    assert handoff >= 0.2 and rollout >= 0.002 * longest
    assert rollout < 0.002 * longest + 0.15  # the round's own requests, not the handoff


def test_the_round_latency_is_what_the_rounds_waited_beyond_the_simulated_round():
  ro = _sync_calibration()["rollout"]
  # The simulated round: every response decoded at 4 ms a token, then the 10 ms reward; the
  # decode-batch intercept (20 ms) is not part of it. Tried: rounds 35 ms slower than that, with
  # one outlier; rounds faster than it (no negative latency); a latency the rounds already carry.
  rounds = [(0.07, 0.004 * n + 0.01 + 0.035, n) for n in (10, 50, 90, 90)]
  ro["rounds"]["round_walls"] = rounds + [(0.07, 0.004 * 10 + 0.01 + 0.5, 10)]
  assert round_latency_s(ro, batch_size=4, group_size=4) == pytest.approx(0.035, abs=1e-6)
  ro["rounds"]["round_walls"] = [(0.07, 0.004 * n + 0.01 - 0.005, n) for n in (10, 50, 90)]
  assert round_latency_s(ro, batch_size=4, group_size=4) == 0.0
  ro["rounds"]["round_walls"], ro["latency_s"] = rounds, 0.5  # not the batches' intercept
  assert round_latency_s(ro, batch_size=4, group_size=4) == pytest.approx(0.035, abs=1e-6)


def test_the_rule_prices_a_sync_step_by_the_batches_latency_and_the_rounds_only_beside_it():
  cal = _sync_calibration(lengths=(50,))
  knobs = dict(batch_size=4, group_size=4, pause_mode=PauseMode.ABORT, steps=6, warmup=2)
  # 50 tokens at 4 ms, latency + reward, the train step 0.5 s, export 0.1 s, the idle handoff.
  rule = 16 / (0.2 + 0.02 + 0.01 + 0.5 + 0.1 + 0.07)
  assert sim.simulate(sim_config(cal, "sync", 0, **knobs), seed=0).samples_per_s == pytest.approx(
      rule, rel=1e-6)
  cal["rollout"]["rounds"]["latency_s"] = 0.045  # printed beside the rule, not applied (yet)
  assert sim.simulate(sim_config(cal, "sync", 0, **knobs), seed=0).samples_per_s == pytest.approx(
      rule, rel=1e-6)


def test_the_calibrations_line_names_the_rounds_latency():
  cal = _sync_calibration()
  cal["rollout"]["rounds"]["latency_s"] = 0.045
  cal["rollout"]["request_batch_s"] = 0.002
  cal["rollout"]["contention"] = 1.1
  cal.update(wall_s=60.0, loadavg=[1.0, 1.2], probe_s=0.03)
  assert "latency 20.0ms (45.0ms from the sync rounds' walls)" in _calibration.describe(cal)
