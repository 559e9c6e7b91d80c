"""Packing, gradient accumulation, compile counts and the non-finite guard (single device).

The reference for packing is deliberately naive: each trajectory run alone through the full-logits
forward, log-softmax at the temperature, the response tokens' log-probs gathered by hand, and the
loss applied to a padded `[B, L]` batch. The packed path shares none of that code past the model.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flashrl_jax import losses
from flashrl_jax.losses import LossConfig
from flashrl_jax.model import BAND_WIDTHS
from flashrl_jax.model._packed import narrowest_band
from flashrl_jax.testing import tiny_config
from flashrl_jax.trainer import (BatchConfig, LossInputs, OptimizerConfig, TrainConfig, Trainer,
                                 compute_advantages, create_train_state, make_mesh,
                                 micro_batch_ladder, minibatch_gradients, pack,
                                 random_trajectories)
from flashrl_jax.trainer._step import sequence_logprobs

MODEL = tiny_config()


def trajectories(seed=0, n=7, response=(1, 12)):
  return random_trajectories(np.random.default_rng(seed), n, vocab_size=MODEL.vocab_size,
                             prompt_lengths=(1, 9), response_lengths=response, group_size=3)


@pytest.fixture(scope="module")
def model_state():
  config = TrainConfig()
  graphdef, state = create_train_state(MODEL, config, make_mesh(""), seed=3)
  return graphdef, state.params


def packed_loss_and_grads(graphdef, params, config, batch):
  """Loss and gradient of minibatch 0 of a host batch, as the RL step computes them."""
  batch = jax.tree.map(jnp.asarray, batch)

  @jax.jit
  def run(params, batch):
    advantages = compute_advantages(config, batch)
    take = lambda x: x[0]
    return minibatch_gradients(params, graphdef, config, jax.tree.map(take, batch),
                               LossInputs(advantages[0]))

  loss, grads, metrics = run(params, batch)
  return float(loss), grads, metrics


def assert_trees_close(a, b, rtol=2e-5, atol=1e-7):
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol),
               jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))


def test_pack_layout():
  # Reward = sample id, so each slot can name its trajectory.
  trajs = [dataclasses.replace(t, reward=float(t.sample_id)) for t in trajectories(n=9)]
  config = BatchConfig(row_length=24, rows=2, sequences_per_row=2, max_response_length=12)
  batch = pack(trajs, config, num_minibatches=2)
  k, m = batch.input_ids.shape[:2]
  assert k == 2 and m in (1, 2, 3, 4)  # a count of the ladder
  seen = []
  for at in zip(*np.nonzero(batch.sample_mask)):
    ki, mi, row, slot = at
    tr = trajs[int(batch.rewards[at])]
    seen.append(tr.sample_id)
    assert (ki == 0) == (tr.sample_id < 5)  # contiguous minibatches, in the given order
    p, r = len(tr.prompt_ids), len(tr.response_ids)
    ids, seg = batch.input_ids[ki, mi, row], batch.segment_ids[ki, mi, row]
    index = batch.token_index[at][:r]
    # The column before each response token predicts it; all inside this slot's own segment.
    np.testing.assert_array_equal(ids[index + 1], tr.response_ids)
    np.testing.assert_array_equal(batch.targets[ki, mi, row][index], tr.response_ids)
    assert (seg[index] == slot + 1).all() and (seg == slot + 1).sum() == p + r
    np.testing.assert_array_equal(ids[index[0] - p + 1:index[0] + 1], tr.prompt_ids)
    np.testing.assert_array_equal(batch.positions[ki, mi, row][seg == slot + 1], np.arange(p + r))
    np.testing.assert_array_equal(batch.behavior_logp[at][:r], tr.behavior_logp)
    assert batch.loss_mask[at].sum() == r and batch.group_ids[at] == tr.group_id
  assert sorted(seen) == list(range(9))
  assert ((batch.segment_ids != 0).sum(-1) <= config.row_length).all()
  # Padding slots are groups of one (advantage 0) with unique negative ids.
  pad = batch.group_ids[~batch.sample_mask]
  assert (pad < 0).all() and len(set(pad.tolist())) == pad.size


def test_pack_errors():
  config = BatchConfig(row_length=16, rows=2, sequences_per_row=4, max_response_length=8)
  long = trajectories(n=1, response=(9, 9))
  with pytest.raises(ValueError, match="max_response_length=8"):
    pack(long, config)
  with pytest.raises(ValueError, match="cannot fill 3 minibatches"):
    pack(trajectories(n=2), config, num_minibatches=3)


def naive_loss(graphdef, params, config, trajs):
  """Each trajectory alone, full logits, hand-gathered log-probs, padded [B, L] loss."""
  model = nnx.merge(graphdef, params)
  width = max(len(t.response_ids) for t in trajs)
  logps, masks, behavior = [], [], []
  for t in trajs:
    ids = jnp.asarray(np.concatenate([t.prompt_ids, t.response_ids]), jnp.int32)[None]
    log_probs = jax.nn.log_softmax(model(ids)[0] / config.temperature)
    p, r = len(t.prompt_ids), len(t.response_ids)
    logp = log_probs[p - 1:p + r - 1][jnp.arange(r), jnp.asarray(t.response_ids)]
    logps.append(jnp.pad(logp, (0, width - r)))
    masks.append(np.arange(width) < r)
    behavior.append(np.pad(t.behavior_logp, (0, width - r)))
  rewards = np.array([t.reward for t in trajs], np.float32)
  groups = np.array([t.group_id for t in trajs])
  advantages = losses.grpo_advantages(rewards, groups)
  return losses.compute_policy_loss(config.loss, logp=jnp.stack(logps),
                                    behavior_logp=np.stack(behavior), advantages=advantages,
                                    mask=np.stack(masks))[0]


def test_packed_equals_unpacked(model_state):
  graphdef, params = model_state
  config = TrainConfig(temperature=0.8, batch=BatchConfig(row_length=40, rows=2,
                                                          sequences_per_row=4,
                                                          max_response_length=12))
  trajs = trajectories(seed=5)
  batch = pack(trajs, config.batch)
  assert batch.sample_mask[0, 0].sum(-1).max() > 1  # several sequences share a row
  loss, grads, _ = packed_loss_and_grads(graphdef, params, config, batch)
  # One jit over the unrolled per-trajectory forwards: op-by-op it compiles every op per shape.
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: naive_loss(graphdef, p, config, trajs)))(params)
  np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-5)
  assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-7)


def test_packed_equals_unpacked_in_every_attention_layout(model_state):
  """Rows of 384 tokens: micro-batches whose longest sequence fits a 64- or 128-token band attend
  over their bands, the others densely in causal blocks (each micro-batch chooses on device); the
  minibatch's loss and gradient still equal the naive per-trajectory reference."""
  graphdef, params = model_state
  rng = np.random.default_rng(7)
  group = lambda n, lengths, first: [
      dataclasses.replace(t, group_id=t.group_id + first, sample_id=t.sample_id + 100 * first)
      for t in random_trajectories(rng, n, vocab_size=MODEL.vocab_size, prompt_lengths=(1, 9),
                                   response_lengths=lengths, group_size=2)]
  trajs = group(2, (240, 260), 0) + group(4, (90, 110), 10) + group(8, (20, 45), 20)
  config = TrainConfig(temperature=0.8, batch=BatchConfig(row_length=384, rows=1,
                                                          sequences_per_row=8,
                                                          max_response_length=320))
  batch = pack(trajs, config.batch)
  layouts = [int(narrowest_band(jnp.asarray(micro), BAND_WIDTHS)) for micro in batch.segment_ids[0]]
  assert set(layouts) == {0, 1, 2}, layouts  # band 64, band 128 and dense all occur
  loss, grads, _ = packed_loss_and_grads(graphdef, params, config, batch)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: naive_loss(graphdef, p, config, trajs)))(params)
  np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-5)
  assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("row_length,slots", [(40, 4), (64, 2)])
