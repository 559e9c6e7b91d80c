"""Per-token log-probs and entropy of target tokens, without materialising `[B, T, V]` at once.

RL losses need log pi(y_t | y_<t) for the sampled tokens only. The vocabulary projection is applied
chunk by chunk over the sequence under `jax.checkpoint`, so the forward keeps one `[B, C, V]` block
alive and the backward recomputes it, instead of storing the whole log-softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *,
                   temperature: float = 1.0, chunk_size: int = 128
                   ) -> tuple[jax.Array, jax.Array]:
  """Returns (logp `[B, T]`, entropy `[B, T]`) of `targets` under `log_softmax(h @ W / temperature)`.

  `hidden` `[B, T, D]`, `unembedding` `[D, V]`, `targets` `[B, T]` int. `temperature` must match the
  rollout engine's for the log-probs to be comparable with its behaviour log-probs.
  """
  b, t, d = hidden.shape
  chunk = max(1, min(chunk_size, t))
  pad = (-t) % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  h_chunks = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, C, D]
  y_chunks = targets.reshape(b, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one_chunk(args):
    h, y = args
    logits = jnp.einsum("bcd,dv->bcv", h, unembedding, preferred_element_type=jnp.float32)
    logits = logits / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, entropy

  logp, entropy = jax.lax.map(one_chunk, (h_chunks, y_chunks))
  unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp), unchunk(entropy)
