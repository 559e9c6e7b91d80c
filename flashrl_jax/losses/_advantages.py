"""Advantage estimators: group baselines (GRPO, Dr. GRPO, RLOO), token returns (REINFORCE++, GAE).

Why here: the advantage is half of every policy loss and the most common source of silent
ablation bugs (which std, which baseline, what a group of one means), so each estimator is a
small pure function with its convention written down.

Groups are explicit integer ids `[B]` (samples sharing an id answered the same prompt). Group
statistics use a `[B, B]` same-group matrix: static shapes, any id values, no sorting, and cheap
at rollout batch sizes. A group of size 1 has no baseline to compare against: its advantage is
defined as 0 for GRPO, Dr. GRPO and RLOO (the sample carries no learning signal).

Token-level estimators take `[B, T]` rewards (or `[B]` sequence rewards, placed on the last valid
token) and a mask; masked positions are transparent (skipped by the recursion, so interior
non-response tokens, e.g. tool outputs in a multi-turn trace, neither discount nor bootstrap) and
get advantage 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def _check_groups(rewards: ArrayLike, group_ids: ArrayLike) -> tuple[jax.Array, jax.Array]:
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B] (one scalar per sample), got shape {rewards.shape}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids has shape {group_ids.shape} but rewards has shape {rewards.shape}"
        )
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")
    return rewards, group_ids


def _group_moments(rewards: jax.Array, group_ids: jax.Array):
    """Per-sample size, mean and unbiased (ddof=1) std of its own group; std is 0 for size 1."""
    same = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32)  # [B, B]
    size = same.sum(-1)
    mean = same @ rewards / size
    # Deviations from the group's own mean (not E[x²] − E[x]²) to avoid cancellation.
    sq_dev = (same * (rewards[None, :] - mean[:, None]) ** 2).sum(-1)
    std = jnp.sqrt(sq_dev / jnp.maximum(size - 1.0, 1.0))
    return size, mean, std


def grpo_advantages(
    rewards: ArrayLike, group_ids: ArrayLike, *, scale_by_std: bool = True, eps: float = 1e-6
) -> jax.Array:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath §4.1.2), `[B]`.

    `Â_i = (r_i − mean_g(r)) / (std_g(r) + eps)` within sample i's group g, with the unbiased
    (ddof=1) std as in the common PyTorch implementations; `scale_by_std=False` gives
    `r_i − mean_g(r)` (Dr. GRPO). Groups of size 1 get 0.
    """
    rewards, group_ids = _check_groups(rewards, group_ids)
    size, mean, std = _group_moments(rewards, group_ids)
    adv = rewards - mean
    if scale_by_std:
        adv = adv / (std + eps)
    return jnp.where(size > 1, adv, 0.0)


def dr_grpo_advantages(rewards: ArrayLike, group_ids: ArrayLike) -> jax.Array:
    """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training"), `[B]`.

    `Â_i = r_i − mean_g(r)`: no std division, which the paper shows biases updates toward
    too-easy and too-hard prompts. Groups of size 1 get 0.
    """
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


def rloo_advantages(rewards: ArrayLike, group_ids: ArrayLike) -> jax.Array:
    """RLOO advantages (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE..."), `[B]`.

    `Â_i = r_i − (1/(n−1)) Σ_{j≠i in g} r_j`, the leave-one-out baseline (unbiased, since it does
    not depend on sample i). Groups of size 1 (`n = 1`, no other sample) get 0.
    """
    rewards, group_ids = _check_groups(rewards, group_ids)
    size, mean, _ = _group_moments(rewards, group_ids)
    others_mean = (size * mean - rewards) / jnp.maximum(size - 1.0, 1.0)
    return jnp.where(size > 1, rewards - others_mean, 0.0)


