"""Counts the XLA programs this process builds, so a server can show that nothing compiles mid-run.

Why from JAX's monitoring events and not the runner's jit caches: a compile anywhere in the process
(an eager op on a new shape, a helper jitted outside the runner) stalls the engine thread just the
same. JAX reports one backend-compile event per program it builds, whether XLA compiled it or it
came from the persistent compilation cache (which reports a hit as well). JAX's listener registry is
process-wide, so this counter is too: it is installed once, on first use.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax
from jax import monitoring

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "flashrl_jax", "jax")

_BUILD_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileCounts:
  """Programs built so far in this process: `programs` = compiled + loaded from the persistent
  cache (`cache_hits`); `seconds` spent building them."""

  programs: int = 0
  cache_hits: int = 0
  seconds: float = 0.0

  @property
  def compiled(self) -> int:
    return self.programs - self.cache_hits

  def __sub__(self, other: "CompileCounts") -> "CompileCounts":
    return CompileCounts(self.programs - other.programs, self.cache_hits - other.cache_hits,
                         self.seconds - other.seconds)


class _Counter:
  def __init__(self):
    self._lock = threading.Lock()
    self._counts = CompileCounts()
    monitoring.register_event_duration_secs_listener(self._on_duration)
    monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, seconds: float, **_) -> None:
    if event == _BUILD_EVENT:
      with self._lock:
        c = self._counts
        self._counts = dataclasses.replace(c, programs=c.programs + 1, seconds=c.seconds + seconds)

  def _on_event(self, event: str, **_) -> None:
    if event == _CACHE_HIT_EVENT:
      with self._lock:
        self._counts = dataclasses.replace(self._counts, cache_hits=self._counts.cache_hits + 1)

  def counts(self) -> CompileCounts:
    with self._lock:
      return self._counts


_counter: _Counter | None = None
_install_lock = threading.Lock()


def compile_counts() -> CompileCounts:
  """What this process has built since the counter was installed (the first call installs it)."""
  global _counter
  with _install_lock:
    if _counter is None:
      _counter = _Counter()
  return _counter.counts()


def enable_compilation_cache(path: str, max_bytes: int = 2 << 30) -> None:
  """Keeps every compiled program in JAX's persistent cache at `path` (least recently used beyond
  `max_bytes` go), so a restarted server loads its programs instead of compiling them."""
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_compilation_cache_max_size", max_bytes)
