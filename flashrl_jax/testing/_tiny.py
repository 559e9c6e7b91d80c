"""Tiny random models of each family, for tests and CPU demos."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flashrl_jax.model import Decoder, Family, Llama3RopeScaling, ModelConfig, save_hf
from flashrl_jax.model._tokenizer import char_tokenizer


def tiny_config(family: Family | str = Family.QWEN3, **overrides) -> ModelConfig:
  """A 2-layer config small enough for CPU tests; head_dim deliberately != hidden/heads for Qwen3."""
  family = Family(family)
  base = dict(family=family, vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=16 if family is Family.QWEN3 else 8,
              rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
              bos_token_id=1, eos_token_ids=(2,))
  if family is Family.LLAMA:
    base["rope_scaling"] = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=64)
  base.update(overrides)
  return ModelConfig(**base)


def tiny_model(config: ModelConfig | None = None, seed: int = 0, **kwargs) -> Decoder:
  return Decoder(config or tiny_config(), rngs=nnx.Rngs(seed), **kwargs)


def write_tiny_checkpoint(path: str, config: ModelConfig | None = None, seed: int = 0,
                          with_tokenizer: bool = True) -> Decoder:
  """Saves a random tiny model (and the built-in char tokenizer) as an HF directory."""
  config = config or tiny_config()
  model = tiny_model(config, seed)
  save_hf(model, path)
  if with_tokenizer:
    tok = char_tokenizer()
    if tok.vocab_size > config.vocab_size:
      raise ValueError(f"char tokenizer needs vocab_size >= {tok.vocab_size}.")
    tok.save(path)
  return model
