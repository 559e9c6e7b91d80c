"""One rollout worker as a processor-sharing decode server, plus the request/group records.

Why: simulating every decode step of a 128-GPU cluster would cost millions of events per training
step. Between two events (an admission, a finish, a pause) a worker's number of active requests is
constant, so its decode step time is constant and every active request gains tokens at the same
rate 1/step_time(active). The worker therefore keeps one counter `progress` (tokens each active slot
has decoded since the worker started) and gives each request a finish threshold
`progress_at_admission + length`; the next finish is the smallest threshold. Events are only
admissions, finishes and pauses: O(samples), not O(tokens).

Prefill and weight loads *block* the worker (no decode progress) for their duration; prefill counts
as busy time, a pause does not. When the step time depends on the requests' contexts (which grow as
they decode), a decode is re-timed every `REFRESH_TOKENS` tokens, so a long tail is not priced at
the contexts it started with.
"""

from __future__ import annotations

import heapq
import itertools

from flashrl_jax.sim import _costs

_EPS = 1e-9
REFRESH_TOKENS = 16.0


class Group:
  """One prompt and its `n` responses; ready for training when every response has its reward."""

  __slots__ = ("gid", "prompt_z", "requests", "issue_time", "unrewarded", "ready_time", "cancelled")

  def __init__(self, gid: int, prompt_z: float, lengths, prompt_tokens: int, issue_time: float):
    self.gid = gid
    self.prompt_z = prompt_z
    self.requests = [Request(self, i, int(n), prompt_tokens) for i, n in enumerate(lengths)]
    self.issue_time = issue_time
    self.unrewarded = len(self.requests)
    self.ready_time: float | None = None
    self.cancelled = False

  @property
  def start_version(self) -> int:
    """Oldest policy version its responses were dispatched at (staleness counts from it)."""
    return min(r.start_version for r in self.requests)

  @property
  def complete(self) -> bool:
    """Every response generated and scored (what `SampleBuffer.put` requires)."""
    return self.unrewarded == 0

  @property
  def tokens(self) -> int:
    return sum(r.length + r.prompt_tokens for r in self.requests)


class Request:
  """One response to generate: `length` decode tokens after a `prompt_tokens` prefill."""

  __slots__ = ("group", "index", "length", "prompt_tokens", "start_version", "start_time",
               "finish_time", "threshold", "worker", "cancelled")

  def __init__(self, group: Group, index: int, length: int, prompt_tokens: int):
    self.group = group
    self.index = index
    self.length = length
    self.prompt_tokens = prompt_tokens
    self.start_version: int | None = None
    self.start_time: float | None = None
    self.finish_time: float | None = None
    self.threshold = 0.0
    self.worker: Worker | None = None
    self.cancelled = False


def _context_offset(request: Request) -> float:
  """An active request's context minus the worker's `progress`: its prompt + what it decoded since
  admission (`progress − its start`, its start being `threshold − length`)."""
  return request.prompt_tokens - (request.threshold - request.length)


