"""Failpoints: named places in a run where a fault test makes something fail exactly there.

Why: "SIGKILL the controller during the export" must hit the export, not a moment near it, or the
test proves nothing (and flakes on a loaded machine). A process started with

  FLASHRL_FAILPOINTS="train@2=kill,published@3=corrupt,handoff@5=kill_server:0"

fires each entry once, the first time its point is reached for that policy version, doing for real
what the action names: `kill` SIGKILLs the run (this process, and the controller when hit in a
learner process: `RUN_PID_ENV`); `kill_server:i` SIGKILLs local rollout server
i's process group; `kill_engine:i` stops server i's engine thread (its `/debug/kill_engine`, served
only with `--enable_fault_injection`, which the run adds when a plan asks for it); `corrupt`
truncates the weight file of the version directory at the point. The points:

- `train@v`: in the training thread, as the update from version v starts (its batch is consumed);
- `export@v`: while version v is written (its temp directory holds the weights, not yet renamed);
- `published@v`: after version v is exported, before the fleet is told to load it;
- `handoff@v`: servers paused for version v, before they load it.

With the variable unset every `hit` is one dict lookup. Nothing here imports JAX (the fleet uses it).
"""

from __future__ import annotations

import dataclasses
import enum
import http.client
import json
import logging
import os
import signal
import urllib.request
from typing import Any

log = logging.getLogger(__name__)

ENV = "FLASHRL_FAILPOINTS"
# Set in a learner process's environment to the controller's pid: `kill` there kills the run.
RUN_PID_ENV = "FLASHRL_RUN_PID"


class Point(enum.Enum):
  TRAIN = "train"
  EXPORT = "export"
  PUBLISHED = "published"
  HANDOFF = "handoff"


class Action(enum.Enum):
  KILL = "kill"
  KILL_SERVER = "kill_server"
  KILL_ENGINE = "kill_engine"
  CORRUPT = "corrupt"


@dataclasses.dataclass(frozen=True)
class Failpoint:
  point: Point
  version: int
  action: Action
  server: int | None = None  # for KILL_SERVER / KILL_ENGINE


def parse(spec: str) -> tuple[Failpoint, ...]:
  """`point@version=action[:server]`, comma-separated; ValueError naming the bad entry."""
  out = []
  for entry in filter(None, (e.strip() for e in spec.split(","))):
    try:
      where, what = entry.split("=")
      point, version = where.split("@")
      action, _, server = what.partition(":")
      fp = Failpoint(Point(point), int(version), Action(action), int(server) if server else None)
    except ValueError:
      raise ValueError(f"bad failpoint {entry!r} in {ENV}: expected point@version=action[:i] with "
                       f"point in {[p.value for p in Point]}, action in "
                       f"{[a.value for a in Action]}") from None
    if (fp.action in (Action.KILL_SERVER, Action.KILL_ENGINE)) != (fp.server is not None):
      raise ValueError(f"failpoint {entry!r}: kill_server and kill_engine (only) name a server")
    out.append(fp)
  return tuple(out)


_plan: tuple[Failpoint, ...] | None = None
_fired: set[Failpoint] = set()


def plan() -> tuple[Failpoint, ...]:
  global _plan
  if _plan is None:
    _plan = parse(os.environ.get(ENV, ""))
  return _plan


def needs_engine_kill() -> bool:
  """Whether the plan stops an engine thread (its servers must serve `/debug/kill_engine`)."""
  return any(fp.action is Action.KILL_ENGINE for fp in plan())


def hit(point: str, version: int, **context: Any) -> None:
  """Fires the plan's entries for (`point`, `version`), once each.

  `context`: `servers` (`LocalServers`) and `urls` for server faults, `path` (a version directory)
  for `corrupt`."""
  for fp in plan():
    if fp.point.value != point or fp.version != version or fp in _fired:
      continue
    _fired.add(fp)
    log.warning("failpoint %s@%d: %s%s", point, version, fp.action.value,
                "" if fp.server is None else f" server {fp.server}")
    _fire(fp, context)


def _fire(fp: Failpoint, context: dict[str, Any]) -> None:
  if fp.action is Action.KILL:
    run_pid = int(os.environ.get(RUN_PID_ENV, os.getpid()))
    if run_pid != os.getpid():
      os.kill(run_pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
  elif fp.action is Action.KILL_SERVER:
    context["servers"].kill(fp.server)
  elif fp.action is Action.KILL_ENGINE:
    url = context["urls"][fp.server]
    req = urllib.request.Request(url + "/debug/kill_engine", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=30) as r:
        if json.load(r).get("engine_alive") is not False:
          raise RuntimeError(f"failpoint: the engine of {url} did not stop")
    except (http.client.RemoteDisconnected, ConnectionError):
      # The supervisor saw the dead engine first (a handoff runs beside training) and restarted
      # the server before it answered: the engine is stopped, which is what was asked.
      pass
  elif fp.action is Action.CORRUPT:
    weights = sorted(f for f in os.listdir(context["path"]) if f.endswith(".safetensors"))
    file = os.path.join(context["path"], weights[0])
    with open(file, "r+b") as f:
      f.truncate(os.path.getsize(file) // 2)
