"""The fused log-prob head (`token_logprobs`): values and gradients against float64 NumPy.

The head has a hand-written VJP, so its gradients are checked here directly: with respect to the
hidden states and the unembedding matrix (also through a tied embedding's transpose), for the
log-prob and the entropy outputs separately and together, over chunk sizes that divide the sequence,
do not divide it, and exceed it, with masked (padding) tokens, and against the previous
autodiff-through-`jax.checkpoint` implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashrl_jax import model as M
from flashrl_jax.testing import tiny_config, tiny_model

B, T, D, V = 3, 13, 8, 40


# --- float64 NumPy reference ---------------------------------------------------------------------

def reference_head(h, w, y, temperature):
  """(logp, entropy, log_softmax) in float64, the naive full-logits way."""
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64) / temperature
  log_sm = z - z.max(-1, keepdims=True)
  log_sm = log_sm - np.log(np.exp(log_sm).sum(-1, keepdims=True))
  logp = np.take_along_axis(log_sm, np.asarray(y)[..., None], -1)[..., 0]
  entropy = -(np.exp(log_sm) * log_sm).sum(-1)
  return logp, entropy, log_sm


def reference_loss(h, w, y, temperature, a, c):
  """sum_t a_t logp_t + c_t H_t: a weighted loss touching both outputs (float64)."""
  logp, entropy, _ = reference_head(h, w, y, temperature)
  return float((a * logp).sum() + (c * entropy).sum())


def reference_grads(h, w, y, temperature, a, c):
  """Analytic float64 gradients of `reference_loss` w.r.t. `h` and `w`."""
  h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
  _, entropy, log_sm = reference_head(h, w, y, temperature)
  p = np.exp(log_sm)
  onehot = np.eye(w.shape[1])[np.asarray(y)]
  dz = a[..., None] * (onehot - p) - c[..., None] * p * (log_sm + entropy[..., None])
  dz /= temperature
  return dz @ w.T, np.einsum("btd,btv->dv", h, dz)


def test_reference_gradients_match_finite_differences():
  """The NumPy reference is itself checked by central differences, so it is independent evidence."""
  rng = np.random.default_rng(0)
  h, w = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 7))
  y, a, c = rng.integers(0, 7, (2, 3)), rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
  dh, dw = reference_grads(h, w, y, 0.7, a, c)
  eps = 1e-6
  for array, grad in ((h, dh), (w, dw)):
    numeric = np.zeros_like(array)
    for index in np.ndindex(array.shape):
      old = array[index]
      array[index] = old + eps
      up = reference_loss(h, w, y, 0.7, a, c)
      array[index] = old - eps
      down = reference_loss(h, w, y, 0.7, a, c)
      array[index] = old
      numeric[index] = (up - down) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


# --- the head vs the reference -------------------------------------------------------------------

def _inputs(seed=1):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = rng.normal(size=(D, V)).astype(np.float32)
  y = rng.integers(0, V, (B, T)).astype(np.int32)
  a, c = rng.normal(size=(B, T)), rng.normal(size=(B, T))
  return h, w, y, a, c


# Chunks of 1 and 13 divide T = 13, 4 and 5 do not (padding), 64 is larger than T.
@pytest.mark.parametrize("chunk,temperature", [(1, 1.0), (4, 0.6), (5, 1.0), (13, 0.6), (64, 1.3)])
def test_values_and_gradients_match_float64_reference(chunk, temperature):
  h, w, y, a, c = _inputs()
  logp, entropy = M.token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y),
                                   temperature=temperature, chunk_size=chunk)
  ref_logp, ref_entropy, _ = reference_head(h, w, y, temperature)
  np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(entropy, ref_entropy, rtol=1e-5, atol=1e-5)

  def loss(h, w, a, c):
    logp, entropy = M.token_logprobs(h, w, jnp.asarray(y), temperature=temperature,
                                     chunk_size=chunk)
    return (a * logp).sum() + (c * entropy).sum()

  # Both outputs carry gradient, then each alone (the other's cotangent is a symbolic zero).
  for weights in ((a, c), (a, 0 * c), (0 * a, c)):
    ref_dh, ref_dw = reference_grads(h, w, y, temperature, *weights)
    a32, c32 = (jnp.asarray(x, jnp.float32) for x in weights)
    if not weights[1].any():
      fn = lambda h, w: (a32 * M.token_logprobs(h, w, jnp.asarray(y), temperature=temperature,
                                                chunk_size=chunk)[0]).sum()
    elif not weights[0].any():
      fn = lambda h, w: (c32 * M.token_logprobs(h, w, jnp.asarray(y), temperature=temperature,
                                                chunk_size=chunk)[1]).sum()
    else:
      fn = lambda h, w: loss(h, w, a32, c32)
    dh, dw = jax.jit(jax.grad(fn, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-5)


def test_masked_tokens_get_no_gradient():
  """Padding positions (mask 0, arbitrary targets) contribute nothing, as in the trainer's losses."""
  h, w, y, a, _ = _inputs(seed=2)
  mask = np.ones((B, T), np.float32)
  mask[0, 9:] = mask[2, :4] = 0.0
  y[0, 9:] = 0  # what packing puts at padding

  def masked_mean_logp(h, w):
    logp, entropy = M.token_logprobs(h, w, jnp.asarray(y), chunk_size=5)
    valid = mask != 0
    return (jnp.where(valid, logp + 0.1 * entropy, 0.0) * a).sum() / mask.sum()

  dh, dw = jax.grad(masked_mean_logp, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
  ref_dh, ref_dw = reference_grads(h, w, y, 1.0, a * mask / mask.sum(), 0.1 * a * mask / mask.sum())
  np.testing.assert_array_equal(np.asarray(dh)[mask == 0], 0.0)
  np.testing.assert_allclose(dh, ref_dh, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-6)


def test_tied_embedding_gradient_flows_through_the_transpose():
  """With tied embeddings the unembedding is `embed.T`: its gradient lands on `embed` transposed."""
  h, w, y, a, c = _inputs(seed=3)
  embed = jnp.asarray(w.T)  # [V, D], as the Decoder stores it

  def loss(h, embed):
    logp, entropy = M.token_logprobs(h, embed.T, jnp.asarray(y), temperature=0.8, chunk_size=4)
    return (jnp.asarray(a, jnp.float32) * logp + jnp.asarray(c, jnp.float32) * entropy).sum()

  dh, d_embed = jax.grad(loss, argnums=(0, 1))(jnp.asarray(h), embed)
  ref_dh, ref_dw = reference_grads(h, w, y, 0.8, a, c)
  np.testing.assert_allclose(dh, ref_dh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(d_embed, ref_dw.T, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_keep_their_dtype():
  h, w, y, a, _ = _inputs(seed=4)
  hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  loss = lambda h, w: (a * M.token_logprobs(h, w, jnp.asarray(y), chunk_size=5)[0]).sum()
  dh, dw = jax.grad(loss, argnums=(0, 1))(hb, wb)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  ref_dh, ref_dw = reference_grads(np.asarray(hb, np.float32), np.asarray(wb, np.float32), y, 1.0,
                                   a, 0 * a)
  np.testing.assert_allclose(np.asarray(dh, np.float32), ref_dh, rtol=0.05, atol=0.05)
  np.testing.assert_allclose(np.asarray(dw, np.float32), ref_dw, rtol=0.05, atol=0.05)


# --- agreement with the previous implementation, through a real model ----------------------------

def previous_token_logprobs(hidden, unembedding, targets, *, temperature=1.0, chunk_size=128):
  """The implementation the fused head replaced: autodiff through `jax.checkpoint`ed chunks."""
  b, t, d = hidden.shape
  chunk = max(1, min(chunk_size, t))
  pad = (-t) % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  h_chunks = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)
  y_chunks = targets.reshape(b, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one_chunk(args):
    h, y = args
    logits = jnp.einsum("bcd,dv->bcv", h, unembedding, preferred_element_type=jnp.float32)
    log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)
    logp = jnp.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)

  logp, entropy = jax.lax.map(one_chunk, (h_chunks, y_chunks))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp), unchunk(entropy)


@pytest.mark.parametrize("tied", [True, False])
def test_model_gradients_agree_with_previous_implementation(tied):
  from flax import nnx
  model = tiny_model(tiny_config("qwen3", tie_word_embeddings=tied), seed=5)
  params = nnx.state(model, nnx.Param)
  graphdef = nnx.graphdef(model)
  rng = np.random.default_rng(6)
  ids = jnp.asarray(rng.integers(0, 96, (2, 11)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, 96, (2, 11)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(2, 11)), jnp.float32)

  def loss(params, head):
    m = nnx.merge(graphdef, params)
    logp, entropy = head(m.hidden_states(ids), m.unembedding(), targets, temperature=0.9,
                         chunk_size=3)
    return (weights * logp).sum() - 0.01 * entropy.sum()

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  new_loss, new = value_and_grad(params, M.token_logprobs)
  old_loss, old = value_and_grad(params, previous_token_logprobs)
  np.testing.assert_allclose(new_loss, old_loss, rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
