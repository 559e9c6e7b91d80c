"""Behaviour/mismatch diagnostics: how off-policy is a batch, and how far its ratios spread.

Why: in asynchronous training the question "is this run stable?" is answered by how stale the
samples are (in policy versions) and how far `r = π_θ / μ` strays from 1. These functions work on
any batch, inside or outside a loss, and return dicts of scalar float32 arrays ready to log.
Everything is computed under `stop_gradient`; statistics over an empty selection are 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from flashrl_jax.losses import _inputs

# Fixed (not data-dependent) edges so histograms are comparable across steps and runs. Buckets are
# [edge_k, edge_{k+1}) with an open bucket below the first and above the last edge.
RATIO_HISTOGRAM_EDGES: tuple[float, ...] = (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)


def ratio_outside_fraction(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    mask: ArrayLike,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> jax.Array:
    """Fraction of valid tokens whose `r = exp(logp − behavior_logp)` lies outside `[low, high]`."""
    t = _inputs.prepare(logp, behavior_logp, jnp.zeros(jnp.shape(logp)[:1]), mask)
    lr = jax.lax.stop_gradient(t.logp - t.behavior_logp)  # unclamped: compared in log space
    outside = (lr < math.log(low)) | (lr > math.log(high))
    return _inputs.masked_mean(outside, t.valid)


def ratio_histogram(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    mask: ArrayLike,
    *,
    edges: tuple[float, ...] = RATIO_HISTOGRAM_EDGES,
) -> dict[str, jax.Array]:
    """Fractions of valid tokens per IS-ratio bucket, keyed `is_ratio_hist/<lo>-<hi>`.

    With the default edges the keys are `<0.5`, `0.5-0.8`, ..., `1.25-2`, `>=2` (prefixed). The
    fractions sum to 1 when at least one token is valid, else all are 0.
    """
    if list(edges) != sorted(edges) or len(set(edges)) != len(edges) or min(edges) <= 0:
        raise ValueError(f"edges must be strictly increasing and positive, got {edges}")
    t = _inputs.prepare(logp, behavior_logp, jnp.zeros(jnp.shape(logp)[:1]), mask)
    lr = jax.lax.stop_gradient(t.logp - t.behavior_logp)
    log_edges = [math.log(e) for e in edges]
    bounds = [-math.inf, *log_edges, math.inf]
    names = [f"<{edges[0]:g}"]
    names += [f"{lo:g}-{hi:g}" for lo, hi in zip(edges[:-1], edges[1:])]
    names += [f">={edges[-1]:g}"]
    return {
        f"is_ratio_hist/{name}": _inputs.masked_mean((lr >= lo) & (lr < hi), t.valid)
        for name, lo, hi in zip(names, bounds[:-1], bounds[1:])
    }


def ratio_metrics(token_log_ratio: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
    """The ratio metrics every loss reports, from `log r = logp − behavior_logp` (clamped).

    `approx_kl` is Schulman's k3 estimator of KL(μ ‖ π_θ) with tokens sampled from the behaviour
    policy μ: `k3 = (r − 1) − log r` (non-negative, unbiased). `log_ratio_mean` is `−k1`.
    """
    lr = jax.lax.stop_gradient(token_log_ratio)
    r = jnp.exp(lr)
    return {
        "ratio_mean": _inputs.masked_mean(r, valid),
        "ratio_max": _inputs.masked_max(r, valid),
        "ratio_min": _inputs.masked_min(r, valid),
        "log_ratio_mean": _inputs.masked_mean(lr, valid),
        "approx_kl": _inputs.masked_mean((r - 1.0) - lr, valid),
        "ratio_outside_0.5_2_frac": _inputs.masked_mean(
            (lr < math.log(0.5)) | (lr > math.log(2.0)), valid
        ),
        "tokens": valid.sum().astype(jnp.float32),
    }


def staleness(trainer_version: ArrayLike, behavior_version: ArrayLike) -> jax.Array:
    """Per-sample staleness `trainer_version − behavior_version` (in policy versions), `[B]` int32.

    `behavior_version` is the policy version that generated each sample (for a sample whose
    generation spanned a weight update, pass the oldest version involved).
    """
    behavior_version = jnp.asarray(behavior_version)
    if behavior_version.ndim != 1:
        raise ValueError(f"behavior_version must be [B], got shape {behavior_version.shape}")
    if jnp.ndim(trainer_version) != 0:
        shape = jnp.shape(trainer_version)
        raise ValueError(f"trainer_version must be a scalar, got shape {shape}")
    return (jnp.asarray(trainer_version) - behavior_version).astype(jnp.int32)


def staleness_metrics(
    trainer_version: ArrayLike,
    behavior_version: ArrayLike,
    *,
    sample_mask: ArrayLike | None = None,
    max_bucket: int = 8,
) -> dict[str, jax.Array]:
    """Summary and histogram of per-sample staleness.

    Keys: `staleness_mean/max/min`, `staleness_hist/k` for `k = 0 … max_bucket−1` and
    `staleness_hist/>=max_bucket` (fractions of samples), and `staleness_negative_frac` (samples
    claiming a version newer than the trainer: a bookkeeping bug upstream; they are not in the
    histogram). `sample_mask` `[B]` excludes padding samples.
    """
    if max_bucket < 1:
        raise ValueError(f"max_bucket must be >= 1, got {max_bucket}")
    s = staleness(trainer_version, behavior_version)
    if sample_mask is None:
        valid = jnp.ones(s.shape, bool)
    else:
        valid = jnp.asarray(sample_mask) != 0
        if valid.shape != s.shape:
            raise ValueError(
                f"sample_mask has shape {valid.shape} but behavior_version has shape {s.shape}"
            )
    out = {
        "staleness_mean": _inputs.masked_mean(s.astype(jnp.float32), valid),
        "staleness_max": _inputs.masked_max(s.astype(jnp.float32), valid),
        "staleness_min": _inputs.masked_min(s.astype(jnp.float32), valid),
        "staleness_negative_frac": _inputs.masked_mean(s < 0, valid),
    }
    for k in range(max_bucket):
        out[f"staleness_hist/{k}"] = _inputs.masked_mean(s == k, valid)
    out[f"staleness_hist/>={max_bucket}"] = _inputs.masked_mean(s >= max_bucket, valid)
    return out
