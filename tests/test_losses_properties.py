"""Hypothesis property tests: any mask, any junk at masked positions, any grouping."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flashrl_jax import losses

# Few distinct shapes: every new shape recompiles, and the machine is small.
SHAPES = st.sampled_from([(1, 1), (3, 4), (4, 5)])  # (3, 4), (4, 5): shared with other files
JUNK = st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, 3.0])
AGGS = st.sampled_from([a.value for a in losses.Aggregation])
SETTINGS = settings(max_examples=25, deadline=None)

LOSSES = {
    "ppo": lambda lp, b, a, m, x, agg: losses.ppo(lp, b, a, m, dual_clip=3.0, aggregation=agg),
    "gspo": lambda lp, b, a, m, x, agg: losses.ppo(lp, b, a, m, sequence_ratio=True,
                                                  aggregation=agg),
    "decoupled_ppo": lambda lp, b, a, m, x, agg: losses.decoupled_ppo(
        lp, b, a, m, prox_logp=x, behavior_weight_cap=2.0, aggregation=agg),
    "tis": lambda lp, b, a, m, x, agg: losses.tis(lp, b, a, m, aggregation=agg),
    "cispo": lambda lp, b, a, m, x, agg: losses.cispo(lp, b, a, m, aggregation=agg),
    "topr": lambda lp, b, a, m, x, agg: losses.topr(
        lp, b, a, m, positive=np.arange(len(a)) % 2 == 0, aggregation=agg),
    "grpo": lambda lp, b, a, m, x, agg: losses.grpo(lp, b, a, m, ref_logp=x, kl_coef=0.1,
                                                   aggregation=agg),
}


@st.composite
def token_batches(draw):
    shape = draw(SHAPES)
    floats = lambda lo, hi: hnp.arrays(  # noqa: E731
        np.float32, shape, elements=st.floats(lo, hi, width=32)
    )
    lp = draw(floats(-8.0, -0.125))
    beh = lp + draw(floats(-1.0, 1.0))
    extra = lp + draw(floats(-1.0, 1.0))
    adv = draw(floats(-3.0, 3.0))
    adv = np.broadcast_to(adv[:, :1], shape).copy()  # sequence-level, as TOPR's T+ needs
    mask = draw(hnp.arrays(np.bool_, shape))
    junk = draw(hnp.arrays(np.float32, shape, elements=JUNK))
    return lp, beh, extra, adv, mask, junk


def run(name, agg, lp, beh, extra, adv, mask):
    fn = lambda x: LOSSES[name](x, beh, adv, mask, extra, agg)  # noqa: E731
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(lp))
    return float(loss), metrics, np.asarray(grad)


@SETTINGS
@given(batch=token_batches(), name=st.sampled_from(sorted(LOSSES)), agg=AGGS)
def test_loss_is_finite_and_blind_to_masked_positions(batch, name, agg):
    lp, beh, extra, adv, mask, junk = batch
    loss, metrics, grad = run(name, agg, lp, beh, extra, adv, mask)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert not grad[~mask].any()
    if not mask.any():
        assert loss == 0.0
    # Overwrite every masked-out position of every input with junk: nothing may change.
    dirty = [np.where(mask, x, junk) for x in (lp, beh, extra, adv)]
    loss2, _, grad2 = run(name, agg, *dirty, mask)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad2, grad, rtol=1e-6, atol=1e-7)


@SETTINGS
@given(batch=token_batches(), name=st.sampled_from(sorted(LOSSES)))
def test_nonfinite_masked_in_tokens_act_as_masked_out(batch, name):
    lp, beh, extra, adv, mask, junk = batch
    bad = mask & ~np.isfinite(junk)
    loss, metrics, grad = run(name, "token-mean", np.where(bad, junk, lp), beh, extra, adv, mask)
    assert float(metrics["nonfinite_tokens"]) == bad.sum()
    want_loss, _, want_grad = run(name, "token-mean", lp, beh, extra, adv, mask & ~bad)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7)


@SETTINGS
@given(shape=SHAPES, data=st.data(), c=st.floats(-10, 10), agg=AGGS)
def test_aggregating_a_constant(shape, data, c, agg):
    mask = data.draw(hnp.arrays(np.bool_, shape))
    got = float(losses.aggregate(np.full(shape, c, np.float32), mask, agg, max_length=6))
    n = mask.sum(1)[mask.any(1)]  # valid tokens of the non-empty rows
    expected = {
        "token-mean": c if mask.any() else 0.0,
        "seq-mean-token-mean": c if mask.any() else 0.0,
        "seq-mean-token-sum": c * n.mean() if mask.any() else 0.0,
        "seq-mean-token-sum-norm": c * n.mean() / 6 if mask.any() else 0.0,
    }[agg]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@st.composite
def groups(draw):
    n = 8  # fixed, so no recompiles; the ids make group sizes vary from 1 to 8
    rewards = draw(hnp.arrays(np.float32, n, elements=st.sampled_from([0.0, 0.5, 1.0, 2.0])))
    ids = draw(hnp.arrays(np.int32, n, elements=st.integers(-3, 4)))
    return rewards, ids


@SETTINGS
@given(batch=groups(), data=st.data())
def test_group_advantage_invariants(batch, data):
    rewards, ids = batch
    perm = np.asarray(data.draw(st.permutations(range(len(ids)))))
    relabel = {g: 100 + 7 * i for i, g in enumerate(np.unique(ids)[::-1])}
    new_ids = np.array([relabel[g] for g in ids], np.int32)
    for fn in (losses.grpo_advantages, losses.dr_grpo_advantages, losses.rloo_advantages):
        adv = np.asarray(fn(rewards, ids))
        assert np.isfinite(adv).all()
        np.testing.assert_allclose(fn(rewards[perm], ids[perm]), adv[perm], atol=1e-6)
        np.testing.assert_allclose(fn(rewards, new_ids), adv, atol=1e-6)
        for g in np.unique(ids):
            members = ids == g
            if members.sum() == 1:
                assert adv[members][0] == 0.0  # documented: a group of one has no signal
            else:
                np.testing.assert_allclose(adv[members].sum(), 0.0, atol=1e-5)
    # RLOO is the mean-centred advantage rescaled by n / (n − 1)
    sizes = (ids[:, None] == ids[None, :]).sum(1)
    scale = np.where(sizes > 1, sizes / np.maximum(sizes - 1, 1), 0.0)
    np.testing.assert_allclose(
        losses.rloo_advantages(rewards, ids),
        scale * np.asarray(losses.dr_grpo_advantages(rewards, ids)), rtol=1e-5, atol=1e-6,
    )


@SETTINGS
@given(
    versions=hnp.arrays(np.int32, 8, elements=st.integers(0, 20)),
    keep=hnp.arrays(np.bool_, 8),
    trainer=st.integers(0, 20),
)
def test_staleness_histogram_partitions_the_samples(versions, keep, trainer):
    m = losses.staleness_metrics(trainer, versions, sample_mask=keep, max_bucket=4)
    hist = sum(float(v) for k, v in m.items() if k.startswith("staleness_hist/"))
    total = hist + float(m["staleness_negative_frac"])
    np.testing.assert_allclose(total, 1.0 if keep.any() else 0.0, rtol=1e-6)
    if keep.any():
        s = trainer - versions[keep]
        np.testing.assert_allclose(m["staleness_mean"], s.mean(), rtol=1e-5)
        assert float(m["staleness_max"]) == s.max() and float(m["staleness_min"]) == s.min()
