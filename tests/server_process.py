"""One real rollout server process for a test module, with its output drained.

A pipe nobody reads fills up (64 KiB of logged errors, e.g. a long fuzz campaign), and the server
then blocks on its next log line, event loop and all: every later request times out."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading


@contextlib.contextmanager
def server_process(*args: str):
  """`python -m flashrl_jax.rollout.server *args` (with `--port=0`) as a child; yields its URL.
  Its output is read to the end by a thread (see the module docstring)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen([sys.executable, "-m", "flashrl_jax.rollout.server", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=root)
  lines: list[str] = []
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("flashrl_jax rollout server ready on "):
        break
    else:
      raise RuntimeError("server exited:\n" + "".join(lines))
    threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True).start()
    yield line.split(" on ")[1].strip()
  finally:
    proc.terminate()
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
