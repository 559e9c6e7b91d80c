"""Runs the sandbox's controller side as an unprivileged user, for the non-root tests.

    python tests/sandbox_unprivileged.py drop --uid U [--no-userns] -- SCENARIO-ARGS  (as root)
    python tests/sandbox_unprivileged.py SCENARIO ...                                 (as U)

`drop` (root): in a private mount namespace, makes the Python installation, the venv and the
repository reachable by U even when they sit under an 0700 directory such as /root (a tmpfs over
that directory with just those paths bound back), then becomes U for real (setgid/setuid; no
capabilities left) and re-executes this file with the scenario arguments. With `--no-userns` it
first enters a user namespace whose `user.max_user_namespaces` is 0 (uids mapped 1:1), so U cannot
create user namespaces: the machine a non-root controller meets when a distribution disables them.
Nothing outside this process tree changes.

Scenarios (as U) print one JSON object on stdout for the test to check: `isolated` (user
namespaces available) and `unisolated` (not available).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None) -> None:
  enc = lambda s: None if s is None else s.encode()
  if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    raise OSError(ctypes.get_errno(), f"mount {source} {target}")


def _expose(paths: list[str]) -> None:
  """Makes `paths` reachable by any uid: a tmpfs (0755) over each 0700-style ancestor, with the
  needed paths bound back in. Runs in a private mount namespace."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  by_blocker: dict[str, list[str]] = {}
  for path in paths:
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
      ancestor = os.sep.join(parts[:i])
      if not os.stat(ancestor).st_mode & 0o001:
        by_blocker.setdefault(ancestor, []).append(path)
        break
  for blocker, needed in by_blocker.items():
    stage = tempfile.mkdtemp(prefix="flashrl_expose_")
    staged = []
    for i, path in enumerate(needed):
      os.mkdir(f"{stage}/{i}")
      _mount(path, f"{stage}/{i}", None, MS_BIND | MS_REC)
      staged.append((f"{stage}/{i}", path))
    _mount("tmpfs", blocker, "tmpfs", 0, "mode=755")
    for source, path in staged:
      os.makedirs(path, mode=0o755, exist_ok=True)
      _mount(source, path, None, MS_MOVE)
      os.rmdir(source)
    os.rmdir(stage)


def drop(uid: int, no_userns: bool, argv: list[str]) -> int:
  ready_r, ready_w = os.pipe()
  go_r, go_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    try:
      if _libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if no_userns else 0)) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
      os.write(ready_w, b"x")
      os.read(go_r, 1)  # the parent has written our uid/gid maps
      if no_userns:
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
          f.write("0")
      _expose([os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, ROOT)])
      os.setgroups([])
      os.setgid(uid)
      os.setuid(uid)
      os.chdir(ROOT)
      os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv],
                dict(os.environ, PYTHONPATH=ROOT, HOME="/tmp"))
    except BaseException as error:  # noqa: BLE001
      print(f"drop failed: {error!r}", file=sys.stderr)
      os._exit(70)
  os.read(ready_r, 1)
  if no_userns:
    for name in ("uid_map", "gid_map"):
      with open(f"/proc/{pid}/{name}", "w") as f:
        f.write("0 0 65536")
  os.write(go_w, b"x")
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status)


_ATTACK = """
import json, os, signal, socket
pids = os.listdir("/proc") if os.path.isdir("/proc") else []
out = {{"uid": os.getuid(), "visible_pids": sorted(int(p) for p in pids if p.isdigit())}}
def attempt(name, fn):
  try:
    out[name] = ["ok", fn()]
  except BaseException as error:
    out[name] = [type(error).__name__, str(error)[:100]]
attempt("kill_victim", lambda: os.kill({victim}, signal.SIGKILL))
attempt("kill_controller", lambda: os.kill({controller}, signal.SIGUSR1))
if {kill_all}:
  attempt("kill_all", lambda: os.kill(-1, signal.SIGKILL))
attempt("read_file", lambda: open({path!r}).read())
attempt("write_file", lambda: open({path!r}, "w").write("pwned"))
def read_memory():
  start = int(open("/proc/{controller}/maps").readline().split("-")[0], 16)
  with open("/proc/{controller}/mem", "rb") as f:
    f.seek(start)
    return len(f.read(16))
attempt("read_controller_memory", read_memory)
for sig in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM):  # silently dropped by the kernel
  attempt(f"kill_init_{{sig.name}}", lambda: os.kill(1, sig))
attempt("init_root", lambda: os.listdir("/proc/1/root"))
attempt("init_memory", lambda: open("/proc/1/mem", "rb").close())
attempt("list_run_dir", lambda: os.listdir({run_dir!r}))
attempt("connect", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1).close())
import ctypes
out["new_user_namespace"] = ctypes.CDLL(None).unshare(0x10000000)
print(json.dumps(out))
"""


