"""Aggregation modes and advantage estimators against numbers worked out by hand."""

import math

import numpy as np
import pytest

from flashrl_jax import losses

PER_TOKEN = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = np.array([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "agg,max_length,expected",
    [
        ("token-mean", None, (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", None, ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum", None, ((1 + 2) + 4) / 2),
        ("seq-mean-token-sum-norm", None, ((1 + 2) / 3 + 4 / 3) / 2),  # L defaults to T = 3
        ("seq-mean-token-sum-norm", 10, ((1 + 2) / 10 + 4 / 10) / 2),
    ],
)
def test_aggregation_2x3_by_hand(agg, max_length, expected):
    got = losses.aggregate(PER_TOKEN, MASK, agg, max_length=max_length)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # the enum and its string value are interchangeable
    got_enum = losses.aggregate(PER_TOKEN, MASK, losses.Aggregation(agg), max_length=max_length)
    assert float(got_enum) == float(got)
    # Through a loss: on-policy TIS with A = 1 has per-token loss −logp.
    loss, _ = losses.tis(-PER_TOKEN, -PER_TOKEN, np.ones(2), MASK, aggregation=agg,
                         max_length=max_length)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "agg,expected",
    [
        ("token-mean", 1.5),
        ("seq-mean-token-mean", 1.5),  # the empty row is not counted as a sequence
        ("seq-mean-token-sum", 3.0),
        ("seq-mean-token-sum-norm", 1.0),
    ],
)
def test_aggregation_skips_empty_rows_and_masked_garbage(agg, expected):
    per_token = np.array([[1.0, 2.0, np.nan], [np.inf, -np.inf, np.nan]])
    mask = np.array([[1, 1, 0], [0, 0, 0]])
    np.testing.assert_allclose(losses.aggregate(per_token, mask, agg), expected, rtol=1e-6)
    assert float(losses.aggregate(per_token, np.zeros_like(mask), agg)) == 0.0


def test_unknown_aggregation_is_a_clear_error():
    with pytest.raises(ValueError, match="aggregation='token_mean' is not one of"):
        losses.aggregate(PER_TOKEN, MASK, "token_mean")
    with pytest.raises(ValueError, match="max_length"):
        losses.aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm", max_length=0)


# ---------------------------------------------------------------- group advantages

REWARDS = np.array([1.0, 0.0, 1.0, 5.0, 2.0])
GROUPS = np.array([3, 3, 3, 9, 4])  # group 3 of three samples, two singleton groups


def test_grpo_advantages_by_hand():
    # group 3: mean 2/3, deviations (1/3, −2/3, 1/3), unbiased var = (6/9)/2 = 1/3
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / std, (-2 / 3) / std, (1 / 3) / std, 0.0, 0.0]
    got = losses.grpo_advantages(REWARDS, GROUPS, eps=0.0)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    got_eps = losses.grpo_advantages(REWARDS, GROUPS, eps=0.1)
    np.testing.assert_allclose(got_eps[:3], np.array([1, -2, 1]) / 3 / (std + 0.1), rtol=1e-5)


def test_dr_grpo_and_unscaled_grpo_advantages_by_hand():
    expected = [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0]
    np.testing.assert_allclose(losses.dr_grpo_advantages(REWARDS, GROUPS), expected, rtol=1e-6)
    np.testing.assert_allclose(
        losses.grpo_advantages(REWARDS, GROUPS, scale_by_std=False), expected, rtol=1e-6
    )


def test_rloo_advantages_by_hand():
    # 1 − mean(0, 1), 0 − mean(1, 1), 1 − mean(1, 0); singletons get 0
    np.testing.assert_allclose(
        losses.rloo_advantages(REWARDS, GROUPS), [0.5, -1.0, 0.5, 0.0, 0.0], rtol=1e-6
    )