def _token_rewards(rewards: ArrayLike, mask: jax.Array) -> jax.Array:
    """`[B, T]` rewards as given, or `[B]` rewards placed on each row's last valid token."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape == mask.shape:
        return jnp.where(mask, rewards, 0.0)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards has shape {rewards.shape} but must be [B] = {mask.shape[:1]} or "
            f"[B, T] = {mask.shape} for mask of shape {mask.shape}"
        )
    t = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask, t, -1), axis=-1)  # -1 for an empty row: reward goes nowhere
    return jnp.where(t[None, :] == last[:, None], rewards[:, None], 0.0)


def _check_mask(mask: ArrayLike) -> jax.Array:
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {mask.shape}")
    return mask != 0


def whiten(x: ArrayLike, mask: ArrayLike, *, eps: float = 1e-8) -> jax.Array:
    """`(x − μ) / sqrt(σ² + eps)` with μ, σ² (population) over the valid tokens; 0 elsewhere."""
    x = jnp.asarray(x, jnp.float32)
    mask = jnp.asarray(mask) != 0
    n = jnp.maximum(mask.sum(), 1)
    mean = jnp.where(mask, x, 0.0).sum() / n
    var = jnp.where(mask, (x - mean) ** 2, 0.0).sum() / n
    return jnp.where(mask, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)


def _reverse_scan(step, init, *xs):
    """Runs `step(carry, x_t) -> (carry, y_t)` from t = T−1 down to 0 over `[B, T]` arrays."""
    _, ys = jax.lax.scan(step, init, tuple(x.T for x in xs), reverse=True)
    return ys.T


def discounted_returns(rewards: ArrayLike, mask: ArrayLike, *, gamma: float = 1.0) -> jax.Array:
    """`G_t = r_t + γ G_{t'}` with `t'` the next valid token; `[B, T]`, 0 at masked positions."""
    mask = _check_mask(mask)
    rewards = _token_rewards(rewards, mask)

    def step(g, x):
        r, m = x
        g = jnp.where(m, r + gamma * g, g)
        return g, jnp.where(m, g, 0.0)

    return _reverse_scan(step, jnp.zeros(mask.shape[0]), rewards, mask)


def reinforce_plus_plus_advantages(
    rewards: ArrayLike, mask: ArrayLike, *, gamma: float = 1.0, eps: float = 1e-8
) -> jax.Array:
    """REINFORCE++ advantages `[B, T]` (Hu 2025, "REINFORCE++: ... Robust to Prompt and Reward
    Models").

    Discounted token returns `G_t` (see `discounted_returns`), then normalised over all valid
    tokens of the *batch* (no per-prompt baseline, no critic): `(G − μ) / sqrt(σ² + eps)`. Per-token
    KL penalties (`kl_reward_penalty`) belong in `rewards` beforehand, as in the paper.
    """
    mask = _check_mask(mask)
    return whiten(discounted_returns(rewards, mask, gamma=gamma), mask, eps=eps)


def gae_advantages(
    rewards: ArrayLike,
    values: ArrayLike,
    mask: ArrayLike,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016), returns `(advantages, returns)`.

    Over the valid tokens of a row, `δ_t = r_t + γ V_{t'} − V_t` and `Â_t = δ_t + γλ Â_{t'}`, with
    `t'` the next valid token and `V = 0`, `Â = 0` past the last one (the episode ends with the
    response). `returns = Â + V` are the value-head targets. Both are 0 at masked positions.
    """
    mask = _check_mask(mask)
    values = jnp.asarray(values, jnp.float32)
    if values.shape != mask.shape:
        raise ValueError(f"values has shape {values.shape} but mask has shape {mask.shape}")
    rewards = _token_rewards(rewards, mask)
    values = jnp.where(mask, values, 0.0)

    def step(carry, x):
        next_value, next_adv = carry
        r, v, m = x
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
        return carry, jnp.where(m, adv, 0.0)

    zeros = jnp.zeros(mask.shape[0])
    adv = _reverse_scan(step, (zeros, zeros), rewards, values, mask)
    return adv, jnp.where(mask, adv + values, 0.0)
