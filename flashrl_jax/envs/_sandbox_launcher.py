"""Trusted launcher for one sandboxed run; run as a script (`python -I -S <file>`), never imported.

Why a separate script instead of `preexec_fn`: the parent is a multi-threaded JAX process, and
running Python between fork and exec there can deadlock. Here the isolation is set up in a fresh,
single-threaded interpreter, so it may take its time. The threat model is in `_sandbox.py`.

Steps: read the JSON spec from stdin; enter new namespaces (as root directly; otherwise through an
unprivileged user namespace); report the isolation that holds on the results fd (fd 3), before any
untrusted code exists; fork PID 1 of the new PID namespace, which builds a minimal root (read-only
system and Python dirs, private /tmp, a few device nodes, a fresh /proc) and forks the runner's
process; that one chroots into the new root, becomes an unprivileged user (a fresh uid as root; an
unmapped user in a nested user namespace otherwise), sets resource limits and execs a fresh
interpreter on `_sandbox_runner.py`. Without namespaces the runner
runs in this interpreter after the same limits and (as root) the same uid drop.

Exit codes: the runner's (0 reported, 1 the program raised, 3 MemoryError), 4 the sandbox could
not be set up, 5 refused (no isolation and no opt-in), 128+N the runner was killed by signal N.
Standard library only, so it works under `-I -S` from any working directory.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
EXIT_SETUP, EXIT_REFUSED = 4, 5
RESULTS_FD = 3
# Mount flags the kernel locks on mounts inherited by a user namespace: a read-only remount must
# repeat them, or it fails with EPERM.
_LOCKED_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
                 os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
                 os.ST_RELATIME: MS_RELATIME}
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")


class SetupError(Exception):
  pass


def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _check(ok: bool, what: str) -> None:
  if not ok:
    errno = ctypes.get_errno()
    raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _mount(libc, source, target, fstype, flags, data=None) -> bool:
  enc = lambda s: None if s is None else s.encode()
  return libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def _write_file(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


def report(doc: dict) -> None:
  data = (json.dumps(doc) + "\n").encode()
  while data:
    data = data[os.write(RESULTS_FD, data):]


def _enter_namespaces(libc, root: bool) -> tuple[bool, str]:
  """New pid/mount/net/ipc/uts namespaces (and a user namespace when not root): (ok, why not)."""
  flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
  uid, gid = os.geteuid(), os.getegid()
  if libc.unshare(flags if root else flags | CLONE_NEWUSER) != 0:
    errno = ctypes.get_errno()
    return False, f"unshare: {os.strerror(errno)}"
  if not root:  # root of the new user namespace is us: enough to mount, nothing outside it
    _write_file("/proc/self/setgroups", "deny")
    _write_file("/proc/self/uid_map", f"0 {uid} 1")
    _write_file("/proc/self/gid_map", f"0 {gid} 1")
  return True, ""


def _bind_readonly(libc, source: str, target: str) -> None:
  _check(_mount(libc, source, target, None, MS_BIND | MS_REC), f"bind {source}")
  flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
  for st_flag, ms_flag in _LOCKED_FLAGS.items():
    if os.statvfs(target).f_flag & st_flag:
      flags |= ms_flag
  # Never fall back to a writable bind: the Python install may belong to the controller's user.
  _check(_mount(libc, None, target, None, flags), f"read-only remount of {source}")


def _interpreter() -> str:
  """The base interpreter (not a venv's copy or link: the venv is not inside the new root)."""
  return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _python_dirs() -> list[str]:
  """What the runner's interpreter needs: its installation (stdlib, shared library, binary)."""
  dirs = [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)]
  dirs.append(os.path.dirname(_interpreter()))
  covered = []
  for d in sorted(set(dirs)):
    if d == os.sep:
      raise SetupError("Python is installed at /: binding it would expose the whole host")
    if not any(d == c or d.startswith(c + os.sep) for c in covered + list(_SYSTEM_DIRS)):
      covered.append(d)
  return covered


