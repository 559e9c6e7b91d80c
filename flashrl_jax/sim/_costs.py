"""Cost models: how long a decode step, a prefill, a train step, a weight sync and a reward take.

Why: the simulator's predictions are only as good as these few numbers, so each is a small typed
value that can be either *calibrated* on this machine (a linear decode step fitted to measured step
times, a per-token train cost fitted to `time/train_s`) or *derived* from hardware for the paper's
scale (a roofline: a decode step reads the weights once plus every active request's KV cache).

A decode model is a strategy object with one method, `step_time(active, context) -> seconds`: one
decode step advances every active request of a worker by one token, so a worker with `a` active
requests makes `a / step_time(a)` tokens/s and each request `1 / step_time(a)` tokens/s. `context`
is the context (prompt + generated tokens) the step is priced at, for models whose step depends on
it: the active requests' mean (an engine whose attention reads each request's own cache, as
SGLang's paged kernels do) or their longest (`Context.LONGEST`: an engine that pads every request
of a step to one span, as ours does, `flashrl_jax.rollout._runner`); `context_sensitive` says
whether the simulator must re-time a long decode as the contexts grow.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

import numpy as np


class Context(enum.Enum):
  """Which context of a worker's active requests its decode step is priced at."""
  MEAN = "mean"
  LONGEST = "longest"


class DecodeModel(Protocol):
  context_sensitive: bool
  context_of: Context

  def step_time(self, active: int, context: float = 0.0) -> float:
    """Seconds for one decode step of one worker with `active` concurrent requests (>= 1), priced
    at `context` tokens (their mean or longest context, per `context_of`)."""


@dataclasses.dataclass(frozen=True)
class LinearDecode:
  """step_time(a) = t_base + t_per_active · a (a memory-bound step: weights once, KV per request)."""

  t_base_s: float
  t_per_active_s: float = 0.0
  context_sensitive = False
  context_of = Context.MEAN

  def __post_init__(self):
    if self.t_base_s <= 0 or self.t_per_active_s < 0:
      raise ValueError(f"need t_base_s > 0 and t_per_active_s >= 0, got {self}")

  def step_time(self, active: int, context: float = 0.0) -> float:
    del context
    return self.t_base_s + self.t_per_active_s * active


@dataclasses.dataclass(frozen=True)
class RooflineDecode:
  """A decode step bounded by memory bandwidth or compute, whichever is slower, plus an overhead.

  step_time(a) = max((W + a·kv·ctx) / BW, a · 2P / F) + overhead, where W is the weight bytes read
  once per step, kv the KV-cache bytes per token, ctx the mean context a request attends to (prompt
  plus half its response, on average), P the parameter count and F the achievable FLOP/s. All of
  this is per worker (a tensor-parallel worker of g GPUs has g× the bandwidth and FLOP/s).
  """

  weight_bytes: float
  kv_bytes_per_token: float
  mean_context: float
  params: float
  bandwidth: float
  flops: float
  overhead_s: float = 0.0
  context_sensitive = False  # priced at `mean_context`, a workload constant
  context_of = Context.MEAN

  def __post_init__(self):
    if min(self.weight_bytes, self.bandwidth, self.flops, self.params) <= 0:
      raise ValueError(f"roofline needs positive sizes and rates, got {self}")

  @classmethod
  def qwen3_8b(cls, mean_context: float, gpus: int = 1, mbu: float = 0.7, mfu: float = 0.5,
               overhead_s: float = 0.002) -> RooflineDecode:
    """Qwen3-8B in bf16 on H100/H800-class GPUs (3.35 TB/s HBM, 989 TFLOP/s dense bf16).

    36 layers × 8 KV heads × 128 head dim × (K and V) × 2 bytes = 144 KiB of KV cache per token;
    `mbu`/`mfu` are the achieved fractions of peak bandwidth/FLOP/s of a good inference engine.
    """
    return cls(weight_bytes=2 * 8.19e9, kv_bytes_per_token=36 * 8 * 128 * 2 * 2,
               mean_context=mean_context, params=8.19e9, bandwidth=gpus * 3.35e12 * mbu,
               flops=gpus * 989e12 * mfu, overhead_s=overhead_s)

  def step_time(self, active: int, context: float = 0.0) -> float:
    del context
    memory = (self.weight_bytes + active * self.kv_bytes_per_token * self.mean_context) / self.bandwidth
    compute = active * 2.0 * self.params / self.flops
    return max(memory, compute) + self.overhead_s


