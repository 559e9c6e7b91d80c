"""A minimal discrete-event loop: a heap of (time, sequence, callback).

Why: the simulator needs deterministic ordering. Ties in time are broken by insertion order (the
sequence number), never by comparing callbacks, so a run is a pure function of its config and seed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class EventLoop:
  """Calls `fn(*args)` at simulated time `t`; `now` is the time of the event being handled."""

  def __init__(self):
    self.now = 0.0
    self.handled = 0
    self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
    self._seq = itertools.count()

  def at(self, t: float, fn: Callable[..., Any], *args) -> None:
    if t < self.now:
      raise ValueError(f"cannot schedule in the past: {t} < {self.now}")
    heapq.heappush(self._heap, (t, next(self._seq), fn, args))

  def run(self, done: Callable[[], bool], max_events: int = 50_000_000) -> None:
    """Handle events in time order until `done()` or the heap is empty."""
    while self._heap and not done():
      if self.handled >= max_events:
        raise RuntimeError(f"simulation exceeded {max_events} events")
      t, _, fn, args = heapq.heappop(self._heap)
      self.now = t
      self.handled += 1
      fn(*args)