class Worker:
  """A rollout worker with `slots` concurrent decode slots (continuous batching)."""

  def __init__(self, wid: int, slots: int, decode: _costs.DecodeModel, prefill_s_per_token: float,
               request_s: float = 0.0):
    self.wid = wid
    self.slots = slots
    self.decode = decode
    self.prefill_s_per_token = prefill_s_per_token
    self.request_s = request_s
    self.slow = 1.0  # time multiplier of every cost, while a co-located trainer competes
    # Σ (prompt − progress at admission) over active requests: their mean context is
    # `_context_base / a + progress` (each has decoded `progress − its start` tokens).
    self._context_base = 0.0
    self.active: list[tuple[float, int, Request]] = []  # heap keyed by finish threshold
    self.progress = 0.0
    self.last = 0.0
    self.blocked_until = 0.0
    self.epoch = 0  # bumped on every change; finish events carry it so stale ones are ignored
    self.busy_s = 0.0
    self._seq = itertools.count()

  @property
  def load(self) -> int:
    return len(self.active)

  @property
  def free_slots(self) -> int:
    return self.slots - len(self.active)

  def advance(self, now: float) -> None:
    """Bring `progress` up to time `now` (decode only runs outside blocked intervals)."""
    start = max(self.last, self.blocked_until)
    if self.active and now > start:
      dt = now - start
      self.progress += dt / self.step_time()
      self.busy_s += dt
    self.last = max(self.last, now)

  def admit(self, request: Request, now: float) -> None:
    if not self.free_slots:
      raise RuntimeError(f"worker {self.wid} has no free slot")
    self.advance(now)
    prefill = (self.request_s + self.prefill_s_per_token * request.prompt_tokens) * self.slow
    self.blocked_until = max(self.blocked_until, now) + prefill
    self.busy_s += prefill
    request.threshold = self.progress + request.length
    request.worker = self
    heapq.heappush(self.active, (request.threshold, next(self._seq), request))
    self._context_base += request.prompt_tokens - self.progress
    self.epoch += 1

  def step_time(self) -> float:
    a = len(self.active)
    if not a:
      context = 0.0
    elif self.decode.context_sensitive and self.decode.context_of is _costs.Context.LONGEST:
      context = self.progress + max(_context_offset(r) for _, _, r in self.active)
    else:
      context = self._context_base / a + self.progress
    return self.decode.step_time(a, context) * self.slow

  def _leave(self, request: Request) -> None:
    self._context_base -= _context_offset(request)

  def set_slow(self, now: float, factor: float) -> None:
    """From `now` on, every cost takes `factor` times as long (progress so far is kept)."""
    self.advance(now)
    self.slow = factor
    self.epoch += 1

  def block(self, now: float, seconds: float) -> None:
    """Stop decoding for `seconds` from `now` (or from the end of a block already under way)."""
    self.advance(now)
    self.blocked_until = max(self.blocked_until, now) + seconds
    self.epoch += 1

  def prefill(self, now: float, tokens: float) -> None:
    """Block for re-prefilling `tokens` (abort-mode resume), counted as busy time."""
    seconds = self.prefill_s_per_token * tokens * self.slow
    self.block(now, seconds)
    self.busy_s += seconds

  def next_finish(self, now: float) -> tuple[float, bool] | None:
    """(time, whether a request finishes then): the next finish, or — for a context-sensitive
    decode model, a finish more than `REFRESH_TOKENS` away — the moment to re-time the step."""
    if not self.active:
      return None
    remaining = max(self.active[0][0] - self.progress, 0.0)
    finishing = True
    if self.decode.context_sensitive and remaining > REFRESH_TOKENS:
      remaining, finishing = REFRESH_TOKENS, False
    return max(now, self.blocked_until) + remaining * self.step_time(), finishing

  def pop_finished(self, now: float, finishing: bool = True) -> list[Request]:
    """Remove the head request (its finish event fired) and any others that tie with it; with
    `finishing` False (a re-timing event) only bring the progress up to `now`."""
    self.advance(now)
    done = []
    if finishing:
      self.progress = max(self.progress, self.active[0][0])
      while self.active and self.active[0][0] <= self.progress + _EPS * max(1.0, self.progress):
        _, _, request = heapq.heappop(self.active)
        request.finish_time = now
        self._leave(request)
        done.append(request)
    self.epoch += 1
    return done

  def generated(self, request: Request) -> float:
    """Tokens `request` has decoded so far (call after `advance`)."""
    return min(max(self.progress - (request.threshold - request.length), 0.0), request.length)

  def remove(self, doomed: set[int], now: float) -> list[Request]:
    """Cancel the active requests whose group id is in `doomed`; returns them."""
    self.advance(now)
    keep = [item for item in self.active if item[2].group.gid not in doomed]
    gone = [item[2] for item in self.active if item[2].group.gid in doomed]
    for request in gone:
      self._leave(request)
    if gone:
      self.active = keep
      heapq.heapify(self.active)
      self.epoch += 1
    return gone