def _build_root(libc, new_root: str, scratch_mb: int) -> None:
  """A minimal root filesystem at `new_root`.

  Visible: the system dirs and the Python installation (read-only), a private size-capped /tmp
  (also /var/tmp and /dev/shm), five device nodes and a /proc of the new PID namespace. Not
  visible: everything else of the host (home dirs, the repository, run dirs, checkpoints, /run).
  """
  _check(_mount(libc, None, "/", None, MS_REC | MS_PRIVATE), "make / private")
  _check(_mount(libc, "tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755"),
         "tmpfs root")
  os.umask(0o022)
  # /tmp first: a Python installed under /tmp is then bound inside it, not hidden by it.
  os.makedirs(new_root + "/tmp")
  _check(_mount(libc, "tmpfs", new_root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                f"size={scratch_mb}m,mode=1777"), "tmpfs /tmp")
  for path in _SYSTEM_DIRS + tuple(_python_dirs()):
    target = new_root + path
    if os.path.islink(path) and path in _SYSTEM_DIRS:
      os.symlink(os.readlink(path), target)  # merged /usr: /lib -> usr/lib
    elif os.path.isdir(path):
      os.makedirs(target, exist_ok=True)
      _bind_readonly(libc, path, target)
  os.makedirs(new_root + "/dev", exist_ok=True)
  for name in _DEVICES:
    target = f"{new_root}/dev/{name}"
    open(target, "w").close()
    _check(_mount(libc, f"/dev/{name}", target, None, MS_BIND), f"bind /dev/{name}")
  os.symlink("/tmp", new_root + "/dev/shm")
  os.makedirs(new_root + "/var", exist_ok=True)
  if not os.path.lexists(new_root + "/var/tmp"):
    os.symlink("/tmp", new_root + "/var/tmp")
  os.makedirs(new_root + "/proc")
  # Some container runtimes forbid a fresh /proc inside a user namespace; Python runs without one.
  _mount(libc, "proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  read_only = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
  _check(_mount(libc, None, new_root, None, read_only), "read-only root")


def _own_process_count() -> int:
  uid = str(os.getuid())
  count = 0
  for entry in os.scandir("/proc"):
    try:
      with open(os.path.join(entry.path, "status")) as f:
        count += any(line.startswith("Uid:") and line.split()[1] == uid for line in f)
    except OSError:
      pass
  return count


def _set_limits(limits: dict, nproc: int) -> None:
  mb = 1 << 20
  resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb, limits["memory_mb"] * mb))
  resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
  resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
  resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
  resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _become_sandbox_user(libc, uid) -> None:
  if uid is not None:  # root: a fresh uid that owns nothing and is counted alone by RLIMIT_NPROC
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
  _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "no_new_privs")
  # Last credential change is done (each one clears it): if our parent dies, so do we.
  libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _pin_sys_path() -> None:
  """Fallback as root: keep the stdlib importable after the uid drop even under an 0700 dir.

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

  for module in list(sys.modules.values()):  # packages already imported search their __path__
    search = getattr(module, "__path__", None)
    if isinstance(search, list):
      search[:] = [repin(p) for p in search]


def _exec_runner(python: str, runner_src: str, job: dict) -> None:
  """A fresh interpreter for the code: nothing of this process (or its capabilities) survives."""
  fd = os.memfd_create("job")  # the job is the runner's stdin; it swaps in /dev/null itself
  os.write(fd, json.dumps(job).encode())
  os.lseek(fd, 0, os.SEEK_SET)
  os.dup2(fd, 0)
  os.close(fd)
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
         "HOME": "/tmp", "TMPDIR": "/tmp"}
  os.execve(python, [python, "-I", "-S", "-B", "-c", runner_src], env)


def _start_runner(libc, spec: dict, python: str, runner_src: str, job: dict, root: bool,
                  new_root: str) -> None:
  """The runner's process: enter the new root, become the sandbox user, exec the runner."""
  os.chdir(new_root)
  if not root:
    # A nested user namespace without any uid mapping: the code runs as the overflow ("nobody")
    # user, and its capabilities there are gone at the exec below. (Before the chroot: the kernel
    # refuses new user namespaces to chrooted processes, which also keeps the code from making any.)
    _check(libc.unshare(CLONE_NEWUSER) == 0, "unshare nested user namespace")
  _check(libc.chroot(b".") == 0, "chroot")
  os.chdir("/tmp")
  _set_limits(spec["limits"], spec["limits"]["nproc"])
  _become_sandbox_user(libc, spec["uid"] if root else None)
  _exec_runner(python, runner_src, job)


