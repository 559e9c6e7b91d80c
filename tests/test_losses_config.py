"""LossConfig validation, compute_policy_loss dispatch, KL estimators, entropy, diagnostics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashrl_jax import losses
from flashrl_jax.losses import LossName

B, T = 3, 4
RNG = np.random.default_rng(1)
LP = -RNG.uniform(0.1, 2.0, (B, T)).astype(np.float32)
BEH = (LP + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
PROX = (LP + RNG.normal(0, 0.2, (B, T))).astype(np.float32)
REF = (LP + RNG.normal(0, 0.2, (B, T))).astype(np.float32)
ENT = RNG.uniform(0.5, 2.0, (B, T)).astype(np.float32)
ADV = np.array([1.0, -0.5, 2.0], np.float32)
POS = np.array([True, False, True])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
INPUTS = dict(logp=LP, behavior_logp=BEH, advantages=ADV, mask=MASK, prox_logp=PROX,
              ref_logp=REF, positive=POS, entropy=ENT)


def test_config_turns_strings_into_enums():
    c = losses.LossConfig(name="cispo", aggregation="seq-mean-token-sum", kl_estimator="k1")
    assert c.name is LossName.CISPO
    assert c.aggregation is losses.Aggregation.SEQ_MEAN_TOKEN_SUM
    assert c.kl_estimator is losses.KLEstimator.K1
    assert {n.value for n in LossName} == {"ppo", "decoupled_ppo", "tis", "cispo", "topr", "grpo"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.clip_low = 0.1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(name="ppo2"), "unknown loss name 'ppo2'"),
        (dict(aggregation="mean"), "aggregation='mean' is not one of"),
        (dict(kl_estimator="k5"), "kl_estimator='k5' is not one of"),
        (dict(clip_low=1.5), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip must be > 1"),
        (dict(name="tis", dual_clip=3.0), "dual_clip applies to"),
        (dict(name="ppo", is_cap=2.0), "is_cap applies to tis and topr"),
        (dict(name="tis", is_cap=0.0), "is_cap must be > 0"),
        (dict(name="ppo", behavior_weight_cap=2.0), "behavior_weight_cap applies to decoupled_ppo"),
        (dict(name="decoupled_ppo", behavior_weight_cap=0.0), "behavior_weight_cap must be > 0"),
        (dict(name="decoupled_ppo", sequence_ratio=True), "sequence_ratio is not defined"),
        (dict(max_length=0), "max_length"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(entropy_coef=-1.0), "entropy_coef"),
    ],
)
def test_config_rejects_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        losses.LossConfig(**kwargs)


DIRECT = {
    LossName.PPO: lambda: losses.ppo(LP, BEH, ADV, MASK, clip_high=0.28, dual_clip=3.0),
    LossName.DECOUPLED_PPO: lambda: losses.decoupled_ppo(
        LP, BEH, ADV, MASK, prox_logp=PROX, clip_high=0.28, behavior_weight_cap=1.5
    ),
    LossName.TIS: lambda: losses.tis(LP, BEH, ADV, MASK, is_cap=2.0),
    LossName.CISPO: lambda: losses.cispo(LP, BEH, ADV, MASK, clip_high=0.28),
    LossName.TOPR: lambda: losses.topr(LP, BEH, ADV, MASK, positive=POS, is_cap=1.0),
    LossName.GRPO: lambda: losses.grpo(
        LP, BEH, ADV, MASK, ref_logp=REF, kl_coef=0.05, clip_high=0.28, kl_estimator="k2"
    ),
}
CONFIG = {
    LossName.PPO: dict(clip_high=0.28, dual_clip=3.0),
    LossName.DECOUPLED_PPO: dict(clip_high=0.28, behavior_weight_cap=1.5),
    LossName.TIS: dict(),  # the loss's default cap (2.0) applies when is_cap is None
    LossName.CISPO: dict(clip_high=0.28),
    LossName.TOPR: dict(),
    LossName.GRPO: dict(clip_high=0.28, kl_coef=0.05, kl_estimator="k2"),
}


@pytest.mark.parametrize("name", list(LossName))
def test_compute_policy_loss_dispatches_to_the_named_loss(name):
    config = losses.LossConfig(name=name.value, **CONFIG[name])
    loss, metrics = compute = losses.compute_policy_loss(config, **INPUTS)
    direct_loss, direct_metrics = DIRECT[name]()
    np.testing.assert_allclose(loss, direct_loss, rtol=1e-6)
    for key, value in direct_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=key)
    assert float(metrics["loss"]) == float(loss)
    # the losses really differ from each other on this off-policy batch
    others = [float(DIRECT[n]()[0]) for n in LossName if n is not name]
    assert all(abs(o - float(compute[0])) > 1e-4 for o in others)


def test_compute_policy_loss_adds_kl_and_entropy_terms():
    config = losses.LossConfig(name="cispo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss, metrics = losses.compute_policy_loss(config, **INPUTS)
    base, _ = losses.cispo(LP, BEH, ADV, MASK)
    valid = MASK > 0
    d = (LP - REF)[valid].astype(np.float64)
    kl = (np.exp(-d) - 1 + d).mean()
    expected = float(base) + 0.1 * kl - 0.01 * ENT[valid].mean()
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_ref"], kl, rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"], ENT[valid].mean(), rtol=1e-6)
    # the entropy gradient flows (to the entropy input) with weight −coef / tokens
    g = jax.grad(lambda h: losses.compute_policy_loss(config, **{**INPUTS, "entropy": h})[0])(ENT)
    np.testing.assert_allclose(g, np.where(valid, -0.01 / valid.sum(), 0.0), rtol=1e-5)


@pytest.mark.parametrize(
    "name,bad_input", [("ppo", "ref_logp"), ("grpo", "ref_logp"), ("decoupled_ppo", "prox_logp"),
                       ("tis", "entropy"), ("cispo", "behavior_logp")]
)
def test_compute_policy_loss_drops_tokens_with_bad_inputs_from_every_term(name, bad_input):
    bad = INPUTS[bad_input].copy()
    bad[0, 0] = np.nan
    bad[2, 1] = -np.inf
    config = losses.LossConfig(name=name, kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = losses.compute_policy_loss(config, **{**INPUTS, bad_input: bad})
    mask = MASK.copy()
    mask[0, 0] = mask[2, 1] = 0
    expected, expected_metrics = losses.compute_policy_loss(config, **{**INPUTS, "mask": mask})
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(metrics["entropy"], expected_metrics["entropy"], rtol=1e-6)
    assert float(metrics["nonfinite_tokens"]) == 2.0


@pytest.mark.parametrize(
    "config,missing",
    [
        (losses.LossConfig(name="decoupled_ppo"), "prox_logp"),
        (losses.LossConfig(name="topr"), "positive"),
        (losses.LossConfig(name="ppo", kl_coef=0.1), "ref_logp"),
        (losses.LossConfig(name="grpo", kl_coef=0.1), "ref_logp"),
        (losses.LossConfig(name="tis", entropy_coef=0.1), "entropy"),
    ],
)
def test_compute_policy_loss_missing_inputs(config, missing):
    with pytest.raises(ValueError, match=f"needs {missing}"):
        losses.compute_policy_loss(config, **{**INPUTS, missing: None})


def test_compute_policy_loss_jits_with_config_static():
    config = losses.LossConfig(name="grpo", kl_coef=0.04, sequence_ratio=True)
    step = jax.jit(lambda lp: losses.compute_policy_loss(config, **{**INPUTS, "logp": lp}))
    loss, metrics = step(LP)
    eager, _ = losses.compute_policy_loss(config, **INPUTS)
    np.testing.assert_allclose(loss, eager, rtol=1e-6)
    assert all(jnp.ndim(v) == 0 for v in metrics.values())


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_are_unbiased_or_not_as_documented():
    """Exact expectations over a categorical: E_p[k1] = E_p[k3] = KL(p‖q); E_p[k2] ≠ KL."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.25, 0.25, 0.25, 0.25])
    true_kl = (p * np.log(p / q)).sum()
    lp, lq = np.log(p)[None].astype(np.float32), np.log(q)[None].astype(np.float32)
    for est in ("k1", "k3"):
        k = np.asarray(losses.kl_divergence(lp, lq, estimator=est))[0]
        np.testing.assert_allclose((p * k).sum(), true_kl, rtol=1e-5)
    k2 = np.asarray(losses.kl_divergence(lp, lq, estimator="k2"))[0]
    np.testing.assert_allclose((p * k2).sum(), (p * 0.5 * np.log(q / p) ** 2).sum(), rtol=1e-5)
    assert abs((p * k2).sum() - true_kl) > 1e-3
    k3 = np.asarray(losses.kl_divergence(lp, lq, estimator="k3"))
    assert (k3 >= 0).all()


