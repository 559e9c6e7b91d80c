"""Typed model configuration, and its translation to and from HF `config.json`.

One frozen dataclass describes every supported decoder (Qwen3, Qwen2/2.5, Llama 3). The family decides
the few structural switches (qkv bias, per-head q/k RMSNorm); everything else is a number read from
`config.json`. HF spells some fields differently across transformers versions (v5 nests `rope_theta` in
`rope_parameters` and writes `dtype`; v4 writes top-level `rope_theta`/`rope_scaling`/`torch_dtype`):
`from_hf` accepts both, `to_hf` writes both so v4 readers (e.g. SGLang) and v5 readers agree.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Family(enum.Enum):
  """A supported HF architecture family."""

  QWEN3 = "qwen3"
  QWEN2 = "qwen2"
  LLAMA = "llama"

  @property
  def architecture(self) -> str:
    return {Family.QWEN3: "Qwen3ForCausalLM", Family.QWEN2: "Qwen2ForCausalLM",
            Family.LLAMA: "LlamaForCausalLM"}[self]

  @classmethod
  def from_architecture(cls, name: str) -> "Family":
    for family in cls:
      if family.architecture == name:
        return family
    supported = ", ".join(f.architecture for f in cls)
    raise ValueError(f"Unsupported architecture {name!r}; supported: {supported}.")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1's frequency-dependent RoPE rescaling (`rope_type: llama3`)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f"Invalid llama3 rope scaling {self}.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only LM. Field names follow HF where one exists."""

  family: Family
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 4096
  rope_scaling: Llama3RopeScaling | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not isinstance(self.family, Family):
      object.__setattr__(self, "family", Family(self.family))
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE.")
    if self.rope_scaling is not None and self.family is not Family.LLAMA:
      raise ValueError(f"rope_scaling of type llama3 is only supported for Llama, not {self.family}.")

  @property
  def qkv_bias(self) -> bool:
    return self.family is Family.QWEN2

  @property
  def qk_norm(self) -> bool:
    return self.family is Family.QWEN3

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  # --- HF config.json --------------------------------------------------------------------------

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
    """Builds a config from a parsed HF `config.json`; a missing or unsupported field is an error."""
    archs = hf.get("architectures") or []
    if len(archs) != 1:
      raise ValueError(f"config.json must name exactly one architecture, got {archs!r}.")
    family = Family.from_architecture(archs[0])

    def need(key):
      if key not in hf:
        raise ValueError(f"config.json is missing required field {key!r} for {archs[0]}.")
      return hf[key]

    rope = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type") or legacy_scaling.get("rope_type") or legacy_scaling.get("type")
    scaling_fields = {**legacy_scaling, **rope}
    rope_scaling = None
    if rope_type in (None, "default"):
      pass
    elif rope_type == "llama3":
      rope_scaling = Llama3RopeScaling(
          factor=float(scaling_fields["factor"]),
          low_freq_factor=float(scaling_fields["low_freq_factor"]),
          high_freq_factor=float(scaling_fields["high_freq_factor"]),
          original_max_position_embeddings=int(scaling_fields["original_max_position_embeddings"]))
    else:
      raise ValueError(f"Unsupported rope type {rope_type!r}; supported: default, llama3.")
    if family is Family.LLAMA and (hf.get("attention_bias") or hf.get("mlp_bias")):
      raise ValueError("Llama checkpoints with attention_bias/mlp_bias are not supported.")

    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return cls(
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_scaling=rope_scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )

  def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
    """The HF `config.json` dict that transformers (v4 and v5) and SGLang load."""
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    legacy_scaling = None
    if self.rope_scaling is not None:
      legacy_scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
      rope_parameters = {**legacy_scaling, "rope_theta": self.rope_theta}
    hf: dict[str, Any] = {
        "architectures": [self.family.architecture],
        "model_type": self.family.value,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "rope_theta": self.rope_theta,
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope_parameters,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                         else (self.eos_token_ids[0] if self.eos_token_ids else None)),
    }
    if self.family is not Family.QWEN3:
      hf["attention_bias"] = self.qkv_bias
    if self.family is Family.LLAMA:
      hf["mlp_bias"] = False
    if self.family in (Family.QWEN3, Family.QWEN2):
      hf["use_sliding_window"] = False
      hf["sliding_window"] = None
    return hf
