"""The decode slots' KV cache: one `[B, K, S, H]` array per layer, written row by row in place.

Why not the model's `KVCache` (`[L, B, S, K, H]`, written with a scatter): on XLA:CPU that scatter
becomes a loop fusion that rewrites the whole 5-D buffer for every layer of every decode step, and
reading a layer back costs a transposing copy for attention; together they made decode time grow
~3x from S=64 to S=544. Here each layer is its own buffer, each row's new token is a
`dynamic_update_slice` (in place on a donated buffer), and the layout `[B, K, S, H]` is the one the
attention dot wants, so the `[B, S, K, H]` view the decoder reads folds into it.

`SlotCache` follows the cache protocol `Decoder.extend` uses (`write`, `k[layer]`, `v[layer]`,
`lengths`, `max_length`, `replace`); it only supports one new token per row (decode). Prefill runs on a
fresh model `KVCache` and is copied in with `insert_prefill`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from flashrl_jax.model import KVCache


class _LayerView:
  """`view[layer]` is that layer's cache as `[B, S, K, H]`; the transpose folds into the attention
  dot, which then reads the buffer in its physical layout."""

  def __init__(self, layers: tuple[jax.Array, ...], axes: tuple[int, ...]):
    self._layers, self._axes = layers, axes

  def __getitem__(self, layer: int) -> jax.Array:
    return jnp.transpose(self._layers[layer], self._axes)


# Keys are stored `[B, K, S, H]` (q.k contracts H, the minor axis); values `[B, K, H, S]` (p.v
# contracts S, now the minor axis). In `[B, S, K, H]` order a layout is `transpose(_TO_BSKH)`.
_K_TO_BSKH = (0, 2, 1, 3)
_V_TO_BSKH = (0, 3, 1, 2)
_K_FROM_KH = (1, 0, 2)  # one row's [T, K, H] -> [K, T, H]
_V_FROM_KH = (1, 2, 0)  # one row's [T, K, H] -> [K, H, T]


def _write_row(buf: jax.Array, row: int, update: jax.Array, index: tuple,
               keep_old: jax.Array) -> jax.Array:
  """Writes `update` (one row, buffer layout minus B) at `(row, *index)` unless `keep_old`."""
  index = (row, *index)
  old = jax.lax.dynamic_slice(buf, index, (1, *update.shape))
  new = jnp.where(keep_old, old, update[None].astype(buf.dtype))
  return jax.lax.dynamic_update_slice(buf, new, index)


@struct.dataclass
class SlotCache:
  ks: tuple[jax.Array, ...]  # L x [B, K, S, H]
  vs: tuple[jax.Array, ...]  # L x [B, K, H, S]
  lengths: jax.Array  # [B] int32

  @classmethod
  def zeros(cls, *, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int,
            head_dim: int, dtype, place=lambda x: x) -> "SlotCache":
    zeros = lambda shape: tuple(place(jnp.zeros(shape, dtype)) for _ in range(num_layers))
    return cls(ks=zeros((batch_size, num_kv_heads, max_length, head_dim)),
               vs=zeros((batch_size, num_kv_heads, head_dim, max_length)),
               lengths=place(jnp.zeros((batch_size,), jnp.int32)))

  @property
  def max_length(self) -> int:
    return self.ks[0].shape[2]

  @property
  def k(self) -> _LayerView:
    return _LayerView(self.ks, _K_TO_BSKH)

  @property
  def v(self) -> _LayerView:
    return _LayerView(self.vs, _V_TO_BSKH)

  def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
            valid: jax.Array) -> "SlotCache":
    """Writes one token per row (`k_new` `[B, 1, K, H]` at `positions` `[B, 1]`) where `valid`."""
    if k_new.shape[1] != 1:
      raise ValueError("SlotCache.write takes one token per row; prefill into a KVCache.")
    k, v = self.ks[layer], self.vs[layer]
    for b in range(k_new.shape[0]):
      skip, at = ~valid[b, 0], positions[b, 0]
      k = _write_row(k, b, jnp.transpose(k_new[b], _K_FROM_KH), (0, at, 0), skip)
      v = _write_row(v, b, jnp.transpose(v_new[b], _V_FROM_KH), (0, 0, at), skip)
    ks, vs = list(self.ks), list(self.vs)
    ks[layer], vs[layer] = k, v
    return self.replace(ks=tuple(ks), vs=tuple(vs))

  def insert_prefill(self, fresh: KVCache, slots: jax.Array) -> "SlotCache":
    """Copies row i of `fresh` (`[L, G, T, K, H]`, T <= S) to row `slots[i]`; slots >= B are dropped."""
    b = self.lengths.shape[0]
    ks, vs = list(self.ks), list(self.vs)
    for i in range(fresh.k.shape[1]):
      slot = slots[i]
      dropped = slot >= b
      row = jnp.minimum(slot, b - 1)
      for layer in range(len(ks)):
        k_row = jnp.transpose(fresh.k[layer, i], _K_FROM_KH)
        v_row = jnp.transpose(fresh.v[layer, i], _V_FROM_KH)
        ks[layer] = _write_row(ks[layer], row, k_row, (0, 0, 0), dropped)
        vs[layer] = _write_row(vs[layer], row, v_row, (0, 0, 0), dropped)
    lengths = self.lengths.at[slots].set(fresh.lengths, mode="drop")
    return SlotCache(ks=tuple(ks), vs=tuple(vs), lengths=lengths)

  # --- decoding on the first rows only -------------------------------------------------------------
  # When few requests are left (the tail of a long-tail batch), they are packed into the first rows
  # and decode runs on that prefix: attention and the sampler then cost O(prefix), not O(slots).

  def prefix(self, n: int) -> "SlotCache":
    return SlotCache(ks=tuple(k[:n] for k in self.ks), vs=tuple(v[:n] for v in self.vs),
                     lengths=self.lengths[:n])

  def with_prefix(self, part: "SlotCache") -> "SlotCache":
    """This cache with its first rows replaced by `part` (in place on a donated buffer)."""
    return SlotCache(ks=tuple(map(write_prefix, self.ks, part.ks)),
                     vs=tuple(map(write_prefix, self.vs, part.vs)),
                     lengths=write_prefix(self.lengths, part.lengths))

  def move_row(self, src: jax.Array, dst: jax.Array) -> "SlotCache":
    """Copies row `src` (its KV and length) to row `dst`."""
    def move(buf):
      row = jax.lax.dynamic_slice_in_dim(buf, src, 1, axis=0)
      return jax.lax.dynamic_update_slice_in_dim(buf, row, dst, axis=0)
    return SlotCache(ks=tuple(map(move, self.ks)), vs=tuple(map(move, self.vs)),
                     lengths=move(self.lengths))


def write_prefix(full: jax.Array, part: jax.Array) -> jax.Array:
  """`full` with its first `len(part)` rows replaced by `part` (in place on a donated buffer)."""
  return jax.lax.dynamic_update_slice(full, part, (0,) * full.ndim)
