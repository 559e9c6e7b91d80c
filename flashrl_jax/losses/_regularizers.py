"""Regularisers: KL to a reference policy (loss term or reward penalty) and the entropy bonus.

Why: GRPO regularises toward a frozen reference policy with a per-token KL estimate, PPO-RLHF and
REINFORCE++ subtract it from the reward instead; both need the same three estimators from
Schulman's note "Approximating KL Divergence" (2020). With tokens sampled from π_θ and
`ρ = log π_ref − log π_θ = ref_logp − logp`, estimates of KL(π_θ ‖ π_ref) are:

* k1 = −ρ                    unbiased, high variance, can be negative;
* k2 = ρ² / 2                biased, low variance, ≥ 0;
* k3 = (e^ρ − 1) − ρ         unbiased, low variance, ≥ 0 (GRPO, DeepSeekMath eq. 4).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashrl_jax._enums import parse_enum
from flashrl_jax.losses import _aggregation, _inputs


class KLEstimator(enum.Enum):
    """Schulman's per-token KL estimators (see the module docstring for the formulas)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


def as_kl_estimator(value: KLEstimator | str) -> KLEstimator:
    """Turns a `KLEstimator` or its string value into the enum, or raises ValueError."""
    return parse_enum(KLEstimator, value, "kl_estimator")


def kl_divergence(
    logp: ArrayLike, ref_logp: ArrayLike, *, estimator: KLEstimator | str = KLEstimator.K3
) -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref), `[B, T]`, differentiable w.r.t. `logp`.

    Raw: no masking and no non-finite handling (use `kl_loss`/`kl_reward_penalty` for those).
    `ρ` is clamped to ±MAX_LOG_RATIO before `exp` so k3 cannot overflow.
    """
    est = as_kl_estimator(estimator)
    rho = _inputs.log_ratio(jnp.asarray(ref_logp), jnp.asarray(logp))
    if est is KLEstimator.K1:
        return -rho
    if est is KLEstimator.K2:
        return 0.5 * rho**2
    return jnp.expm1(rho) - rho  # expm1: no cancellation when π_θ ≈ π_ref


def _prepare_kl(logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike) -> _inputs.Tokens:
    # The KL term has no behaviour policy or advantage: reuse the shared hygiene with dummies.
    return _inputs.prepare(logp, ref_logp, jnp.zeros(jnp.shape(logp)[:1]), mask)


def kl_loss(
    logp: ArrayLike,
    ref_logp: ArrayLike,
    mask: ArrayLike,
    *,
    coef: float,
    estimator: KLEstimator | str = KLEstimator.K3,
    aggregation: _aggregation.Aggregation | str = _aggregation.Aggregation.TOKEN_MEAN,
    max_length: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL-to-reference loss term `coef · agg(KL_t)` and metrics `kl_ref`, `kl_loss`.

    Tokens with non-finite `logp`/`ref_logp` are dropped (counted in `nonfinite_tokens`).
    """
    t = _prepare_kl(logp, ref_logp, mask)
    kl = kl_divergence(t.logp, t.behavior_logp, estimator=estimator)
    kl_mean = _aggregation.aggregate(kl, t.valid, aggregation, max_length=max_length)
    loss = coef * kl_mean
    metrics = {
        "kl_ref": _inputs.masked_mean(kl, t.valid),
        "kl_loss": loss,
        "nonfinite_tokens": t.nonfinite_tokens,
    }
    return loss, jax.lax.stop_gradient(metrics)


def kl_reward_penalty(
    logp: ArrayLike,
    ref_logp: ArrayLike,
    mask: ArrayLike,
    *,
    coef: float,
    estimator: KLEstimator | str = KLEstimator.K1,
) -> jax.Array:
    """Per-token reward penalty `−coef · sg(KL_t)`, `[B, T]`, 0 at masked or non-finite tokens.

    Add it to the token rewards before computing returns (PPO-RLHF, REINFORCE++). `logp` here is
    usually the behaviour log-prob of the sampled token; k1 is the customary estimator.
    """
    t = _prepare_kl(logp, ref_logp, mask)
    kl = kl_divergence(t.logp, t.behavior_logp, estimator=estimator)
    return jax.lax.stop_gradient(jnp.where(t.valid, -coef * kl, 0.0))


def entropy_bonus(
    entropy: ArrayLike,
    mask: ArrayLike,
    *,
    coef: float,
    aggregation: _aggregation.Aggregation | str = _aggregation.Aggregation.TOKEN_MEAN,
    max_length: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Entropy bonus loss term `−coef · agg(H_t)` and metric `entropy`.

    `entropy` `[B, T]` is the per-token entropy of π_θ computed outside (from the logits, chunked
    over the vocabulary); the gradient flows through it. Non-finite entropies are dropped.
    """
    entropy = jnp.asarray(entropy)
    mask = jnp.asarray(mask)
    if entropy.ndim != 2 or entropy.shape != mask.shape:
        raise ValueError(
            f"entropy has shape {entropy.shape} and mask has shape {mask.shape}; "
            "both must be the same [B, T]"
        )
    valid = (mask != 0) & jnp.isfinite(entropy)
    entropy = jnp.where(valid, entropy, 0.0)
    h = _aggregation.aggregate(entropy, valid, aggregation, max_length=max_length)
    metrics = {"entropy": _inputs.masked_mean(entropy, valid)}
    return -coef * h, jax.lax.stop_gradient(metrics)
