"""Run untrusted, model-written Python under limits, many at once, without blocking the event loop.

The code comes from a policy being trained, so everything it does is adversarial: the policy is
optimised against whatever the reward measures, flaws included. The threat model, line by line
with the test that proves each line, is `docs/sandbox.md`; in short:

* The verdict is not here. A run returns what the program produced; a code reward's tests and
  expected answers stay in the controller (`_code_grader.py`) and never enter the sandbox. The
  program's answers cross the process boundary as JSON on a pipe and are compared as plain data,
  so no object, exit code, printed marker or tampered harness of the program can pass a test.
* Isolation, by mode (`SandboxResult.isolation`):
    ROOT_NAMESPACES  controller is root: new pid/mount/net/ipc/uts namespaces, a minimal chroot
                     (read-only system + Python dirs, private tmpfs /tmp), a fresh uid per run.
    USER_NAMESPACES  controller is not root, kernel allows unprivileged user namespaces: the same
                     namespaces and chroot; the code runs as an unmapped user of a nested user
                     namespace. It cannot name (so not signal) any process outside its PID
                     namespace, and sees none of the controller's files.
    ROOT_UID         root, no namespaces: a fresh uid only. Python's socket API is blocked
                     (bypassable); the host filesystem is visible (world-readable files can be
                     read, world-writable dirs written).
    NONE             not root and no user namespaces: the code would run as the controller's own
                     user, able to signal the trainer and write its files. Refused (REFUSED,
                     `SandboxUnavailable`) unless `SandboxConfig.allow_unisolated`; said loudly
                     (each result's `warning`, one log line) when it does run.
* Limits in every mode: wall clock (process group and PID namespace SIGKILLed), RLIMIT_AS,
  RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE, capped stdout/stderr/report, a scrubbed
  environment, empty stdin, no_new_privs.

Not protected against: kernel or interpreter exploits (use a VM or gVisor for those), and the
weaker modes' gaps above.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Sequence

import psutil

log = logging.getLogger(__name__)

_LAUNCHER = str(pathlib.Path(__file__).with_name("_sandbox_launcher.py"))
_UID_BASE = 100_000  # fresh uids (no passwd entry needed) so RLIMIT_NPROC counts only this run
_EXIT_MEMORY, _EXIT_SETUP, _EXIT_REFUSED = 3, 4, 5
_RUN_COUNTER = itertools.count()  # process-wide, so two Sandbox objects never share a uid


class Isolation(enum.Enum):
  """What the caller asks for."""
  AUTO = "auto"              # namespaces when possible, else the documented fallback
  NAMESPACES = "namespaces"  # require namespaces (SETUP_ERROR when unavailable)
  FALLBACK = "fallback"      # never use namespaces (to test the fallback, or for nested sandboxes)


class IsolationMode(enum.Enum):
  """What a run actually got (see the module docstring)."""
  ROOT_NAMESPACES = "root_namespaces"
  USER_NAMESPACES = "user_namespaces"
  ROOT_UID = "root_uid"
  NONE = "none"

  @property
  def isolated(self) -> bool:
    return self in (IsolationMode.ROOT_NAMESPACES, IsolationMode.USER_NAMESPACES)


WARNINGS = {
    IsolationMode.ROOT_UID: (
        "sandbox without namespaces: code runs under a fresh uid but sees the host filesystem "
        "(reads world-readable files, writes world-writable dirs) and can reach the network "
        "through raw syscalls or subprocesses"),
    IsolationMode.NONE: (
        "UNISOLATED sandbox: not root and no user namespaces, so code under test runs as the "
        "controller's own user and can signal the trainer, read its memory and overwrite its "
        "files and checkpoints"),
}


class SandboxStatus(enum.Enum):
  """How the sandboxed process ended. Whether it was *correct* is the grader's business."""
  COMPLETED = "completed"        # the runner reported and exited 0
  FAILED = "failed"              # the program raised, or the process exited non-zero
  TIMEOUT = "timeout"            # wall-clock or CPU limit
  MEMORY_LIMIT = "memory_limit"
  KILLED = "killed"              # another signal (e.g. file size limit)
  SETUP_ERROR = "setup_error"    # the sandbox could not be created
  REFUSED = "refused"            # no isolation available and `allow_unisolated` not set


