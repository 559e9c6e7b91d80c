"""The long-tail law of response lengths, and `fit_lengths` to recover one from measured lengths.

Why: the whole case for asynchrony rests on the long tail of response lengths (a synchronous batch
waits for its longest response). The same law drives the synthetic tasks the controller trains on
(the *required* answer length of each problem, `flashrl_jax.envs.generate_synthetic`) and the
simulator's workload, so a simulated run and a real one draw from one definition. Lengths are
clipped to `[min_len, max_len]` the way `max_new_tokens` clips a real run.

Responses to one prompt are correlated in a real model (a hard prompt makes all of its `n` responses
long), which is what makes whole-group placement worse than prompt replication. `prompt_corr` ρ is
the share of the Gaussian-copula variance that is common to a group:
z = √ρ·z_prompt + √(1−ρ)·z_sample, and the length is the law's quantile at Φ(z).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np


class LengthLaw(enum.Enum):
  LOGNORMAL = "lognormal"  # median `median`, log-std `sigma`: q99/q50 = exp(2.326 * sigma)
  PARETO = "pareto"        # scale `median * 2**(-1/alpha)`, index `alpha`: q99/q50 = 50**(1/alpha)
  CONSTANT = "constant"    # every length is `median` (the synchronous-friendly control)


def _phi(x: float) -> float:
  return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
  """A law of lengths (tokens or items), clipped to `[min_len, max_len]`.

  Attributes:
    law: lognormal, Pareto or constant.
    median: the law's median before clipping (a Pareto's scale is `median * 2**(-1/alpha)`).
    sigma: log-std of a lognormal.
    alpha: tail index of a Pareto.
    min_len, max_len: clip range; `max_len` plays the role of the generation limit L.
    prompt_corr: ρ ∈ [0, 1), the within-group share of the copula variance (`sample_groups`).
  """

  law: LengthLaw = LengthLaw.LOGNORMAL
  median: float = 8.0
  sigma: float = 1.0
  alpha: float = 1.5
  min_len: int = 1
  max_len: int = 256
  prompt_corr: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "law", LengthLaw(self.law))
    if self.median <= 0 or self.sigma < 0 or self.alpha <= 0:
      raise ValueError(f"need median > 0, sigma >= 0, alpha > 0; got {self}")
    if not 1 <= self.min_len <= self.max_len:
      raise ValueError(f"need 1 <= min_len <= max_len; got {self.min_len}, {self.max_len}")
    if not 0.0 <= self.prompt_corr < 1.0:
      raise ValueError(f"prompt_corr must be in [0, 1), got {self.prompt_corr}")

  @classmethod
  def with_mean(cls, mean: float, sigma: float = 1.0, max_len: int = 32768,
                **kwargs) -> LengthDistribution:
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
    return cls(LengthLaw.LOGNORMAL, median=math.exp(0.5 * (lo + hi)), sigma=sigma,
               max_len=max_len, **kwargs)

  @property
  def pareto_scale(self) -> float:
    """x_m of the Pareto whose median is `median`."""
    return self.median * 2.0 ** (-1.0 / self.alpha)

  def mean(self) -> float:
    """Mean length after clipping at `max_len` (ignores the small `min_len` clip)."""
    if self.law is LengthLaw.CONSTANT:
      return float(min(max(self.median, self.min_len), self.max_len))
    if self.law is LengthLaw.LOGNORMAL:
      if self.sigma == 0:
        return float(min(self.median, self.max_len))
      return _clipped_lognormal_mean(math.log(self.median), self.sigma, self.max_len)
    a, xm, m = self.alpha, self.pareto_scale, float(self.max_len)
    if m <= xm:
      return m
    # E[min(X, m)] = ∫_0^m P(X > x) dx = xm + ∫_xm^m (xm/x)^a dx.
    tail = xm * math.log(m / xm) if a == 1 else xm / (1 - a) * ((m / xm) ** (1 - a) - 1)
    return xm + tail

  def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` independent integer lengths (what a synthetic task's problems draw)."""
    if self.law is LengthLaw.LOGNORMAL:
      raw = self.median * np.exp(self.sigma * rng.standard_normal(size))
    elif self.law is LengthLaw.PARETO:
      raw = self.pareto_scale * (1.0 - rng.random(size)) ** (-1.0 / self.alpha)
    else:
      raw = np.full(size, self.median)
    return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)

  def prompt_factors(self, rng: np.random.Generator, num_groups: int) -> np.ndarray:
    """The per-prompt standard-normal factors z_prompt, `[num_groups]`."""
    return rng.standard_normal(num_groups)

  def sample_groups(self, rng: np.random.Generator, prompt_z, group_size: int) -> np.ndarray:
    """Integer lengths `[len(prompt_z), group_size]`; a row shares its prompt factor (ρ)."""
    z_prompt = np.asarray(prompt_z, dtype=np.float64).reshape(-1, 1)
    if self.law is LengthLaw.CONSTANT:
      raw = np.full((z_prompt.shape[0], group_size), self.median)
    else:
      rho = self.prompt_corr
      z = math.sqrt(rho) * z_prompt + math.sqrt(1.0 - rho) * rng.standard_normal(
          (z_prompt.shape[0], group_size))
      if self.law is LengthLaw.LOGNORMAL:
        raw = self.median * np.exp(self.sigma * z)
      else:  # inverse CDF of the Pareto at the copula's uniform Φ(z)
        from scipy import special  # only this law needs it
        u = np.clip(special.ndtr(z), 0.0, 1.0 - 1e-16)
        raw = self.pareto_scale * (1.0 - u) ** (-1.0 / self.alpha)
    return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


