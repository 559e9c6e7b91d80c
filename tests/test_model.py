"""Decoder invariants (JAX only): cached decode == full forward, packed == unpacked, chunked log-probs
== naive, and the loader's errors on bad checkpoints."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flashrl_jax import model as M
from flashrl_jax.testing import tiny_config, tiny_model, write_tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def model(request):
  from flax import nnx
  m = tiny_model(tiny_config(request.param), seed=3)
  # Give biases and norm scales non-trivial values so every parameter matters.
  state = nnx.state(m, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
  nnx.update(m, jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape), state))
  return m


def test_cached_prefill_and_decode_equal_full_forward(model):
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 96, size=(3, 12)), jnp.int32)
  full = np.asarray(model(ids))
  prompt_lens = np.array([5, 3, 7])
  cache = model.init_cache(batch_size=3, max_length=16)
  # Prefill right-padded prompts of different lengths, then decode one token at a time per row.
  prompt = jnp.where(jnp.arange(12)[None] < prompt_lens[:, None], ids, 0)[:, :8]
  hidden, cache = model.extend(prompt, jnp.asarray(prompt_lens), cache)
  logits = np.asarray(model.logits(hidden))
  for b, n in enumerate(prompt_lens):
    np.testing.assert_allclose(logits[b, :n], full[b, :n], rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lens)
  step = jax.jit(lambda m, tok, c: m.extend(tok[:, None], jnp.ones(3, jnp.int32), c))
  for i in range(4):
    pos = prompt_lens + i
    tok = ids[jnp.arange(3), pos]
    hidden, cache = step(model, tok, cache)
    out = np.asarray(model.logits(hidden[:, 0]))
    np.testing.assert_allclose(out, full[np.arange(3), pos], rtol=1e-4, atol=1e-4)


def test_packed_equals_unpacked(model):
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 96, size=5), rng.integers(0, 96, size=4)
  packed = np.zeros((1, 11), np.int32)
  packed[0, :5], packed[0, 5:9] = a, b
  segments = np.array([[1] * 5 + [2] * 4 + [0] * 2])
  positions = np.array([list(range(5)) + list(range(4)) + [0, 0]])
  out = np.asarray(model(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments)))
  assert np.isfinite(out).all()  # padding rows stay finite
  np.testing.assert_allclose(out[0, :5], np.asarray(model(jnp.asarray(a[None])))[0], atol=1e-5)
  np.testing.assert_allclose(out[0, 5:9], np.asarray(model(jnp.asarray(b[None])))[0], atol=1e-5)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 5), (1.3, 64)])
def test_chunked_logprobs_equal_naive(model, temperature, chunk):
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(0, 96, size=(2, 13)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, 96, size=(2, 13)), jnp.int32)
  hidden = model.hidden_states(ids)
  logp, entropy = M.token_logprobs(hidden, model.unembedding(), targets, temperature=temperature,
                                   chunk_size=chunk)
  logits = np.asarray(model(ids), np.float64) / temperature
  log_sm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  naive = np.take_along_axis(log_sm, np.asarray(targets)[..., None], -1)[..., 0]
  naive_entropy = -(np.exp(log_sm) * log_sm).sum(-1)
  np.testing.assert_allclose(np.asarray(logp), naive, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(entropy), naive_entropy, rtol=1e-5, atol=1e-5)
  # Gradients flow through the checkpointed chunks and agree with the naive path.
  def chunked_sum(h):
    return M.token_logprobs(h, model.unembedding(), targets, temperature=temperature,
                            chunk_size=chunk)[0].sum()
  def naive_sum(h):
    lp = jax.nn.log_softmax(model.logits(h) / temperature)
    return jnp.take_along_axis(lp, targets[..., None], -1).sum()
  np.testing.assert_allclose(jax.grad(chunked_sum)(hidden), jax.grad(naive_sum)(hidden),
                             rtol=1e-4, atol=1e-5)


def test_logical_axis_names_on_every_param(model):
  from flax import nnx
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  names = {n for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
           for n in spec}
  assert names <= {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"}
  assert {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"} <= names


def test_bad_checkpoints_fail_loudly(tmp_path):
  good = tmp_path / "good"
  write_tiny_checkpoint(str(good), tiny_config("qwen2"))
  tensors = load_file(str(good / "model.safetensors"))
  config = json.loads((good / "config.json").read_text())

  def variant(name, cfg=None, drop=(), reshape=None, extra=None):
    d = tmp_path / name
    d.mkdir()
    t = {k: v for k, v in tensors.items() if k not in drop}
    if reshape:
      t[reshape] = t[reshape][:-1]
    if extra:
      t[extra] = np.zeros(3, np.float32)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg or config))
    return str(d)

  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
    M.load_hf(variant("missing", drop=("model.layers.1.mlp.up_proj.weight",)))
  with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.bias.*shape"):
    M.load_hf(variant("shape", reshape="model.layers.0.self_attn.k_proj.bias"))
  with pytest.raises(ValueError, match="unexpected tensors.*model.extra.weight"):
    M.load_hf(variant("extra", extra="model.extra.weight"))
  with pytest.raises(ValueError, match="Unsupported architecture 'GPT2LMHeadModel'"):
    M.load_hf(variant("arch", cfg={**config, "architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
    M.load_hf(variant("field", cfg={k: v for k, v in config.items() if k != "hidden_size"}))
  pickle_dir = tmp_path / "pickle"
  pickle_dir.mkdir()
  (pickle_dir / "config.json").write_text(json.dumps(config))
  (pickle_dir / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(ValueError, match="non-safetensors"):
    M.load_hf(str(pickle_dir))


def test_transformers5_and_legacy_rope_fields_both_parse():
  base = tiny_config("llama").to_hf()
  legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
  v5 = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
  assert M.ModelConfig.from_hf(legacy) == M.ModelConfig.from_hf(v5) == tiny_config("llama")


def test_tokenizer_round_trip(tmp_path):
  tok = M.char_tokenizer()
  text = "12+30=42\nanswer: 7"
  assert tok.decode(tok.encode(text)) == text
  tok.save(str(tmp_path))
  again = M.load_tokenizer(str(tmp_path))
  assert again.encode(text) == tok.encode(text)
  assert again.eos_token_id == tok.eos_token_id == 2
  assert again.decode([5, tok.eos_token_id, 6]) == tok.decode([5, 6])


def _packed_row(lengths, start, t, rng):
  """One row of `t` tokens holding sequences of `lengths` from column `start` (segments 1, 2, ...)."""
  ids, segments, positions = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32), np.zeros(
      (1, t), np.int32)
  seqs, at = [], start
  for i, n in enumerate(lengths):
    seqs.append((at, rng.integers(0, 96, size=n)))
    ids[0, at:at + n], segments[0, at:at + n], positions[0, at:at + n] = seqs[-1][1], i + 1, range(n)
    at += n
  return ids, positions, segments, seqs


@pytest.mark.parametrize("width", M.BAND_WIDTHS)
@pytest.mark.parametrize("offset", [0, 1, 63])
def test_attention_band_is_exact_up_to_width_plus_one_tokens(model, width, offset):
  """A band of `width` is exact for sequences of `width + 1` tokens wherever they start in a chunk,
  and `by_band` never picks it for `width + 2` (which starting one column before a chunk boundary
  reaches back past the band: forcing the band there must change the result, so the bound is tight)."""
  rng = np.random.default_rng(width + offset)
  t = 384
  ids, positions, segments, seqs = _packed_row([width + 1, width + 1, 7], offset, t, rng)
  banded = model.hidden_states(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments),
                               band_width=width)
  for at, seq in seqs:  # each sequence alone, no packing
    alone = model.hidden_states(jnp.asarray(seq[None]))[0]
    np.testing.assert_allclose(np.asarray(banded)[0, at:at + len(seq)], alone, atol=2e-5)
  assert int(M.by_band(lambda w: jnp.int32(-1 if w is None else w), jnp.asarray(segments))) <= width

  start = width - 1  # the longer sequence's last token sits two chunks after its first
  ids, positions, segments, seqs = _packed_row([width + 2], start, t, rng)
  chosen = M.by_band(lambda w: jnp.int32(-1 if w is None else w), jnp.asarray(segments))
  assert int(chosen) not in (width, *[w for w in M.BAND_WIDTHS if w < width])
  forced = model.hidden_states(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments),
                               band_width=width)
  alone = model.hidden_states(jnp.asarray(seqs[0][1][None]))[0]
  assert np.abs(np.asarray(forced)[0, start:start + width + 2] - alone).max() > 1e-3


def test_packed_dense_fallback_in_causal_blocks_equals_unpacked(model):
  """A row whose longest sequence is longer than every band: the dense form, computed in causal
  query blocks (no block above the diagonal), equals each sequence run alone."""
  rng = np.random.default_rng(5)
  ids, positions, segments, seqs = _packed_row([300, 50, 20], 3, 384, rng)
  assert int(M.by_band(lambda w: jnp.int32(-1 if w is None else w), jnp.asarray(segments))) == -1
  out = model.hidden_states(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments))
  assert np.isfinite(np.asarray(out)).all()  # padding rows stay finite
  for at, seq in seqs:
    alone = model.hidden_states(jnp.asarray(seq[None]))[0]
    np.testing.assert_allclose(np.asarray(out)[0, at:at + len(seq)], alone, atol=2e-5)
