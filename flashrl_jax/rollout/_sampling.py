"""Token sampling for the rollout engine: typed per-request options, and one batched device sampler.

Why it looks like this: every decode slot may carry different options (one greedy, one at T=0.7 with
top-p 0.9, ...) yet all slots are sampled in one jitted call, so options become per-row arrays
(`RowSampling`) and each truncation rule is a small strategy object that says which sorted
candidates it keeps. The behaviour log-prob follows SGLang: `log_softmax(logits / T)` of the chosen
token after the min-new-tokens ban and before any top-k/top-p/min-p truncation; greedy rows report
`log_softmax(logits)`. Randomness is a pure function of (request seed, output index), so a request
draws the same tokens whatever slot, batch or recomputation it runs in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import regex
from flax import struct

# How many stop token ids (eos included) one request may ban before `min_new_tokens`.
MAX_STOP_IDS = 16
# The most candidates per position `top_logprobs_num` may ask for (OpenAI's own cap is 20).
MAX_TOP_LOGPROBS = 20
# Integer options travel to the device as int32 (`RowSampling`): larger values are refused at the
# edge, never left to overflow on the engine thread.
INT32_MAX = 2**31 - 1
# Temperatures below this sample greedily, as SGLang does (`_SAMPLING_EPS`): `logits / T` would
# overflow float32 and turn the behaviour log-prob into +-inf or NaN.
SAMPLING_EPS = 1e-6
# Temperatures above this sample as this one: float32 `logits / T` is already uniform up to rounding,
# and a larger T (1e300 is a valid JSON number) becomes inf on the device, where a banned logit's
# -inf / inf is NaN.
MAX_TEMPERATURE = 1e30

# SGLang `sampling_params` keys this engine does not implement, each with the test for its neutral
# value: a neutral value (what SGLang's own clients send by default, e.g. `logit_bias: {}`) is
# accepted and changes nothing; any other value would change behaviour we cannot honour, so it is
# refused (HTTP 400 naming the key), never silently ignored.
_NEUTRAL = {
    "frequency_penalty": lambda v: v == 0, "presence_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "json_schema": lambda v: False, "regex": lambda v: False, "ebnf": lambda v: False,
    "structural_tag": lambda v: False,
    "logit_bias": lambda v: isinstance(v, Mapping) and all(b == 0 for b in v.values()),
    # Named in SGLang's contract or sent by other SGLang-compatible clients; only null is neutral.
    "beam_width": lambda v: False, "watermark": lambda v: False, "choice": lambda v: False,
}
# SGLang keys that change nothing here and are accepted with any value: `stream_interval` only
# paces streaming, and `custom_params` is read only by a custom logit processor (which a request
# cannot install on this server: `custom_logit_processor` is refused at the request level).
_IGNORED = {"stream_interval", "custom_params"}

@dataclasses.dataclass(frozen=True)
class Sampling:
  """One request's sampling options, SGLang's `sampling_params` (same names and defaults).

  `max_new_tokens=None` means "until the context is full". `sampling_seed=None` lets the engine draw
  a seed. `n` is handled by the caller (one engine request per sample).
  """

  max_new_tokens: int | None = 128
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  min_new_tokens: int = 0
  n: int = 1
  skip_special_tokens: bool = True
  spaces_between_special_tokens: bool = True
  no_stop_trim: bool = False
  sampling_seed: int | None = None
  stop_regex: tuple[str, ...] = ()  # matched against the decoded output, like `stop`

  def __post_init__(self):
    if self.max_new_tokens is not None and self.max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}.")
    if self.min_new_tokens < 0:
      raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}.")
    if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
      raise ValueError(f"min_new_tokens={self.min_new_tokens} > max_new_tokens="
                       f"{self.max_new_tokens}.")
    if not (0 <= self.temperature and math.isfinite(self.temperature)):
      raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}.")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k == 0 or self.top_k < -1 or self.top_k > INT32_MAX:
      raise ValueError(f"top_k must be -1 (all) or in [1, {INT32_MAX}], got {self.top_k}.")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
    if self.min_new_tokens > INT32_MAX:
      raise ValueError(f"min_new_tokens must be <= {INT32_MAX}, got {self.min_new_tokens}.")
    if self.n < 1:
      raise ValueError(f"n must be >= 1, got {self.n}.")
    if any(not s for s in self.stop):
      raise ValueError("stop strings must be non-empty.")
    if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
      raise ValueError(f"stop_token_ids must be in [0, {INT32_MAX}], got "
                       f"{list(self.stop_token_ids)[:8]}.")
    for pattern in self.stop_regex:
      try:
        regex.compile(pattern)
      except regex.error as e:
        raise ValueError(f"stop_regex {pattern!r:.100} is not a valid regular expression: "
                         f"{e}.") from None

  @property
  def greedy(self) -> bool:
    return self.temperature < SAMPLING_EPS

  @classmethod
  def from_json(cls, obj: Mapping[str, Any] | None) -> "Sampling":
    """Parses a JSON `sampling_params` object; unknown or unsupported keys raise ValueError."""
    if obj is None:
      return cls()
    if not isinstance(obj, Mapping):
      raise ValueError(f"sampling_params must be an object, got {type(obj).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in obj.items():
      if key in _IGNORED:
        continue
      if key in _NEUTRAL:
        if value is not None and not _is_neutral(key, value):
          raise ValueError(f"sampling param {key}={value!r:.100} is not supported by this engine "
                           "(only its neutral value is).")
        continue
      if key not in fields:
        raise ValueError(f"unknown sampling param {key!r}.")
      if value is None:
        if key in ("max_new_tokens", "sampling_seed"):
          kwargs[key] = None
        continue  # JSON null means "default", as in SGLang.
      kwargs[key] = _coerce(key, value)
    return cls(**kwargs)


def _is_neutral(key: str, value: Any) -> bool:
  try:
    return bool(_NEUTRAL[key](value))
  except TypeError:  # e.g. a string where a number is expected: not neutral
    return False


def _coerce(key: str, value: Any) -> Any:
  def number(v, kind):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise ValueError(f"sampling param {key} must be a number, got {v!r:.100}.")
    if isinstance(v, float) and not math.isfinite(v):  # 1e400 parses as inf
      raise ValueError(f"sampling param {key} must be finite, got {v!r}.")
    if kind is int and v != int(v):
      raise ValueError(f"sampling param {key} must be an integer, got {v!r}.")
    try:
      return kind(v)
    except OverflowError:  # JSON allows an integer like 10**400, which no float holds
      raise ValueError(f"sampling param {key} is out of range, got {v!r:.100}.") from None

  if key in ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed"):
    return number(value, int)
  if key in ("temperature", "top_p", "min_p"):
    return number(value, float)
  if key in ("stop", "stop_regex"):
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
      raise ValueError(f"{key} must be a string or a list of strings, got {value!r:.100}.")
    return tuple(s for s in stops if s) if key == "stop_regex" else tuple(stops)
  if key == "stop_token_ids":
    if not isinstance(value, list):
      raise ValueError(f"stop_token_ids must be a list of ints, got {value!r:.100}.")
    return tuple(number(v, int) for v in value)
  if not isinstance(value, bool):
    raise ValueError(f"sampling param {key} must be a boolean, got {value!r:.100}.")
  return value


# --- per-row device arrays ---------------------------------------------------------------------------

@struct.dataclass
class RowSampling:
  """`Sampling` of B rows as arrays `[B]` (stop_ids `[B, MAX_STOP_IDS]`, -1 padded)."""

  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array  # int32, -1 = all
  min_p: jax.Array
  seed: jax.Array  # uint32 [B, 2]: high and low halves of a 64-bit seed
  min_new: jax.Array  # int32: ban stop_ids while fewer tokens than this were generated
  stop_ids: jax.Array  # int32 [B, MAX_STOP_IDS]

  @staticmethod
  def host(rows: list[tuple[Sampling, int, tuple[int, ...]]], size: int) -> "RowSampling":
    """NumPy arrays for `size` rows from (options, seed, banned ids) triples; the rest are idle."""
    temperature = np.zeros(size, np.float32)
    top_p = np.ones(size, np.float32)
    top_k = np.full(size, -1, np.int32)
    min_p = np.zeros(size, np.float32)
    seed = np.zeros((size, 2), np.uint32)
    min_new = np.zeros(size, np.int32)
    stop_ids = np.full((size, MAX_STOP_IDS), -1, np.int32)
    for i, (s, row_seed, banned) in enumerate(rows):
      if s is None:
        continue
      temperature[i] = 0.0 if s.greedy else min(s.temperature, MAX_TEMPERATURE)
      top_p[i], top_k[i], min_p[i] = s.top_p, s.top_k, s.min_p
      seed[i] = (row_seed >> 32) & 0xFFFFFFFF, row_seed & 0xFFFFFFFF
      min_new[i] = s.min_new_tokens
      stop_ids[i, :len(banned)] = banned
    return RowSampling(temperature, top_p, top_k, min_p, seed, min_new, stop_ids)


# --- truncation strategies ---------------------------------------------------------------------------
# Each sees candidates sorted by decreasing probability and keeps a prefix of them.

class TopK:
  def keep(self, sorted_probs: jax.Array, rows: RowSampling) -> jax.Array:
    rank = jnp.arange(sorted_probs.shape[-1])[None]
    k = jnp.where(rows.top_k > 0, rows.top_k, sorted_probs.shape[-1])
    return rank < k[:, None]


class TopP:
  def keep(self, sorted_probs: jax.Array, rows: RowSampling) -> jax.Array:
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    return mass_before < rows.top_p[:, None]


class MinP:
  def keep(self, sorted_probs: jax.Array, rows: RowSampling) -> jax.Array:
    return sorted_probs >= rows.min_p[:, None] * sorted_probs[:, :1]


TRUNCATIONS = (TopK(), TopP(), MinP())


def _truncate(scaled: jax.Array, rows: RowSampling) -> jax.Array:
  """Sets logits outside every strategy's kept prefix to -inf (the top candidate always stays)."""
  sorted_logits = -jnp.sort(-scaled, axis=-1)
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  keep = jnp.ones(scaled.shape, bool)
  for strategy in TRUNCATIONS:
    keep &= strategy.keep(sorted_probs, rows)
  num_kept = jnp.maximum(keep.sum(-1), 1)
  threshold = jnp.take_along_axis(sorted_logits, (num_kept - 1)[:, None], axis=-1)
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _needs_truncation(rows: RowSampling, vocab: int) -> jax.Array:
  sampled = rows.temperature > 0
  return jnp.any(sampled & (((rows.top_k > 0) & (rows.top_k < vocab)) | (rows.top_p < 1)
                            | (rows.min_p > 0)))


