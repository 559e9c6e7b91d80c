"""The decode cache's attention (`DecodeView.attend`, row by row over the slot buffers) against
float64 NumPy.

What is tried: one decode step whose rows hold 1, 64, 65, 130, 300 and 512 positions (the new
token included) in scattered slots, a padding row pointing at the spare slot with a junk length,
and a step of the shortest span (64); with every row over the step's span and with each row over
its own bucket of `row_spans` (the lengths sit on the buckets' edges). Each row must equal softmax
attention over exactly its own positions `[0, length]`, computed in float64. And with buckets, a
row must not read past its own: the keys and values there are NaN."""

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


ROW_SPANS = (64, 128, 256, 512)


@pytest.mark.parametrize("row_spans", [(), ROW_SPANS])
@pytest.mark.parametrize("span,lengths", [(512, [0, 63, 64, 129, 299, 511]), (64, [0, 5, 63])])
def test_each_row_attends_over_exactly_its_own_positions(span, lengths, row_spans):
  out, want = attend_rows(span, lengths, row_spans)
  for i, length in enumerate(lengths):
    np.testing.assert_allclose(out[i], want[i], rtol=2e-5, atol=2e-6, err_msg=f"row {i} ({length})")
  assert np.all(np.isfinite(out[-1]))  # the padding row: finite, unused


def test_a_row_reads_only_its_own_bucket():
  lengths = [0, 63, 64, 129, 299, 450]
  out, want = attend_rows(512, lengths, ROW_SPANS, poison_past=ROW_SPANS)
  for i, length in enumerate(lengths):
    np.testing.assert_allclose(out[i], want[i], rtol=2e-5, atol=2e-6, err_msg=f"row {i} ({length})")
  # Without buckets every row reads the step's whole span, NaN included (the poison is live).
  out, _ = attend_rows(512, lengths, (), poison_past=ROW_SPANS)
  assert np.isnan(out[0]).all() and np.isfinite(out[-2]).all()


def attend_rows(span, lengths, row_spans, *, poison_past=()):
  """`DecodeView.attend` on random keys/values and the float64 reference for each row; keys and
  values past each row's bucket of `poison_past` (if given) are NaN."""
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
  if poison_past:
    for row, length in zip(rows, lengths):
      bucket = next(s for s in poison_past if s >= length + 1)
      ks[row, :, bucket:], vs[row, :, :, bucket:] = np.nan, np.nan
  cache = cache.replace(ks=(jnp.asarray(ks),), vs=(jnp.asarray(vs),), lengths=jnp.asarray(cached))
  view = cache.view(jnp.asarray(rows), span, row_spans)
  q = rng.standard_normal((len(rows), 1, K * G, H)).astype(np.float32)
  positions = view.lengths[:, None]  # the new token's position, as `Decoder.extend` builds it
  mask = jnp.arange(span)[None, None] <= positions[:, :, None]  # [b, 1, span]
  out = jax.jit(lambda q, m: view.attend(0, q, m, K, jnp.float32))(jnp.asarray(q), mask)
  want = [reference(q[i, 0].reshape(K, G, H), ks[rows[i]], vs[rows[i]], length + 1)
          for i, length in enumerate(lengths)]
  return np.asarray(out).reshape(len(rows), K, G, H), want
