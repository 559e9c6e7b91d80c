"""Decoder building blocks: RMSNorm, grouped-query attention, SwiGLU MLP, and one decoder layer.

Every parameter carries logical axis names in its `out_sharding` metadata (`embed`, `heads`,
`kv_heads`, `head_dim`, `mlp`, `vocab`); nothing here knows about a mesh. Eager sharding is off so a
model can be built anywhere; the trainer and the rollout engine map the names to a mesh with their
own rules tables. Activations are annotated through `shard`, a callable the owner supplies (identity by
default), so layers never read an ambient mesh.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flashrl_jax.model._cache import KVCache
from flashrl_jax.model._packed import BandMask, CausalBlocks, band_layout, query_layout
from flashrl_jax.model._rope import apply_rope

ShardFn = Callable[[jax.Array, Sequence[str | None]], jax.Array]


def no_shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  del names
  return x


def param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  """A parameter annotated with logical axis names (no eager placement)."""
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(names),
                   eager_sharding=False)


_normal = jax.nn.initializers.normal(0.02)


def dense(x: jax.Array, kernel: jax.Array, num_in: int = 1) -> jax.Array:
  """`x` `[B, T, *I]` times `kernel` `[*I, *O]` -> `[B, T, *O]`, as one 2-D matmul over all tokens.

  Why not `einsum("btd,df->btf")`: its kernel gradient contracts over two axes (batch, length),
  which XLA:CPU lowers with transposed copies of the `[B*T, F]` activations; the 2-D form measured
  1.5x faster for the SwiGLU MLP forward+backward (hidden 256, 4x256 tokens), same numbers.
  """
  lead, ins, outs = x.shape[:x.ndim - num_in], kernel.shape[:num_in], kernel.shape[num_in:]
  y = x.reshape(-1, math.prod(ins)) @ kernel.reshape(math.prod(ins), math.prod(outs))
  return y.reshape(*lead, *outs)


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32, scaled after casting back (HF's order of operations)."""

  def __init__(self, dim: int, eps: float, *, name: str, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, jax.nn.initializers.ones, (dim,), (name,), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                      num_kv_heads: int, dtype) -> jax.Array:
  """Masked softmax attention with grouped KV heads: `q` `[B,T,N,H]`, `k`/`v` `[B,S,K,H]`,
  `mask` `[B,T,S]` -> `[B,T,N,H]`.

  Laid out for XLA:CPU, where this form measured 2x faster forward+backward (and ~8x faster
  forward) than the textbook einsums on a packed [16, 256] training batch: both matmuls are plain
  batched `[B, K]` products over `(G*T, H)` rows (no transposed dot outputs); the mask is an
  additive bias (a `where` fused into the dot made XLA emit a naive loop); and the softmax is
  normalised after the `probs @ v` product, dividing `[.., H]` instead of `[.., S]`. The shift is
  the row max without gradient (softmax is shift-invariant). A finite floor (not -inf) keeps
  fully-masked padding rows finite (uniform) instead of NaN.
  """
  b, t, n, h = q.shape
  groups = n // num_kv_heads
  scale = np.float32(1.0 / np.sqrt(h))
  q = (q * scale.astype(q.dtype)).reshape(b, t, num_kv_heads, groups, h)
  q = q.transpose(0, 2, 3, 1, 4).reshape(b, num_kv_heads, groups * t, h)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
  scores = jnp.einsum("bkqh,bksh->bkqs", q, k, preferred_element_type=jnp.float32)
  bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None]  # [B, 1, 1, T, S]
  scores = scores.reshape(b, num_kv_heads, groups, t, -1) + bias
  weights = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  out = jnp.einsum("bkqs,bksh->bkqh", weights.reshape(b, num_kv_heads, groups * t, -1).astype(dtype),
                   v, preferred_element_type=jnp.float32).reshape(b, num_kv_heads, groups, t, h)
  out = out / weights.sum(-1, keepdims=True)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(dtype)