def _uniforms(seed: jax.Array, steps: jax.Array) -> jax.Array:
  def one(s, step):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s[0]), s[1])
    return jax.random.uniform(jax.random.fold_in(key, step))
  return jax.vmap(one)(seed, steps)


def _inverse_cdf(weights: jax.Array, u: jax.Array, chunk: int = 128) -> jax.Array:
  """Index i with cumsum(w)[i-1] <= u * sum(w) < cumsum(w)[i], per row of `weights` `[B, V]`.

  Two levels (chunk sums, then one chunk) so it costs one pass over V instead of a log-depth scan.
  """
  b, vocab = weights.shape
  n = -(-vocab // chunk)
  chunks = jnp.pad(weights, ((0, 0), (0, n * chunk - vocab))).reshape(b, n, chunk)
  sums = chunks.sum(-1)  # [B, n]
  cums = jnp.cumsum(sums, axis=-1)
  target = u * cums[:, -1]
  j = jnp.minimum(jnp.sum(cums <= target[:, None], axis=-1), n - 1)
  start = jnp.take_along_axis(cums - sums, j[:, None], -1)[:, 0]
  inside = jnp.cumsum(jnp.take_along_axis(chunks, j[:, None, None], 1)[:, 0], axis=-1)  # [B, C]
  k = jnp.minimum(jnp.sum(inside <= (target - start)[:, None], axis=-1), chunk - 1)
  return jnp.minimum(j * chunk + k, vocab - 1)


def sample(logits: jax.Array, rows: RowSampling, steps: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row. `logits` `[B, V]` float32, `steps` `[B]` = tokens generated so far.

  Returns (tokens `[B]` int32, behaviour log-probs `[B]` float32).
  """
  tokens, logprobs, _ = sample_with_top(logits, rows, steps, 0)
  return tokens, logprobs


def sample_with_top(logits: jax.Array, rows: RowSampling, steps: jax.Array, top_n: int
                    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
  """`sample`, plus the `top_n` most likely candidates of each row under the same behaviour
  distribution (SGLang's `output_top_logprobs`): (ids, log-probs) `[B, top_n]`."""
  tokens, scaled, lse = _sample(logits, rows, steps)
  logprobs = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - lse
  # The full [B, V] log-softmax only when candidates are asked for (a pass over V saved per step).
  top = top_candidates(scaled - lse[:, None], top_n) if top_n else top_candidates(scaled, 0)
  return tokens, logprobs, top


def top_candidates(logp: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """The `n` most likely tokens of each row of `logp` `[..., V]`: (ids, log-probs) `[..., n]`."""
  if n == 0:
    shape = logp.shape[:-1] + (0,)
    return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, logp.dtype)
  values, ids = jax.lax.top_k(logp, n)
  return ids.astype(jnp.int32), values


def _sample(logits: jax.Array, rows: RowSampling, steps: jax.Array):
  """(tokens `[B]`, the behaviour logits `[B, V]` (banned ids -inf, divided by T), their
  log-sum-exp `[B]`)."""
  b, vocab = logits.shape
  banning = (steps < rows.min_new)[:, None] & (rows.stop_ids >= 0)  # [B, MAX_STOP_IDS]

  def ban(x):
    banned = jnp.where(banning, rows.stop_ids, vocab)
    return x.at[jnp.arange(b)[:, None], banned].set(-jnp.inf, mode="drop")

  # Most steps ban nothing: skip the scatter (it copies the [B, V] logits).
  logits = jax.lax.cond(jnp.any(banning), ban, lambda x: x, logits)
  greedy = rows.temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, rows.temperature)[:, None]
  top = jnp.max(scaled, axis=-1, keepdims=True)
  lse = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1)) + top[:, 0]

  def draw(_):
    truncated = jax.lax.cond(_needs_truncation(rows, vocab), _truncate, lambda x, _: x, scaled,
                             rows)
    weights = jnp.exp(truncated - jnp.max(truncated, axis=-1, keepdims=True))
    drawn = _inverse_cdf(weights, _uniforms(rows.seed, steps))
    # Guard against float round-off landing on a zero-probability (truncated) candidate.
    ok = jnp.take_along_axis(weights, drawn[:, None], -1)[:, 0] > 0
    return jnp.where(ok, drawn, jnp.argmax(truncated, axis=-1))

  # An all-greedy batch (e.g. evaluation) skips the random draw entirely.
  drawn = jax.lax.cond(jnp.all(greedy), lambda _: jnp.zeros(b, jnp.int32), draw, None)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  return tokens, scaled, lse
