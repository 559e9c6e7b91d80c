"""Simulator tests: determinism, a hand-computed sync step, the α invariants, rollout mechanisms."""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl_jax import sim
from flashrl_jax.sim import _worker as sim_worker
from flashrl_jax.scheduling import EmpiricalLengths, LengthDistribution, PauseMode


class CycleLengths:
  """Test double for `LengthDistribution`: hands out `values` in order, cyclically (no randomness)."""

  def __init__(self, values):
    self._values = itertools.cycle(values)

  def sample_groups(self, rng, prompt_z, group_size):
    del rng
    return np.array([[next(self._values) for _ in range(group_size)] for _ in prompt_z])


def tiny(**changes) -> sim.SimConfig:
  base = sim.SimConfig(
      gpus=4, slots=4, batch_prompts=4, group_size=4, steps=4, warmup_steps=1,
      lengths=LengthDistribution.with_mean(200, sigma=1.0, max_len=2000), prompt_tokens=16,
      cost=sim.CostModel(decode=sim.LinearDecode(0.01, 0.001), prefill_s_per_token=1e-4,
                         train=sim.TrainModel(0.5, 1e-4), sync=sim.SyncModel(0.1, 0.05, 0.2, 0.05),
                         reward_s=0.05, reward_workers=4))
  return base.replace(**changes)


def test_deterministic_given_seed():
  config = tiny(training=sim.AsyncTraining(alpha=2, train_gpus=1))
  a, b = sim.simulate(config, seed=3), sim.simulate(config, seed=3)
  assert a.summary() == b.summary()
  assert [r.response_lengths for r in a.records] == [r.response_lengths for r in b.records]
  assert sim.simulate(config, seed=4).summary() != a.summary()


@pytest.mark.parametrize("dispatch, generation_s", [
    # Durations 1, 3, 2, 0.5 s on 2 single-slot workers.
    (sim.BatchRollout(), 3.0 + 2.0),  # waves (1, 3) and (2, 0.5): sum of per-wave maxima
    (sim.QueueScheduling(), 3.5),     # list schedule: w0 runs 1 → 2 → 0.5, w1 runs 3
])
def test_sync_step_is_generation_plus_train_plus_sync(dispatch, generation_s):
  config = sim.SimConfig(
      gpus=2, slots=1, batch_prompts=2, group_size=2, steps=3, warmup_steps=0,
      lengths=CycleLengths((100, 300, 200, 50)), prompt_tokens=0, dispatch=dispatch,
      cost=sim.CostModel(decode=sim.LinearDecode(0.01), train=sim.TrainModel(fixed_s=1.0),
                         sync=sim.SyncModel(export_s=0.2, load_s=0.3)))
  result = sim.simulate(config)
  step = generation_s + 1.0 + 0.5
  ends = [r.end_time for r in result.records]
  np.testing.assert_allclose(ends, [step * k - 0.5 for k in (1, 2, 3)], rtol=1e-9)
  np.testing.assert_allclose([r.gen_s for r in result.records], generation_s, rtol=1e-9)
  assert result.staleness_hist == {0: 12}
  assert result.idle_fraction > 0


def test_async_alpha_zero_is_on_policy_and_never_overlaps():
  result = sim.simulate(tiny(training=sim.AsyncTraining(alpha=0, train_gpus=1), steps=6), seed=1)
  assert set(result.staleness_hist) == {0}
  assert result.dropped_samples == 0
  for prev, cur in zip(result.records, result.records[1:]):
    # Every response of step k+1 started after step k's update finished training.
    assert cur.first_start >= prev.end_time


@settings(max_examples=12, deadline=None)
@given(alpha=st.integers(0, 4), seed=st.integers(0, 2**16), train_gpus=st.integers(1, 3),
       train_s=st.floats(0.0, 3.0), pause=st.sampled_from(list(PauseMode)),
       abort_hopeless=st.booleans(), behind=st.booleans())
def test_staleness_bound_holds_for_every_consumed_sample(alpha, seed, train_gpus, train_s, pause,
                                                         abort_hopeless, behind):
  training = sim.AsyncTraining(alpha=alpha, train_gpus=train_gpus, abort_hopeless=abort_hopeless,
                               publish_behind=behind)
  config = tiny(training=training, pause=pause,
                cost=dataclasses.replace(tiny().cost, train=sim.TrainModel(train_s, 1e-4)))
  result = sim.simulate(config, seed=seed)
  for record in result.records:
    assert max(record.staleness) <= alpha
    assert min(record.staleness) >= 0
  assert sum(result.staleness_hist.values()) == config.steps * config.samples_per_step