def _namespace_init(libc, spec: dict, runner_src: str, job: dict, root: bool) -> None:
  """PID 1 of the new namespace: build the root, start the runner, wait for it, exit with it.

  PID 1 is trusted and stays out of reach: the kernel drops signals from inside the namespace to
  an init without handlers, and a non-dumpable process cannot be traced or read through /proc.
  The code therefore runs as an ordinary process (its CPU limit's SIGXCPU, its own signals and
  `alarm` behave normally), and its orphans are reaped here. When PID 1 exits the kernel kills
  everything else in the namespace.
  """
  os.setsid()  # "my process group" (kill(0, ...)) then stays inside the namespace
  new_root = os.getcwd()  # the controller's empty scratch dir; the tmpfs hides it
  python = _interpreter()
  _build_root(libc, new_root, spec["limits"]["scratch_mb"])
  pid = os.fork()
  if pid == 0:
    try:
      _start_runner(libc, spec, python, runner_src, job, root, new_root)
    except BaseException:  # noqa: BLE001 -- never let a setup failure run code half-isolated
      traceback.print_exc()
      os._exit(EXIT_SETUP)
  libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
  libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  for sig in signal.valid_signals():  # Python's own SIGINT handler would let signals through
    if callable(signal.getsignal(sig)):
      signal.signal(sig, signal.SIG_DFL)
  null = os.open(os.devnull, os.O_RDWR)
  for fd in (0, 1, 2, RESULTS_FD):  # only the code's side of the pipes may keep them open
    os.dup2(null, fd)
  while True:
    done, status = os.wait()
    if done == pid:
      os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _run_unnamespaced(libc, spec: dict, runner_src: str, job: dict, root: bool) -> None:
  """Fallback modes: the runner in this (forked) interpreter, after the limits and the uid drop."""
  nproc = spec["limits"]["nproc"]
  if not root:  # RLIMIT_NPROC counts every process of our uid, so allow what already runs
    nproc += _own_process_count()
  job["block_sockets"] = True  # no network namespace: best-effort Python-level block
  os.environ["TMPDIR"] = os.environ["HOME"] = os.getcwd()
  if root:
    _pin_sys_path()
  _set_limits(spec["limits"], nproc)
  _become_sandbox_user(libc, spec["uid"] if root else None)
  scope = {"__name__": "_sandbox_runner"}
  exec(compile(runner_src, "_sandbox_runner.py", "exec"), scope)
  scope["main"](job)


def _kill_uid(uid: int) -> None:
  for _ in range(5):  # a forking straggler may spawn between scans
    pids = []
    for entry in os.scandir("/proc"):
      try:
        with open(os.path.join(entry.path, "status")) as f:
          if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f):
            pids.append(int(entry.name))
      except (OSError, ValueError):
        pass
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except OSError:
        pass
    if not pids:
      return


def _supervise(child: int, controller: int, uid) -> None:
  """Waits for the child and exits with its status; if the controller dies first, nobody would
  time or clean up this run, so everything of it is killed here (the namespace dies with its PID 1;
  without namespaces: the process group and, as root, every process of the sandbox uid)."""
  try:
    fds = [os.pidfd_open(child), os.pidfd_open(controller)]
  except OSError:  # kernels before 5.3: poll
    fds = []
  while True:
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
      os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    if os.getppid() != controller:
      os.kill(child, signal.SIGKILL)
      if uid is not None:
        _kill_uid(uid)
      os.killpg(0, signal.SIGKILL)
    if fds:
      select.select(fds, [], [], 1.0)
    else:
      time.sleep(0.1)


def main() -> None:
  spec = json.loads(sys.stdin.buffer.read())
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)  # nothing downstream reads our spec pipe
  if spec["results_fd"] != RESULTS_FD:
    os.dup2(spec["results_fd"], RESULTS_FD)
    os.close(spec["results_fd"])
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")) as f:
    runner_src = f.read()
  job = {"code": spec["code"], "entry": spec["entry"], "calls": spec["calls"]}
  libc = _libc()
  root = os.geteuid() == 0
  namespaced, why = False, "namespaces not requested"
  if spec["isolation"] != "fallback":
    namespaced, why = _enter_namespaces(libc, root)
  if namespaced:
    mode = "root_namespaces" if root else "user_namespaces"
  else:
    mode = "root_uid" if root else "none"
  if spec["isolation"] == "namespaces" and not namespaced:
    report({"isolation": "", "error": why})
    os.write(2, f"sandbox setup: namespaces unavailable ({why})\n".encode())
    os._exit(EXIT_SETUP)
  if mode == "none" and not spec["allow_unisolated"]:
    report({"isolation": "", "error": why, "refused": True})
    os.write(2, f"sandbox refused: not root and no user namespaces ({why})\n".encode())
    os._exit(EXIT_REFUSED)
  # Written before any untrusted code exists, so the code cannot change what was reported.
  report({"isolation": mode, "detail": why})
  # With namespaces the child is PID 1 of the new PID namespace: when it dies, so does the rest.
  child = os.fork()
  if child == 0:
    try:
      if namespaced:
        _namespace_init(libc, spec, runner_src, job, root)
      else:
        _run_unnamespaced(libc, spec, runner_src, job, root)
    except BaseException:  # noqa: BLE001 -- never let a setup failure run code half-isolated
      traceback.print_exc()
      os._exit(EXIT_SETUP)
  _supervise(child, spec["controller_pid"], spec["uid"] if root and not namespaced else None)


if __name__ == "__main__":
  main()
