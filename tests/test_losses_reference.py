"""Each policy loss against an independent float64 NumPy implementation of its published formula.

Values and gradients w.r.t. `logp` are both checked. The NumPy gradients are derived by hand from
each formula (so a misplaced stop-gradient in the JAX code shows up as a gradient mismatch), and
for the losses without a stop-gradient weight also by central finite differences of the NumPy
value, which checks the hand derivations themselves.
"""

import jax
import numpy as np
import pytest

from flashrl_jax import losses

AGGS = [a.value for a in losses.Aggregation]
MAX_LENGTH = 7  # a Dr. GRPO constant different from T, so the normaliser is really exercised
B, T = 4, 5
MASK = np.array(
    [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], dtype=np.float64
)


# ---------------------------------------------------------------- float64 NumPy references


def np_token_weights(mask, agg, max_length=None):
    """c such that the aggregated loss is Σ_it c_it ℓ_it (written from the mode definitions)."""
    m = mask.astype(np.float64)
    n = m.sum(1, keepdims=True)
    rows = max((n > 0).sum(), 1)
    if agg == "token-mean":
        return m / max(m.sum(), 1)
    if agg == "seq-mean-token-mean":
        return m / np.maximum(n, 1) / rows
    if agg == "seq-mean-token-sum":
        return m / rows
    return m / (max_length or mask.shape[1]) / rows


def np_ppo_obj(r, a, lo, hi, dual=None):
    """Per-token PPO objective and d obj / d log r."""
    unclipped, clipped = r * a, np.clip(r, 1 - lo, 1 + hi) * a
    obj = np.minimum(unclipped, clipped)
    dobj = np.where(unclipped <= clipped, r * a, 0.0)
    if dual is not None:
        floored = (a < 0) & (obj < dual * a)
        obj = np.where(floored, dual * a, obj)
        dobj = np.where(floored, 0.0, dobj)
    return obj, dobj


def np_ppo(lp, b, a, mask, agg, lo=0.2, hi=0.2, dual=None, seq=False):
    c = np_token_weights(mask, agg, MAX_LENGTH)
    log_r = lp - b
    if seq:  # GSPO: s_i = exp(mean_t log r_it) over the row's valid tokens
        n = np.maximum(mask.sum(1, keepdims=True), 1)
        log_r = np.broadcast_to((log_r * mask).sum(1, keepdims=True) / n, lp.shape)
    obj, dobj = np_ppo_obj(np.exp(log_r), a, lo, hi, dual)
    if seq:  # chain rule through the row mean: d log s_i / d lp_it = mask_it / n_i
        grad = -(c * dobj).sum(1, keepdims=True) * mask / n
    else:
        grad = -c * dobj
    return -(c * obj).sum(), grad


def np_decoupled(lp, b, prox, a, mask, agg, lo=0.2, hi=0.2, cap=None):
    c = np_token_weights(mask, agg, MAX_LENGTH)
    w = np.exp(prox - b)
    if cap is not None:
        w = np.minimum(w, cap)
    obj, dobj = np_ppo_obj(np.exp(lp - prox), a, lo, hi)
    return -(c * w * obj).sum(), -c * w * dobj


def np_weighted(lp, b, a, mask, agg, weight_fn):
    """−Σ c·sg(weight(r))·A·logp: the gradient is −c·weight·A, the weight being a constant."""
    c = np_token_weights(mask, agg, MAX_LENGTH)
    w = weight_fn(np.exp(lp - b))
    return -(c * w * a * lp).sum(), -c * w * a


def np_kl(lp, ref, est):
    """Per-token estimate of KL(π_θ‖π_ref) and its derivative w.r.t. lp."""
    d = lp - ref  # = −log(π_ref/π_θ)
    if est == "k1":
        return d, np.ones_like(d)
    if est == "k2":
        return 0.5 * d**2, d
    return np.exp(-d) - 1 + d, 1 - np.exp(-d)


