"""The decoder LM: one Flax NNX module for Qwen3, Qwen2/2.5 and Llama 3 layouts.

Three entry points share the same layers:
- `__call__(input_ids, positions=None, segment_ids=None)` -> logits, for training and parity tests;
  with `segment_ids` several sequences are packed in one row and attend only within themselves;
- `hidden_states(...)` -> final normed hidden states, for chunked log-probs (`token_logprobs`) that
  never build the full `[B, T, V]` log-softmax;
- `extend(tokens, num_new, cache)` -> (hidden, cache): appends up to T tokens per row to an explicit
  KV cache at each row's own position; prefill is extend on an empty cache, decode is extend with T=1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flashrl_jax.model._cache import KVCache
from flashrl_jax.model._config import ModelConfig
from flashrl_jax.model._layers import (MLP, Attention, DecoderLayer, RMSNorm, ShardFn, no_shard,
                                       param)
from flashrl_jax.model._packed import packed_attention_mask
from flashrl_jax.model._rope import inverse_frequencies


class Decoder(nnx.Module):
  """A causal decoder LM. `param_dtype` stores the weights, `dtype` is the compute dtype."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
               dtype=jnp.float32, shard: ShardFn = no_shard):
    self.config, self.dtype, self.shard = config, dtype, shard
    c = config
    inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    self.embed = param(rngs, jax.nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                       ("vocab", "embed"), param_dtype)
    layers = []
    for _ in range(c.num_layers):
      attention = Attention(
          hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
          head_dim=c.head_dim, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, eps=c.rms_norm_eps,
          inv_freq=inv_freq, param_dtype=param_dtype, dtype=dtype, shard=shard, rngs=rngs)
      mlp = MLP(c.hidden_size, c.intermediate_size, param_dtype=param_dtype, dtype=dtype,
                shard=shard, rngs=rngs)
      layers.append(DecoderLayer(attention=attention, mlp=mlp, hidden=c.hidden_size,
                                 eps=c.rms_norm_eps, param_dtype=param_dtype, rngs=rngs))
    self.layers = nnx.List(layers)
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, name="embed",
                              param_dtype=param_dtype, rngs=rngs)
    self.lm_head = None if c.tie_word_embeddings else param(
        rngs, jax.nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size), ("embed", "vocab"),
        param_dtype)

  # --- pieces -------------------------------------------------------------------------------------

  def unembedding(self) -> jax.Array:
    """The `[D, V]` output projection (the transposed embedding when tied)."""
    w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return w.astype(self.dtype)

  def logits(self, hidden: jax.Array) -> jax.Array:
    return jnp.einsum("...d,dv->...v", hidden, self.unembedding(),
                      preferred_element_type=jnp.float32)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
    return self.shard(x, ("batch", "length", "embed"))

  def _run_layers(self, x, positions, mask, cache=None, valid=None):
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, positions, mask, cache, i, valid)
    return self.final_norm(x), cache

  # --- full-sequence forward ----------------------------------------------------------------------

  def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, band_width: int | None = None
                    ) -> jax.Array:
    """Final normed hidden states `[B, T, D]`.

    `segment_ids` `[B, T]` (0 = padding) packs several sequences in a row: a token attends to earlier
    tokens of its own segment only. `positions` are per-segment RoPE positions (default 0..T-1).
    `band_width` (packed rows only) attends each `band_width`-token chunk of a row over itself and
    the chunk before: exact only when no sequence is longer than `band_width + 1` tokens, which
    `flashrl_jax.model.by_band` checks on device before choosing it.
    """
    b, t = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    else:
      mask = packed_attention_mask(segment_ids, band_width)
    hidden, _ = self._run_layers(self._embed(input_ids), positions, mask)
    return hidden

  def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Logits `[B, T, V]` in float32."""
    return self.logits(self.hidden_states(input_ids, positions, segment_ids))

  # --- cached forward -----------------------------------------------------------------------------

  def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
    c = self.config
    return KVCache.zeros(num_layers=c.num_layers, batch_size=batch_size, max_length=max_length,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                         dtype=dtype or self.dtype)

  def extend(self, tokens: jax.Array, num_new: jax.Array,
             cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Appends `tokens[b, :num_new[b]]` to row b of `cache`; returns hidden `[B, T, D]` and the cache.

    Token t of row b sits at position `cache.lengths[b] + t` and attends to every cached position up to
    its own. Hidden states at t >= num_new[b] are meaningless. The caller keeps
    `cache.lengths + num_new <= cache.max_length`.
    """
    b, t = tokens.shape
    offsets = jnp.arange(t, dtype=jnp.int32)[None]
    positions = cache.lengths[:, None] + offsets  # [B, T]
    valid = offsets < num_new[:, None]
    key_index = jnp.arange(cache.max_length, dtype=jnp.int32)[None, None]
    mask = key_index <= positions[:, :, None]  # [B, T, S]
    hidden, cache = self._run_layers(self._embed(tokens), positions, mask, cache, valid)
    return hidden, cache.replace(lengths=cache.lengths + num_new.astype(jnp.int32))