def _clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
  # E[min(X, c)] = e^{μ+σ²/2} Φ((ln c − μ − σ²)/σ) + c (1 − Φ((ln c − μ)/σ)).
  lc = math.log(cap)
  return (math.exp(mu + 0.5 * sigma**2) * _phi((lc - mu - sigma**2) / sigma)
          + cap * (1.0 - _phi((lc - mu) / sigma)))


def fit_lengths(samples, law: LengthLaw | str = LengthLaw.LOGNORMAL, *,
                max_len: int | None = None) -> LengthDistribution:
  """Maximum-likelihood fit of a `LengthDistribution` to measured lengths.

  Args:
    samples: lengths, 1-D, or 2-D `[groups, n]` (one row per prompt) to also estimate `prompt_corr`
      as the between-group share of the log-length variance (one-way ANOVA).
    law: lognormal or Pareto.
    max_len: the run's generation limit; defaults to the largest sample. Samples at the limit are
      treated as exact (no censoring correction), which slightly under-estimates the tail.
  """
  law = LengthLaw(law)
  if law is LengthLaw.CONSTANT:
    raise ValueError("fit a lognormal or a Pareto; a constant law has nothing to fit")
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
  if law is LengthLaw.LOGNORMAL:
    return LengthDistribution(law, median=float(np.exp(logs.mean())),
                              sigma=max(float(logs.std()), 1e-3), max_len=cap, prompt_corr=rho)
  xm = float(flat.min())
  alpha = len(flat) / max(float(np.sum(np.log(flat / xm))), 1e-9)
  return LengthDistribution(law, median=xm * 2.0 ** (1.0 / alpha), alpha=alpha, max_len=cap,
                            prompt_corr=rho)


@dataclasses.dataclass(frozen=True)
class EmpiricalLengths:
  """Lengths resampled from measured groups (one row = one prompt's responses).

  Why: a policy's real lengths are not a clean parametric law — a warm-started model answers most
  prompts near the required length and now and then runs on to the generation limit — and a
  simulation of a measured workload should see that tail as it is. A prompt factor z picks a row
  (the row at quantile Φ(z), so a re-issued prompt keeps its difficulty) and the group's responses
  are drawn from that row with replacement (fresh responses to the same prompt).
  """

  groups: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    groups = tuple(tuple(int(x) for x in row) for row in self.groups)
    object.__setattr__(self, "groups", groups)
    if not groups or any(not row for row in groups) or min(min(row) for row in groups) < 1:
      raise ValueError("need at least one non-empty group of lengths, all >= 1")

  @property
  def max_len(self) -> int:
    return max(max(row) for row in self.groups)

  def mean(self) -> float:
    return float(np.mean([x for row in self.groups for x in row]))

  def prompt_factors(self, rng: np.random.Generator, num_groups: int) -> np.ndarray:
    return rng.standard_normal(num_groups)

  def sample_groups(self, rng: np.random.Generator, prompt_z, group_size: int) -> np.ndarray:
    z = np.asarray(prompt_z, dtype=np.float64).ravel()
    quantile = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0))) if z.size else z
    rows = np.minimum((quantile * len(self.groups)).astype(np.int64), len(self.groups) - 1)
    return np.array([rng.choice(self.groups[r], size=group_size, replace=True) for r in rows],
                    dtype=np.int64).reshape(len(rows), group_size)
