"""Shared input handling for every policy loss: shape checks, non-finite tokens, log-ratios.

Why one module: all losses must reject bad shapes with the same message and treat NaN/±inf the
same way, so an ablation between losses never differs in its input hygiene. The rules:

* Token arrays are `[B, T]` and must all have `logp`'s shape; `advantages` is `[B]` (a sequence
  advantage broadcast over its tokens) or `[B, T]`. Shapes are static, so a mismatch raises
  `ValueError` at trace time, naming the arrays and their shapes.
* `mask` is read as boolean (`mask != 0`).
* A token is *valid* iff it is masked in AND every input at that token (log-probs, advantage) is
  finite. A masked-in token with a NaN/±inf input (e.g. a `-inf` log-prob from a server) is dropped
  from the loss and counted in the metric `nonfinite_tokens`: the loss stays finite and the count
  makes the problem visible instead of silent.
* Invalid positions are replaced by 0 with `jnp.where` *before* any `exp`, so neither the forward
  value nor the gradient ever touches them (a NaN times a zero cotangent would still be NaN).
* Log-ratios are clamped to `[-MAX_LOG_RATIO, MAX_LOG_RATIO]` before `exp` (as verl does): `e^20 ≈
  4.9e8` cannot overflow float32, and beyond the clamp the gradient is 0. Well inside any regime a
  run should be in.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

MAX_LOG_RATIO = 20.0


class Tokens(NamedTuple):
    """Sanitised loss inputs: every array is `[B, T]` float32 and 0 wherever `valid` is False."""

    logp: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array
    extra: dict[str, jax.Array]  # other log-prob arrays (prox_logp, ref_logp), same treatment
    valid: jax.Array  # [B, T] bool
    nonfinite_tokens: jax.Array  # scalar float32: masked-in tokens dropped for a NaN/inf input


def _float(x: ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    # bf16 log-probs are upcast: ratios of nearly equal bf16 numbers are mostly rounding noise.
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def check_token_shapes(logp: jax.Array, **arrays: jax.Array | None) -> None:
    """Raises ValueError unless `logp` is `[B, T]` and every non-None array has its shape."""
    if logp.ndim != 2:
        raise ValueError(f"logp must be a [B, T] array, got shape {logp.shape}")
    for name, x in arrays.items():
        if x is not None and x.shape != logp.shape:
            raise ValueError(
                f"{name} has shape {x.shape} but logp has shape {logp.shape}; "
                "token arrays must all be [B, T]"
            )


def check_sequence_shape(name: str, x: jax.Array, logp: jax.Array) -> None:
    """Raises ValueError unless `x` is `[B]` for `logp` of shape `[B, T]`."""
    if x.shape != logp.shape[:1]:
        raise ValueError(
            f"{name} has shape {x.shape} but must be [B] = {logp.shape[:1]} for logp of shape "
            f"{logp.shape}"
        )


def prepare(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    **extra: ArrayLike | None,
) -> Tokens:
    """Checks shapes, drops non-finite tokens, zeroes invalid positions (see module docstring)."""
    # Only `logp` is differentiated: the others are data, even if the caller computed them from
    # the same parameters inside its grad function (a leaked gradient through prox_logp or
    # ref_logp would silently change the objective).
    sg = lambda x: jax.lax.stop_gradient(_float(x))  # noqa: E731
    logp, behavior_logp, advantages = _float(logp), sg(behavior_logp), sg(advantages)
    mask = jnp.asarray(mask)
    extra_arrays = {k: sg(v) for k, v in extra.items() if v is not None}
    check_token_shapes(logp, behavior_logp=behavior_logp, mask=mask, **extra_arrays)
    if advantages.shape == logp.shape[:1]:
        advantages = jnp.broadcast_to(advantages[:, None], logp.shape)
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages has shape {advantages.shape} but must be [B] = {logp.shape[:1]} or "
            f"[B, T] = {logp.shape} for logp of shape {logp.shape}"
        )
    masked_in = mask != 0
    finite = jnp.isfinite(logp) & jnp.isfinite(behavior_logp) & jnp.isfinite(advantages)
    for x in extra_arrays.values():
        finite &= jnp.isfinite(x)
    valid = masked_in & finite
    zero = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    return Tokens(
        logp=zero(logp),
        behavior_logp=zero(behavior_logp),
        advantages=zero(advantages),
        extra={k: zero(v) for k, v in extra_arrays.items()},
        valid=valid,
        nonfinite_tokens=(masked_in & ~finite).sum().astype(jnp.float32),
    )


def log_ratio(numerator_logp: jax.Array, denominator_logp: jax.Array) -> jax.Array:
    """`clip(numerator − denominator, ±MAX_LOG_RATIO)`: a log-ratio that is safe to exponentiate."""
    return jnp.clip(numerator_logp - denominator_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def sequence_log_ratio(token_log_ratio: jax.Array, valid: jax.Array) -> jax.Array:
    """GSPO's length-normalised sequence log-ratio, broadcast back to `[B, T]`.

    `log s_i = (1/n_i) Σ_t log r_it` over the valid tokens of row i, i.e. `s_i` is the geometric
    mean of the token ratios (Zheng et al. 2025, "Group Sequence Policy Optimization"). It is
    differentiable: `∂ log s_i / ∂ logp_it = 1/n_i`. Empty rows get `log s = 0`.
    """
    n = jnp.maximum(valid.sum(-1, keepdims=True), 1)
    row = jnp.where(valid, token_log_ratio, 0.0).sum(-1, keepdims=True) / n
    return jnp.broadcast_to(row, token_log_ratio.shape)


def masked_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean of `x` over `valid`; 0 when nothing is valid."""
    return jnp.where(valid, x, 0.0).sum() / jnp.maximum(valid.sum(), 1)


def masked_max(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Max of `x` over `valid`; 0 when nothing is valid."""
    return jnp.where(valid.any(), jnp.where(valid, x, -jnp.inf).max(), 0.0)


def masked_min(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Min of `x` over `valid`; 0 when nothing is valid."""
    return jnp.where(valid.any(), jnp.where(valid, x, jnp.inf).min(), 0.0)