class _Host:
  """What the sandbox must not touch: a victim process and a run dir of the controller's user."""

  def __init__(self):
    self.victim = subprocess.Popen(["sleep", "60"])
    from tests.reward_hacks import make_run_dir  # the run's dataset, with the hidden tests
    self.run_dir = make_run_dir(0o755)
    self.path = os.path.join(self.run_dir, "checkpoint.bin")
    with open(self.path, "w") as f:
      f.write("original")
    self.server = socket.create_server(("127.0.0.1", 0))
    self.server.settimeout(0.2)
    self.usr1 = 0
    signal.signal(signal.SIGUSR1, self._on_usr1)

  def _on_usr1(self, *_):
    self.usr1 += 1

  def attack_code(self, kill_all: bool) -> str:
    return _ATTACK.format(victim=self.victim.pid, controller=os.getpid(), kill_all=kill_all,
                          path=self.path, run_dir=self.run_dir,
                          port=self.server.getsockname()[1])

  def damage(self) -> dict:
    time.sleep(0.2)
    try:
      self.server.accept()[0].close()
      connected = True
    except socket.timeout:
      connected = False
    with open(self.path) as f:
      content = f.read()
    return {"victim_alive": self.victim.poll() is None, "file": content, "usr1": self.usr1,
            "connected": connected}

  def close(self):
    self.victim.kill()
    self.victim.wait()
    self.server.close()
    shutil.rmtree(self.run_dir)


def _nested_pid_ns_procs(uid: int) -> int:
  """Live processes of `uid` inside a nested PID namespace (a sandbox's), except its init."""
  count = 0
  for entry in os.scandir("/proc"):
    try:
      with open(os.path.join(entry.path, "status")) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      nspid = fields["NSpid"].split()
      count += (int(fields["Uid"].split()[0]) == uid and len(nspid) > 1 and nspid[-1] != "1"
                and not fields["State"].strip().startswith("Z"))
    except (OSError, KeyError, ValueError):
      pass
  return count


def _fork_bomb_peak(envs, limit: int) -> tuple[int, str]:
  import asyncio
  code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
  sandbox = envs.Sandbox(envs.SandboxConfig(max_processes=limit, memory_mb=256))
  peak = 0

  async def main():
    nonlocal peak
    task = asyncio.ensure_future(sandbox.run(code, timeout_s=1.5))
    while not task.done():
      peak = max(peak, await asyncio.to_thread(_nested_pid_ns_procs, os.getuid()))
      await asyncio.sleep(0.02)
    return await task

  result = asyncio.run(main())
  time.sleep(0.2)
  return peak, result.status.value, _nested_pid_ns_procs(os.getuid())


def _reward_hacks(envs) -> dict:
  from tests.reward_hacks import HACKS, HONEST, TESTS
  reward = envs.CodeReward(envs.Sandbox(envs.SandboxConfig(timeout_s=5, memory_mb=256)))
  sample = envs.Sample("", "", tests=TESTS, id="hack")
  return {name: reward.score_sync("", code, sample).reward
          for name, code in {"honest": HONEST, **HACKS}.items()}


def scenario_isolated() -> dict:
  from flashrl_jax import envs
  host = _Host()
  try:
    sandbox = envs.Sandbox(envs.SandboxConfig(timeout_s=10, memory_mb=256))
    mode = sandbox.check()
    result = sandbox.run_sync(host.attack_code(kill_all=True))
    out = {"controller_uid": os.getuid(), "mode": mode.value, "status": result.status.value,
           "warning": result.warning, "stderr": result.stderr[-500:],
           "attack": json.loads(result.stdout or "{}"), "damage": host.damage()}
    out["fork_bomb"] = _fork_bomb_peak(envs, limit=8)
    out["rewards"] = _reward_hacks(envs)  # with the dataset on disk
  finally:
    host.close()
  return out


def scenario_unisolated() -> dict:
  from flashrl_jax import envs
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger().addHandler(handler)
  marker_dir = tempfile.mkdtemp(prefix="flashrl_marker_")
  marker = os.path.join(marker_dir, "ran")
  out = {"controller_uid": os.getuid()}
  strict = envs.Sandbox(envs.SandboxConfig(timeout_s=10, memory_mb=256))
  try:
    strict.check()
    out["check"] = "passed"
  except envs.SandboxUnavailable as error:
    out["check"] = f"SandboxUnavailable: {error}"
  refused = strict.run_sync(f"open({marker!r}, 'w').write('x')")
  out["refused"] = {"status": refused.status.value, "isolation": refused.isolation,
                    "ran": os.path.exists(marker)}
  shutil.rmtree(marker_dir)
  try:
    envs.make_reward_fn(envs.RewardConfig(kind=envs.RewardKind.CODE))
    out["factory"] = "built"
  except envs.SandboxUnavailable:
    out["factory"] = "SandboxUnavailable"
  required = envs.Sandbox(envs.SandboxConfig(isolation=envs.Isolation.NAMESPACES))
  out["required_status"] = required.run_sync("pass").status.value
  host = _Host()
  try:
    opted = envs.Sandbox(envs.SandboxConfig(timeout_s=10, memory_mb=256, allow_unisolated=True))
    mode = opted.check()
    result = opted.run_sync(host.attack_code(kill_all=False))
    opted.run_sync("pass")
    out.update(mode=mode.value, status=result.status.value, warning=result.warning,
               attack=json.loads(result.stdout or "{}"), damage=host.damage(),
               warnings_logged=sum(r.levelno == logging.WARNING and "UNISOLATED" in r.getMessage()
                                   for r in records))
  finally:
    host.close()
  return out


def main() -> None:
  if sys.argv[1] == "drop":
    parser = argparse.ArgumentParser()
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--no-userns", action="store_true")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(sys.argv[2:])
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    sys.exit(drop(args.uid, args.no_userns, rest))
  scenario = {"isolated": scenario_isolated, "unisolated": scenario_unisolated}[sys.argv[1]]
  print(json.dumps(scenario(), default=str))


if __name__ == "__main__":
  main()