def test_a_handoff_behind_training_leaves_the_trainer_export_and_wait():
  # Training-bound (2-token responses at 0.1 ms a step, α = 2): publishing before the next step,
  # the trainer's period is train + export + handoff (pause, load, resume: 0.1 + 0.4 + 0.1);
  # behind it, train + export. With a step shorter than the handoff, the trainer waits for the
  # previous handoff, so its period is never shorter than a handoff.
  def period(train_s: float, behind: bool | None) -> float:
    cost = sim.CostModel(decode=sim.LinearDecode(1e-4, 0.0), train=sim.TrainModel(train_s, 0.0),
                         sync=sim.SyncModel(0.2, 0.1, 0.4, 0.1), reward_s=0.0)
    config = tiny(cost=cost, lengths=CycleLengths([2]), steps=6, warmup_steps=2,
                  training=sim.AsyncTraining(alpha=2, train_gpus=1, publish_behind=behind))
    result = sim.simulate(config, seed=0)
    assert max(s for r in result.records for s in r.staleness) <= 2
    return result.step_time_s

  assert period(1.0, behind=False) == pytest.approx(1.0 + 0.2 + 0.6, rel=1e-3)
  assert period(1.0, behind=True) == pytest.approx(1.0 + 0.2, rel=1e-3)
  assert period(1.0, behind=None) == period(1.0, behind=True)  # the controller's rule at α = 2
  assert 0.6 <= period(0.2, behind=True) < period(0.2, behind=False)


def test_async_outpaces_sync_on_long_tail():
  sync = sim.simulate(tiny(steps=6), seed=0)
  fast = sim.simulate(tiny(steps=6, training=sim.AsyncTraining(alpha=2, train_gpus=1)), seed=0)
  assert fast.samples_per_s > 1.3 * sync.samples_per_s


def test_prompt_replication_cuts_generation_time_on_skewed_groups():
  # Hard prompts make all 8 of their responses long; fewer groups than workers.
  skewed = LengthDistribution.with_mean(300, sigma=1.2, max_len=4000, prompt_corr=0.9)
  cost = dataclasses.replace(tiny().cost, decode=sim.LinearDecode(0.01, 0.002))
  gen = {}
  for placement in (sim.GroupPlacement(), sim.PromptReplication()):
    config = tiny(gpus=8, slots=8, group_size=8, batch_prompts=4, lengths=skewed, cost=cost,
                  placement=placement)
    gen[type(placement)] = np.mean([sim.simulate(config, seed=s).gen_time_s for s in range(3)])
  assert gen[sim.PromptReplication] < 0.8 * gen[sim.GroupPlacement]


def test_queue_scheduling_beats_batch_rollout():
  gen = {}
  for dispatch in (sim.BatchRollout(), sim.QueueScheduling()):
    gen[type(dispatch)] = sim.simulate(tiny(dispatch=dispatch, batch_prompts=8), seed=0).gen_time_s
  assert gen[sim.QueueScheduling] < 0.8 * gen[sim.BatchRollout]


def test_async_throughput_is_monotone_in_rollout_workers():
  rates = []
  for gpus in (2, 3, 5, 9):
    config = tiny(gpus=gpus, steps=6, training=sim.AsyncTraining(alpha=2, train_gpus=1),
                  cost=dataclasses.replace(tiny().cost, train=sim.TrainModel(0.1, 1e-5)))
    rates.append(sim.simulate(config, seed=0).samples_per_s)
  assert all(b >= 0.98 * a for a, b in zip(rates, rates[1:])), rates
  assert rates[-1] > 2 * rates[0]


@pytest.mark.parametrize("mode", [PauseMode.ABORT, PauseMode.RETRACT])
def test_modes_that_drop_the_kv_cache_pay_for_reprefill(mode):
  base = tiny(training=sim.AsyncTraining(alpha=2, train_gpus=1),
              cost=dataclasses.replace(tiny().cost, prefill_s_per_token=2e-3))
  in_place = sim.simulate(base.replace(pause=PauseMode.IN_PLACE), seed=0)
  dropped = sim.simulate(base.replace(pause=mode), seed=0)
  assert dropped.samples_per_s < in_place.samples_per_s


