"""Importance-weighted REINFORCE losses: TIS, CISPO and TOPR.

Why together: all three maximise `sg(weight) · A · logp`, a REINFORCE objective whose gradient is
`weight · A · ∇logp`; they differ only in how the importance weight `r = π_θ/μ` against the
behaviour policy is bounded. Because the weight is under stop-gradient, no token's gradient is
ever zeroed by clipping (unlike PPO); the bound only limits its size.

`behavior_logp` is the rollout engine's log-prob of the sampled token (see `_ppo`). Input rules
(shapes, masks, NaN/inf) are those of `_inputs`; shared metrics are `_diagnostics.ratio_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashrl_jax.losses import _aggregation, _diagnostics, _inputs

Agg = _aggregation.Aggregation


def _weighted_logp_loss(
    t: _inputs.Tokens,
    weight_fn: Callable[[jax.Array], jax.Array],
    *,
    aggregation: Agg | str,
    max_length: int | None,
    sequence_ratio: bool,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """`−agg(sg(weight_fn(r)) · A · logp)`; returns the loss, shared metrics and the ratio used."""
    token_lr = _inputs.log_ratio(t.logp, t.behavior_logp)
    lr = _inputs.sequence_log_ratio(token_lr, t.valid) if sequence_ratio else token_lr
    r = jax.lax.stop_gradient(jnp.exp(lr))
    weight = jax.lax.stop_gradient(weight_fn(r))
    per_token = -(weight * t.advantages * t.logp)
    loss = _aggregation.aggregate(per_token, t.valid, aggregation, max_length=max_length)
    metrics = {
        **_diagnostics.ratio_metrics(token_lr, t.valid),
        "weight_mean": _inputs.masked_mean(weight, t.valid),
        "nonfinite_tokens": t.nonfinite_tokens,
        "pg_loss": loss,
    }
    if sequence_ratio:
        rows = t.valid.any(-1)
        metrics["seq_ratio_mean"] = _inputs.masked_mean(r[:, 0], rows)
        metrics["seq_ratio_max"] = _inputs.masked_max(r[:, 0], rows)
    return loss, metrics, r


def tis(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    is_cap: float = 2.0,
    aggregation: Agg | str = Agg.TOKEN_MEAN,
    max_length: int | None = None,
    sequence_ratio: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training"; truncated IS after Ionides 2008).

    Loss `= −agg( sg(min(r, is_cap)) · A · logp )`, `r = exp(logp − behavior_logp)`. With
    `sequence_ratio=True`, `r` is GSPO's per-sequence geometric mean. Metrics: shared ratio
    metrics, `truncated_frac` (tokens with `r > is_cap`), `weight_mean`, `nonfinite_tokens`.
    """
    if not is_cap > 0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}")
    t = _inputs.prepare(logp, behavior_logp, advantages, mask)
    loss, metrics, r = _weighted_logp_loss(
        t,
        lambda r: jnp.minimum(r, is_cap),
        aggregation=aggregation,
        max_length=max_length,
        sequence_ratio=sequence_ratio,
    )
    metrics["truncated_frac"] = _inputs.masked_mean(r > is_cap, t.valid)
    return loss, jax.lax.stop_gradient(metrics)


def cispo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Agg | str = Agg.TOKEN_MEAN,
    max_length: int | None = None,
    sequence_ratio: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO, clipped IS-weight policy optimisation (MiniMax 2025, "MiniMax-M1", eq. 4).

    Loss `= −agg( sg(clip(r, 1−clip_low, 1+clip_high)) · A · logp )`. MiniMax-M1 effectively only
    clips from above (a large `clip_low`, e.g. 1.0 meaning no lower bound). Metrics: shared ratio
    metrics, `clip_frac` (tokens with `r` outside the range), `weight_mean`, `nonfinite_tokens`.
    """
    if not 0.0 <= clip_low <= 1.0 or not clip_high >= 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    t = _inputs.prepare(logp, behavior_logp, advantages, mask)
    loss, metrics, r = _weighted_logp_loss(
        t,
        lambda r: jnp.clip(r, lo, hi),
        aggregation=aggregation,
        max_length=max_length,
        sequence_ratio=sequence_ratio,
    )
    metrics["clip_frac"] = _inputs.masked_mean((r < lo) | (r > hi), t.valid)
    return loss, jax.lax.stop_gradient(metrics)


def topr(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    positive: ArrayLike,
    is_cap: float = 1.0,
    aggregation: Agg | str = Agg.TOKEN_MEAN,
    max_length: int | None = None,
    sequence_ratio: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE").

    `positive` `[B]` marks trajectories in T+ (by default: reward > 0; the caller decides). T+ gets
    weight 1 (plain SFT-like REINFORCE, never down-weighted); T− gets `sg(clip(r, 0, is_cap))`, so
    pushing down a bad trajectory is tapered when the current policy already gives it little mass.
    Loss `= −agg( weight · A · logp )`. The paper's ratio is per trajectory; this uses the token
    ratio unless `sequence_ratio=True` (geometric mean, GSPO-style). Metrics: shared ratio metrics,
    `truncated_frac` (T− tokens with `r > is_cap`, over all valid tokens), `positive_frac` (valid
    tokens in T+), `weight_mean`, `nonfinite_tokens`.
    """
    if not is_cap > 0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}")
    positive = jnp.asarray(positive)
    t = _inputs.prepare(logp, behavior_logp, advantages, mask)
    _inputs.check_sequence_shape("positive", positive, t.logp)
    pos = jnp.broadcast_to((positive != 0)[:, None], t.logp.shape)
    loss, metrics, r = _weighted_logp_loss(
        t,
        lambda r: jnp.where(pos, 1.0, jnp.clip(r, 0.0, is_cap)),
        aggregation=aggregation,
        max_length=max_length,
        sequence_ratio=sequence_ratio,
    )
    metrics["truncated_frac"] = _inputs.masked_mean(~pos & (r > is_cap), t.valid)
    metrics["positive_frac"] = _inputs.masked_mean(pos, t.valid)
    return loss, jax.lax.stop_gradient(metrics)