class Attention(nnx.Module):
  """Grouped-query attention with RoPE, optional qkv bias (Qwen2) and per-head q/k norm (Qwen3)."""

  def __init__(self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
               qkv_bias: bool, qk_norm: bool, eps: float, inv_freq: np.ndarray, param_dtype,
               dtype, shard: ShardFn, rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.dtype, self.shard = dtype, shard
    self.inv_freq = tuple(float(f) for f in inv_freq)  # static, hashable
    p = lambda shape, names, init=_normal: param(rngs, init, shape, names, param_dtype)
    self.q_proj = p((hidden, num_heads, head_dim), ("embed", "heads", "head_dim"))
    self.k_proj = p((hidden, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))
    self.v_proj = p((hidden, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))
    self.o_proj = p((num_heads, head_dim, hidden), ("heads", "head_dim", "embed"))
    zeros = jax.nn.initializers.zeros
    self.q_bias = p((num_heads, head_dim), ("heads", "head_dim"), zeros) if qkv_bias else None
    self.k_bias = p((num_kv_heads, head_dim), ("kv_heads", "head_dim"), zeros) if qkv_bias else None
    self.v_bias = p((num_kv_heads, head_dim), ("kv_heads", "head_dim"), zeros) if qkv_bias else None
    norm = lambda: RMSNorm(head_dim, eps, name="head_dim", param_dtype=param_dtype, rngs=rngs)
    self.q_norm = norm() if qk_norm else None
    self.k_norm = norm() if qk_norm else None

  def _project(self, x, kernel, bias):
    y = dense(x, kernel[...].astype(self.dtype))  # [B, T, D] @ [D, N, H] -> [B, T, N, H]
    return y if bias is None else y + bias[...].astype(self.dtype)

  def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array,
               cache: KVCache | None = None, layer: int = 0,
               valid: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    """`x` `[B,T,D]`, `positions` `[B,T]`, `mask` `[B,T,S]` over keys (S = T, or the cache length),
    or, for packed training rows without a cache, a `BandMask` or `CausalBlocks` (`_packed.py`)."""
    q = self._project(x, self.q_proj, self.q_bias)
    k = self._project(x, self.k_proj, self.k_bias)
    v = self._project(x, self.v_proj, self.v_bias)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = np.asarray(self.inv_freq, np.float32)
    q = self.shard(apply_rope(q, positions, inv_freq), ("batch", "length", "heads", "head_dim"))
    k = self.shard(apply_rope(k, positions, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
    if cache is not None:
      cache = cache.write(layer, k, v, positions, valid)
    if cache is not None and hasattr(cache, "attend"):
      # A cache laid out for it attends itself (the rollout engine's decode view: row by row,
      # without first gathering the rows it needs into one array).
      out = cache.attend(layer, q, mask, self.num_kv_heads, self.dtype)
    elif isinstance(mask, BandMask):  # packed training rows: each query chunk over its band
      w = mask.width
      out = grouped_attention(query_layout(q, w), band_layout(k, w), band_layout(v, w), mask.mask,
                              self.num_kv_heads, self.dtype).reshape(q.shape)
    elif isinstance(mask, CausalBlocks):
      w = mask.width
      out = jnp.concatenate([
          grouped_attention(q[:, i:i + w], k[:, :i + w], v[:, :i + w], mask.mask[:, i:i + w, :i + w],
                            self.num_kv_heads, self.dtype) for i in range(0, q.shape[1], w)], axis=1)
    else:
      if cache is not None:
        k, v = cache.k[layer].astype(self.dtype), cache.v[layer].astype(self.dtype)
      out = grouped_attention(q, k, v, mask, self.num_kv_heads, self.dtype)
    out = dense(out, self.o_proj[...].astype(self.dtype), num_in=2)  # [B,T,N,H] @ [N,H,D]
    return self.shard(out, ("batch", "length", "embed")), cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, hidden: int, intermediate: int, *, param_dtype, dtype, shard: ShardFn,
               rngs: nnx.Rngs):
    self.dtype, self.shard = dtype, shard
    self.gate_proj = param(rngs, _normal, (hidden, intermediate), ("embed", "mlp"), param_dtype)
    self.up_proj = param(rngs, _normal, (hidden, intermediate), ("embed", "mlp"), param_dtype)
    self.down_proj = param(rngs, _normal, (intermediate, hidden), ("mlp", "embed"), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate = dense(x, self.gate_proj[...].astype(self.dtype))  # [B, T, F]
    up = dense(x, self.up_proj[...].astype(self.dtype))
    h = self.shard(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return dense(h, self.down_proj[...].astype(self.dtype))


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, *, attention: Attention, mlp: MLP, hidden: int, eps: float, param_dtype,
               rngs: nnx.Rngs):
    self.input_norm = RMSNorm(hidden, eps, name="embed", param_dtype=param_dtype, rngs=rngs)
    self.attn = attention
    self.post_attn_norm = RMSNorm(hidden, eps, name="embed", param_dtype=param_dtype, rngs=rngs)
    self.mlp = mlp

  def __call__(self, x, positions, mask, cache=None, layer=0, valid=None):
    attn_out, cache = self.attn(self.input_norm(x), positions, mask, cache, layer, valid)
    x = x + attn_out
    x = x + self.mlp(self.post_attn_norm(x))
    return x, cache
