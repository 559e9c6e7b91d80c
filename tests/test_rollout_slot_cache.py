"""The decode cache's attention (`DecodeView.attend`, row by row over the slot buffers) against
float64 NumPy.

What is tried: one decode step whose rows hold 1, 64, 65, 130, 300 and 512 positions (the new
token included) in scattered slots, a padding row pointing at the spare slot with a junk length,
and a step of the shortest span (64). Each row must equal softmax attention over exactly its own
positions `[0, length]`, computed in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashrl_jax.rollout._slot_cache import SlotCache

K, G, H = 2, 2, 16  # kv heads, query heads per kv head, head dim


def reference(q_row, keys, values, attended):
  """q_row [K, G, H], keys [K, S, H], values [K, H, S]: float64 attention over `attended` keys."""
  q = q_row.astype(np.float64) / np.sqrt(H)
  k = keys[:, :attended].astype(np.float64)
  v = values[:, :, :attended].astype(np.float64)
  scores = np.einsum("kgh,ksh->kgs", q, k)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("kgs,khs->kgh", weights, v)


@pytest.mark.parametrize("span,lengths", [(512, [0, 63, 64, 129, 299, 511]), (64, [0, 5, 63])])
def test_each_row_attends_over_exactly_its_own_positions(span, lengths):
  rng = np.random.default_rng(0)
  slots = len(lengths) + 2
  cache = SlotCache.zeros(num_layers=1, num_slots=slots, max_length=span, num_kv_heads=K,
                          head_dim=H, dtype=jnp.float32)
  ks = rng.standard_normal((slots + 1, K, span, H)).astype(np.float32) * 2
  vs = rng.standard_normal((slots + 1, K, H, span)).astype(np.float32)
  # Rows live in scattered slots; the last batch row is padding (the spare slot, junk length).
  rows = np.array([slots - 1 - i for i in range(len(lengths))] + [slots], np.int32)
  cached = np.zeros(slots + 1, np.int32)
  cached[rows[:-1]] = lengths
  cached[slots] = 10 * span  # junk: padding rows are never read
  cache = cache.replace(ks=(jnp.asarray(ks),), vs=(jnp.asarray(vs),), lengths=jnp.asarray(cached))
  view = cache.view(jnp.asarray(rows), span)
  q = rng.standard_normal((len(rows), 1, K * G, H)).astype(np.float32)
  positions = view.lengths[:, None]  # the new token's position, as `Decoder.extend` builds it
  mask = jnp.arange(span)[None, None] <= positions[:, :, None]  # [b, 1, span]
  out = jax.jit(lambda q, m: view.attend(0, q, m, K, jnp.float32))(jnp.asarray(q), mask)
  out = np.asarray(out).reshape(len(rows), K, G, H)
  for i, length in enumerate(lengths):
    want = reference(q[i, 0].reshape(K, G, H), ks[rows[i]], vs[rows[i]], length + 1)
    np.testing.assert_allclose(out[i], want, rtol=2e-5, atol=2e-6, err_msg=f"row {i} ({length})")
  assert np.all(np.isfinite(out[-1]))  # the padding row: finite, unused
