"""flashrl_jax.losses: off-policy policy losses, advantages, KL/entropy terms, diagnostics.

Pure functions of `[B, T]` arrays; the model never runs inside a loss (log-probs and entropies are
computed outside, chunked over the vocabulary). Ratios are taken against the *behaviour policy*,
the log-probs the rollout engine reported for the tokens it sampled. Every loss returns
`(loss, metrics)`: a scalar and a dict of scalar arrays. The trainer selects a loss with a
`LossConfig` and calls `compute_policy_loss`; formulas and papers are listed in README.md.
"""

from flashrl_jax.losses._advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    whiten,
)
from flashrl_jax.losses._aggregation import Aggregation, aggregate
from flashrl_jax.losses._config import LossConfig, LossName, compute_policy_loss
from flashrl_jax.losses._diagnostics import (
    RATIO_HISTOGRAM_EDGES,
    ratio_histogram,
    ratio_outside_fraction,
    staleness,
    staleness_metrics,
)
from flashrl_jax.losses._inputs import MAX_LOG_RATIO
from flashrl_jax.losses._ppo import decoupled_ppo, grpo, ppo
from flashrl_jax.losses._regularizers import (
    KLEstimator,
    entropy_bonus,
    kl_divergence,
    kl_loss,
    kl_reward_penalty,
)
from flashrl_jax.losses._reinforce import cispo, tis, topr

__all__ = [
    "Aggregation",
    "KLEstimator",
    "LossConfig",
    "LossName",
    "MAX_LOG_RATIO",
    "RATIO_HISTOGRAM_EDGES",
    "aggregate",
    "cispo",
    "compute_policy_loss",
    "decoupled_ppo",
    "discounted_returns",
    "dr_grpo_advantages",
    "entropy_bonus",
    "gae_advantages",
    "grpo",
    "grpo_advantages",
    "kl_divergence",
    "kl_loss",
    "kl_reward_penalty",
    "ppo",
    "ratio_histogram",
    "ratio_outside_fraction",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "staleness",
    "staleness_metrics",
    "tis",
    "topr",
    "whiten",
]
