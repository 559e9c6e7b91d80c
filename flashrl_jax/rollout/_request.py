"""One generation request's life inside the engine: its tokens, log-probs, versions and finish rule.

Why a module of its own: the scheduler moves requests between the queue and decode slots (and back,
on retract), the device code knows nothing of them, and the server only reads their snapshots. What a
request has produced so far must survive all of those moves unchanged, so it lives here, host-side,
as plain Python lists; the engine thread is the only writer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Sequence

# The protocol's value types are shared with the client, so both sides speak one vocabulary.
import regex

from flashrl_jax.fleet import FinishKind, FinishReason, VersionSpan
from flashrl_jax.rollout._sampling import MAX_STOP_IDS, MAX_TOP_LOGPROBS, Sampling

log = logging.getLogger(__name__)


# A position's top candidates: ((token id, log-prob), ...), most likely first.
TopRow = tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class LogprobOptions:
  """What a request wants beyond its output tokens' log-probs (SGLang's top-level fields)."""

  input_start: int = -1  # logprob_start_len: prompt positions from here get log-probs (-1: none)
  top_n: int = 0  # top_logprobs_num: candidates per output position (and prompt, when asked)

  def __post_init__(self):
    if self.input_start < -1:
      raise ValueError(f"logprob_start_len must be >= -1, got {self.input_start}.")
    if not 0 <= self.top_n <= MAX_TOP_LOGPROBS:
      raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_n}.")


@dataclasses.dataclass(frozen=True)
class Output:
  """A snapshot of one request: everything the server returns for it."""

  rid: str
  prompt_ids: tuple[int, ...]
  output_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  versions: tuple[VersionSpan, ...]
  finish: FinishReason | None  # None while still running
  weight_version: str
  latency_s: float
  # Only for requests that asked (see `LogprobOptions`): prompt log-probs from `input_start` (the
  # first is None when it is position 0) and top candidates per prompt and output position.
  input_logprobs: tuple[float | None, ...] | None = None
  input_top: tuple[TopRow, ...] = ()
  output_top: tuple[TopRow, ...] = ()
  # Set when the request failed inside the engine: the server answers `error_status`, 500 when it
  # was not the request's fault (a client retries it elsewhere), 400 when it was (e.g. a stop_regex
  # that backtracks past its time budget: dropped, not retried).
  error: str | None = None
  error_status: int = 500


def validate_request(prompt_ids: Sequence[int], sampling: Sampling, *, vocab_size: int,
                     context_length: int, eos_ids: Sequence[int],
                     logprobs: LogprobOptions = LogprobOptions()) -> None:
  """Raises ValueError for a request an engine with these limits cannot serve."""
  if not prompt_ids:
    raise ValueError("the prompt is empty.")
  if logprobs.input_start >= len(prompt_ids):
    raise ValueError(f"logprob_start_len={logprobs.input_start} must be < the prompt length "
                     f"({len(prompt_ids)} tokens).")
  bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size}).")
  if len(prompt_ids) >= context_length:
    raise ValueError(f"The input ({len(prompt_ids)} tokens) is longer than the model's context "
                     f"length ({context_length} tokens, prompt + output).")
  bad = [t for t in sampling.stop_token_ids if t >= vocab_size]
  if bad:
    raise ValueError(f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab_size}).")
  banned = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))
  if len(banned) > MAX_STOP_IDS:
    raise ValueError(f"at most {MAX_STOP_IDS} stop token ids (eos included) are supported.")


# Per search of one stop_regex pattern over the output (the `regex` module enforces it).
STOP_REGEX_TIMEOUT_S = 0.05


class RequestFault(ValueError):
  """What a request asked for fails while it runs: it ends with HTTP 400, like any bad request."""


class Request:
  """Mutable engine-side state of one sample. Only the engine thread mutates it."""

  def __init__(self, rid: str, prompt_ids: list[int], sampling: Sampling, *, seed: int,
               max_new_tokens: int, eos_ids: tuple[int, ...], group: str | None = None,
               on_update: Callable[[Output], None] | None = None, stream: bool = False,
               logprobs: LogprobOptions = LogprobOptions()):
    self.rid, self.group, self.sampling, self.seed = rid, group, sampling, seed
    self.logprob_options = logprobs
    self.input_logprobs: list[float | None] | None = None  # set once, before the first prefill
    self.input_top: list[TopRow] = []
    self.output_top: list[TopRow] = []
    self.prompt_ids = list(prompt_ids)
    self.max_new_tokens = max_new_tokens
    self.stop_ids = tuple(dict.fromkeys(
        tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else eos_ids)))
    self.output_ids: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[list] = []  # [version, start, end]
    self.finish: FinishReason | None = None
    self.on_update, self.stream = on_update, stream
    self.created = time.perf_counter()
    self.finished_at: float | None = None
    self.current_version = ""
    self.error: str | None = None
    self.error_status = 500
    self.solo = False  # prefill alone: a group it was in failed, so it may be the cause
    self._done = threading.Event()
    self._final: Output | None = None

  # --- engine side -------------------------------------------------------------------------------

  @property
  def num_generated(self) -> int:
    return len(self.output_ids)

  def all_ids(self) -> list[int]:
    """Prompt plus everything generated: what a (re)prefill must process."""
    return self.prompt_ids + self.output_ids

  @property
  def wants_input_logprobs(self) -> bool:
    return self.logprob_options.input_start >= 0 and self.input_logprobs is None

  def set_input_logprobs(self, logprobs: Sequence[float | None], tops: Sequence[TopRow]) -> None:
    """Stores whole-prompt scores (position 0 first), keeping positions from `input_start`."""
    start = self.logprob_options.input_start
    self.input_logprobs = list(logprobs[start:])
    if self.input_logprobs:
      self.input_logprobs[0] = None  # as SGLang: the first returned position carries no log-prob
    self.input_top = [tuple(row[:self.logprob_options.top_n]) for row in tops[start:]]
    if self.input_top:
      self.input_top[0] = ()

  def append(self, token: int, logprob: float, version: str,
             top: tuple[Sequence[int], Sequence[float]] | None = None) -> None:
    index = len(self.output_ids)
    self.output_ids.append(token)
    self.logprobs.append(logprob)
    if self.logprob_options.top_n and top is not None:
      # A banned candidate (min_new_tokens) has log-prob -inf: not a candidate, and not JSON.
      self.output_top.append(tuple(
          (int(t), float(lp)) for t, lp in zip(top[0][:self.logprob_options.top_n],
                                               top[1][:self.logprob_options.top_n])
          if math.isfinite(lp)))
    self.current_version = version
    if self.versions and self.versions[-1][0] == version:
      self.versions[-1][2] = index + 1
    else:
      self.versions.append([version, index, index + 1])

  def check_finish(self, tokenizer) -> FinishReason | None:
    """The finish reason after the last appended token, if it ends the request."""
    n = len(self.output_ids)
    if n >= self.sampling.min_new_tokens and n and self.output_ids[-1] in self.stop_ids:
      return FinishReason(FinishKind.STOP, matched=self.output_ids[-1])
    if n >= self.sampling.min_new_tokens and n and self.sampling.stop and tokenizer is not None:
      # As in SGLang, a match anywhere in a tail window counts (each token decodes to >= 1 char
      # except rare byte pieces, hence the margin); earlier matches would have stopped us already.
      window = max(len(s) for s in self.sampling.stop) + 8
      tail = tokenizer.decode(self.output_ids[-window:], self.sampling.skip_special_tokens)
      for stop in self.sampling.stop:
        if stop in tail:
          return FinishReason(FinishKind.STOP, matched=stop)
    if n >= self.sampling.min_new_tokens and n and self.sampling.stop_regex and tokenizer is not None:
      # A regex may match a span of any length, so search the whole output; the first token whose
      # arrival makes any pattern match ends the request (earlier tokens matched nothing).
      text = tokenizer.decode(self.output_ids, self.sampling.skip_special_tokens)
      for pattern in self.sampling.stop_regex:
        try:  # a request's pattern runs on the engine thread: its backtracking is bounded
          match = regex.search(pattern, text, timeout=STOP_REGEX_TIMEOUT_S)
        except TimeoutError:
          raise RequestFault(f"stop_regex {pattern!r:.100} took more than {STOP_REGEX_TIMEOUT_S} s "
                             "on the output (catastrophic backtracking?).") from None
        if match:
          return FinishReason(FinishKind.STOP, matched=match.group(0))
    if n >= self.max_new_tokens:
      return FinishReason(FinishKind.LENGTH, length=n)
    return None

  def snapshot(self, weight_version: str) -> Output:
    end = self.finished_at if self.finished_at is not None else time.perf_counter()
    return Output(
        rid=self.rid, prompt_ids=tuple(self.prompt_ids), output_ids=tuple(self.output_ids),
        logprobs=tuple(self.logprobs),
        versions=tuple(VersionSpan(v, s, e) for v, s, e in self.versions), finish=self.finish,
        weight_version=weight_version, latency_s=end - self.created,
        input_logprobs=None if self.input_logprobs is None else tuple(self.input_logprobs),
        input_top=tuple(self.input_top), output_top=tuple(self.output_top), error=self.error,
        error_status=self.error_status)

  def notify(self, weight_version: str) -> None:
    """Reports progress to a streaming caller (`on_update` always hears the final snapshot)."""
    if self.stream and self.on_update is not None:
      self._emit(self.snapshot(weight_version))

  def _emit(self, output: Output) -> None:
    try:  # a caller's callback (e.g. into a closed event loop) must never break the engine loop
      self.on_update(output)
    except Exception:  # pylint: disable=broad-except
      log.exception("on_update callback of request %s failed", self.rid)

  def fail(self, message: str, weight_version: str, status: int = 500) -> None:
    """Ends the request with an error (finish `abort` carrying the message); see `Output.error`."""
    self.error, self.error_status = message, status
    self.complete(FinishReason(FinishKind.ABORT, message=message), weight_version)

  def complete(self, finish: FinishReason, weight_version: str) -> None:
    self.finish = finish
    self.finished_at = time.perf_counter()
    self._final = self.snapshot(weight_version)
    self._done.set()
    if self.on_update is not None:
      self._emit(self._final)

  # --- caller side -------------------------------------------------------------------------------

  @property
  def done(self) -> bool:
    return self._done.is_set()

  def result(self, timeout: float | None = None) -> Output:
    """Blocks until the request finishes; returns its final snapshot."""
    if not self._done.wait(timeout):
      raise TimeoutError(f"request {self.rid} did not finish within {timeout} s.")
    return self._final
