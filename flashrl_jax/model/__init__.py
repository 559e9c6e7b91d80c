"""The decoder LM (Qwen3 / Qwen2.5 / Llama 3) in Flax NNX, its KV cache, log-probs and HF I/O."""

from flashrl_jax.model._cache import KVCache
from flashrl_jax.model._config import Family, Llama3RopeScaling, ModelConfig
from flashrl_jax.model._decoder import Decoder
from flashrl_jax.model._hf_io import (HFDirWriter, hf_tensor_specs, hf_tensors, load_hf,
                                      load_hf_state, read_config, save_hf, tensor_map,
                                      to_hf_array, write_hf_dir)
from flashrl_jax.model._layers import ShardFn, no_shard
from flashrl_jax.model._logprobs import token_logprobs
from flashrl_jax.model._manifest import (MANIFEST, CorruptVersionError, sha256_file,
                                         verify_version)
from flashrl_jax.model._packed import BAND_WIDTHS, band_widths, by_band
from flashrl_jax.model._tokenizer import CHAT_TEMPLATE, Tokenizer, char_tokenizer, load_tokenizer

__all__ = [
    "BAND_WIDTHS", "CHAT_TEMPLATE", "MANIFEST", "CorruptVersionError", "Decoder", "Family",
    "HFDirWriter", "KVCache", "Llama3RopeScaling", "ModelConfig", "ShardFn", "Tokenizer",
    "band_widths", "by_band", "char_tokenizer", "hf_tensor_specs", "hf_tensors", "load_hf",
    "load_hf_state", "load_tokenizer", "no_shard", "read_config", "save_hf", "sha256_file",
    "tensor_map", "to_hf_array", "token_logprobs", "verify_version", "write_hf_dir",
]