def test_metrics_records_match_the_controller_format():
  result = sim.simulate(tiny(training=sim.AsyncTraining(alpha=1, train_gpus=1)), seed=0)
  lines = result.to_metrics()
  assert len(lines) == 5
  for key in ("step", "policy_version", "samples_per_s", "staleness_hist", "reward_mean",
              "time/train_s", "time/wait_data_s", "response_lengths"):
    assert key in lines[0]
  assert [line["policy_version"] for line in lines] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("changes, error", [
    (dict(placement=sim.GroupPlacement(), slots=2), ValueError),
    (dict(training=sim.AsyncTraining(alpha=1, train_gpus=4)), ValueError),
    (dict(gpus_per_worker=3), ValueError),
    (dict(pause="sideways"), ValueError),
    (dict(dispatch="queue"), TypeError),
])
def test_bad_configs_fail_when_built(changes, error):
  with pytest.raises(error):
    tiny(**changes)


def test_fit_linear_decode_and_roofline():
  decode = sim.fit_linear_decode([1, 2, 4, 8], [0.011, 0.012, 0.014, 0.018])
  assert decode.t_base_s == pytest.approx(0.010)
  assert decode.t_per_active_s == pytest.approx(0.001)
  roof = sim.RooflineDecode.qwen3_8b(mean_context=4096)
  # Memory bound: a bigger batch costs more per step but much less per token.
  assert roof.step_time(64) > roof.step_time(1)
  assert roof.step_time(64) / 64 < roof.step_time(1) / 4


def test_tabulated_costs_interpolate_and_extrapolate():
  decode = sim.TabulatedDecode((1, 4, 8), (0.002, 0.003, 0.005))
  assert decode.step_time(1) == decode.step_time(0) == pytest.approx(0.002)
  assert decode.step_time(2) == pytest.approx(0.002 + 0.001 / 3)
  assert decode.step_time(16) == pytest.approx(0.005 + 8 * 0.0005)  # the last slope continues
  train = sim.TabulatedTrain((1000, 3000), (0.4, 0.8))
  assert train.time(2000, devices=7) == pytest.approx(0.6)
  with pytest.raises(ValueError):
    sim.TabulatedDecode((4, 2), (0.1, 0.2))


def test_request_cost_blocks_the_worker_once_per_request():
  # One single-slot worker, two prompts of one 10-token response each, 0.01 s per token: each
  # request first blocks the worker for request_s, then decodes.
  config = sim.SimConfig(
      gpus=1, slots=1, batch_prompts=2, group_size=1, steps=1, warmup_steps=0,
      lengths=CycleLengths((10,)), prompt_tokens=0,
      cost=sim.CostModel(decode=sim.LinearDecode(0.01), request_s=0.05))
  result = sim.simulate(config)
  assert result.records[0].gen_s == pytest.approx(2 * (0.05 + 10 * 0.01))


def test_empirical_lengths_keep_the_measured_rows():
  groups = ((5, 5, 6), (100, 120, 200), (7, 8, 9))
  lengths = EmpiricalLengths(groups)
  rng = np.random.default_rng(0)
  z = lengths.prompt_factors(rng, 300)
  drawn = lengths.sample_groups(rng, z, 4)
  assert drawn.shape == (300, 4)
  rows = {frozenset(map(int, row)) for row in drawn}
  assert all(any(r <= set(g) for g in groups) for r in rows)  # every group comes from one row
  again = lengths.sample_groups(np.random.default_rng(9), z[:1], 4)  # a re-issued prompt
  assert set(map(int, again[0])) <= next(set(g) for g in groups if set(map(int, drawn[0])) <= set(g))
  assert lengths.max_len == 200 and lengths.mean() == pytest.approx(np.mean(sum(groups, ())))


def test_a_trainer_sharing_the_rollouts_process_slows_and_is_slowed():
  # Async on one rollout worker: training overlaps generation, so with interference the train
  # steps take longer (by at most the factor) and the run is slower; sync never overlaps them.
  base = tiny(training=sim.AsyncTraining(alpha=2, train_gpus=1), steps=6)
  shared = base.replace(cost=dataclasses.replace(base.cost, train_beside_rollout=2.0,
                                                 rollout_beside_train=1.5))
  plain, slowed = sim.simulate(base, seed=0), sim.simulate(shared, seed=0)
  assert plain.train_time_s < slowed.train_time_s <= 2.0 * plain.train_time_s + 1e-9
  assert slowed.samples_per_s < plain.samples_per_s
  sync = tiny(steps=3)
  sync_shared = sync.replace(cost=dataclasses.replace(sync.cost, train_beside_rollout=2.0,
                                                      rollout_beside_train=1.5))
  assert sim.simulate(sync_shared, seed=0).summary() == sim.simulate(sync, seed=0).summary()