def test_vocab_projection_on_slots_or_tokens_agree(model_state, row_length, slots):
  """Projecting gathered response slots and projecting every packed token give the same log-probs,
  entropies and gradients (the step picks the smaller of the two from the shapes)."""
  graphdef, params = model_state
  config = TrainConfig(temperature=0.8, batch=BatchConfig(
      row_length=row_length, rows=4, sequences_per_row=slots, max_response_length=12))
  micro = jax.tree.map(lambda x: jnp.asarray(x[0, 0]), pack(trajectories(seed=8), config.batch))

  def objective(p, project_slots):
    model = nnx.merge(graphdef, p)
    logp, entropy = sequence_logprobs(model, micro, config, project_slots=project_slots)
    masked = lambda x: jnp.where(micro.loss_mask, x, 0.0)
    return jnp.sum(masked(logp)) + 0.3 * jnp.sum(masked(entropy)), (masked(logp), masked(entropy))

  results = [jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=1)(params, choice)
             for choice in (True, False)]
  ((_, (logp_a, ent_a)), grads_a), ((_, (logp_b, ent_b)), grads_b) = results
  assert float(jnp.abs(logp_a).sum()) > 0  # the batch has response tokens
  np.testing.assert_allclose(logp_a, logp_b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ent_a, ent_b, rtol=1e-5, atol=1e-6)
  assert_trees_close(grads_a, grads_b, rtol=1e-4, atol=1e-6)


