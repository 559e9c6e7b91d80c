"""Attention over packed training rows that only computes the keys a row's sequences can reach.

Why: a training row packs many sequences (`segment_ids`), and a token attends only to earlier tokens
of its own sequence. The dense form scores every query against all T keys of its row and masks
almost all of them away: on the long-tail benchmark's rows of 384 tokens (2 layers, hidden 64)
attention was ~70% of the jitted train step's time on one core, while most sequences are under 64
tokens. When no sequence in a micro-batch is longer than `width + 1` tokens, every key a query needs
lies in its own `width`-token chunk of the row or the chunk before (a query `o` tokens into its
sequence needs keys back `o <= width` positions), so attention over those `2 * width` keys is exact.
`by_band` picks, per micro-batch and on device, the narrowest band that is exact (a `lax.switch`
over `band_widths`) and falls back to the dense form otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp

# Chunk widths tried narrowest first; a band is only worth it when it covers less than the row.
BAND_WIDTHS = (64, 128)
CAUSAL_BLOCK = 128  # query chunk of the dense fallback

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class BandMask:
  """`mask` `[B * T/width, width, 2 * width]`: query chunk i of a row over key chunks i-1 and i."""

  mask: jax.Array
  width: int


@dataclasses.dataclass(frozen=True)
class CausalBlocks:
  """The dense packed `mask` `[B, T, T]`, attended in query chunks of `width` over the keys up to
  each chunk's end: the chunks above the diagonal are never computed (2/3 of the work at T = 3W)."""

  mask: jax.Array
  width: int


def band_widths(length: int) -> tuple[int, ...]:
  """The `BAND_WIDTHS` that divide a row of `length` tokens and attend over less than all of it."""
  return tuple(w for w in BAND_WIDTHS if length % w == 0 and 2 * w < length)


def packed_mask(segment_ids: jax.Array) -> jax.Array:
  """`[B, T, T]`: causal, within a segment, never to padding (segment 0)."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))[None]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal & same & (segment_ids[:, None, :] != 0)


def packed_attention_mask(segment_ids: jax.Array, band_width: int | None
                          ) -> BandMask | CausalBlocks | jax.Array:
  """How packed rows `[B, T]` attend: over `band_width`-token bands, else the dense mask (in causal
  blocks when the row is several of them long)."""
  if band_width is not None:
    return band_mask(segment_ids, band_width)
  t = segment_ids.shape[1]
  mask = packed_mask(segment_ids)
  return CausalBlocks(mask, CAUSAL_BLOCK) if t % CAUSAL_BLOCK == 0 and t > CAUSAL_BLOCK else mask


def narrowest_band(segment_ids: jax.Array, widths: tuple[int, ...]) -> jax.Array:
  """Index into `widths` of the narrowest exact band for this packing; `len(widths)`: none is.

  A band of `width` is exact when no query looks back more than `width` positions under the packed
  mask (a sequence of at most `width + 1` tokens).
  """
  t = segment_ids.shape[1]
  back = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
  farthest = jnp.max(jnp.where(packed_mask(segment_ids), back, 0))
  return sum((farthest > w).astype(jnp.int32) for w in widths)


def by_band(fn: Callable[[int | None], T], segment_ids: jax.Array) -> T:
  """`fn(band_width)` with the narrowest exact band for `segment_ids` `[B, T]`, else `fn(None)`.

  The choice is made on device per call (a `lax.switch`), so one compiled program serves every
  packing. Put it *around* a gradient, not inside one: differentiating through a switch carries
  every branch's residuals, which measured slower than the dense form alone.
  """
  widths = band_widths(segment_ids.shape[1])
  if not widths:
    return fn(None)
  branches = [functools.partial(fn, w) for w in (*widths, None)]
  return jax.lax.switch(narrowest_band(segment_ids, widths), branches)


def band_mask(segment_ids: jax.Array, width: int) -> BandMask:
  """The packed mask of `segment_ids` `[B, T]` restricted to each query chunk's band."""
  b, t = segment_ids.shape
  chunks = segment_ids.reshape(b, t // width, width)
  previous = jnp.pad(chunks[:, :-1], ((0, 0), (1, 0), (0, 0)))  # segment 0: never attended
  keys = jnp.concatenate([previous, chunks], axis=2)  # [B, C, 2W]
  causal = jnp.arange(2 * width)[None, :] <= jnp.arange(width)[:, None] + width
  mask = causal & (chunks[..., :, None] == keys[..., None, :]) & (keys[..., None, :] != 0)
  return BandMask(mask.reshape(b * (t // width), width, 2 * width), width)


def band_layout(x: jax.Array, width: int) -> jax.Array:
  """Keys/values `[B, T, K, H]` -> `[B * T/width, 2 * width, K, H]`: each chunk after its previous."""
  b, t = x.shape[:2]
  chunks = x.reshape(b, t // width, width, *x.shape[2:])
  previous = jnp.pad(chunks[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (x.ndim - 1))
  return jnp.concatenate([previous, chunks], axis=2).reshape(b * (t // width), 2 * width,
                                                             *x.shape[2:])


def query_layout(x: jax.Array, width: int) -> jax.Array:
  """Queries `[B, T, N, H]` -> `[B * T/width, width, N, H]`."""
  b, t = x.shape[:2]
  return x.reshape(b * (t // width), width, *x.shape[2:])
