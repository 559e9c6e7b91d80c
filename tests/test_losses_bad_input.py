"""Bad input: shape mismatches, all-masked rows, NaN/±inf log-probs, exploding ratios."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashrl_jax import losses

B, T = 3, 4
RNG = np.random.default_rng(0)
LP = -RNG.uniform(0.1, 2.0, (B, T)).astype(np.float32)
BEH = (LP + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
ADV = np.array([1.0, -0.5, 2.0], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)

# Every loss as f(logp, behavior_logp, advantages, mask, **extra_token_arrays); the extras are the
# other log-prob inputs, which get the same bad-input treatment.
LOSSES = {
    "ppo": lambda lp, b, a, m, **kw: losses.ppo(lp, b, a, m, dual_clip=3.0),
    "ppo_seq": lambda lp, b, a, m, **kw: losses.ppo(lp, b, a, m, sequence_ratio=True),
    "decoupled_ppo": lambda lp, b, a, m, prox=None, **kw: losses.decoupled_ppo(
        lp, b, a, m, prox_logp=BEH if prox is None else prox, behavior_weight_cap=2.0
    ),
    "tis": lambda lp, b, a, m, **kw: losses.tis(lp, b, a, m),
    "cispo": lambda lp, b, a, m, **kw: losses.cispo(lp, b, a, m, sequence_ratio=True),
    "topr": lambda lp, b, a, m, **kw: losses.topr(lp, b, a, m, positive=np.array([1, 0, 0])),
    "grpo": lambda lp, b, a, m, ref=None, **kw: losses.grpo(
        lp, b, a, m, ref_logp=BEH if ref is None else ref, kl_coef=0.1
    ),
}


def value_and_grad(name, lp, b=BEH, a=ADV, m=MASK, **kw):
    fn = lambda x: LOSSES[name](x, b, a, m, **kw)  # noqa: E731
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(lp))
    return float(loss), metrics, np.asarray(grad)


@pytest.mark.parametrize("name", LOSSES)
def test_shape_mismatch_names_arrays_and_shapes(name):
    mismatch = r"behavior_logp has shape \(3, 5\) but logp has shape \(3, 4\)"
    with pytest.raises(ValueError, match=mismatch):
        LOSSES[name](LP, np.zeros((B, T + 1)), ADV, MASK)
    with pytest.raises(ValueError, match=r"mask has shape \(4, 3\)"):
        LOSSES[name](LP, BEH, ADV, MASK.T)
    with pytest.raises(ValueError, match=r"advantages has shape \(2,\)"):
        LOSSES[name](LP, BEH, ADV[:2], MASK)
    with pytest.raises(ValueError, match=r"logp must be a \[B, T\] array, got shape \(4,\)"):
        LOSSES[name](LP[0], BEH[0], ADV, MASK[0])
    # static shapes: the error surfaces while tracing under jit too
    with pytest.raises(ValueError, match="behavior_logp has shape"):
        jax.jit(lambda lp, b: LOSSES[name](lp, b, ADV, MASK)[0])(LP, np.zeros((B + 1, T)))


def test_extra_array_shape_mismatches():
    with pytest.raises(ValueError, match=r"prox_logp has shape \(3, 3\)"):
        losses.decoupled_ppo(LP, BEH, ADV, MASK, prox_logp=BEH[:, :3])
    with pytest.raises(ValueError, match=r"ref_logp has shape \(3, 3\)"):
        losses.grpo(LP, BEH, ADV, MASK, ref_logp=BEH[:, :3])
    with pytest.raises(ValueError, match=r"positive has shape \(2,\) but must be \[B\]"):
        losses.topr(LP, BEH, ADV, MASK, positive=np.ones(2, bool))


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("agg", [a.value for a in losses.Aggregation])
def test_all_masked_batch_is_exactly_zero(name, agg):
    fn = lambda x: LOSSES[name](x, BEH, ADV, np.zeros_like(MASK))  # noqa: E731
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(LP))
    assert float(loss) == 0.0
    assert not np.asarray(grad).any()
    assert all(np.isfinite(v) for v in metrics.values())
    assert float(metrics["tokens"]) == 0.0


@pytest.mark.parametrize("name", LOSSES)
def test_all_masked_row_contributes_nothing(name):
    mask = MASK.copy()
    mask[1] = 0
    keep = [0, 2]
    loss, _, grad = value_and_grad(name, LP, m=mask)
    # the same batch without row 1 at all (grpo/decoupled extras use BEH, sliced alike)
    fn = LOSSES[name]
    if name in ("decoupled_ppo", "grpo"):
        key = "prox" if name == "decoupled_ppo" else "ref"
        sub = fn(LP[keep], BEH[keep], ADV[keep], mask[keep], **{key: BEH[keep]})[0]
    elif name == "topr":
        sub = losses.topr(LP[keep], BEH[keep], ADV[keep], mask[keep], positive=np.array([1, 0]))[0]
    else:
        sub = fn(LP[keep], BEH[keep], ADV[keep], mask[keep])[0]
    np.testing.assert_allclose(loss, sub, rtol=1e-6)
    assert not grad[1].any()


BAD = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("bad", BAD)
def test_nonfinite_at_masked_out_positions_never_leaks(name, bad):
    clean = value_and_grad(name, LP)
    lp, beh, adv = LP.copy(), BEH.copy(), np.broadcast_to(ADV[:, None], (B, T)).copy()
    lp[MASK == 0], beh[MASK == 0], adv[MASK == 0] = bad, bad, bad
    extra = {"prox": beh, "ref": beh}
    loss, metrics, grad = value_and_grad(name, lp, beh, adv, **extra)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    np.testing.assert_allclose(loss, clean[0], rtol=1e-6)
    np.testing.assert_allclose(grad, clean[2], rtol=1e-6)
    assert float(metrics["nonfinite_tokens"]) == 0.0


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["logp", "behavior_logp", "advantages", "extra"])
def test_nonfinite_at_masked_in_tokens_are_dropped_and_counted(name, bad, where):
    """Documented behaviour: such tokens are excluded (as if masked out) and counted."""
    lp, beh, adv = LP.copy(), BEH.copy(), np.broadcast_to(ADV[:, None], (B, T)).copy()
    extra = BEH.copy()
    target = {"logp": lp, "behavior_logp": beh, "advantages": adv, "extra": extra}[where]
    target[0, 1] = bad
    target[2, 3] = bad
    loss, metrics, grad = value_and_grad(name, lp, beh, adv, prox=extra, ref=extra)
    counts_extra = name in ("decoupled_ppo", "grpo")
    expected_dropped = 0 if (where == "extra" and not counts_extra) else 2
    assert float(metrics["nonfinite_tokens"]) == expected_dropped
    assert np.isfinite(loss) and np.isfinite(grad).all()
    if expected_dropped:
        mask = MASK.copy()
        mask[0, 1] = mask[2, 3] = 0
        ref_loss, _, ref_grad = value_and_grad(name, LP, m=mask)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", LOSSES)
def test_exploding_ratio_stays_finite(name):
    """A finite but huge log-ratio (e.g. a near-zero behaviour prob) must not overflow exp."""
    beh = BEH.copy()
    beh[0, 0] = -200.0
    loss, metrics, grad = value_and_grad(name, LP, beh, prox=beh, ref=beh)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert np.isfinite(float(metrics["ratio_max"]))


def test_bad_hyperparameters_raise():
    with pytest.raises(ValueError, match="clip_low"):
        losses.ppo(LP, BEH, ADV, MASK, clip_low=-0.1)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        losses.ppo(LP, BEH, ADV, MASK, dual_clip=0.5)
    with pytest.raises(ValueError, match="is_cap"):
        losses.tis(LP, BEH, ADV, MASK, is_cap=0.0)
    with pytest.raises(ValueError, match="behavior_weight_cap"):
        losses.decoupled_ppo(LP, BEH, ADV, MASK, prox_logp=BEH, behavior_weight_cap=-1.0)
    with pytest.raises(ValueError, match="needs ref_logp"):
        losses.grpo(LP, BEH, ADV, MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_estimator=.* is not one of"):
        losses.grpo(LP, BEH, ADV, MASK, ref_logp=BEH, kl_estimator="k4")


@pytest.mark.parametrize("name", LOSSES)
def test_bfloat16_log_probs_are_upcast(name):
    lp16, beh16 = LP.astype(jnp.bfloat16), BEH.astype(jnp.bfloat16)
    loss16, _, grad16 = value_and_grad(name, lp16, beh16, prox=beh16, ref=beh16)
    lp32, beh32 = np.asarray(lp16, np.float32), np.asarray(beh16, np.float32)
    loss32, _, grad32 = value_and_grad(name, lp32, beh32, prox=beh32, ref=beh32)
    np.testing.assert_allclose(loss16, loss32, rtol=1e-6)  # computed in float32 either way
    np.testing.assert_allclose(grad16.astype(np.float32), grad32, rtol=1e-2, atol=1e-3)