def test_micro_batch_ladder():
  assert micro_batch_ladder(1) == [1]
  assert micro_batch_ladder(3) == [1, 2, 3]
  assert micro_batch_ladder(5) == [1, 2, 3, 4, 6]
  assert micro_batch_ladder(16) == [1, 2, 3, 4, 6, 8, 12, 16]
  assert micro_batch_ladder(13) == [1, 2, 3, 4, 6, 8, 12, 16]
  with pytest.raises(ValueError):
    micro_batch_ladder(0)


def test_pack_rounds_the_micro_batch_count_up_the_ladder():
  # One full-length trajectory per row, one row per micro-batch: n trajectories need n micro-batches.
  config = BatchConfig(row_length=24, rows=1, sequences_per_row=1, max_response_length=12)
  rng = np.random.default_rng(3)
  for n, expected in [(1, 1), (3, 3), (5, 6), (7, 8), (9, 12)]:
    trajs = random_trajectories(rng, n, vocab_size=96, prompt_lengths=(12, 12),
                                response_lengths=(12, 12))
    batch = pack(trajs, config)
    assert batch.micro_batches == expected
    assert int(batch.sample_mask.sum()) == n  # every trajectory placed once, the rest padding


def test_gradient_accumulation_equals_full_batch(model_state):
  graphdef, params = model_state
  loss_config = LossConfig(aggregation="seq-mean-token-mean", sequence_ratio=True)
  trajs = trajectories(seed=6)
  big = TrainConfig(loss=loss_config, batch=BatchConfig(row_length=24, rows=8,
                                                        sequences_per_row=1,
                                                        max_response_length=12))
  small = big.replace(batch=BatchConfig(row_length=24, rows=1, sequences_per_row=2,
                                        max_response_length=12))
  full = pack(trajs, big.batch)
  split = pack(trajs, small.batch, min_micro_batches=8)
  assert full.micro_batches == 1 and split.micro_batches == 8
  assert not split.sample_mask[0, -1].any()  # an empty micro-batch is in there too
  loss, grads, metrics = packed_loss_and_grads(graphdef, params, big, full)
  acc_loss, acc_grads, acc_metrics = packed_loss_and_grads(graphdef, params, small, split)
  np.testing.assert_allclose(acc_loss, loss, rtol=1e-5)
  assert_trees_close(acc_grads, grads, rtol=1e-4, atol=1e-7)
  for key in ("loss", "pg_loss", "ratio_mean", "ratio_max", "ratio_min", "clip_frac", "tokens",
              "seq_ratio_mean", "seq_ratio_max"):
    np.testing.assert_allclose(acc_metrics[key], metrics[key], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def trainer():
  config = TrainConfig(loss=LossConfig(name="ppo"), num_minibatches=2,
                       optimizer=OptimizerConfig(learning_rate=1e-3),
                       batch=BatchConfig(row_length=48, rows=4, sequences_per_row=2,
                                         max_response_length=16))
  return Trainer(MODEL, config, make_mesh(""), seed=1)


def test_no_recompilation_across_lengths(trainer):
  rng = np.random.default_rng(0)
  for response in [(1, 4), (8, 16), (3, 9)]:  # different lengths, all one micro-batch
    trajs = random_trajectories(rng, 6, vocab_size=96, prompt_lengths=(2, 6),
                                response_lengths=response)
    metrics = trainer.update(trajs)
    assert metrics["micro_batches"] == 1
  assert trainer.compilations() == 1
  more = random_trajectories(rng, 20, vocab_size=96, prompt_lengths=(2, 6),
                             response_lengths=(4, 16))
  assert trainer.update(more)["micro_batches"] == 2
  assert trainer.update(more[:5])["micro_batches"] == 1
  # At most one more shape: the 2-micro-batch one (in a full-suite process JAX may already hold an
  # identical executable from an earlier test, so the count can stay at 1; it must never grow more).
  assert trainer.compilations() <= 2
  assert trainer.policy_version == 5


def test_warmup_compiles_every_micro_batch_count_ahead():
  config = TrainConfig(batch=BatchConfig(row_length=48, rows=4, sequences_per_row=2,
                                         max_response_length=16))
  trainer = Trainer(MODEL, config, make_mesh(""), seed=2)
  before = jax.device_get(trainer.state)
  # 8 full-length trajectories need 8 rows: 2 micro-batches of 4 rows at worst.
  assert trainer.warmup(max_sequences=8) == [1, 2]
  # Warm-up also ran each count (on a copy of the state): the state itself is untouched.
  after = jax.device_get(trainer.state)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)
  builds = []
  listener = lambda event, seconds, **_: (
      builds.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
  rng = np.random.default_rng(0)
  short = random_trajectories(rng, 8, vocab_size=96, prompt_lengths=(2, 4), response_lengths=(2, 4))
  long = random_trajectories(rng, 8, vocab_size=96, prompt_lengths=(20, 30),
                             response_lengths=(12, 16))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    assert [trainer.update(t)["micro_batches"] for t in (short, long)] == [1, 2]
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not builds, "a step compiled although warmup had built its shape"
  assert trainer.policy_version == 2  # warmup compiled, it did not train


def test_non_finite_gradients_are_skipped_and_counted(trainer):
  params = trainer.state.params
  # A NaN in one embedding row that the batch uses: every gradient becomes NaN.
  poisoned = jax.tree.map(lambda x: x, params)
  poisoned["embed"].set_value(params["embed"].get_value().at[5].set(jnp.nan))
  trainer.set_state(trainer.state.replace(params=poisoned))
  before = jax.tree.map(np.asarray, trainer.state.params)
  trajs = trajectories(seed=9, n=6)
  for i in (0, -1):  # token 5 in both minibatches
    trajs[i] = dataclasses.replace(trajs[i], prompt_ids=np.array([5, 5, 7]))
  total = int(trainer.state.skipped_updates)  # read before the donating step
  metrics = trainer.update(trajs)
  assert metrics["skipped_updates"] == trainer.config.updates_per_step
  assert int(trainer.state.skipped_updates) == total + trainer.config.updates_per_step
  after = jax.tree.map(np.asarray, trainer.state.params)
  jax.tree.map(np.testing.assert_array_equal, after, before)  # untouched, NaN only where it was
  assert np.isnan(after["embed"].get_value()).sum() == MODEL.hidden_size
