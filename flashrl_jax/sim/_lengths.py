"""Response-length models for the simulator, and `fit_lengths` to build one from measured lengths.

Why: the whole case for asynchrony rests on the long tail of response lengths (a synchronous batch
waits for its longest response). The simulator therefore needs a length law that matches a real run
(fitted from its `metrics.jsonl`) or a target model (Qwen3-8B-like: mean ~8k, tail clipped at the
32k generation limit). Lengths are clipped at `max_len` the way `max_new_tokens` clips a real run.

Responses to one prompt are correlated (a hard prompt makes all of its `n` responses long), which is
what makes whole-group placement worse than prompt replication. `prompt_corr` ρ is the share of the
log-length variance that is common to the group: log len = μ + σ(√ρ·z_prompt + √(1−ρ)·z_sample).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np
from scipy import special


class LengthFamily(enum.Enum):
  LOGNORMAL = "lognormal"  # loc = μ (mean of log length), shape = σ (std of log length)
  PARETO = "pareto"        # loc = x_m (scale, the minimum), shape = a (tail index)


def _phi(x: float) -> float:
  return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclasses.dataclass(frozen=True)
class LengthModel:
  """A long-tail law of response lengths (tokens), clipped to `[min_len, max_len]`.

  Attributes:
    family: lognormal or Pareto.
    loc: μ of a lognormal (log scale) or x_m of a Pareto.
    shape: σ of a lognormal or the tail index a of a Pareto.
    min_len, max_len: clip range; `max_len` plays the role of the generation limit L.
    prompt_corr: ρ ∈ [0, 1), within-group share of the (Gaussian-copula) variance.
    prompt_tokens: prompt length, used for prefill and training-token counts.
  """

  family: LengthFamily = LengthFamily.LOGNORMAL
  loc: float = 8.0
  shape: float = 1.0
  min_len: int = 1
  max_len: int = 32768
  prompt_corr: float = 0.0
  prompt_tokens: int = 256

  def __post_init__(self):
    object.__setattr__(self, "family", LengthFamily(self.family))
    if self.shape <= 0 or (self.family is LengthFamily.PARETO and self.loc <= 0):
      raise ValueError(f"invalid {self.family.value} parameters loc={self.loc}, shape={self.shape}")
    if not 1 <= self.min_len <= self.max_len:
      raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
    if not 0.0 <= self.prompt_corr < 1.0:
      raise ValueError(f"prompt_corr must be in [0, 1), got {self.prompt_corr}")
    if self.prompt_tokens < 0:
      raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")

  @classmethod
  def with_mean(cls, mean: float, sigma: float = 1.0, max_len: int = 32768, **kwargs) -> LengthModel:
    """A lognormal with log-std `sigma` whose mean *after clipping at max_len* is `mean`."""
    if not 1 < mean < max_len:
      raise ValueError(f"need 1 < mean < max_len, got mean={mean}, max_len={max_len}")
    lo, hi = -5.0, math.log(max_len) + 5.0
    for _ in range(200):  # bisection: the clipped mean is increasing in μ
      mid = 0.5 * (lo + hi)
      if _clipped_lognormal_mean(mid, sigma, max_len) < mean:
        lo = mid
      else:
        hi = mid
    return cls(LengthFamily.LOGNORMAL, 0.5 * (lo + hi), sigma, max_len=max_len, **kwargs)

  def mean(self) -> float:
    """Mean length after clipping at `max_len` (ignores the tiny `min_len` clip)."""
    if self.family is LengthFamily.LOGNORMAL:
      return _clipped_lognormal_mean(self.loc, self.shape, self.max_len)
    a, xm, m = self.shape, self.loc, float(self.max_len)
    if m <= xm:
      return m
    # E[min(X, m)] = ∫_0^m P(X > x) dx = xm + ∫_xm^m (xm/x)^a dx.
    tail = xm * math.log(m / xm) if a == 1 else xm / (1 - a) * ((m / xm) ** (1 - a) - 1)
    return xm + tail

  def prompt_factors(self, rng: np.random.Generator, num_groups: int) -> np.ndarray:
    """The per-prompt standard-normal factors z_prompt, `[num_groups]`."""
    return rng.standard_normal(num_groups)

  def sample(self, rng: np.random.Generator, prompt_z, group_size: int) -> np.ndarray:
    """Integer lengths `[len(prompt_z), group_size]`; a row shares its prompt factor."""
    rho = self.prompt_corr
    z_prompt = np.asarray(prompt_z, dtype=np.float64).reshape(-1, 1)
    z = math.sqrt(rho) * z_prompt + math.sqrt(1.0 - rho) * rng.standard_normal(
        (z_prompt.shape[0], group_size))
    if self.family is LengthFamily.LOGNORMAL:
      raw = np.exp(self.loc + self.shape * z)
    else:  # inverse CDF of the Pareto applied to the copula's uniform Φ(z)
      u = np.clip(special.ndtr(z), 0.0, 1.0 - 1e-16)
      raw = self.loc * (1.0 - u) ** (-1.0 / self.shape)
    return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


def _clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
  # E[min(X, c)] = e^{μ+σ²/2} Φ((ln c − μ − σ²)/σ) + c (1 − Φ((ln c − μ)/σ)).
  lc = math.log(cap)
  return (math.exp(mu + 0.5 * sigma**2) * _phi((lc - mu - sigma**2) / sigma)
          + cap * (1.0 - _phi((lc - mu) / sigma)))


def fit_lengths(samples, family: LengthFamily | str = LengthFamily.LOGNORMAL, *,
                max_len: int | None = None, prompt_tokens: int = 256) -> LengthModel:
  """Maximum-likelihood fit of a `LengthModel` to measured response lengths.

  Args:
    samples: lengths, 1-D, or 2-D `[groups, n]` (one row per prompt) to also estimate `prompt_corr`
      as the between-group share of the log-length variance (one-way ANOVA).
    family: the law to fit.
    max_len: the run's generation limit; defaults to the largest sample. Samples at the limit are
      treated as exact (no censoring correction), which slightly under-estimates the tail.
    prompt_tokens: carried into the model.
  """
  family = LengthFamily(family)
  x = np.asarray(samples, dtype=np.float64)
  if x.size < 2 or np.any(x < 1):
    raise ValueError("need at least two lengths, all >= 1")
  logs = np.log(x)
  rho = 0.0
  if x.ndim == 2 and x.shape[0] > 1 and x.shape[1] > 1:
    total = logs.var()
    between = logs.mean(axis=1).var() - logs.var(axis=1, ddof=1).mean() / x.shape[1]
    rho = float(np.clip(between / total, 0.0, 0.95)) if total > 0 else 0.0
  flat = x.ravel()
  cap = int(max_len if max_len is not None else flat.max())
  if family is LengthFamily.LOGNORMAL:
    loc, shape = float(logs.mean()), max(float(logs.std()), 1e-3)
  else:
    xm = float(flat.min())
    shape = len(flat) / max(float(np.sum(np.log(flat / xm))), 1e-9)
    loc = xm
  return LengthModel(family, loc, shape, min_len=1, max_len=cap, prompt_corr=rho,
                     prompt_tokens=prompt_tokens)
