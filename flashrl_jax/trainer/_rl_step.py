"""The RL update as one pure, jitted function: `train_step(state, batch) -> (state, metrics)`.

Why one function: everything an RL step does on device (advantages, the no-gradient proximal and
reference log-probs, `ppo_epochs x num_minibatches` optimizer updates) compiles into one program
that takes the donated state and returns the next one; the host only packs data and reads metrics.

Order inside a step:
1. advantages from rewards and group ids over the *whole* batch (groups span micro-batches);
2. `prox_logp` under the step's starting parameters (decoupled PPO's proximal policy), and the frozen
   reference model's log-probs when the loss has a KL term; neither is differentiated;
3. for each epoch, for each minibatch (in an order drawn from the state's rng when
   `shuffle_minibatches`): accumulate gradients over its micro-batches, then one guarded AdamW update
   (non-finite gradients skip it and are counted).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from flashrl_jax import losses
from flashrl_jax.losses import LossName
from flashrl_jax.model import by_band
from flashrl_jax.trainer._batch import BATCH_AXES, Batch
from flashrl_jax.trainer._config import AdvantageEstimator, BatchConfig, TrainConfig
from flashrl_jax.trainer._optimizer import apply_update, current_learning_rate, make_optimizer
from flashrl_jax.trainer._sharding import Rules, named_sharding, replicated
from flashrl_jax.trainer._state import TrainState
from flashrl_jax.trainer._step import LossInputs, minibatch_gradients, sequence_logprobs


def compute_advantages(config: TrainConfig, batch: Batch) -> jax.Array:
  """`[K, M, R, S, L]` advantages of every response token, from the whole batch's rewards/groups."""
  lead = batch.rewards.shape
  rewards, groups = batch.rewards.reshape(-1), batch.group_ids.reshape(-1)
  mask = batch.loss_mask.reshape(-1, batch.loss_mask.shape[-1])
  match config.advantage:
    case AdvantageEstimator.GRPO:
      adv = losses.grpo_advantages(rewards, groups)[:, None]
    case AdvantageEstimator.DR_GRPO:
      adv = losses.dr_grpo_advantages(rewards, groups)[:, None]
    case AdvantageEstimator.RLOO:
      adv = losses.rloo_advantages(rewards, groups)[:, None]
    case AdvantageEstimator.REINFORCE_PP:
      rewards = jnp.where(batch.sample_mask.reshape(-1), rewards, 0.0)
      adv = losses.reinforce_plus_plus_advantages(rewards, mask)
  adv = jnp.broadcast_to(adv, mask.shape)
  return jnp.where(mask, adv, 0.0).reshape(*lead, -1)


def all_sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, config: TrainConfig,
                          batch: Batch) -> jax.Array:
  """`[K, M, R, S, L]` log-probs of every micro-batch under `params`, without gradient."""
  model = nnx.merge(graphdef, jax.lax.stop_gradient(params))
  k, m = batch.input_ids.shape[:2]
  flat = jax.tree.map(lambda x: x.reshape(k * m, *x.shape[2:]), batch)
  logp = jax.lax.map(lambda micro: by_band(
      lambda width: sequence_logprobs(model, micro, config, band_width=width)[0],
      micro.segment_ids), flat)
  return logp.reshape(k, m, *logp.shape[1:])


def _batch_metrics(config: TrainConfig, state: TrainState, batch: Batch, advantages: jax.Array
                   ) -> dict[str, jax.Array]:
  samples = batch.sample_mask
  n = jnp.maximum(samples.sum(), 1)
  mask = batch.loss_mask
  seq_adv = jnp.where(mask, advantages, 0.0).sum(-1) / jnp.maximum(mask.sum(-1), 1)
  mean = lambda x: jnp.where(samples, x, 0.0).sum() / n
  # A sample is as stale as the oldest policy version that generated any of its tokens.
  oldest = jnp.where(mask, batch.behavior_version, jnp.iinfo(jnp.int32).max).min(-1)
  oldest = jnp.where(mask.any(-1), oldest, batch.start_version)
  return {
      "reward_mean": mean(batch.rewards),
      "advantage_mean": mean(seq_adv),
      "advantage_abs_mean": mean(jnp.abs(seq_adv)),
      "response_length_mean": mean(mask.sum(-1).astype(jnp.float32)),
      "samples": samples.sum().astype(jnp.float32),
      **losses.staleness_metrics(state.policy_version, oldest.reshape(-1),
                                 sample_mask=samples.reshape(-1)),
  }


