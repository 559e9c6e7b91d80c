"""Start, kill and restart local rollout server processes, each pinned to its own cores or device.

Rollout servers run as separate processes (like SGLang's), so that a crash, a hang or a restart of
one never takes the controller down, and so that each gets disjoint CPU cores (`taskset`), one GPU
(`CUDA_VISIBLE_DEVICES`) or one TPU chip (`TPU_VISIBLE_CHIPS` with one-chip process bounds). Each
process runs in its own process group, so `kill` (SIGKILL, for fault tests) and `stop` also reach
its children; logs go to one file per server. The same launcher starts our JAX server
(`flashrl_jax.rollout.server`) or the protocol stub (`flashrl_jax.testing._stub`).
`launch/start_local_servers.sh` runs this module's `main`, which starts K servers, prints their URLs
and stops them all on SIGINT/SIGTERM.

No server outlives its launcher: each is told its launcher's pid (`LAUNCHER_PID_ENV`) and our JAX
server stops itself once that process is gone (`exit_with_launcher`), so a run or benchmark killed
with SIGKILL, which cannot stop anything, leaves no server taking cores from the next measurement.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from absl import app as absl_app
from absl import flags

DEFAULT_MODULE = "flashrl_jax.rollout.server"
# The pid of the process that started a server (set by `LocalServers`, read by `exit_with_launcher`).
LAUNCHER_PID_ENV = "FLASHRL_LAUNCHER_PID"

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def split_cpus(num_servers: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
  """Disjoint, contiguous core sets, one per server, from `cpus` (default: this process's)."""
  cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
  if not 1 <= num_servers <= len(cpus):
    raise ValueError(f"cannot give {num_servers} servers disjoint cores out of {cpus}")
  per = len(cpus) // num_servers
  return [cpus[i * per:(i + 1) * per] for i in range(num_servers)]


@dataclasses.dataclass(frozen=True)
class ServerSpec:
  """How to (re)start one server process."""
  argv: tuple[str, ...]
  env: tuple[tuple[str, str], ...]
  cpus: tuple[int, ...] | None
  url: str
  log_path: str


def device_env(i: int, gpu_ids=None, tpu_ids=None) -> dict[str, str]:
  """The environment that gives server `i` its device: GPUs `gpu_ids[i]`, TPU chip `tpu_ids[i]`,
  or CPU only."""
  if gpu_ids is not None:
    ids = gpu_ids[i] if isinstance(gpu_ids[i], Sequence) else [gpu_ids[i]]
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
  if tpu_ids is not None:  # one chip per non-communicating process, each its own mesh controller
    port = str(8476 + i)
    return {"TPU_VISIBLE_CHIPS": str(tpu_ids[i]), "TPU_VISIBLE_DEVICES": str(tpu_ids[i]),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}", "TPU_MESH_CONTROLLER_PORT": port,
            "JAX_PLATFORMS": "tpu"}
  return {"JAX_PLATFORMS": "cpu"}