@dataclasses.dataclass(frozen=True)
class TabulatedDecode:
  """Decode step time measured at a few active counts, linearly interpolated between them.

  What a measured engine gives: its step time is not linear in the active count (decode runs on
  power-of-two buckets of slots, and a core shared by several server processes takes their steps
  in turn), so the measurements are used as they are. Below the first point the first value holds;
  beyond the last, the last segment's slope continues. The table holds at context `context_ref`;
  an engine whose decode attends over the requests' caches costs more with longer contexts, by a
  factor `1 + context_slope · (context − context_ref)` (measured too, with every request at the
  same context), where the context is the requests' mean or their longest (`context_of`: our
  engine pads a step's requests to one span set by the longest, so a long request makes every
  request beside it cost what it does).
  """

  active: tuple[float, ...]  # mean live requests (a stream's are fractional)
  step_s: tuple[float, ...]
  context_ref: float = 0.0
  context_slope: float = 0.0
  context_of: Context = Context.MEAN

  def __post_init__(self):
    object.__setattr__(self, "active", tuple(float(a) for a in self.active))
    object.__setattr__(self, "step_s", tuple(float(t) for t in self.step_s))
    if len(self.active) != len(self.step_s) or not self.active:
      raise ValueError(f"need as many step times as active counts, got {self}")
    if any(b <= a for a, b in zip(self.active, self.active[1:])) or self.active[0] <= 0:
      raise ValueError(f"active counts must be > 0 and increasing, got {self.active}")
    if min(self.step_s) <= 0:
      raise ValueError(f"step times must be > 0, got {self.step_s}")
    if self.context_slope < 0:
      raise ValueError(f"context_slope must be >= 0, got {self.context_slope}")

  @property
  def context_sensitive(self) -> bool:
    return self.context_slope > 0

  def step_time(self, active: int, context: float = 0.0) -> float:
    step = _interp(active, self.active, self.step_s)
    if self.context_slope:
      step *= max(1.0 + self.context_slope * (context - self.context_ref), 0.1)
    return step


def _interp(x: float, xs: tuple, ys: tuple) -> float:
  """Piecewise-linear through (xs, ys); flat below xs[0], last slope beyond xs[-1] (never < 0)."""
  if x <= xs[0] or len(xs) == 1:
    return ys[0]
  if x >= xs[-1]:
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return max(ys[-1] + slope * (x - xs[-1]), 0.0)
  return float(np.interp(x, xs, ys))


def fit_linear_decode(active, step_s) -> LinearDecode:
  """Least-squares `LinearDecode` from measured (active slots, decode step seconds) pairs."""
  a = np.asarray(active, dtype=np.float64)
  t = np.asarray(step_s, dtype=np.float64)
  if a.shape != t.shape or a.size == 0:
    raise ValueError("need equally many active counts and step times")
  if a.size == 1 or np.ptp(a) == 0:
    return LinearDecode(float(t.mean() / max(a.mean(), 1.0)), float(t.mean() / max(a.mean(), 1.0)))
  slope, intercept = np.polyfit(a, t, 1)
  slope = max(float(slope), 0.0)
  intercept = float(t.mean() - slope * a.mean())
  return LinearDecode(max(intercept, 1e-9), slope)