def test_kl_reward_penalty_is_masked_and_gradient_free():
    pen = losses.kl_reward_penalty(LP, REF, MASK, coef=0.5, estimator="k1")
    np.testing.assert_allclose(pen, np.where(MASK > 0, -0.5 * (LP - REF), 0.0), rtol=1e-6)
    g = jax.grad(lambda x: losses.kl_reward_penalty(x, REF, MASK, coef=0.5).sum())(LP)
    assert not np.asarray(g).any()


def test_kl_loss_gradient_matches_k3_derivative():
    g = jax.grad(lambda x: losses.kl_loss(x, REF, MASK, coef=2.0)[0])(LP)
    valid = MASK > 0
    expected = np.where(valid, 2.0 * (1 - np.exp(REF - LP)) / valid.sum(), 0.0)
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- diagnostics


def test_staleness_metrics_by_hand():
    m = losses.staleness_metrics(10, np.array([10, 9, 9, 7, 1, 11]), max_bucket=4)
    np.testing.assert_array_equal(losses.staleness(10, np.array([10, 9, 1])), [0, 1, 9])
    np.testing.assert_allclose(m["staleness_mean"], (0 + 1 + 1 + 3 + 9 - 1) / 6)
    assert float(m["staleness_max"]) == 9 and float(m["staleness_min"]) == -1
    np.testing.assert_allclose(
        [m[f"staleness_hist/{k}"] for k in ("0", "1", "2", "3", ">=4")],
        [1 / 6, 2 / 6, 0, 1 / 6, 1 / 6],
    )
    np.testing.assert_allclose(m["staleness_negative_frac"], 1 / 6)
    masked = losses.staleness_metrics(10, np.array([10, 2]), sample_mask=np.array([1, 0]))
    assert float(masked["staleness_max"]) == 0.0


def test_ratio_histogram_and_outside_fraction_by_hand():
    ratios = np.array([[0.3, 0.7, 1.0, 1.1], [1.5, 1.9, 5.0, 1.0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]])
    beh = np.full(ratios.shape, -1.0)
    lp = (np.log(ratios) + beh).astype(np.float32)
    hist = losses.ratio_histogram(lp, beh, mask)
    expected = {"<0.5": 1, "0.5-0.8": 1, "0.8-0.95": 0, "0.95-1.05": 1, "1.05-1.25": 1,
                "1.25-2": 2, ">=2": 1}
    for key, count in expected.items():
        np.testing.assert_allclose(hist[f"is_ratio_hist/{key}"], count / 7, err_msg=key)
    frac = losses.ratio_outside_fraction(lp, beh, mask)
    np.testing.assert_allclose(frac, 2 / 7, rtol=1e-6)  # 0.3 and 5.0
    with pytest.raises(ValueError, match="strictly increasing"):
        losses.ratio_histogram(lp, beh, mask, edges=(1.0, 0.5))
