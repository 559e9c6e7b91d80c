"""The judged side of a sandboxed run: load the program, call its entry point, report plain data.

This runs inside the sandbox, in the same process as the code under test, so nothing here is
trusted: the code can replace any of it, or skip it and write its own report. That is harmless by
construction. The process holds nothing worth stealing (the program and the call arguments, never
the expected answers), and what it reports on fd 3 is only ever read as the program's answers: one
JSON line `{"results": [{"value": v} | {"error": "..."}, ...]}` that the grader, in the
controller's process, compares with the expected values as plain data. A forged report can only
claim answers, which is what the program was asked to produce in the first place.

Started by `_sandbox_launcher.py`: as `python -I -S -c <this source>` with the job as JSON on stdin
(namespace modes), or by calling `main(job)` in the launcher's interpreter (fallback modes).
Exit codes: 0 reported, 1 the program raised at top level, 3 MemoryError. Standard library only.
"""

import builtins
import json
import os
import sys
import traceback

RESULTS_FD = 3
EXIT_RAISED, EXIT_MEMORY = 1, 3
_MAX_DEPTH = 100


def _plain(value, depth: int = 0):
  """The JSON form of a returned value; exact built-in types only (no subclass's methods run)."""
  if depth > _MAX_DEPTH:
    raise ValueError(f"result nested deeper than {_MAX_DEPTH} levels")
  kind = type(value)
  if value is None or kind in (bool, int, float, str):
    return value
  if kind in (list, tuple):
    return [_plain(v, depth + 1) for v in value]
  if kind is dict and all(type(k) is str for k in value):
    return {k: _plain(v, depth + 1) for k, v in value.items()}
  raise TypeError(f"cannot report a {kind.__name__}: return None, bool, int, float, str, list, "
                  "tuple or dict with str keys")


def _describe(error: BaseException) -> str:
  try:
    return f"{type(error).__name__}: {error}"[:300]
  except BaseException:  # noqa: BLE001 -- a hostile __str__
    return "error"


def _emit(doc: dict) -> None:
  data = (json.dumps(doc) + "\n").encode()
  while data:
    data = data[os.write(RESULTS_FD, data):]


def _block_sockets() -> None:
  """Without a network namespace: make Python's socket API unusable (best effort only: ctypes,
  raw syscalls or a subprocess can still reach the network)."""
  import _socket
  import socket

  class _NoSocket:
    def __init__(self, *args, **kwargs):
      raise PermissionError("network access is disabled in this sandbox")

  def _no_net(*args, **kwargs):
    raise PermissionError("network access is disabled in this sandbox")

  for mod in (socket, _socket):
    mod.socket = mod.SocketType = _NoSocket
    mod.getaddrinfo = mod.socketpair = _no_net
  socket.create_connection = socket.create_server = socket.fromfd = _no_net


def _memory_exit() -> None:
  os.write(2, b"MemoryError\n")
  os._exit(EXIT_MEMORY)


def main(job: dict) -> None:
  if job.get("block_sockets"):
    _block_sockets()
  scope = {"__name__": "__main__", "__builtins__": builtins}
  try:
    exec(compile(job["code"], "solution.py", "exec"), scope)
  except MemoryError:
    _memory_exit()
  except BaseException:  # noqa: BLE001 -- SystemExit too: a program that exits has no answers
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(EXIT_RAISED)
  results = None
  if job.get("entry"):
    results = []
    for args, kwargs in job["calls"]:
      try:
        fn = scope.get(job["entry"])
        if not callable(fn):
          raise NameError(f"{job['entry']!r} is not defined as a function")
        results.append({"value": _plain(fn(*args, **kwargs))})
      except MemoryError:
        _memory_exit()
      except BaseException as error:  # noqa: BLE001 -- recorded as this case's answer
        results.append({"error": _describe(error)})
  try:
    sys.stdout.flush()
    sys.stderr.flush()
    _emit({"results": results})
  except MemoryError:
    _memory_exit()
  os._exit(0)


if __name__ == "__main__":
  _job = json.loads(sys.stdin.buffer.read())
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the program gets an empty stdin
  main(_job)
