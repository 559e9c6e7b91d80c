"""How a `[B, T]` matrix of per-token losses becomes one scalar.

Why this is its own module: the choice of normaliser is a real algorithmic knob (GRPO averages per
sequence, DAPO/ROLL per token, Dr. GRPO divides by a constant), and every loss, KL term and entropy
bonus must use the *same* rule so that their coefficients stay comparable.

Empty rows: a row whose mask is all zero contributes nothing, and the sequence-level modes average
over the *non-empty* rows only. A batch with no valid token at all aggregates to exactly 0 (every
denominator is `max(count, 1)`), never NaN.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashrl_jax._enums import parse_enum


class Aggregation(enum.Enum):
    """Loss aggregation modes (`n_i` = valid tokens of row i, `S` = the non-empty rows).

    * `TOKEN_MEAN`: `Σ_{i,t} ℓ_it / Σ_{i,t} mask_it` (DAPO, ROLL default).
    * `SEQ_MEAN_TOKEN_MEAN`: `1/|S| Σ_i (1/n_i) Σ_t ℓ_it` (GRPO as written in DeepSeekMath).
    * `SEQ_MEAN_TOKEN_SUM`: `1/|S| Σ_i Σ_t ℓ_it`.
    * `SEQ_MEAN_TOKEN_SUM_NORM`: `1/|S| Σ_i Σ_t ℓ_it / L` with a constant `L = max_length`
      (Dr. GRPO, Liu et al. 2025: removes the length bias of the per-sequence mean).
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


def as_aggregation(value: Aggregation | str) -> Aggregation:
    """Turns an `Aggregation` or its string value (the flag edge) into the enum, or raises."""
    return parse_enum(Aggregation, value, "aggregation")


def aggregate(
    per_token: ArrayLike,
    mask: ArrayLike,
    aggregation: Aggregation | str = Aggregation.TOKEN_MEAN,
    *,
    max_length: int | None = None,
) -> jax.Array:
    """Reduces `per_token` `[B, T]` over the tokens where `mask != 0` to a scalar.

    Args:
      per_token: `[B, T]` per-token loss values. Values at masked-out positions are ignored, even
        NaN/inf (they are selected away with `jnp.where`, not multiplied by 0).
      mask: `[B, T]`, read as boolean.
      aggregation: an `Aggregation` or its string value.
      max_length: the constant `L` of `SEQ_MEAN_TOKEN_SUM_NORM`; defaults to `T` (the padded
        length, itself a constant). Ignored by the other modes.
    """
    agg = as_aggregation(aggregation)
    per_token = jnp.asarray(per_token)
    mask = jnp.asarray(mask) != 0
    if per_token.ndim != 2 or per_token.shape != mask.shape:
        raise ValueError(
            f"aggregate needs per_token and mask of the same [B, T] shape, got "
            f"per_token {per_token.shape} and mask {mask.shape}"
        )
    if max_length is not None and (int(max_length) != max_length or max_length <= 0):
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    x = jnp.where(mask, per_token, 0.0)
    if agg is Aggregation.TOKEN_MEAN:
        return x.sum() / jnp.maximum(mask.sum(), 1)
    tokens_per_row = mask.sum(-1)
    row_sum = x.sum(-1)
    if agg is Aggregation.SEQ_MEAN_TOKEN_MEAN:
        per_row = row_sum / jnp.maximum(tokens_per_row, 1)
    elif agg is Aggregation.SEQ_MEAN_TOKEN_SUM:
        per_row = row_sum
    else:
        per_row = row_sum / float(max_length if max_length is not None else per_token.shape[-1])
    # Empty rows have per_row == 0 already; only the denominator must skip them.
    return per_row.sum() / jnp.maximum((tokens_per_row > 0).sum(), 1)