class SandboxUnavailable(RuntimeError):
  """This machine cannot isolate untrusted code, and the config did not opt in to running it."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  timeout_s: float = 10.0
  memory_mb: int = 512
  cpu_s: int | None = None          # None: ceil(timeout) + 1
  max_processes: int = 16           # RLIMIT_NPROC (threads count too)
  max_output_bytes: int = 64 << 10  # per stream (stdout, stderr), kept from the start
  max_result_bytes: int = 1 << 20   # the runner's JSON report
  max_file_bytes: int = 16 << 20    # RLIMIT_FSIZE
  scratch_mb: int = 64              # size of the private /tmp (namespace modes)
  max_open_files: int = 64
  isolation: Isolation = Isolation.AUTO
  allow_unisolated: bool = False    # run code as our own user when nothing better exists
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
  isolation: IsolationMode | None  # None: the launcher never reported (setup failed or refused)
  warning: str = ""                # non-empty when the isolation was weaker than namespaces
  # The runner's report: one {"value": v} or {"error": msg} per call, or None if none arrived.
  results: tuple[dict[str, Any], ...] | None = None
  results_error: str = ""          # why `results` is None although calls were made


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
  """(first `cap` bytes, whether more came); keeps draining so a chatty child never blocks."""
  head, total = bytearray(), 0
  while chunk := await stream.read(1 << 16):
    total += len(chunk)
    if len(head) < cap:
      head += chunk[:cap - len(head)]
  return bytes(head), total > cap


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
  loop = asyncio.get_running_loop()
  reader = asyncio.StreamReader(limit=1 << 16)
  await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
  return reader


def _live_pids_of_uid(uid: int) -> list[int]:
  """Live (non-zombie) processes whose real uid is `uid` (from /proc/<pid>/status: after setuid a
  process is not dumpable and its /proc entry is owned by root)."""
  pids = []
  for entry in os.scandir("/proc"):
    if not entry.name.isdigit():
      continue
    try:
      with open(os.path.join(entry.path, "status")) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
      continue
    zombie = fields.get("State", "").strip().startswith("Z")
    if int(fields.get("Uid", "-1 ").split()[0]) == uid and not zombie:
      pids.append(int(entry.name))
  return pids


def _kill_uid(uid: int) -> None:
  """SIGKILL every process of a sandbox uid (ROOT_UID mode: stragglers that left our group)."""
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


def _classify(returncode: int, timed_out: bool) -> SandboxStatus:
  if timed_out:
    return SandboxStatus.TIMEOUT
  if returncode == 0:
    return SandboxStatus.COMPLETED
  sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
  if sig == signal.SIGXCPU:
    return SandboxStatus.TIMEOUT
  if returncode == _EXIT_MEMORY:
    return SandboxStatus.MEMORY_LIMIT
  if returncode == _EXIT_SETUP:
    return SandboxStatus.SETUP_ERROR
  if returncode == _EXIT_REFUSED:
    return SandboxStatus.REFUSED
  return SandboxStatus.KILLED if sig else SandboxStatus.FAILED


def _parse_report(raw: bytes, truncated: bool) -> tuple[IsolationMode | None, Any, str]:
  """(isolation, results, error) from the results pipe: the launcher's line, then the runner's.

  The first line is the launcher's, written before any untrusted code existed; everything after it
  may come from the program and is parsed as plain data only (no pickle, no eval).
  """
  first, _, rest = raw.partition(b"\n")
  try:
    mode = IsolationMode(json.loads(first)["isolation"])
  except (ValueError, KeyError, TypeError):
    mode = None
  if truncated:
    return mode, None, "report larger than max_result_bytes"
  lines = [line for line in rest.split(b"\n") if line.strip()]
  if not lines:
    return mode, None, "no report (the program exited or was killed before the runner reported)"
  try:
    doc = json.loads(lines[-1])
    results = doc["results"]
    if results is not None and not (isinstance(results, list)
                                    and all(isinstance(r, dict) for r in results)):
      raise TypeError("results is not a list of objects")
  except (ValueError, KeyError, TypeError, RecursionError) as error:
    return mode, None, f"malformed report: {type(error).__name__}"
  return mode, None if results is None else tuple(results), ""


SCRATCH_PREFIX = "flashrl_sandbox_"  # + the controller's pid + "_" (remove_orphaned_scratch_dirs)


def remove_orphaned_scratch_dirs(root: str | None = None) -> list[str]:
  """Removes the scratch dirs of controllers that are gone; returns them.

  A controller killed without cleanup (SIGKILL, OOM) leaves its runs' dirs behind, and a program it
  ran may have left symlinks in them (`x -> /tmp`), so a later recursive walk of /tmp that follows
  links would loop. A dir whose name carries no pid, or the pid of a live process, is kept: under
  pid reuse that errs on keeping.
  """
  root = root or tempfile.gettempdir()
  removed = []
  for entry in os.scandir(root):
    owner = entry.name[len(SCRATCH_PREFIX):].split("_", 1)[0]
    ours = entry.name.startswith(SCRATCH_PREFIX) and owner.isdigit()
    if not ours or psutil.pid_exists(int(owner)):
      continue
    shutil.rmtree(entry.path, ignore_errors=True)
    removed.append(entry.path)
  return removed


class Sandbox:
  """Runs programs in isolated subprocesses; `await run(...)` many of them concurrently."""

  def __init__(self, config: SandboxConfig = SandboxConfig()):
    self.config = config
    remove_orphaned_scratch_dirs()
    self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
    self._warned = False

  def _semaphore(self) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if self._sem is None or self._sem[0] is not loop:  # semaphores are bound to one loop
      self._sem = (loop, asyncio.Semaphore(self.config.max_concurrency))
    return self._sem[1]

  def _next_uid(self) -> int | None:
    if os.geteuid() != 0:
      return None
    return _UID_BASE + (os.getpid() % 256) * 256 + next(_RUN_COUNTER) % 256

  def check(self) -> IsolationMode:
    """Probes the isolation this machine gives (one tiny run), says so loudly if it is weak, and
    raises `SandboxUnavailable` if untrusted code would be refused. Call once at start."""
    result = self.run_sync("pass")
    if result.status is SandboxStatus.REFUSED:
      raise SandboxUnavailable(
          f"{WARNINGS[IsolationMode.NONE]}. Run the controller as root, enable unprivileged user "
          "namespaces (kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0), or set "
          f"SandboxConfig(allow_unisolated=True) to accept the risk. ({result.stderr.strip()})")
    if result.isolation is None:
      raise SandboxUnavailable(f"sandbox setup failed: {result.stderr.strip()[-500:]}")
    return result.isolation

  async def run(self, code: str, *, entry: str | None = None,
                calls: Sequence[tuple[Sequence[Any], dict[str, Any]]] = (),
                timeout_s: float | Callable[[], float] | None = None) -> SandboxResult:
    """Runs `code`; with `entry`, then calls `entry(*args, **kwargs)` for each of `calls` (plain
    JSON data) and returns what each call produced in `SandboxResult.results`.

    A callable `timeout_s` is asked when the run starts, after any wait for a free slot, so an
    adaptive limit uses what the runs that finished meanwhile taught it.
    """
    job = {"code": code, "entry": entry, "calls": [[list(a), dict(k)] for a, k in calls]}
    json.dumps(job)  # plain data only: fail here, in the caller, not in the sandbox
    async with self._semaphore():
      limit = timeout_s() if callable(timeout_s) else timeout_s
      result = await self._run(job, limit or self.config.timeout_s)
    if result.warning and not self._warned:
      self._warned = True
      log.warning("%s", result.warning)
    return result

  def run_sync(self, code: str, **kwargs) -> SandboxResult:
    """Blocking convenience for scripts; never call it from inside a running event loop."""
    return asyncio.run(self.run(code, **kwargs))

  async def _run(self, job: dict, timeout_s: float) -> SandboxResult:
    cfg = self.config
    uid = self._next_uid()
    read_fd, write_fd = os.pipe()
    spec = dict(job, uid=uid, isolation=cfg.isolation.value, allow_unisolated=cfg.allow_unisolated,
                results_fd=write_fd, controller_pid=os.getpid(),
                limits={"memory_mb": cfg.memory_mb, "cpu_s": cfg.cpu_s or math.ceil(timeout_s) + 1,
                        "file_bytes": cfg.max_file_bytes, "nproc": cfg.max_processes,
                        "nofile": cfg.max_open_files, "scratch_mb": cfg.scratch_mb})
    host_dir = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}_")
    # Namespace modes mount the sandbox's root over `work`; the fallback runs the code in it.
    work_dir = os.path.join(host_dir, "work")
    os.mkdir(work_dir)
    proc = None
    try:
      if uid is not None:
        os.chmod(host_dir, 0o755)
        os.chown(work_dir, uid, uid)
      env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
      loop = asyncio.get_running_loop()
      results_reader = await _pipe_reader(read_fd)
      start = loop.time()
      try:
        proc = await asyncio.create_subprocess_exec(
            cfg.python, "-I", "-S", "-B", _LAUNCHER, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=work_dir, env=env,
            pass_fds=(write_fd,), start_new_session=True)  # own group: one killpg reaches all
      finally:
        os.close(write_fd)  # only the sandbox may hold the write end, so EOF means it is gone
      readers = [asyncio.ensure_future(_read_capped(s, cap)) for s, cap in (
          (proc.stdout, cfg.max_output_bytes), (proc.stderr, cfg.max_output_bytes),
          (results_reader, cfg.max_result_bytes))]
      timed_out = False
      try:
        await asyncio.wait_for(_feed_and_wait(proc, json.dumps(spec).encode()), timeout_s)
      except asyncio.TimeoutError:
        timed_out = True
        _killpg(proc.pid)
        await proc.wait()
      elapsed = loop.time() - start
      _killpg(proc.pid)  # stragglers still in the group (fallback modes)
      if uid is not None:
        await asyncio.to_thread(_kill_uid, uid)
      done, pending = await asyncio.wait(readers, timeout=2.0)
      for task in pending:  # a straggler that escaped every kill still holds a pipe
        task.cancel()
      (out, _), (err, _), (raw, raw_more) = [
          t.result() if t in done else (b"", False) for t in readers]
    finally:
      if proc is not None and proc.returncode is None:  # cancelled by the caller: leave nothing
        _killpg(proc.pid)
      shutil.rmtree(host_dir, ignore_errors=True)
    mode, results, results_error = _parse_report(raw, raw_more)
    return SandboxResult(
        status=_classify(proc.returncode, timed_out), returncode=proc.returncode,
        stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
        elapsed_s=elapsed, timeout_s=timeout_s, isolation=mode,
        warning=WARNINGS.get(mode, ""), results=results,
        results_error=results_error if job["entry"] else "")


async def _feed_and_wait(proc: asyncio.subprocess.Process, spec: bytes) -> int:
  try:
    proc.stdin.write(spec)
    await proc.stdin.drain()
    proc.stdin.close()
  except (BrokenPipeError, ConnectionResetError):
    pass  # the launcher died before reading; its exit status says why
  return await proc.wait()