def test_interleaved_group_ids():
    rewards, ids = np.array([1.0, 3.0, 0.0, 5.0]), np.array([7, 2, 7, 2])
    np.testing.assert_allclose(losses.dr_grpo_advantages(rewards, ids), [0.5, -1, -0.5, 1])
    np.testing.assert_allclose(losses.rloo_advantages(rewards, ids), [1, -2, -1, 2])


def test_constant_group_gives_zero_not_nan():
    got = losses.grpo_advantages(np.array([1.0, 1.0, 1.0]), np.array([0, 0, 0]))
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0])


def test_group_advantage_input_errors():
    with pytest.raises(ValueError, match=r"group_ids has shape \(4,\) but rewards has shape"):
        losses.grpo_advantages(REWARDS, GROUPS[:4])
    with pytest.raises(ValueError, match="rewards must be"):
        losses.rloo_advantages(REWARDS[None], GROUPS[None])
    with pytest.raises(ValueError, match="integers"):
        losses.grpo_advantages(REWARDS, GROUPS.astype(float))


# ---------------------------------------------------------------- token advantages


def test_gae_by_hand():
    rewards = np.array([[0.0, 0.0, 1.0]])
    values = np.array([[0.5, 0.6, 0.7]])
    adv, ret = losses.gae_advantages(rewards, values, np.ones((1, 3)), gamma=0.9, lam=0.8)
    a2 = 1 - 0.7
    a1 = (0.9 * 0.7 - 0.6) + 0.72 * a2
    a0 = (0.9 * 0.6 - 0.5) + 0.72 * a1
    np.testing.assert_allclose(adv, [[a0, a1, a2]], rtol=1e-5)
    np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7]], rtol=1e-5)


def test_gae_masked_positions_are_transparent_and_sequence_reward_goes_last():
    mask = np.array([[1, 0, 1, 1, 0]])
    values = np.array([[0.5, 99.0, 0.6, 0.7, 42.0]])
    adv, ret = losses.gae_advantages(np.array([1.0]), values, mask, gamma=0.9, lam=0.8)
    a2 = 1 - 0.7
    a1 = (0.9 * 0.7 - 0.6) + 0.72 * a2
    a0 = (0.9 * 0.6 - 0.5) + 0.72 * a1
    np.testing.assert_allclose(adv, [[a0, 0, a1, a2, 0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ret, [[a0 + 0.5, 0, a1 + 0.6, a2 + 0.7, 0]], rtol=1e-5, atol=1e-7)


def test_gae_with_unit_gamma_lambda_is_monte_carlo_minus_value():
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(2, 4)), rng.normal(size=(2, 4))
    adv, _ = losses.gae_advantages(rewards, values, np.ones((2, 4)))
    mc = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
    np.testing.assert_allclose(adv, mc - values, rtol=1e-5, atol=1e-6)


def test_discounted_returns_by_hand():
    rewards = np.array([[0.0, 1.0, 2.0, 7.0], [3.0, 0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    got = losses.discounted_returns(rewards, mask, gamma=0.5)
    np.testing.assert_allclose(got, [[0 + 0.5 * 2, 1 + 0.5 * 2, 2, 0], [3, 0, 0, 0]])


def test_reinforce_plus_plus_by_hand():
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    # returns (γ = 1): row 0 → 1, 1, 1; row 1 → 2, 2. Over 5 tokens: μ = 1.4, σ² = 0.24.
    got = losses.reinforce_plus_plus_advantages(np.array([1.0, 2.0]), mask, eps=0.0)
    s = math.sqrt(0.24)
    np.testing.assert_allclose(got, [[-0.4 / s] * 3 + [0], [0.6 / s] * 2 + [0, 0]], rtol=1e-5)


def test_token_advantage_input_errors():
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\)"):
        losses.reinforce_plus_plus_advantages(np.ones(3), np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\)"):
        losses.gae_advantages(np.ones(2), np.ones((2, 3)), np.ones((2, 4)))