class LocalServers:
  """A set of local server processes. Use `LocalServers.start(...)`, then `with` or `stop()`."""

  def __init__(self, specs: Sequence[ServerSpec], startup_timeout_s: float,
               on_spawn: Callable[[LocalServers], None] | None = None):
    """`on_spawn(self)` runs right after each process starts (before it is ready): e.g. to record
    its pid, so a controller killed during a (re)start leaves no server nobody can find."""
    self.specs = list(specs)
    self.startup_timeout_s = startup_timeout_s
    self.on_spawn = on_spawn
    self._procs: list[subprocess.Popen | None] = [None] * len(specs)

  @classmethod
  def start(cls, model_path: str, num_servers: int, *,
            cpu_sets: Sequence[Sequence[int]] | None = None,
            gpu_ids: Sequence[int | Sequence[int]] | None = None,
            tpu_ids: Sequence[int] | None = None, base_port: int | None = None,
            host: str = "127.0.0.1", extra_args: Sequence[str] = (),
            module: str = DEFAULT_MODULE, startup_timeout_s: float = 300.0,
            log_dir: str | None = None, python: str = sys.executable,
            env: dict[str, str] | None = None,
            server_env: Sequence[dict[str, str]] | None = None,
            command: Sequence[str] | None = None,
            background: Sequence[bool] | None = None,
            on_spawn: Callable[[LocalServers], None] | None = None) -> LocalServers:
    """Starts `num_servers` processes of `python -m module --model_path=... --port=...` in parallel
    and waits for each to answer `GET /health` 200 (raising with its log tail if one dies).

    `command` replaces `python -m module` (e.g. `[python, path/to/_stub.py]`); the flags follow it.
    `server_env[i]`: server i's device variables, planned by the caller (instead of `device_env`
    from `gpu_ids` / `tpu_ids`). `background[i]`: server i runs at the idle scheduling class
    (`SCHED_IDLE`): on a core it shares with a trainer it takes only the cycles the trainer leaves.
    """
    for name, per in (("cpu_sets", cpu_sets), ("gpu_ids", gpu_ids), ("tpu_ids", tpu_ids),
                      ("server_env", server_env), ("background", background)):
      if per is not None and len(per) != num_servers:
        raise ValueError(f"{name} has {len(per)} entries for {num_servers} servers")
    if gpu_ids is not None and tpu_ids is not None:
      raise ValueError("give gpu_ids or tpu_ids, not both")
    log_dir = log_dir or tempfile.mkdtemp(prefix="flashrl_rollout_")
    os.makedirs(log_dir, exist_ok=True)
    base_env = dict(os.environ if env is None else env)
    specs = []
    for i in range(num_servers):
      port = base_port + i if base_port is not None else free_port(host)
      cpus = tuple(cpu_sets[i]) if cpu_sets is not None else None
      penv = {**base_env, **(server_env[i] if server_env is not None
                             else device_env(i, gpu_ids, tpu_ids))}
      if cpus:  # keep thread pools to the cores the process may use
        penv.setdefault("OMP_NUM_THREADS", str(len(cpus)))
      # taskset pins before exec; a preexec_fn would fork a (multithreaded, JAX-importing) parent.
      pin = ("taskset", "-c", ",".join(map(str, cpus))) if cpus else ()
      if background is not None and background[i]:  # runs only when its cores have nothing else
        pin = ("chrt", "--idle", "0", *pin)
      argv = (*pin, *(command or (python, "-m", module)), f"--model_path={model_path}",
              f"--port={port}", f"--host={host}", *extra_args)
      specs.append(ServerSpec(argv, tuple(sorted(penv.items())), cpus, f"http://{host}:{port}",
                              os.path.join(log_dir, f"server_{i}_{port}.log")))
    servers = cls(specs, startup_timeout_s, on_spawn)
    try:
      for i in range(num_servers):
        servers._spawn(i)
      for i in range(num_servers):
        servers._wait_ready(i)
    except BaseException:
      servers.stop()
      raise
    return servers

  @property
  def urls(self) -> list[str]:
    return [s.url for s in self.specs]

  def pid(self, i: int) -> int | None:
    p = self._procs[i]
    return p.pid if p is not None and p.poll() is None else None

  def log_path(self, i: int) -> str:
    return self.specs[i].log_path

  def kill(self, i: int) -> None:
    """SIGKILLs server `i` and its process group (a crash, for fault tests)."""
    self._signal(i, signal.SIGKILL, wait_s=10.0)

  def restart(self, i: int, *, wait: bool = True) -> None:
    """Kills server `i` if it still runs and starts it again on the same port."""
    self._signal(i, signal.SIGKILL, wait_s=10.0)
    self._spawn(i)
    if wait:
      self._wait_ready(i)

  def stop(self) -> None:
    """SIGTERM to every server group; SIGKILL those still running after 5 s."""
    for i in range(len(self.specs)):
      if self.pid(i) is not None:
        self._send(i, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for i, p in enumerate(self._procs):
      if p is not None:
        try:
          p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
          self._signal(i, signal.SIGKILL, wait_s=5.0)
    self._procs = [None] * len(self.specs)

  def __enter__(self) -> LocalServers:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  def _spawn(self, i: int) -> None:
    spec = self.specs[i]
    with open(spec.log_path, "ab") as log:
      log.write(f"=== {time.strftime('%H:%M:%S')} {' '.join(spec.argv)}\n".encode())
      log.flush()
      self._procs[i] = subprocess.Popen(
          spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          env={**dict(spec.env), LAUNCHER_PID_ENV: str(os.getpid())}, start_new_session=True)
    if self.on_spawn is not None:
      self.on_spawn(self)

  def _wait_ready(self, i: int) -> None:
    spec, proc = self.specs[i], self._procs[i]
    deadline = time.monotonic() + self.startup_timeout_s
    while time.monotonic() < deadline:
      if proc is None or proc.poll() is not None:
        raise RuntimeError(f"server {i} ({spec.url}) exited during startup:\n{self._tail(i)}")
      try:
        with urllib.request.urlopen(spec.url + "/health", timeout=5.0) as r:
          if r.status == 200:
            return
      except (urllib.error.URLError, OSError):
        pass
      time.sleep(0.05)
    raise TimeoutError(f"server {i} ({spec.url}) not healthy after {self.startup_timeout_s}s:\n"
                       f"{self._tail(i)}")

  def _tail(self, i: int, n: int = 4000) -> str:
    try:
      with open(self.specs[i].log_path, "rb") as f:
        return f.read()[-n:].decode(errors="replace")
    except OSError:
      return "(no log)"

  def _send(self, i: int, sig: int) -> None:
    p = self._procs[i]
    try:
      os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError, AttributeError):
      pass

  def _signal(self, i: int, sig: int, wait_s: float) -> None:
    p = self._procs[i]
    if p is None:
      return
    self._send(i, sig)
    try:
      p.wait(wait_s)
    except subprocess.TimeoutExpired:
      self._send(i, signal.SIGKILL)
      p.wait(wait_s)