def np_grpo(lp, b, ref, a, mask, agg, beta, est):
    c = np_token_weights(mask, agg, MAX_LENGTH)
    obj, dobj = np_ppo_obj(np.exp(lp - b), a, 0.2, 0.2)
    kl, dkl = np_kl(lp, ref, est)
    return (c * (-obj + beta * kl)).sum(), c * (-dobj + beta * dkl)


def finite_diff(f, lp, eps=1e-6):
    g = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        up, down = lp.copy(), lp.copy()
        up[idx] += eps
        down[idx] -= eps
        g[idx] = (f(up) - f(down)) / (2 * eps)
    return g


# ---------------------------------------------------------------- data


def make_batch(seed, kinks=(0.8, 1.2, 1.28, 2.0, 3.0)):
    """Random batch whose ratios stay clear of the kinks (clip bounds, caps) of the losses."""
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        lp = -rng.uniform(0.1, 3.0, (B, T))
        b = lp + rng.normal(0, 0.35, (B, T))
        prox = lp + rng.normal(0, 0.25, (B, T))
        ref = lp + rng.normal(0, 0.3, (B, T))
        ratios = np.concatenate([np.exp(lp - b), np.exp(lp - prox), np.exp(prox - b)]).ravel()
        if all(np.abs(ratios - k).min() > 1e-3 for k in kinks):
            a = rng.normal(0, 1, (B, T))
            return lp, b, prox, ref, a
    raise AssertionError("could not draw a kink-free batch")


def jax_value_and_grad(fn, lp, *args, **kwargs):
    f = lambda x: fn(x, *args, **kwargs)[0]  # noqa: E731
    value, grad = jax.value_and_grad(f)(np.float32(lp))
    return float(value), np.asarray(grad, np.float64)


