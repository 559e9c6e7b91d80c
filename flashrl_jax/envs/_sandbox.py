"""Run untrusted, model-written Python against tests, many at once, without blocking the event loop.

Threat model. The code comes from a policy being trained, so we expect accidents and reward hacks
(infinite loops, huge allocations, fork loops, `sys.exit(0)` before the tests, writing files,
calling the network), not a skilled attacker with a kernel exploit.

Protected against:
  * Runaway time: a wall-clock limit per run (the whole process group is SIGKILLed) plus
    `RLIMIT_CPU` as a backstop.
  * Memory bombs: `RLIMIT_AS` (the allocation fails with MemoryError; reported as MEMORY_LIMIT).
  * Fork bombs: as root the code runs under a fresh unprivileged uid per run, so `RLIMIT_NPROC`
    (which does not bind root) caps its process count; in namespace mode it is PID 1's subtree of
    a new PID namespace, so every descendant dies with it, even ones that called `setsid`.
  * Network: a new, empty network namespace (not even loopback is up) when we are root and the
    kernel allows `unshare`; otherwise the *fallback* replaces Python's socket API with one that
    raises. The fallback is best effort only: ctypes, raw syscalls or `os.system("curl ...")` can
    bypass it. `SandboxResult.isolation` says which mode ran.
  * Files: in namespace mode the code runs in a private mount namespace with fresh size-capped
    tmpfs over /tmp, /var/tmp and /dev/shm (its working dir is one of them), so nothing it writes
    there survives; as a non-root uid it cannot write anywhere else that is not world-writable.
    `RLIMIT_FSIZE` caps any single file. The host-side scratch dir is always removed.
  * Fake passes: success needs exit code 0 *and* a per-run random nonce written by the launcher
    after the tests returned, so `sys.exit(0)` / `os._exit(0)` in the solution do not pass.
  * Leaks: the environment is scrubbed (minimal PATH, no HOME or tokens inherited), stdin is
    empty, stdout/stderr are capped (excess is drained and dropped), `-I -S` ignores PYTHON* vars,
    the cwd and site-packages. PR_SET_NO_NEW_PRIVS blocks regaining root through setuid binaries.

Not protected against: kernel or interpreter exploits; reading world-readable host files (the
filesystem is not chrooted); in fallback mode, network access that bypasses Python's socket
module, world-writable dirs outside /tmp, and (when not root) fork bombs racing the per-uid
`RLIMIT_NPROC`, which then counts all of the user's processes; a determined adversary reading the
nonce out of interpreter memory. Use a VM or gVisor for adversarial code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import json
import math
import os
import pathlib
import secrets
import shutil
import signal
import sys
import tempfile

_LAUNCHER = str(pathlib.Path(__file__).with_name("_sandbox_launcher.py"))
_UID_BASE = 100_000  # fresh uids (no passwd entry needed) so RLIMIT_NPROC counts only this run
_EXIT_MEMORY, _EXIT_SETUP = 3, 4
_TAIL = 4096
_RUN_COUNTER = itertools.count()  # process-wide, so two Sandbox objects never share a uid


class Isolation(enum.Enum):
  AUTO = "auto"              # namespaces when possible, else the documented fallback
  NAMESPACES = "namespaces"  # require namespaces (SETUP_ERROR when unavailable)
  FALLBACK = "fallback"      # never use namespaces (to test the fallback, or for nested sandboxes)


class SandboxStatus(enum.Enum):
  PASSED = "passed"
  FAILED = "failed"              # the code or the tests raised / exited without the nonce
  TIMEOUT = "timeout"            # wall-clock or CPU limit
  MEMORY_LIMIT = "memory_limit"
  KILLED = "killed"              # another signal (e.g. file size limit)
  SETUP_ERROR = "setup_error"    # the sandbox could not be created


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  timeout_s: float = 10.0
  memory_mb: int = 512
  cpu_s: int | None = None          # None: ceil(timeout) + 1
  max_processes: int = 16           # RLIMIT_NPROC (threads count too)
  max_output_bytes: int = 64 << 10  # per stream, kept from the start
  max_file_bytes: int = 16 << 20    # RLIMIT_FSIZE
  scratch_mb: int = 64              # size of each private tmpfs (namespace mode)
  max_open_files: int = 64
  isolation: Isolation = Isolation.AUTO
  max_concurrency: int = 8          # runs in flight per Sandbox; the rest wait (not timed)
  python: str = sys.executable

  def __post_init__(self):
    if self.timeout_s <= 0 or self.memory_mb < 32 or self.max_processes < 1:
      raise ValueError(f"need timeout_s > 0, memory_mb >= 32, max_processes >= 1: {self}")
    if self.max_concurrency < 1:
      raise ValueError("max_concurrency must be >= 1")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  status: SandboxStatus
  returncode: int | None
  stdout: str
  stderr: str
  elapsed_s: float
  timeout_s: float
  isolation: str  # "namespaces", "fallback", or "" if the launcher never reported

  @property
  def passed(self) -> bool:
    return self.status is SandboxStatus.PASSED


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bytes]:
  """(first `cap` bytes, last few KiB); keeps draining so a chatty child never blocks on a full pipe."""
  head, tail = bytearray(), b""
  while chunk := await stream.read(1 << 16):
    if len(head) < cap:
      head += chunk[:cap - len(head)]
    tail = (tail + chunk)[-_TAIL:]
  return bytes(head), tail


def _live_pids_of_uid(uid: int) -> list[int]:
  """Live (non-zombie) processes whose real uid is `uid`.

  Reads /proc/<pid>/status rather than the owner of /proc/<pid>: after setuid a process is not
  dumpable and its /proc entry is owned by root.
  """
  pids = []
  for entry in os.scandir("/proc"):
    if not entry.name.isdigit():
      continue
    try:
      with open(os.path.join(entry.path, "status")) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
      continue
    if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
      pids.append(int(entry.name))
  return pids


def _kill_uid(uid: int) -> None:
  """SIGKILL every process of a sandbox uid (fallback mode: stragglers that left our process group)."""
  for _ in range(5):  # a forking straggler may spawn between scans
    pids = _live_pids_of_uid(uid)
    if not pids:
      return
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


def _killpg(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _classify(returncode: int, timed_out: bool, ok_nonce: bool) -> SandboxStatus:
  if timed_out:
    return SandboxStatus.TIMEOUT
  if returncode == 0 and ok_nonce:
    return SandboxStatus.PASSED
  sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
  if sig == signal.SIGXCPU:
    return SandboxStatus.TIMEOUT
  if returncode == _EXIT_MEMORY:
    return SandboxStatus.MEMORY_LIMIT
  if returncode == _EXIT_SETUP:
    return SandboxStatus.SETUP_ERROR
  return SandboxStatus.KILLED if sig else SandboxStatus.FAILED


class Sandbox:
  """Runs code + tests in isolated subprocesses; `await run(...)` many of them concurrently."""

  def __init__(self, config: SandboxConfig = SandboxConfig()):
    self.config = config
    self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

  def _semaphore(self) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if self._sem is None or self._sem[0] is not loop:  # semaphores are bound to one loop
      self._sem = (loop, asyncio.Semaphore(self.config.max_concurrency))
    return self._sem[1]

  def _next_uid(self) -> int | None:
    if os.geteuid() != 0:
      return None
    return _UID_BASE + (os.getpid() % 256) * 256 + next(_RUN_COUNTER) % 256

  def _nproc_limit(self, uid: int | None) -> int:
    if uid is not None:
      return self.config.max_processes
    # Not root: RLIMIT_NPROC counts all of our uid's processes, so allow what already runs.
    mine = sum(1 for e in os.scandir("/proc") if e.name.isdigit() and _owned(e.path))
    return mine + self.config.max_processes

  async def run(self, code: str, tests: str | None = None, *,
                timeout_s: float | None = None) -> SandboxResult:
    async with self._semaphore():
      return await self._run(code, tests, timeout_s or self.config.timeout_s)

  def run_sync(self, code: str, tests: str | None = None, *,
               timeout_s: float | None = None) -> SandboxResult:
    """Blocking convenience for scripts; never call it from inside a running event loop."""
    return asyncio.run(self.run(code, tests, timeout_s=timeout_s))

  async def _run(self, code: str, tests: str | None, timeout_s: float) -> SandboxResult:
    cfg = self.config
    nonce = secrets.token_hex(16)
    uid = self._next_uid()
    spec = {"code": code, "tests": tests, "nonce": nonce, "uid": uid,
            "isolation": cfg.isolation.value,
            "limits": {"memory_mb": cfg.memory_mb, "cpu_s": cfg.cpu_s or math.ceil(timeout_s) + 1,
                       "file_bytes": cfg.max_file_bytes, "nproc": self._nproc_limit(uid),
                       "nofile": cfg.max_open_files, "scratch_mb": cfg.scratch_mb}}
    host_dir = tempfile.mkdtemp(prefix="flashrl_sandbox_")
    # The code's cwd is a subdir: `../x` then hits our root-owned dir, not the world-writable /tmp.
    work_dir = os.path.join(host_dir, "work")
    os.mkdir(work_dir)
    proc = None
    try:
      if uid is not None:
        os.chmod(host_dir, 0o755)
        os.chown(work_dir, uid, uid)  # the fallback runs the code here, as that uid
      env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
      loop = asyncio.get_running_loop()
      start = loop.time()
      proc = await asyncio.create_subprocess_exec(
          cfg.python, "-I", "-S", "-B", _LAUNCHER, stdin=asyncio.subprocess.PIPE,
          stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=work_dir, env=env,
          start_new_session=True)  # own process group, so one killpg reaches every descendant
      readers = [asyncio.ensure_future(_read_capped(s, cfg.max_output_bytes))
                 for s in (proc.stdout, proc.stderr)]
      timed_out = False
      try:
        await asyncio.wait_for(_feed_and_wait(proc, json.dumps(spec).encode()), timeout_s)
      except asyncio.TimeoutError:
        timed_out = True
        _killpg(proc.pid)
        await proc.wait()
      elapsed = loop.time() - start
      _killpg(proc.pid)  # stragglers still in the group (fallback mode)
      if uid is not None:
        await asyncio.to_thread(_kill_uid, uid)
      done, pending = await asyncio.wait(readers, timeout=2.0)
      for task in pending:  # a straggler that escaped every kill still holds the pipe
        task.cancel()
      (out, out_tail), (err, _) = [t.result() if t in done else (b"", b"") for t in readers]
    finally:
      if proc is not None and proc.returncode is None:  # cancelled by the caller: leave nothing behind
        _killpg(proc.pid)
      shutil.rmtree(host_dir, ignore_errors=True)
    stdout, mode = _strip_protocol(out.decode("utf-8", "replace"), nonce)
    ok_nonce = out_tail.decode("utf-8", "replace").rstrip().endswith(nonce)
    status = _classify(proc.returncode, timed_out, ok_nonce)
    return SandboxResult(status=status, returncode=proc.returncode, stdout=stdout,
                         stderr=err.decode("utf-8", "replace"), elapsed_s=elapsed,
                         timeout_s=timeout_s, isolation=mode)


async def _feed_and_wait(proc: asyncio.subprocess.Process, spec: bytes) -> int:
  try:
    proc.stdin.write(spec)
    await proc.stdin.drain()
    proc.stdin.close()
  except (BrokenPipeError, ConnectionResetError):
    pass  # the launcher died before reading; its exit status says why
  return await proc.wait()


def _owned(path: str) -> bool:
  try:
    return os.stat(path).st_uid == os.geteuid()
  except OSError:
    return False


def _strip_protocol(stdout: str, nonce: str) -> tuple[str, str]:
  """Removes the launcher's mode line and success line; returns (user stdout, isolation mode)."""
  mode = ""
  first, _, rest = stdout.partition("\n")
  if first.startswith(nonce + ":"):
    mode, stdout = first[len(nonce) + 1:], rest
  trailer = f"\n{nonce}\n"
  if stdout.endswith(trailer):
    stdout = stdout[:-len(trailer)]
  return stdout, mode