def minibatch_order(config: TrainConfig, rng: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(next rng, `[ppo_epochs * k]` minibatch indices): each epoch a permutation when shuffling."""
  if not config.shuffle_minibatches:
    return rng, jnp.tile(jnp.arange(k), config.ppo_epochs)
  rng, *keys = jax.random.split(rng, config.ppo_epochs + 1)
  return rng, jnp.concatenate([jax.random.permutation(key, k) for key in keys])


def train_step(graphdef: nnx.GraphDef, config: TrainConfig, state: TrainState, batch: Batch,
               ref_params: nnx.State | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One RL step: `ppo_epochs * K` optimizer updates on the K minibatches of `batch`."""
  if config.uses_reference and ref_params is None:
    raise ValueError(f"kl_coef={config.loss.kl_coef} needs the reference model's params.")
  optimizer = make_optimizer(config.optimizer)
  advantages = compute_advantages(config, batch)
  prox_logp = ref_logp = None
  if config.loss.name is LossName.DECOUPLED_PPO:
    prox_logp = all_sequence_logprobs(graphdef, state.params, config, batch)
  if config.uses_reference:
    ref_logp = all_sequence_logprobs(graphdef, ref_params, config, batch)
  inputs = LossInputs(advantages, prox_logp, ref_logp)
  k = batch.num_minibatches

  def update(carry, index):
    params, opt_state = carry
    take = lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False)
    loss, grads, metrics = minibatch_gradients(params, graphdef, config,
                                               jax.tree.map(take, batch),
                                               jax.tree.map(take, inputs))
    learning_rate = current_learning_rate(config.optimizer, opt_state)
    params, opt_state, grad_norm, skipped = apply_update(optimizer, params, opt_state, grads)
    metrics |= {"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate,
                "skipped": skipped}
    return (params, opt_state), metrics

  rng, order = minibatch_order(config, state.rng, k)
  (params, opt_state), per_update = jax.lax.scan(update, (state.params, state.opt_state), order)
  skipped = per_update.pop("skipped").sum()
  metrics = {key: value.mean() for key, value in per_update.items()}
  metrics["learning_rate"] = per_update["learning_rate"][-1]
  metrics |= _batch_metrics(config, state, batch, advantages)
  new_state = state.replace(
      params=params, opt_state=opt_state, step=state.step + 1, rng=rng,
      policy_version=state.policy_version + 1, skipped_updates=state.skipped_updates + skipped)
  metrics |= {"skipped_updates": skipped.astype(jnp.float32),
              "skipped_updates_total": new_state.skipped_updates.astype(jnp.float32),
              "policy_version": new_state.policy_version.astype(jnp.float32)}
  return new_state, metrics


def batch_shardings(mesh: Mesh, rules: Rules, config: BatchConfig) -> Batch:
  """NamedShardings of a packed batch: rows and sequence slots split over the batch mesh axes.

  Only the row axis (R) is split, so the shardings hold for any micro-batch count.
  """
  def one(names):  # every field is [K, M, R, ...]: only the row axis is ever split
    return named_sharding(names, rules, mesh, (1, 1, config.rows) + (1,) * (len(names) - 3))

  return jax.tree.map(one, BATCH_AXES, is_leaf=lambda x: isinstance(x, tuple))


def make_train_step(graphdef: nnx.GraphDef, config: TrainConfig, mesh: Mesh,
                    state_shardings: TrainState, batch_sharding: Batch,
                    ref_shardings: Any = None):
  """`train_step` jitted with explicit in/out shardings and the state donated.

  Returns `step(state, batch, ref_params) -> (state, metrics)`; pass `ref_params=None` without KL.
  """
  step = functools.partial(train_step, graphdef, config)
  return jax.jit(step, in_shardings=(state_shardings, batch_sharding, ref_shardings),
                 out_shardings=(state_shardings, replicated(mesh)), donate_argnums=0)