def test_a_context_sensitive_decode_is_retimed_as_contexts_grow():
  # One request of 400 tokens after a 100-token prompt; a step costs 1 ms at context 100 and
  # 0.5% more per token of context: the decode takes Σ_i 1 ms · (1 + 0.005 · i), i = 0..399.
  decode = sim.TabulatedDecode((1,), (0.001,), context_ref=100.0, context_slope=0.005)
  assert decode.context_sensitive and decode.step_time(1, 300.0) == pytest.approx(0.002)
  config = sim.SimConfig(gpus=1, slots=1, batch_prompts=1, group_size=1, steps=1, warmup_steps=0,
                         lengths=CycleLengths((400,)), prompt_tokens=100,
                         cost=sim.CostModel(decode=decode))
  exact = sum(0.001 * (1 + 0.005 * i) for i in range(400))
  assert sim.simulate(config).records[0].gen_s == pytest.approx(exact, rel=0.02)
  flat = config.replace(cost=sim.CostModel(decode=sim.TabulatedDecode((1,), (0.001,))))
  assert sim.simulate(flat).records[0].gen_s == pytest.approx(0.4)


def test_the_overlap_of_training_and_rollout_is_reported():
  # One single-slot worker, every response 100 tokens at 10 ms (1 s), training 0.4 s, free
  # handoffs, B = n = 1. At α = 1 the bound keeps a prompt in flight while the trainer trains, so
  # the rollout never idles: every training second is beside it, and 0.4 s of each 1 s step of
  # rollout is beside training. At α = 0 nothing is dispatched during a step; sync never overlaps.
  def run(training, interference=1.0):
    return sim.simulate(sim.SimConfig(
        gpus=1 if isinstance(training, sim.SyncTraining) else 2, slots=1, batch_prompts=1,
        group_size=1, steps=6, warmup_steps=2, lengths=CycleLengths((100,)), prompt_tokens=0,
        training=training,
        cost=sim.CostModel(decode=sim.LinearDecode(0.01), train=sim.TrainModel(fixed_s=0.4),
                           train_beside_rollout=interference)))

  pipelined = run(sim.AsyncTraining(alpha=1, train_gpus=1))
  assert pipelined.step_time_s == pytest.approx(1.0)
  assert pipelined.train_beside_rollout == pytest.approx(1.0)
  assert pipelined.rollout_beside_train == pytest.approx(0.4)
  # Twice as slow beside the rollout: 0.8 s of each 1 s is beside training.
  assert run(sim.AsyncTraining(alpha=1, train_gpus=1), 2.0).rollout_beside_train == (
      pytest.approx(0.8))
  for lockstep in (run(sim.AsyncTraining(alpha=0, train_gpus=1)), run(sim.SyncTraining())):
    assert (lockstep.train_beside_rollout, lockstep.rollout_beside_train) == (0.0, 0.0)



def test_an_engine_padding_to_the_longest_context_prices_every_step_there():
  """Two requests on one worker: A (prompt 100 tokens, 50 to decode) and B (prompt 20, 300). A step
  costs 1 ms at context 100 and 0.5% more per context token. Priced at the longest context (our
  engine pads a step's requests to the longest one's span), the step follows A while A is live and
  B once A has left; priced at the mean, it follows their mean. Hand-computed at admission, after
  10 tokens, and after A finished."""
  def worker(context_of):
    decode = sim.TabulatedDecode((1, 2), (0.001, 0.001), context_ref=100.0, context_slope=0.005,
                                 context_of=context_of)
    w = sim_worker.Worker(0, slots=2, decode=decode, prefill_s_per_token=0.0)
    group = sim_worker.Group(0, 0.0, [50, 300], prompt_tokens=100, issue_time=0.0)
    group.requests[1].prompt_tokens = 20
    for request in group.requests:
      w.admit(request, 0.0)
    return w

  longest, mean = worker(sim.Context.LONGEST), worker(sim.Context.MEAN)
  step = lambda context: 0.001 * (1 + 0.005 * (context - 100))
  assert longest.step_time() == pytest.approx(step(100))  # contexts 100 and 20
  assert mean.step_time() == pytest.approx(step(60))
  for w in (longest, mean):  # time stands still (`last`): only the decoded tokens move
    w.progress, w.last = 10.0, 1.0  # both decoded 10 tokens: contexts 110 and 30
  assert longest.step_time() == pytest.approx(step(110))
  assert mean.step_time() == pytest.approx(step(70))
  for w in (longest, mean):
    w.progress = 50.0
    assert [r.index for r in w.pop_finished(1.0)] == [0]  # A is done; B's context is 70
    assert w.step_time() == pytest.approx(step(70))
