"""Rotary position embeddings in HF's rotate-half layout, with Llama 3 frequency rescaling.

Inverse frequencies are computed once in float64 NumPy (static for a config) and applied in float32,
which is what makes our logits match transformers to ~1e-6 relative.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from flashrl_jax.model._config import Llama3RopeScaling


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: Llama3RopeScaling | None = None) -> np.ndarray:
  """`[head_dim // 2]` inverse frequencies, rescaled per Llama 3.1 when `scaling` is given."""
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if scaling is None:
    return inv_freq.astype(np.float32)
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths (low frequencies) are slowed by `factor`; short ones kept; the band between is
  # interpolated smoothly.
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
  """Rotates `x` `[B, T, N, H]` by integer `positions` `[B, T]` (rotate-half convention)."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)
