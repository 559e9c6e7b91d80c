"""One minibatch: log-probs of packed micro-batches, the configured loss, and gradient accumulation.

Why separate from the RL step: this is the part that must be *exactly* the full-batch computation
whatever the packing and the micro-batch split, and the part the packing/accumulation tests pin.
Each micro-batch's loss is weighted by its share of the minibatch's aggregation denominator (tokens
for token-mean, non-empty sequences for the sequence-mean modes), so the accumulated loss and
gradient equal those of one big batch with the same aggregation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flashrl_jax.losses import Aggregation, LossName, compute_policy_loss
from flashrl_jax.model import Decoder, by_band, token_logprobs
from flashrl_jax.trainer._batch import Batch
from flashrl_jax.trainer._config import TrainConfig


class LossInputs(NamedTuple):
  """What the loss needs beyond the packed tokens, per sequence slot; `[..., R, S, L]` arrays."""

  advantages: jax.Array
  prox_logp: jax.Array | None = None
  ref_logp: jax.Array | None = None


def sequence_logprobs(model: Decoder, micro: Batch, config: TrainConfig, *,
                      project_slots: bool | None = None, band_width: int | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """(logp, entropy) `[R, S, L]` of each slot's response tokens, from one packed micro-batch.

  The `[D, V]` vocabulary projection runs on whichever is smaller (`project_slots=None`): the
  `R*S*L` response slots (gather hidden states first: prompt and padding positions never pay for
  it, the win with a large vocabulary and long prompts) or the `R*T` packed positions (project
  every token, then gather the scalar log-probs: the win when many short sequences share a row,
  where `S*L` can be 10x `T`). Both give the same numbers; the choice is static (batch shapes).
  `band_width`: see `Decoder.hidden_states` (callers choose it with `by_band`).
  """
  hidden = model.hidden_states(micro.input_ids, micro.positions, micro.segment_ids,
                               band_width)  # [R, T, D]
  rows, slots, width = micro.token_index.shape
  if project_slots is None:
    project_slots = slots * width <= micro.input_ids.shape[1]
  take = jax.vmap(lambda x, index: x[index])  # row r: x[r][index[r]]
  head = lambda h, y: token_logprobs(h, model.unembedding(), y, temperature=config.temperature,
                                     chunk_size=config.logprob_chunk_size)
  if project_slots:
    logp, entropy = head(take(hidden, micro.token_index).reshape(rows * slots, width, -1),
                         take(micro.targets, micro.token_index).reshape(rows * slots, width))
    return logp.reshape(rows, slots, width), entropy.reshape(rows, slots, width)
  logp, entropy = head(hidden, micro.targets)  # [R, T]
  flat_index = micro.token_index.reshape(rows, slots * width)
  return (take(logp, flat_index).reshape(rows, slots, width),
          take(entropy, flat_index).reshape(rows, slots, width))


def micro_batch_loss(params: nnx.State, graphdef: nnx.GraphDef, config: TrainConfig, micro: Batch,
                     inputs: LossInputs, band_width: int | None = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The configured policy loss of one micro-batch (its own aggregation, unweighted)."""
  model = nnx.merge(graphdef, params)
  logp, entropy = sequence_logprobs(model, micro, config, band_width=band_width)
  flat = lambda x: None if x is None else x.reshape(-1, *x.shape[2:])  # [R, S, ...] -> [R*S, ...]
  return compute_policy_loss(
      config.loss, logp=flat(logp), behavior_logp=flat(micro.behavior_logp),
      advantages=flat(inputs.advantages), mask=flat(micro.loss_mask),
      prox_logp=flat(inputs.prox_logp), ref_logp=flat(inputs.ref_logp),
      positive=flat(micro.rewards > 0) if config.loss.name is LossName.TOPR else None,
      entropy=flat(entropy))


def micro_batch_weights(loss_mask: jax.Array, aggregation: Aggregation) -> jax.Array:
  """`[M]` weights summing to 1 (0 for empty micro-batches) from a minibatch's `[M, R, S, L]` mask.

  Each is the micro-batch's share of the aggregation's denominator: tokens for token-mean,
  non-empty sequences for the sequence-mean modes.
  """
  m = loss_mask.shape[0]
  if aggregation is Aggregation.TOKEN_MEAN:
    counts = loss_mask.reshape(m, -1).sum(-1)
  else:
    counts = loss_mask.any(-1).reshape(m, -1).sum(-1)
  counts = counts.astype(jnp.float32)
  return counts / jnp.maximum(counts.sum(), 1.0)


_COUNTS = ("nonfinite_tokens", "tokens")


def combine_metrics(metrics: dict[str, jax.Array], loss_mask: jax.Array,
                    aggregation: Aggregation) -> dict[str, jax.Array]:
  """Per-micro-batch metrics `[M]` -> minibatch scalars, as if computed on the whole minibatch.

  Counts add, extremes reduce over non-empty micro-batches, aggregated loss terms weigh by the
  aggregation's shares, `seq_*` means by sequence shares and every other (token) mean by token shares.
  """
  by_tokens = micro_batch_weights(loss_mask, Aggregation.TOKEN_MEAN)
  by_rows = micro_batch_weights(loss_mask, Aggregation.SEQ_MEAN_TOKEN_MEAN)
  by_loss = micro_batch_weights(loss_mask, aggregation)
  nonempty = by_tokens > 0
  out = {}
  for key, value in metrics.items():
    if key in _COUNTS:
      out[key] = value.sum()
    elif key.endswith(("_max", "_min")):
      sign = 1.0 if key.endswith("_max") else -1.0
      extreme = sign * jnp.where(nonempty, sign * value, -jnp.inf).max()
      out[key] = jnp.where(nonempty.any(), extreme, 0.0)
    elif key.endswith("loss"):
      out[key] = (by_loss * value).sum()
    elif key.startswith("seq_"):
      out[key] = (by_rows * value).sum()
    else:
      out[key] = (by_tokens * value).sum()
  return out


def minibatch_gradients(params: nnx.State, graphdef: nnx.GraphDef, config: TrainConfig,
                        minibatch: Batch, inputs: LossInputs
                        ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
  """(loss, grads, metrics) of one minibatch `[M, ...]`, accumulated over its M micro-batches."""
  weights = micro_batch_weights(minibatch.loss_mask, config.loss.aggregation)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def body(acc, xs):
    micro, micro_inputs, w = xs

    def gradients(band_width):  # forward and backward of the micro-batch in one attention layout
      def weighted_loss(p):
        loss, metrics = micro_batch_loss(p, graphdef, config, micro, micro_inputs, band_width)
        return w * loss, metrics
      return jax.value_and_grad(weighted_loss, has_aux=True)(params)

    (loss, metrics), grads = by_band(gradients, micro.segment_ids)
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    return acc, (loss, metrics)

  grads, (losses, metrics) = jax.lax.scan(body, zeros, (minibatch, inputs, weights))
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return losses.sum(), grads, combine_metrics(metrics, minibatch.loss_mask,
                                              config.loss.aggregation)
