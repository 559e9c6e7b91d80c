"""The queue-scheduling generation-time bound, checked on random length sets (ROLL Flash, Prop. 1).

With K workers and Q samples of generation time in [0, L] with mean μ, queue scheduling finishes
within Q·μ/K + L (docs/simulator.md); a batch barrier can take ⌈Q/K⌉·L; with async ratio α the
per-step time is bounded by Q·μ/K + L/(1+α).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl_jax import sim
from flashrl_jax.scheduling import LengthDistribution
from tests.test_sim import CycleLengths

T_TOKEN = 0.01  # seconds per decode token (load-independent, so a sample's time is fixed)


def _single_slot(workers: int, lengths, dispatch, group_size: int = 1) -> sim.SimConfig:
  return sim.SimConfig(
      gpus=workers, slots=1, batch_prompts=len(lengths) // group_size, group_size=group_size,
      steps=1, warmup_steps=0, lengths=CycleLengths(lengths), dispatch=dispatch,
      cost=sim.CostModel(decode=sim.LinearDecode(T_TOKEN)))


@settings(max_examples=60, deadline=None)
@given(durations=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=60),
       workers=st.integers(1, 12))
def test_list_scheduling_never_exceeds_the_bound(durations, workers):
  makespan = sim.list_schedule_makespan(durations, workers)
  q_mu = float(np.sum(durations))
  tight = q_mu / workers + (1 - 1 / workers) * max(durations)
  assert makespan <= tight + 1e-9
  assert makespan <= sim.queue_bound(durations, workers, max_len=100.0) + 1e-9
  assert makespan >= q_mu / workers - 1e-9  # and it cannot beat perfect balance


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=40), workers=st.integers(1, 8))
def test_simulated_queue_scheduling_is_list_scheduling_within_the_bound(lengths, workers):
  result = sim.simulate(_single_slot(workers, lengths, sim.QueueScheduling()))
  durations = np.asarray(lengths) * T_TOKEN
  generation = result.records[0].gen_s
  assert generation == pytest.approx(sim.list_schedule_makespan(durations, workers), rel=1e-9)
  assert generation <= sim.queue_bound(durations, workers, max_len=400 * T_TOKEN) + 1e-9
  barrier = sim.simulate(_single_slot(workers, lengths, sim.BatchRollout())).records[0].gen_s
  assert barrier == pytest.approx(sim.barrier_makespan(durations, workers), rel=1e-9)
  assert barrier >= generation - 1e-9


def test_batch_barrier_can_be_much_worse_than_the_bound():
  workers, waves, tail, short = 8, 8, 1000, 10
  # Every wave of 8 holds one long sample: the barrier pays the tail once per wave.
  lengths = [tail if i % workers == 0 else short for i in range(workers * waves)]
  queue = sim.simulate(_single_slot(workers, lengths, sim.QueueScheduling())).gen_time_s
  barrier = sim.simulate(_single_slot(workers, lengths, sim.BatchRollout())).gen_time_s
  durations = np.asarray(lengths) * T_TOKEN
  assert barrier == pytest.approx(waves * tail * T_TOKEN)
  assert queue <= sim.queue_bound(durations, workers)
  assert barrier > 4 * queue


@settings(max_examples=30, deadline=None)
@given(durations=st.lists(st.floats(0.0, 50.0), min_size=4, max_size=16), alpha=st.integers(0, 8),
       workers=st.integers(1, 6))
def test_alpha_windows_amortise_the_tail(durations, alpha, workers):
  # (1+α) batches released together: one list schedule, its time spread over 1+α steps.
  window = np.tile(durations, 1 + alpha)
  per_step = sim.list_schedule_makespan(window, workers) / (1 + alpha)
  bound = sim.amortised_bound(float(np.mean(durations)), len(durations), workers, 50.0, alpha)
  assert per_step <= bound + 1e-9


@settings(max_examples=10, deadline=None)
@given(alpha=st.integers(0, 6), seed=st.integers(0, 2**16), workers=st.sampled_from([4, 12]))
def test_simulated_async_step_time_within_amortised_bound(alpha, seed, workers):
  lengths = LengthDistribution.with_mean(100, sigma=1.2, max_len=2000)
  config = sim.SimConfig(
      gpus=workers + 1, slots=1, batch_prompts=8, group_size=4, steps=16, warmup_steps=alpha + 2,
      lengths=lengths, prompt_tokens=0, cost=sim.CostModel(decode=sim.LinearDecode(T_TOKEN)),
      training=sim.AsyncTraining(alpha=alpha, train_gpus=1))
  result = sim.simulate(config, seed=seed)
  bound = sim.amortised_bound(lengths.mean() * T_TOKEN, config.samples_per_step, workers,
                              lengths.max_len * T_TOKEN, alpha)
  assert result.step_time_s <= bound