def exit_with_launcher(poll_s: float = 0.5, grace_s: float = 30.0) -> threading.Thread | None:
  """In a server `LocalServers` started: SIGTERMs this process once its launcher is gone.

  The server runs in its own session (so a signal to the launcher's group never reaches it), so
  without this a launcher that dies without stopping it (SIGKILL, a crash) leaves it running. The
  launcher is the parent (`taskset` and `chrt` exec into the server): once it exits, the process
  is re-parented, which `getppid` shows at once (even while the dead launcher is an unreaped
  zombie, and already at the first look if it died while this process was starting) and which a
  recycled pid cannot fake (the learner process checks its controller the same way). A process
  not started by `LocalServers` is not watched. If SIGTERM has not ended the process after
  `grace_s`, it exits at once.
  """
  if not os.environ.get(LAUNCHER_PID_ENV):
    return None
  launcher = int(os.environ[LAUNCHER_PID_ENV])

  def watch() -> None:
    while os.getppid() == launcher:
      time.sleep(poll_s)
    log.warning("launcher %d is gone: stopping this server", launcher)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("still running %.0f s after SIGTERM: exiting", grace_s)
    os._exit(1)

  thread = threading.Thread(target=watch, name="exit-with-launcher", daemon=True)
  thread.start()
  return thread


class Accelerator(enum.Enum):
  CPU = "cpu"  # each server gets disjoint CPU cores
  GPU = "gpu"  # each server gets one GPU (and disjoint cores for its host threads)
  TPU = "tpu"  # each server gets one TPU chip (and disjoint cores)


def main(argv: Sequence[str]) -> None:
  """Starts the servers (flags after `--` go to each server), prints URLs, runs until signalled."""
  f = flags.FLAGS
  n, accel = f.num_servers, f.accelerator
  servers = LocalServers.start(
      f.model_path, n, cpu_sets=split_cpus(n), base_port=f.base_port, module=f.module,
      gpu_ids=list(range(n)) if accel is Accelerator.GPU else None,
      tpu_ids=list(range(n)) if accel is Accelerator.TPU else None,
      extra_args=list(argv[1:]), startup_timeout_s=f.startup_timeout_s, log_dir=f.server_log_dir)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so `with` below stops the servers
  with servers:
    for url, spec in zip(servers.urls, servers.specs):
      print(url, spec.log_path, flush=True)
    try:
      signal.pause()
    except KeyboardInterrupt:
      pass


if __name__ == "__main__":
  # Flags exist only when run as a program, so importing this module never clashes with
  # another entry point's flags of the same name (e.g. the JAX server's --port).
  flags.DEFINE_integer("num_servers", 1, "How many servers to start.")
  flags.DEFINE_string("model_path", None, "HF-format checkpoint directory to serve.")
  flags.DEFINE_integer("base_port", None, "Ports base_port, base_port+1, ...; default: free ports.")
  flags.DEFINE_enum_class("accelerator", Accelerator.CPU, Accelerator, "Device per server.")
  flags.DEFINE_string("module", DEFAULT_MODULE, "Server module run with `python -m`.")
  flags.DEFINE_string("server_log_dir", None, "Where server_<i>_<port>.log go (default: temp).")
  flags.DEFINE_float("startup_timeout_s", 600.0, "Seconds to wait for each /health.")
  flags.mark_flag_as_required("model_path")
  absl_app.run(main)
