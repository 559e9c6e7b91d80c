"""Per-token log-probs and entropy of target tokens, without materialising `[B, T, V]` at once.

RL losses need log pi(y_t | y_<t) for the sampled tokens only. The vocabulary projection is applied
chunk by chunk over the sequence, so at most one `[B, C, V]` block of logits is alive at a time.

The head has a hand-written VJP (`jax.custom_vjp`) because automatic differentiation of it is both
wasteful and slow on CPU: it keeps (or, under `jax.checkpoint`, recomputes and then differentiates)
the whole log-softmax chain, and the transpose of `take_along_axis` is a scatter into a zero
`[N, V]` buffer. The forward here stores only the hidden states and per-token log-sum-exp and
entropy; the backward recomputes each chunk's logits once and forms the logit gradient directly:

  d logp_t / d z_tv = onehot(y_t)_v - p_tv
  d H_t    / d z_tv = -p_tv (log p_tv + H_t)

with `z = h @ W / temperature`, `p = softmax(z)`, `H = -sum_v p log p`; the chain rule through the
temperature and the two matmuls gives the gradients of `hidden` and `unembedding`. A cotangent that
is symbolically zero (the entropy when no entropy bonus is used, or an input not being
differentiated) costs nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero


def token_logprobs(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *,
                   temperature: float = 1.0, chunk_size: int = 128
                   ) -> tuple[jax.Array, jax.Array]:
  """Returns (logp `[B, T]`, entropy `[B, T]`) of `targets` under `log_softmax(h @ W / temperature)`.

  `hidden` `[B, T, D]`, `unembedding` `[D, V]`, `targets` `[B, T]` int. `temperature` must match the
  rollout engine's for the log-probs to be comparable with its behaviour log-probs. Both outputs are
  differentiable with respect to `hidden` and `unembedding` (entropy for an entropy bonus).
  """
  b, t, d = hidden.shape
  chunk = max(1, min(chunk_size, t))
  pad = (-t) % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  h_chunks = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, C, D]
  y_chunks = targets.reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, C]
  logp, entropy = _chunked_head(float(temperature), h_chunks, unembedding, y_chunks)
  unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp), unchunk(entropy)


def _scaled_logits(h: jax.Array, w: jax.Array, temperature: float) -> jax.Array:
  """`[B, C, V]` float32 logits of one chunk, divided by the sampling temperature."""
  return jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32) / temperature


def _chunk_forward(temperature, w, h, y):
  """(logp, entropy, lse) `[B, C]` of one chunk, from one pass over its logits."""
  z = _scaled_logits(h, w, temperature)
  z_max = z.max(axis=-1, keepdims=True)
  shifted = z - z_max  # <= 0: exp cannot overflow
  e = jnp.exp(shifted)
  total = e.sum(axis=-1)
  log_total = jnp.log(total)
  lse = z_max[..., 0] + log_total
  target = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
  # H = lse - sum_v p z = log(total) - sum_v p (z - max): relative to the max, no cancellation.
  entropy = log_total - (e * shifted).sum(axis=-1) / total
  return target - lse, entropy, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_head(temperature, h_chunks, w, y_chunks):
  """(logp, entropy) `[n, B, C]` of chunked hidden states `[n, B, C, D]` and targets `[n, B, C]`."""
  logp, entropy, _ = jax.lax.map(lambda hy: _chunk_forward(temperature, w, *hy),
                                 (h_chunks, y_chunks))
  return logp, entropy


def _head_fwd(temperature, h_chunks, w, y_chunks):
  h, wv, y = h_chunks.value, w.value, y_chunks.value
  logp, entropy, lse = jax.lax.map(lambda hy: _chunk_forward(temperature, wv, *hy), (h, y))
  # The `perturbed` flags are Python bools: custom_vjp keeps non-array residuals static, so the
  # backward skips the gradient of an input nobody differentiates at trace time.
  residuals = (h, wv, y, lse, entropy, h_chunks.perturbed, w.perturbed)
  return (logp, entropy), residuals


def _head_bwd(temperature, residuals, cotangents):
  h_chunks, w, y_chunks, lse, entropy, h_perturbed, w_perturbed = residuals
  g_logp, g_entropy = (None if isinstance(g, SymbolicZero) else g for g in cotangents)
  if g_logp is None and g_entropy is None:
    return None, None, None

  def logits_cotangent(h, y, lse_c, entropy_c, g_logp_c, g_entropy_c):
    """d loss / d (h @ W) `[B, C, V]` of one chunk, recomputing its logits."""
    z = _scaled_logits(h, w, temperature)
    log_p = z - lse_c[..., None]
    p = jnp.exp(log_p)
    dz = 0.0
    if g_logp_c is not None:
      # The one-hot is an iota comparison fused into this elementwise pass: no scatter.
      onehot = jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == y[..., None]
      dz = g_logp_c[..., None] * (onehot.astype(z.dtype) - p)
    if g_entropy_c is not None:
      dz = dz - g_entropy_c[..., None] * p * (log_p + entropy_c[..., None])
    return dz / temperature

  def body(dw, xs):
    h, y, lse_c, entropy_c, g_logp_c, g_entropy_c = xs
    dz = logits_cotangent(h, y, lse_c, entropy_c, g_logp_c, g_entropy_c)
    dh = None
    if h_perturbed:
      dh = jnp.einsum("bcv,dv->bcd", dz.astype(w.dtype), w,
                      preferred_element_type=jnp.float32).astype(h.dtype)
    if w_perturbed:
      dw = dw + jnp.einsum("bcd,bcv->dv", h, dz.astype(h.dtype),
                           preferred_element_type=jnp.float32)
    return dw, dh

  dw0 = jnp.zeros(w.shape, jnp.float32) if w_perturbed else None
  dw, dh = jax.lax.scan(body, dw0, (h_chunks, y_chunks, lse, entropy, g_logp, g_entropy))
  return dh, (None if dw is None else dw.astype(w.dtype)), None


_chunked_head.defvjp(_head_fwd, _head_bwd, symbolic_zeros=True)
