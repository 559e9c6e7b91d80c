"""The loss as a typed config: `LossName`, `LossConfig`, and `compute_policy_loss` dispatching once.

Why: an ablation flips the loss by a flag. The flag's string becomes a `LossName` once (here, in
`LossConfig.__post_init__`), invalid combinations fail when the config is built rather than deep
inside a jitted step, and the trainer calls a single function whatever the loss.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
from jax.typing import ArrayLike

from flashrl_jax.losses import _aggregation, _inputs, _ppo, _regularizers, _reinforce


class LossName(enum.Enum):
    """The policy losses of the ROLL Flash comparison (see each function's docstring)."""

    PPO = "ppo"
    DECOUPLED_PPO = "decoupled_ppo"
    TIS = "tis"
    CISPO = "cispo"
    TOPR = "topr"
    GRPO = "grpo"


_SEQUENCE_RATIO_LOSSES = (LossName.PPO, LossName.TIS, LossName.CISPO, LossName.TOPR, LossName.GRPO)
_DUAL_CLIP_LOSSES = (LossName.PPO, LossName.DECOUPLED_PPO, LossName.GRPO)
_DEFAULT_IS_CAP = {LossName.TIS: 2.0, LossName.TOPR: 1.0}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which policy loss, and its hyper-parameters in the papers' symbols.

    Attributes:
      name: the loss (a `LossName` or its string value).
      clip_low, clip_high: ε_low, ε_high of the clip range `[1−ε_low, 1+ε_high]` (PPO, decoupled
        PPO, GRPO, CISPO).
      dual_clip: c of dual-clip PPO (floor `c·A` for A < 0); PPO, decoupled PPO, GRPO only.
      behavior_weight_cap: cap on decoupled PPO's behaviour weight `w = π_prox/μ`.
      is_cap: cap C on the IS weight: TIS `min(r, C)` (default 2), TOPR `clip(r, 0, C)` (default 1).
      aggregation: how per-token losses become a scalar (applies to every term).
      max_length: the constant L of `seq-mean-token-sum-norm` (default: the padded length T).
      sequence_ratio: GSPO's sequence-level geometric-mean ratio (all losses but decoupled PPO).
      kl_coef: β of the KL(π_θ‖π_ref) loss term; GRPO's is built in, others add it the same way.
      kl_estimator: Schulman's k1/k2/k3 for that term.
      entropy_coef: coefficient of the entropy bonus (needs `entropy` at call time).
    """

    name: LossName = LossName.PPO
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    behavior_weight_cap: float | None = None
    is_cap: float | None = None
    aggregation: _aggregation.Aggregation = _aggregation.Aggregation.TOKEN_MEAN
    max_length: int | None = None
    sequence_ratio: bool = False
    kl_coef: float = 0.0
    kl_estimator: _regularizers.KLEstimator = _regularizers.KLEstimator.K3
    entropy_coef: float = 0.0

    def __post_init__(self):
        # Strings from flags become enums here, once; everything downstream sees typed values.
        try:
            name = LossName(self.name)
        except ValueError:
            choices = ", ".join(repr(n.value) for n in LossName)
            msg = f"unknown loss name {self.name!r}; expected one of {choices}"
            raise ValueError(msg) from None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "aggregation", _aggregation.as_aggregation(self.aggregation))
        object.__setattr__(self, "kl_estimator", _regularizers.as_kl_estimator(self.kl_estimator))
        _ppo.check_clip(self.clip_low, self.clip_high, self.dual_clip)
        if self.dual_clip is not None and name not in _DUAL_CLIP_LOSSES:
            raise ValueError(f"dual_clip applies to ppo, decoupled_ppo and grpo, not {name.value}")
        if self.behavior_weight_cap is not None:
            if name is not LossName.DECOUPLED_PPO:
                raise ValueError(f"behavior_weight_cap applies to decoupled_ppo, not {name.value}")
            if not self.behavior_weight_cap > 0:
                raise ValueError(f"behavior_weight_cap must be > 0, got {self.behavior_weight_cap}")
        if self.is_cap is not None:
            if name not in _DEFAULT_IS_CAP:
                raise ValueError(f"is_cap applies to tis and topr, not {name.value}")
            if not self.is_cap > 0:
                raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if self.sequence_ratio and name not in _SEQUENCE_RATIO_LOSSES:
            raise ValueError(f"sequence_ratio is not defined for {name.value}")
        if self.max_length is not None and (
            int(self.max_length) != self.max_length or self.max_length <= 0
        ):
            raise ValueError(f"max_length must be a positive integer, got {self.max_length!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")


def compute_policy_loss(
    config: LossConfig,
    *,
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    prox_logp: ArrayLike | None = None,
    ref_logp: ArrayLike | None = None,
    positive: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The configured policy loss `+ β·KL(π_θ‖π_ref) − entropy_coef·H`, and merged metrics.

    Needs `prox_logp` for decoupled PPO, `positive` for TOPR, `ref_logp` when `kl_coef > 0` and
    `entropy` when `entropy_coef > 0` (ValueError otherwise). A token with any non-finite input is
    dropped from *every* term, so all terms average over the same tokens; the metric
    `nonfinite_tokens` counts all dropped tokens. `metrics["loss"]` is the returned total.
    """
    c = config
    needs = {
        "prox_logp": (prox_logp, c.name is LossName.DECOUPLED_PPO),
        "positive": (positive, c.name is LossName.TOPR),
        "ref_logp": (ref_logp, c.kl_coef > 0),
        "entropy": (entropy, c.entropy_coef > 0),
    }
    for arg, (value, needed) in needs.items():
        if needed and value is None:
            raise ValueError(f"loss {c.name.value} with this config needs {arg}")
    use_ref = c.kl_coef > 0
    use_kl = use_ref and c.name is not LossName.GRPO  # GRPO has its own KL term
    use_entropy = c.entropy_coef > 0
    # One shared validity mask: shapes are checked once, and a token dropped for a non-finite
    # input of any term is dropped from every term, so all terms average over the same tokens.
    t = _inputs.prepare(
        logp, behavior_logp, advantages, mask,
        prox_logp=prox_logp if c.name is LossName.DECOUPLED_PPO else None,
        ref_logp=ref_logp if use_ref else None,
        entropy=entropy if use_entropy else None,
    )
    kept = t.valid

    common = dict(aggregation=c.aggregation, max_length=c.max_length)
    args = (logp, behavior_logp, advantages, kept)
    ppo_clip = dict(clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip)
    is_cap = c.is_cap if c.is_cap is not None else _DEFAULT_IS_CAP.get(c.name)
    seq = dict(sequence_ratio=c.sequence_ratio)
    match c.name:
        case LossName.PPO:
            loss, metrics = _ppo.ppo(*args, **ppo_clip, **seq, **common)
        case LossName.DECOUPLED_PPO:
            loss, metrics = _ppo.decoupled_ppo(
                *args, prox_logp=prox_logp, behavior_weight_cap=c.behavior_weight_cap,
                **ppo_clip, **common,
            )
        case LossName.TIS:
            loss, metrics = _reinforce.tis(*args, is_cap=is_cap, **seq, **common)
        case LossName.CISPO:
            loss, metrics = _reinforce.cispo(
                *args, clip_low=c.clip_low, clip_high=c.clip_high, **seq, **common
            )
        case LossName.TOPR:
            loss, metrics = _reinforce.topr(
                *args, positive=positive, is_cap=is_cap, **seq, **common
            )
        case LossName.GRPO:
            loss, metrics = _ppo.grpo(
                *args, ref_logp=ref_logp, kl_coef=c.kl_coef, kl_estimator=c.kl_estimator,
                **ppo_clip, **seq, **common,
            )
        case _:
            raise AssertionError(f"unhandled loss {c.name}")
    metrics = dict(metrics)
    metrics["nonfinite_tokens"] = t.nonfinite_tokens  # the loss itself only ever sees `kept`
    if use_kl:
        kl_term, kl_metrics = _regularizers.kl_loss(
            logp, ref_logp, kept, coef=c.kl_coef, estimator=c.kl_estimator, **common
        )
        loss = loss + kl_term
        metrics |= {k: v for k, v in kl_metrics.items() if k != "nonfinite_tokens"}
    if use_entropy:
        ent_term, ent_metrics = _regularizers.entropy_bonus(
            entropy, kept, coef=c.entropy_coef, **common
        )
        loss = loss + ent_term
        metrics |= ent_metrics
    metrics["loss"] = jax.lax.stop_gradient(loss)
    return loss, metrics