def assert_matches(jax_vg, np_vg):
    (jv, jg), (nv, ng) = jax_vg, np_vg
    np.testing.assert_allclose(jv, nv, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(jg, ng, rtol=2e-4, atol=1e-6)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_matches_numpy(agg, dual, seed):
    lp, b, _, _, a = make_batch(seed)
    # Two negative-advantage tokens with ratios above the dual-clip constant 3.
    b[0, 0], a[0, 0] = lp[0, 0] - np.log(4.0), -1.5
    b[3, 2], a[3, 2] = lp[3, 2] - np.log(3.5), -0.5
    kw = dict(dual_clip=dual, clip_low=0.2, clip_high=0.28, aggregation=agg, max_length=MAX_LENGTH)
    got = jax_value_and_grad(losses.ppo, lp, b, a, MASK, **kw)
    _, metrics = losses.ppo(lp, b, a, MASK, **kw)
    assert float(metrics["clip_frac"]) > 0  # the clipped branch is exercised
    assert (float(metrics["dual_clip_frac"]) > 0) == (dual is not None)
    want = np_ppo(lp, b, a, MASK, agg, 0.2, 0.28, dual)
    assert_matches(got, want)
    fd = finite_diff(lambda x: np_ppo(x, b, a, MASK, agg, 0.2, 0.28, dual)[0], lp)
    np.testing.assert_allclose(want[1], fd, atol=1e-7)


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_sequence_ratio_matches_numpy(agg):
    lp, b, _, _, a = make_batch(3)
    # GSPO-sized clip ranges so that some sequences are clipped and some are not.
    kw = dict(clip_low=0.02, clip_high=0.03, aggregation=agg, max_length=MAX_LENGTH)
    got = jax_value_and_grad(losses.ppo, lp, b, a, MASK, sequence_ratio=True, **kw)
    want = np_ppo(lp, b, a, MASK, agg, 0.02, 0.03, seq=True)
    assert 0 < float(losses.ppo(lp, b, a, MASK, sequence_ratio=True, **kw)[1]["clip_frac"]) < 1
    assert_matches(got, want)
    fd = finite_diff(lambda x: np_ppo(x, b, a, MASK, agg, 0.02, 0.03, seq=True)[0], lp)
    np.testing.assert_allclose(want[1], fd, atol=1e-7)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("cap", [None, 1.1])
def test_decoupled_ppo_matches_numpy(agg, cap):
    lp, b, prox, _, a = make_batch(4, kinks=(0.8, 1.2, 1.1))
    kw = dict(prox_logp=prox, behavior_weight_cap=cap, aggregation=agg, max_length=MAX_LENGTH)
    got = jax_value_and_grad(losses.decoupled_ppo, lp, b, a, MASK, **kw)
    want = np_decoupled(lp, b, prox, a, MASK, agg, cap=cap)
    assert_matches(got, want)
    fd = finite_diff(lambda x: np_decoupled(x, b, prox, a, MASK, agg, cap=cap)[0], lp)
    np.testing.assert_allclose(want[1], fd, atol=1e-7)


@pytest.mark.parametrize("agg", AGGS)
def test_tis_matches_numpy(agg):
    lp, b, _, _, a = make_batch(5, kinks=(1.1,))
    got = jax_value_and_grad(
        losses.tis, lp, b, a, MASK, is_cap=1.1, aggregation=agg, max_length=MAX_LENGTH
    )
    assert_matches(got, np_weighted(lp, b, a, MASK, agg, lambda r: np.minimum(r, 1.1)))


@pytest.mark.parametrize("agg", AGGS)
def test_cispo_matches_numpy(agg):
    lp, b, _, _, a = make_batch(6, kinks=(0.9, 1.15))
    kw = dict(clip_low=0.1, clip_high=0.15, aggregation=agg, max_length=MAX_LENGTH)
    got = jax_value_and_grad(losses.cispo, lp, b, a, MASK, **kw)
    assert_matches(got, np_weighted(lp, b, a, MASK, agg, lambda r: np.clip(r, 0.9, 1.15)))


@pytest.mark.parametrize("agg", AGGS)
def test_topr_matches_numpy(agg):
    lp, b, _, _, a = make_batch(7, kinks=(0.9,))
    positive = np.array([True, False, True, False])
    weight = lambda r: np.where(positive[:, None], 1.0, np.clip(r, 0, 0.9))  # noqa: E731
    kw = dict(positive=positive, is_cap=0.9, aggregation=agg, max_length=MAX_LENGTH)
    got = jax_value_and_grad(losses.topr, lp, b, a, MASK, **kw)
    assert_matches(got, np_weighted(lp, b, a, MASK, agg, weight))


@pytest.mark.parametrize("name,weight", [("tis", lambda r: np.minimum(r, 2.0)),
                                         ("cispo", lambda r: np.clip(r, 0.8, 1.2))])
def test_sequence_ratio_weighted_losses_match_numpy(name, weight):
    lp, b, _, _, a = make_batch(8)
    n = np.maximum(MASK.sum(1, keepdims=True), 1)
    seq_lr = ((lp - b) * MASK).sum(1, keepdims=True) / n  # GSPO geometric mean, per row
    seq_weight = lambda r: weight(np.exp(seq_lr) * np.ones_like(r))  # noqa: E731
    fn = getattr(losses, name)
    got = jax_value_and_grad(fn, lp, b, a, MASK, sequence_ratio=True)
    assert_matches(got, np_weighted(lp, b, a, MASK, "token-mean", seq_weight))


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_grpo_matches_numpy(est, agg):
    lp, b, _, ref, a = make_batch(9)
    kw = dict(ref_logp=ref, kl_coef=0.3, kl_estimator=est, aggregation=agg)
    got = jax_value_and_grad(losses.grpo, lp, b, a, MASK, **kw)
    want = np_grpo(lp, b, ref, a, MASK, agg, 0.3, est)
    assert_matches(got, want)
    fd = finite_diff(lambda x: np_grpo(x, b, ref, a, MASK, agg, 0.3, est)[0], lp)
    np.testing.assert_allclose(want[1], fd, atol=1e-7)


ON_POLICY = {
    "ppo": lambda lp, a, m, **kw: losses.ppo(lp, lp, a, m, **kw),
    "ppo_dual": lambda lp, a, m, **kw: losses.ppo(lp, lp, a, m, dual_clip=3.0, **kw),
    "decoupled_ppo": lambda lp, a, m, **kw: losses.decoupled_ppo(lp, lp, a, m, prox_logp=lp, **kw),
    "tis": lambda lp, a, m, **kw: losses.tis(lp, lp, a, m, **kw),
    "cispo": lambda lp, a, m, **kw: losses.cispo(lp, lp, a, m, **kw),
    "topr": lambda lp, a, m, **kw: losses.topr(lp, lp, a, m, positive=a[:, 0] > 0, **kw),
    "grpo": lambda lp, a, m, **kw: losses.grpo(lp, lp, a, m, ref_logp=lp, kl_coef=0.5, **kw),
}


@pytest.mark.parametrize("name", ON_POLICY)
@pytest.mark.parametrize("agg", AGGS)
def test_on_policy_gradient_is_reinforce(name, agg):
    """logp == behavior_logp == prox_logp (== ref_logp): every gradient is REINFORCE's −c·A."""
    lp, _, _, _, a = make_batch(10)
    a = np.broadcast_to(a[:, :1], a.shape).copy()  # sequence-level A, so TOPR's T+ is well defined
    def value_at(x):
        return ON_POLICY[name](x, a, MASK, aggregation=agg, max_length=MAX_LENGTH)[0]

    grad = np.asarray(jax.grad(value_at)(np.float32(lp)))
    reinforce = -np_token_weights(MASK, agg, MAX_LENGTH) * a
    np.testing.assert_allclose(grad, reinforce, rtol=1e-5, atol=1e-7)
    # and the same as differentiating the REINFORCE loss through our own aggregation
    pg = jax.grad(lambda x: losses.aggregate(-a * x, MASK, agg, max_length=MAX_LENGTH))
    np.testing.assert_allclose(grad, np.asarray(pg(np.float32(lp))), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["ppo", "tis", "cispo"])
def test_on_policy_sequence_ratio_gradient_is_reinforce(name):
    lp, _, _, _, a = make_batch(11)
    a_seq = a[:, 0]  # [B]: a sequence advantage, the GSPO setting
    fn = getattr(losses, name)
    grad = jax.grad(lambda x: fn(x, x, a_seq, MASK, sequence_ratio=True)[0])(np.float32(lp))
    reinforce = -np_token_weights(MASK, "token-mean") * a_seq[:, None]
    np.testing.assert_allclose(np.asarray(grad), reinforce, rtol=1e-5, atol=1e-7)


def test_on_policy_ratio_metrics_are_exactly_one():
    lp, _, _, _, a = make_batch(12)
    _, metrics = losses.ppo(lp, lp, a, MASK)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["ratio_max"]) == 1.0
    assert float(metrics["approx_kl"]) == 0.0 and float(metrics["clip_frac"]) == 0.0


def test_ppo_metrics_match_numpy():
    lp, b, _, _, a = make_batch(13)
    _, metrics = losses.ppo(lp, b, a, MASK)
    valid = MASK > 0
    r = np.exp(lp - b)[valid]
    av = a[valid]
    clipped = np.clip(r, 0.8, 1.2) * av < r * av
    np.testing.assert_allclose(metrics["ratio_mean"], r.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], r.max(), rtol=1e-5)
    np.testing.assert_allclose(metrics["approx_kl"], (r - 1 - np.log(r)).mean(), rtol=1e-4)
    np.testing.assert_allclose(metrics["clip_frac"], clipped.mean(), rtol=1e-6)
    np.testing.assert_allclose(
        metrics["ratio_outside_0.5_2_frac"], ((r < 0.5) | (r > 2)).mean(), rtol=1e-6
    )
    assert float(metrics["tokens"]) == valid.sum()
