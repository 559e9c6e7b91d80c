"""Random tiny HF transformers models (PyTorch CPU) for parity tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

FAMILIES = ("qwen3", "qwen2", "llama")


def make_hf_model(family: str, *, num_kv_heads: int = 2, num_heads: int = 4, tie: bool = False,
                  seed: int = 0, rope_theta: float = 5000.0):
  """A 2-layer random model whose weights are large enough that logits are far from zero."""
  torch.manual_seed(seed)
  common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                tie_word_embeddings=tie, rms_norm_eps=1e-6, max_position_embeddings=256)
  if family == "qwen3":
    cfg = transformers.Qwen3Config(head_dim=16, rope_theta=rope_theta, **common)
  elif family == "qwen2":
    cfg = transformers.Qwen2Config(rope_theta=rope_theta, **common)
  elif family == "llama":
    cfg = transformers.LlamaConfig(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": rope_theta}, **common)
  else:
    raise ValueError(family)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.3 * torch.randn_like(p))
  return model


def hf_logits(model, input_ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long))
  return out.logits.float().numpy()


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
