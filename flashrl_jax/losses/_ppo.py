"""Clipped-surrogate losses: PPO, decoupled PPO and GRPO.

Why together: all three optimise the same clipped surrogate `min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)`
and differ only in which ratio is clipped (against the behaviour policy, against the proximal
policy with a separate behaviour weight) and in the KL-to-reference term GRPO adds.

Important: `behavior_logp` is the log-prob reported by the rollout engine for the sampled token
(the policy version that *generated* it), not a trainer recomputation; recomputing would make
the ratio of a stale sample 1 and silently remove the off-policy correction.

Clip parameters are static Python numbers (validated eagerly). Inputs follow `_inputs`: shape
errors raise at trace time; masked-in tokens with NaN/±inf inputs are dropped and counted in
`nonfinite_tokens`; an all-masked row contributes nothing. Every loss returns `(loss, metrics)`
where the shared metrics are documented in `_diagnostics.ratio_metrics`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashrl_jax.losses import _aggregation, _diagnostics, _inputs, _regularizers

Agg = _aggregation.Aggregation


def check_clip(clip_low: float, clip_high: float, dual_clip: float | None = None) -> None:
    """Raises ValueError for clip ranges that make the surrogate meaningless."""
    if not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be in [0, 1] (so that 1 − clip_low ≥ 0), got {clip_low}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020 use 3), got {dual_clip}")


def clipped_surrogate(
    ratio: jax.Array, adv: jax.Array, *, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token PPO objective, plus masks of where the clip and the dual clip are active.

    `o = min(r·A, clip(r, 1−clip_low, 1+clip_high)·A)`; with `dual_clip = c`, for `A < 0` the
    objective is floored: `max(o, c·A)` (dual-clip PPO, Ye et al. 2020), which bounds the loss of
    a negative-advantage token whose ratio has exploded.
    """
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    # An explicit select (not jnp.minimum) so a tie keeps the unclipped branch and its full r·A
    # gradient instead of splitting the cotangent between two equal arguments.
    clip_active = clipped < unclipped
    obj = jnp.where(clip_active, clipped, unclipped)
    if dual_clip is None:
        return obj, clip_active, jnp.zeros_like(clip_active)
    floor = dual_clip * adv
    dual_active = (adv < 0) & (obj < floor)
    return jnp.where(dual_active, floor, obj), clip_active & ~dual_active, dual_active


