"""The decode slots' KV cache: one buffer per layer indexed by slot, read and written by slot index.

Why this layout: a decode step runs on the live requests only, wherever their slots are. It names
them with an index vector (`rows`, padded to a batch bucket with the spare row), attends row by row
over each one's own span bucket, read in place (the view covers `span` positions, the runner's
whole context, and each row reads the smallest bucket that holds its own context, chosen on the
device), and scatters each new key/value in place on the donated buffer. So the cost of a step
follows the live work, and nothing is moved or copied when the live set changes (the old design
packed live requests into a prefix of the slots, and writing that prefix back copied the whole cache
every step). One scatter per layer: per-row `dynamic_update_slice`s compiled 2-4x slower at 8-32
rows and ran no faster.

Keys are stored `[B+1, K, S, H]` (q.k contracts H, the minor axis) and values `[B+1, K, H, S]` (p.v
contracts S, then the minor axis); row B is a spare that padding rows of a decode batch write to, so
a padded row never needs a guard. Why not the model's `KVCache` (`[L, B, S, K, H]`, all layers in
one buffer): on XLA:CPU a write into it rewrote the whole 5-D buffer for every layer of every step.

`DecodeView` follows the cache protocol `Decoder.extend` uses (`write`, `lengths`, `max_length`,
`replace`) for one new token per row, and computes attention itself (`attend`). Prefill runs on a fresh model
`KVCache` and is copied in with `SlotCache.insert_prefill`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from flashrl_jax.model import KVCache

_K_FROM_KH = (1, 0, 2)  # one row's [T, K, H] -> [K, T, H]
_V_FROM_KH = (1, 2, 0)  # one row's [T, K, H] -> [K, H, T]


@struct.dataclass
class SlotCache:
  ks: tuple[jax.Array, ...]  # L x [B+1, K, S, H]
  vs: tuple[jax.Array, ...]  # L x [B+1, K, H, S]
  lengths: jax.Array  # [B+1] int32: cached positions per slot

  @classmethod
  def zeros(cls, *, num_layers: int, num_slots: int, max_length: int, num_kv_heads: int,
            head_dim: int, dtype, place=lambda x: x) -> "SlotCache":
    rows = num_slots + 1  # + the spare row padding writes to
    zeros = lambda shape: tuple(place(jnp.zeros(shape, dtype)) for _ in range(num_layers))
    return cls(ks=zeros((rows, num_kv_heads, max_length, head_dim)),
               vs=zeros((rows, num_kv_heads, head_dim, max_length)),
               lengths=place(jnp.zeros((rows,), jnp.int32)))

  @property
  def spare(self) -> int:
    """The row padding writes to (never a request's)."""
    return self.lengths.shape[0] - 1

  def view(self, rows: jax.Array, span: int, row_spans: tuple[int, ...] = ()) -> "DecodeView":
    """The decode cache of slots `rows` `[b]` over their first `span` positions; each row attends
    over the smallest of `row_spans` (ascending, each <= `span`) that holds its context."""
    spans = tuple(s for s in row_spans if s < span) + (span,)
    lengths = self.lengths[rows]
    # The token being written sits at position `lengths`: a row needs lengths + 1 positions.
    buckets = jnp.searchsorted(jnp.asarray(spans, jnp.int32), lengths + 1)
    buckets = jnp.minimum(buckets, len(spans) - 1)  # padding rows' lengths are junk
    return DecodeView(ks=self.ks, vs=self.vs, rows=rows, lengths=lengths, buckets=buckets,
                      span=span, row_spans=spans)

  def insert_prefill(self, fresh: KVCache, slots: jax.Array) -> "SlotCache":
    """Copies row i of `fresh` (`[L, G, T, K, H]`, T <= S) to slot `slots[i]` (padding: the spare)."""
    ks, vs = list(self.ks), list(self.vs)
    for i in range(fresh.k.shape[1]):
      for layer in range(len(ks)):
        k_row = jnp.transpose(fresh.k[layer, i], _K_FROM_KH)[None].astype(ks[layer].dtype)
        v_row = jnp.transpose(fresh.v[layer, i], _V_FROM_KH)[None].astype(vs[layer].dtype)
        ks[layer] = jax.lax.dynamic_update_slice(ks[layer], k_row, (slots[i], 0, 0, 0))
        vs[layer] = jax.lax.dynamic_update_slice(vs[layer], v_row, (slots[i], 0, 0, 0))
    return SlotCache(ks=tuple(ks), vs=tuple(vs), lengths=self.lengths.at[slots].set(fresh.lengths))


@struct.dataclass
class DecodeView:
  """The slot cache as one decode batch sees it: rows `rows`, positions `[0, span)`."""

  ks: tuple[jax.Array, ...]  # L x [B+1, K, S, H], the whole buffers (written in place)
  vs: tuple[jax.Array, ...]
  rows: jax.Array  # [b] int32 slot of each batch row (padding: the spare row)
  lengths: jax.Array  # [b] int32 cached positions of each batch row
  buckets: jax.Array  # [b] int32 index into `row_spans` of the span each row attends over
  span: int = struct.field(pytree_node=False)
  # Ascending spans a row may attend over, the last `span`: a short request beside a long one reads
  # its own bucket, not the longest row's (hidden 256, 16 live requests, one core: 3.0 ms per step
  # at span 64 against 7.7 at 512).
  row_spans: tuple[int, ...] = struct.field(pytree_node=False)

  @property
  def max_length(self) -> int:
    return self.span

  def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
            valid: jax.Array) -> "DecodeView":
    """Writes one token per row (`k_new` `[b, 1, K, H]` at `positions` `[b, 1]`). Rows not `valid`
    are padding: their slot is the spare row, so they write there unguarded (in any order)."""
    del valid
    if k_new.shape[1] != 1:
      raise ValueError("DecodeView.write takes one token per row; prefill into a KVCache.")
    at = positions[:, 0]
    k = self.ks[layer].at[self.rows, :, at, :].set(k_new[:, 0].astype(self.ks[layer].dtype))
    v = self.vs[layer].at[self.rows, :, :, at].set(v_new[:, 0].astype(self.vs[layer].dtype))
    ks, vs = list(self.ks), list(self.vs)
    ks[layer], vs[layer] = k, v
    return self.replace(ks=tuple(ks), vs=tuple(vs))

  def attend(self, layer: int, q: jax.Array, mask: jax.Array, num_kv_heads: int,
             dtype) -> jax.Array:
    """Attention of one query per row (`q` `[b, 1, N, H]`, `mask` `[b, 1, span]`) over that row's
    cached keys/values, row by row -> `[b, 1, N, H]`. A row reads the first `row_spans` bucket that
    holds its context (its positions past that are masked out anyway, so the result is the same).

    Why a loop over rows: each row's keys are a contiguous block of the slot buffer that the dot
    reads in place, where gathering the rows into one `[b, K, span, H]` array first cost as much
    again as the attention itself (32 rows, span 512: 2.4 vs 1.2 ms per layer). Same arithmetic
    as `grouped_attention` (scaled query, additive finite mask floor, normalised after p.v).
    """
    b, _, n, h = q.shape
    groups = n // num_kv_heads
    scale = np.float32(1.0 / np.sqrt(h))
    q = (q[:, 0] * scale.astype(q.dtype)).reshape(b, num_kv_heads, groups, h)
    bias = jnp.where(mask[:, 0], 0.0, jnp.finfo(jnp.float32).min)  # [b, span]
    keys, values = self.ks[layer], self.vs[layer]

    def over(span, q_row, bias_row, row):
      k = jax.lax.dynamic_slice_in_dim(keys, row, 1, 0)[0, :, :span].astype(dtype)
      v = jax.lax.dynamic_slice_in_dim(values, row, 1, 0)[0, :, :, :span].astype(dtype)
      scores = jnp.einsum("kgh,ksh->kgs", q_row, k, preferred_element_type=jnp.float32)
      scores = scores + bias_row[:span]
      weights = jnp.exp(scores - scores.max(-1, keepdims=True))
      out = jnp.einsum("kgs,khs->kgh", weights.astype(dtype), v,
                       preferred_element_type=jnp.float32)
      return out / weights.sum(-1, keepdims=True)

    branches = [functools.partial(over, span) for span in self.row_spans]

    def one(args):
      q_row, bias_row, row, which = args
      return jax.lax.switch(which, branches, q_row, bias_row, row)

    out = jax.lax.map(one, (q, bias, self.rows, self.buckets))  # [b, K, G, H]
    return out.reshape(b, 1, n, h).astype(dtype)

  def commit(self, cache: SlotCache) -> SlotCache:
    """`cache` with this view's writes and new lengths (the spare row's length is junk)."""
    return SlotCache(ks=self.ks, vs=self.vs, lengths=cache.lengths.at[self.rows].set(self.lengths))
