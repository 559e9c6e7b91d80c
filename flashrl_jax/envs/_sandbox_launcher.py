"""Trusted launcher for one sandboxed run; executed as a script (`python -I -S <this file>`), never imported.

Why a separate script instead of `preexec_fn`: the parent is a multi-threaded JAX process, and
running Python between fork and exec there can deadlock. Here the isolation is set up in a fresh,
single-threaded interpreter, so it may take its time: read the JSON spec from stdin, enter new
network/mount/PID namespaces when allowed, set resource limits, drop privileges, and only then
`exec` the untrusted code. See `_sandbox.py` for the threat model. Standard library only, so it
works under `-I -S` from any working directory.

Protocol: the first stdout line is `<nonce>:<mode>`; on success the last one is `<nonce>`. Exit
codes: 0 success, 1 the code or its tests raised,
3 MemoryError, 4 the sandbox itself could not be set up, 128+N killed by signal N (PID-ns mode).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
EXIT_RAISED, EXIT_MEMORY, EXIT_SETUP = 1, 3, 4


def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _enter_namespaces(libc) -> bool:
  """New net+mount+pid namespaces; False when the kernel or our privileges do not allow it."""
  return os.geteuid() == 0 and libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID) == 0


def _mount(libc, source, target, fstype, flags, data=None) -> bool:
  enc = lambda s: None if s is None else s.encode()
  return libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def _private_tmp(libc, scratch_mb: int) -> str:
  """Fresh tmpfs over the world-writable dirs, so nothing written there outlives the run."""
  if not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):
    raise OSError(ctypes.get_errno(), "make / private")
  for path in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(path) and not _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
                                          f"size={scratch_mb}m,mode=1777"):
      raise OSError(ctypes.get_errno(), f"tmpfs on {path}")
  # A /proc for the new PID namespace (hides host processes); containers may forbid it: best effort.
  _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  os.makedirs("/tmp/work", exist_ok=True)
  return "/tmp/work"


def _wait_and_exit(pid: int) -> None:
  """The outer launcher (outside the PID namespace) mirrors the namespace init's exit status."""
  _, status = os.waitpid(pid, 0)
  os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _set_limits(spec: dict) -> None:
  lim = spec["limits"]
  mb = 1 << 20
  resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
  resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
  resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
  resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
  resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop_privileges(libc, uid: int | None) -> None:
  if uid is not None and os.geteuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
  libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no regaining privileges via setuid binaries
  # Set after setuid (a credential change clears it): if our parent dies, so do we.
  libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _pin_sys_path() -> None:
  """Keep the stdlib importable after dropping privileges even if it lives under an 0700 dir.

  (pyenv installs under /root are common.) A directory fd opened while still root can be walked
  through `/proc/self/fd/N` without search permission on its ancestors; only the stdlib dirs
  themselves (world-readable) are exposed this way, not their parents' other contents.
  """
  pinned = {}
  for path in sys.path:
    if os.path.isdir(path):
      pinned[path] = f"/proc/self/fd/{os.open(path, os.O_RDONLY | os.O_DIRECTORY)}"
  sys.path[:] = list(pinned.values())

  def repin(entry: str) -> str:
    for old, new in pinned.items():
      if entry == old or entry.startswith(old + os.sep):
        return new + entry[len(old):]
    return entry

  # Packages already imported (e.g. `encodings`, which lazily imports codecs) search __path__.
  for module in list(sys.modules.values()):
    search = getattr(module, "__path__", None)
    if isinstance(search, list):
      search[:] = [repin(p) for p in search]


def _block_sockets() -> None:
  """Fallback when no network namespace: make the socket API unusable from Python code.

  Best effort only: code using ctypes/raw syscalls or a subprocess can still reach the network.
  """
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


def _run_untrusted(spec: dict) -> None:
  scope = {"__name__": "__main__", "__builtins__": __builtins__}
  try:
    exec(compile(spec["code"], "solution.py", "exec"), scope)
    if spec.get("tests"):
      exec(compile(spec["tests"], "tests.py", "exec"), scope)
  except MemoryError:
    os.write(2, b"MemoryError\n")
    os._exit(EXIT_MEMORY)
  except BaseException:  # noqa: BLE001 -- SystemExit(0) from the code must not count as a pass.
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(EXIT_RAISED)
  sys.stdout.flush()
  os.write(1, f"\n{spec['nonce']}\n".encode())
  os._exit(0)


def main() -> None:
  spec = json.loads(sys.stdin.read())
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)  # the untrusted code gets an empty stdin, not our spec pipe
  libc = _libc()
  namespaced = spec["isolation"] != "fallback" and _enter_namespaces(libc)
  if spec["isolation"] == "namespaces" and not namespaced:
    os.write(2, b"sandbox setup: namespaces unavailable\n")
    os._exit(EXIT_SETUP)
  try:
    if namespaced:
      pid = os.fork()  # the child is PID 1 of the new namespace; when it dies, all its descendants die
      if pid:
        _wait_and_exit(pid)
      os.chdir(_private_tmp(libc, spec["limits"]["scratch_mb"]))
      if spec["uid"] is not None:
        os.chown(".", spec["uid"], spec["uid"])
    if not namespaced:
      _block_sockets()  # before the drop: importing _socket may need root's search permissions
    if spec["uid"] is not None:
      _pin_sys_path()
    _set_limits(spec)
    _drop_privileges(libc, spec["uid"])
  except Exception:  # noqa: BLE001
    traceback.print_exc()
    os._exit(EXIT_SETUP)
  os.environ["TMPDIR"] = os.environ["HOME"] = os.getcwd()
  # First stdout line, written before any untrusted code runs: tells the parent which mode held.
  os.write(1, f"{spec['nonce']}:{'namespaces' if namespaced else 'fallback'}\n".encode())
  _run_untrusted(spec)


if __name__ == "__main__":
  main()
