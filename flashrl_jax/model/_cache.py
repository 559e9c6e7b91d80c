"""The KV cache: an explicit pytree passed into and returned from every cached forward.

`k`/`v` are `[layers, batch, max_len, kv_heads, head_dim]`; `lengths[b]` counts the valid positions of
row `b` (rows advance independently, which is what continuous batching needs). Positions at or beyond
`lengths[b]` hold garbage that attention masks out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, H]
  v: jax.Array  # [L, B, S, K, H]
  lengths: jax.Array  # [B] int32

  @property
  def max_length(self) -> int:
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @classmethod
  def zeros(cls, *, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int,
            head_dim: int, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch_size, max_length, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch_size,), jnp.int32))

  def insert(self, row: jax.Array | int, other: "KVCache", other_row: int = 0) -> "KVCache":
    """Copies row `other_row` of `other` (same L, S, K, H) into row `row` of this cache."""
    k = jax.lax.dynamic_update_index_in_dim(self.k, other.k[:, other_row], row, axis=1)
    v = jax.lax.dynamic_update_index_in_dim(self.v, other.v[:, other_row], row, axis=1)
    lengths = self.lengths.at[row].set(other.lengths[other_row])
    return KVCache(k=k, v=v, lengths=lengths)

  def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
            valid: jax.Array) -> "KVCache":
    """Writes `[B, T, K, H]` keys/values of one layer at `positions` `[B, T]` where `valid`."""
    batch = jnp.arange(k_new.shape[0])[:, None]
    # Invalid (padding) tokens are sent out of bounds and dropped, so they never clobber the cache.
    pos = jnp.where(valid, positions, self.max_length)
    k = self.k.at[layer, batch, pos].set(k_new.astype(self.k.dtype), mode="drop")
    v = self.v.at[layer, batch, pos].set(v_new.astype(self.v.dtype), mode="drop")
    return self.replace(k=k, v=v)