def _sequence_ratio_metrics(seq_lr: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
    rows = valid.any(-1)
    s = jnp.exp(jax.lax.stop_gradient(seq_lr[:, 0]))
    return {
        "seq_ratio_mean": _inputs.masked_mean(s, rows),
        "seq_ratio_max": _inputs.masked_max(s, rows),
    }


def _surrogate_terms(
    t: _inputs.Tokens,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    sequence_ratio: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The PPO/GRPO per-token objective on prepared tokens, and its metrics."""
    token_lr = _inputs.log_ratio(t.logp, t.behavior_logp)
    lr = _inputs.sequence_log_ratio(token_lr, t.valid) if sequence_ratio else token_lr
    obj, clip_active, dual_active = clipped_surrogate(
        jnp.exp(lr), t.advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    metrics = {
        **_diagnostics.ratio_metrics(token_lr, t.valid),
        "clip_frac": _inputs.masked_mean(clip_active, t.valid),
        "dual_clip_frac": _inputs.masked_mean(dual_active, t.valid),
        "nonfinite_tokens": t.nonfinite_tokens,
    }
    if sequence_ratio:
        metrics |= _sequence_ratio_metrics(lr, t.valid)
    return obj, metrics


def ppo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: Agg | str = Agg.TOKEN_MEAN,
    max_length: int | None = None,
    sequence_ratio: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate against the behaviour policy (Schulman et al. 2017, "Proximal Policy
    Optimization Algorithms"; asymmetric clip-higher as in DAPO).

    Loss `= −agg( min(r·A, clip(r, 1−clip_low, 1+clip_high)·A) )`, `r = exp(logp − behavior_logp)`,
    optionally floored at `dual_clip·A` for `A < 0`. With `sequence_ratio=True` the token ratio is
    replaced by GSPO's `s_i = exp(mean_t log r_it)` broadcast over row i (Zheng et al. 2025; pair it
    with `seq-mean-token-mean` and much smaller clip ranges, e.g. 3e-4/4e-4, for GSPO proper).

    Metrics: shared ratio metrics (`approx_kl` = k3 of KL(μ‖π_θ)), `clip_frac` (tokens where the
    clipped branch is the active one), `dual_clip_frac`, `nonfinite_tokens`, `pg_loss`, and
    `seq_ratio_mean/max` with `sequence_ratio`.
    """
    check_clip(clip_low, clip_high, dual_clip)
    t = _inputs.prepare(logp, behavior_logp, advantages, mask)
    clip = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    obj, metrics = _surrogate_terms(t, **clip, sequence_ratio=sequence_ratio)
    loss = _aggregation.aggregate(-obj, t.valid, aggregation, max_length=max_length)
    metrics["pg_loss"] = loss
    return loss, jax.lax.stop_gradient(metrics)


def decoupled_ppo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    prox_logp: ArrayLike,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behavior_weight_cap: float | None = None,
    dual_clip: float | None = None,
    aggregation: Agg | str = Agg.TOKEN_MEAN,
    max_length: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; as used
    for asynchronous RL by AReaL, Fu et al. 2025).

    Loss `= −agg( w · min(r_p·A, clip(r_p, 1−clip_low, 1+clip_high)·A) )` with the proximal ratio
    `r_p = exp(logp − prox_logp)` (the trust region is around the trainer's parameters at the start
    of the step, `prox_logp`) and the behaviour weight `w = sg(exp(prox_logp − behavior_logp))`
    (the off-policy correction). With `behavior_weight_cap = C`, `w ← min(w, C)` (truncation;
    AReaL's variant instead drops tokens with `w > C`).

    Extra metrics: `prox_ratio_mean/max`, `behavior_weight_mean/max`, `behavior_weight_capped_frac`,
    `clip_frac` and `dual_clip_frac` (on `r_p`); the shared ratio metrics use `r = π_θ/μ`.
    """
    check_clip(clip_low, clip_high, dual_clip)
    if behavior_weight_cap is not None and not behavior_weight_cap > 0:
        raise ValueError(f"behavior_weight_cap must be > 0, got {behavior_weight_cap}")
    t = _inputs.prepare(logp, behavior_logp, advantages, mask, prox_logp=prox_logp)
    prox = t.extra["prox_logp"]
    w = jnp.exp(_inputs.log_ratio(prox, t.behavior_logp))
    capped = jnp.zeros_like(t.valid)
    if behavior_weight_cap is not None:
        capped = w > behavior_weight_cap
        w = jnp.minimum(w, behavior_weight_cap)
    w = jax.lax.stop_gradient(w)
    prox_lr = _inputs.log_ratio(t.logp, prox)
    obj, clip_active, dual_active = clipped_surrogate(
        jnp.exp(prox_lr), t.advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    loss = _aggregation.aggregate(-(w * obj), t.valid, aggregation, max_length=max_length)
    prox_r = jnp.exp(prox_lr)
    metrics = {
        **_diagnostics.ratio_metrics(_inputs.log_ratio(t.logp, t.behavior_logp), t.valid),
        "prox_ratio_mean": _inputs.masked_mean(prox_r, t.valid),
        "prox_ratio_max": _inputs.masked_max(prox_r, t.valid),
        "behavior_weight_mean": _inputs.masked_mean(w, t.valid),
        "behavior_weight_max": _inputs.masked_max(w, t.valid),
        "behavior_weight_capped_frac": _inputs.masked_mean(capped, t.valid),
        "clip_frac": _inputs.masked_mean(clip_active, t.valid),
        "dual_clip_frac": _inputs.masked_mean(dual_active, t.valid),
        "nonfinite_tokens": t.nonfinite_tokens,
        "pg_loss": loss,
    }
    return loss, jax.lax.stop_gradient(metrics)


def grpo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    ref_logp: ArrayLike | None = None,
    kl_coef: float = 0.04,
    kl_estimator: _regularizers.KLEstimator | str = _regularizers.KLEstimator.K3,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: Agg | str = Agg.TOKEN_MEAN,
    max_length: int | None = None,
    sequence_ratio: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3): PPO clip on group-normalised advantages
    (see `grpo_advantages`) plus a per-token KL penalty to a frozen reference policy.

    Loss `= agg( −min(r·A, clip(r)·A) + β·D_t )` with `β = kl_coef` (the paper's 0.04 by default)
    and `D_t` the chosen estimate of KL(π_θ‖π_ref) (the paper's is k3:
    `π_ref/π_θ − log(π_ref/π_θ) − 1`).
    The paper aggregates with `seq-mean-token-mean`; pass it to reproduce it exactly (the default
    here is `token-mean`, like every loss in this package). `ref_logp` may be omitted iff
    `kl_coef == 0`. Note k-estimators assume tokens drawn from π_θ; for stale samples they are
    the usual (uncorrected) approximation.

    Extra metrics over `ppo`'s: `kl_ref` (token mean of `D_t`), `kl_loss` (= β·agg(D)), and
    `pg_loss` (the clipped-surrogate part alone).
    """
    check_clip(clip_low, clip_high, dual_clip)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if ref_logp is None and kl_coef != 0:
        raise ValueError("grpo needs ref_logp when kl_coef != 0")
    t = _inputs.prepare(logp, behavior_logp, advantages, mask, ref_logp=ref_logp)
    clip = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    obj, metrics = _surrogate_terms(t, **clip, sequence_ratio=sequence_ratio)

    def agg(x):
        return _aggregation.aggregate(x, t.valid, aggregation, max_length=max_length)

    pg_loss = agg(-obj)
    if ref_logp is None:
        kl = jnp.zeros_like(obj)
    else:
        kl = _regularizers.kl_divergence(t.logp, t.extra["ref_logp"], estimator=kl_estimator)
    kl_loss = kl_coef * agg(kl)
    metrics |= {"pg_loss": pg_loss, "kl_loss": kl_loss, "kl_ref": _inputs.masked_mean(kl, t.valid)}
    return pg_loss + kl_loss, jax.lax.stop_gradient(metrics)
