"""Child processes that never outlive the experiment that started them (JAX-free).

Benchmarks and sweeps start runs (`experiments.train`), calibrations and probe servers as child
processes, each with rollout servers of its own. Stopped by Ctrl-C or `kill` (SIGTERM), an
experiment must stop them too: a server left running keeps its core busy under whatever is measured
next. Python's default SIGTERM ends a process without running `finally` blocks or `__exit__`, and
`subprocess.run` SIGKILLs its child when interrupted, which then cannot stop its own servers; hence
`unwind_on_sigterm` in every launcher's `main`, and `run`/`stop` to end a child with SIGTERM first.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

GRACE_S = 15.0  # a run needs a few seconds to stop its servers (LocalServers.stop: up to 10 s)


def unwind_on_sigterm() -> None:
  """SIGTERM unwinds like Ctrl-C: `SystemExit` runs every `finally` and `__exit__` on its way out,
  so the process stops what it started (from the main thread, before starting anything)."""
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def stop(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
  """Ends `proc` if it still runs: SIGTERM (a launcher then stops its own children), SIGKILL
  after `grace_s`. Its pipes, if any, are drained meanwhile: a child blocked writing its last log
  lines to a full pipe would never get to exit."""
  if proc.poll() is not None:
    return
  proc.terminate()
  try:
    proc.communicate(timeout=grace_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()


@contextlib.contextmanager
def stopped_on_exit(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
  """`with stopped_on_exit(Popen(...)) as proc:`: however the block ends, `proc` does not run on
  past it (`stop`)."""
  try:
    yield proc
  finally:
    stop(proc)


def run(cmd: Sequence[str], **popen_kwargs) -> subprocess.CompletedProcess:
  """`subprocess.run(cmd, capture_output=True, text=True, **popen_kwargs)`, except that when this
  process is interrupted (Ctrl-C, SIGTERM under `unwind_on_sigterm`) the child is stopped with
  `stop`, not SIGKILLed, before the interruption goes on."""
  with (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **popen_kwargs) as popen, stopped_on_exit(popen) as proc):
    stdout, stderr = proc.communicate()
  return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)