@dataclasses.dataclass(frozen=True)
class TrainModel:
  """Train-step time: fixed + per_token_s · tokens / devices (ideal data-parallel scaling).

  `per_token_s` is device-seconds per trained token (prompt + response), covering the old-policy
  and reference forward passes and the backward pass; `fixed_s` (optimizer step, launch, logging)
  does not shrink with devices.
  """

  fixed_s: float = 0.0
  per_token_s: float = 0.0

  def __post_init__(self):
    if self.fixed_s < 0 or self.per_token_s < 0:
      raise ValueError(f"train costs must be >= 0, got {self}")

  @classmethod
  def qwen3_8b(cls, mfu: float = 0.4, fixed_s: float = 5.0, flops_per_param_token: float = 8.0):
    """8·P FLOPs per token (fwd+bwd 6P, old-logprob forward 2P) at `mfu` of 989 TFLOP/s."""
    return cls(fixed_s=fixed_s, per_token_s=flops_per_param_token * 8.19e9 / (989e12 * mfu))

  def time(self, tokens: float, devices: int) -> float:
    return self.fixed_s + self.per_token_s * tokens / max(devices, 1)


@dataclasses.dataclass(frozen=True)
class TabulatedTrain:
  """Train-step time measured at a few trained-token counts (on the devices the run gives the
  trainer), linearly interpolated: what a standalone train-step microbenchmark gives, including
  the steps where packing spills into another micro-batch."""

  tokens: tuple[int, ...]
  seconds: tuple[float, ...]

  def __post_init__(self):
    object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
    object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
    if len(self.tokens) != len(self.seconds) or not self.tokens:
      raise ValueError(f"need as many times as token counts, got {self}")
    if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or min(self.seconds) < 0:
      raise ValueError(f"token counts must increase and times be >= 0, got {self}")

  def time(self, tokens: float, devices: int) -> float:
    del devices  # measured on the run's own trainer devices
    return _interp(tokens, self.tokens, self.seconds)


@dataclasses.dataclass(frozen=True)
class SyncModel:
  """Weight handoff after each update: export (trainer), then pause → load → resume (rollout)."""

  export_s: float = 0.0
  pause_s: float = 0.0
  load_s: float = 0.0
  resume_s: float = 0.0

  def __post_init__(self):
    if min(self.export_s, self.pause_s, self.load_s, self.resume_s) < 0:
      raise ValueError(f"sync costs must be >= 0, got {self}")

  @property
  def rollout_s(self) -> float:
    """How long rollout workers are stopped for one update."""
    return self.pause_s + self.load_s + self.resume_s

  @property
  def total_s(self) -> float:
    return self.export_s + self.rollout_s


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Every cost the simulator charges, in one value.

  Attributes:
    decode: per-worker decode step model.
    prefill_s_per_token: seconds a worker spends per prompt token admitted (decode stalls meanwhile).
    request_s: seconds a worker spends per request admitted, whatever its length (prefill launch,
      HTTP and per-request work of the server and of the client on the same cores; decode stalls).
    train: train-step model.
    sync: weight-handoff model.
    reward_s: seconds to score one response.
    reward_workers: concurrent reward computations (None: unbounded).
    train_beside_rollout: train-step time multiplier while the rollout is busy, and
    rollout_beside_train: rollout cost multiplier while the trainer trains — for a trainer and a
      rollout client that share a core (or one process and its interpreter lock), as on CPU here
      (1: none).
  """

  decode: DecodeModel = LinearDecode(0.01, 0.0)
  prefill_s_per_token: float = 0.0
  request_s: float = 0.0
  train: TrainModel | TabulatedTrain = TrainModel()
  sync: SyncModel = SyncModel()
  reward_s: float = 0.0
  reward_workers: int | None = None
  train_beside_rollout: float = 1.0
  rollout_beside_train: float = 1.0

  def __post_init__(self):
    if self.train_beside_rollout < 1.0 or self.rollout_beside_train < 1.0:
      raise ValueError(f"interference factors must be >= 1, got {self}")
    if self.prefill_s_per_token < 0 or self.reward_s < 0 or self.request_s < 0:
      raise ValueError(f"costs must be >= 0, got {self}")
    if self.reward_workers is not None and self.reward_workers < 1:
      raise ValueError(f"reward_workers must be >= 1 or None, got {self.reward_workers}")
