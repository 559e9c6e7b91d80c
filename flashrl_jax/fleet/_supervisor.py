"""Keeps the rollout fleet whole: restarts dead or hung servers, back on the right weights.

The client already survives a server going away: its requests are retried on the others and the
server leaves rotation. What the client cannot do is start a process, or know which weights a
returning server must serve: a restarted server comes up on the initial checkpoint, and if it
rejoined as soon as `/health` answered, requests would run on stale weights. So the supervisor
takes a failed server out of the client (out of rotation *and* out of weight publishes), restarts
it when it is one of ours (`LocalServers`) or retries until it answers when it is external,
makes it load the policy version the others serve, and only then adds it back. Publishes and
rejoins hold one lock, so a server never misses a version in between. A weight publish that fails
on some servers goes on with the others and hands the failed ones to the same recovery path,
instead of crashing the run and leaving the rest paused. A server that *refuses* a version (answers
`success: false`: it could not load the directory and keeps serving its weights) is healthy and is
not restarted: the handoff raises `VersionRefused` once generation has resumed, so the controller
can re-export the version, and servers that rejoin keep loading the last version every server took.

A server counts as failed when its process exits, when the client has marked it down for longer
than `unhealthy_grace_s`, when it is out of rotation and has failed `sick_probes` background
`/health` probes in a row (a server whose engine thread died answers, but 503), or when
`hang_failures` of its requests in a row failed (timeouts, connection errors, 5xx) with no success
in between, which is how a server that answers `/health` but never finishes a generation shows.

`record_pids` / `reap_orphans`: server processes run in their own sessions, so a controller killed
with SIGKILL leaves them behind; the next run with the same workdir kills them before starting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request

from flashrl_jax import _failpoints as failpoints
from flashrl_jax.fleet._client import RolloutClient
from flashrl_jax.fleet._local import LocalServers
from flashrl_jax.fleet._protocol import PauseMode
from flashrl_jax.fleet._servers import ServerOpError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
  poll_s: float = 0.5
  hang_failures: int = 2  # failed requests in a row, none succeeding, before a restart
  unhealthy_grace_s: float = 30.0  # marked down by the client this long: restart / re-admit
  sick_probes: int = 2  # out of rotation and failing this many /health probes in a row: restart
  rejoin_poll_s: float = 1.0  # how often an external server that left is probed


class VersionRefused(RuntimeError):
  """Servers refused to load a published version (they serve their previous weights).

  `refused` maps url → the server's reason; `accepted` lists the servers now serving it."""

  def __init__(self, version: int, path: str, refused: dict[str, str], accepted: list[str]):
    self.version, self.path, self.refused, self.accepted = version, path, refused, accepted
    reasons = "; ".join(f"{url}: {why[:300]}" for url, why in refused.items())
    super().__init__(f"{len(refused)} server(s) refused policy version {version} ({path}): "
                     f"{reasons}")


@dataclasses.dataclass
class _Watch:
  ok: int = 0
  bad: int = 0
  bad_since_ok: int = 0
  down_since: float | None = None


class Supervisor:
  """Use `async with Supervisor(...)` inside the client's `async with`."""

  def __init__(self, client: RolloutClient, *, servers: LocalServers | None,
               served: tuple[str, int] | None = None,
               config: SupervisorConfig = SupervisorConfig(), pid_file: str | None = None):
    """`served`: (weights path, version) the fleet serves now, if it is not what the servers started
    with; every handoff replaces it. A server that rejoins loads it first."""
    self.client, self.servers, self.config = client, servers, config
    self._served = served
    self.failures = 0  # servers taken out of rotation, since this supervisor started
    self.restarts = 0  # local server processes restarted
    self.pid_file = pid_file
    self.lock = asyncio.Lock()  # publishes and rejoins
    self._recovering: dict[str, asyncio.Task] = {}
    self._restarts: set[asyncio.Future] = set()  # restart threads; awaited on exit (no orphans)
    self._watch: dict[str, _Watch] = {}
    self._task: asyncio.Task | None = None

  async def __aenter__(self) -> Supervisor:
    self._task = asyncio.create_task(self._run())
    return self

  async def __aexit__(self, *exc) -> None:
    tasks = [t for t in [self._task, *self._recovering.values()] if t is not None]
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # A thread still starting a server must finish first, or `LocalServers.stop` would miss it.
    await asyncio.gather(*self._restarts, return_exceptions=True)

  @property
  def recovering(self) -> list[str]:
    return sorted(self._recovering)

  # --- weight publishes that tolerate failed servers ---------------------------------------------

  async def handoff(self, path: str, version: int, pause_mode: PauseMode, *,
                    idle: bool = False) -> dict[str, float]:
    """pause -> load -> continue on every server in the client; servers that fail go to recovery.

    `idle`: the caller has nothing in flight (a sync step's end), so there is nothing to pause:
    only the load runs (an update to an idle server applies at once), two round trips fewer.
    Raises `VersionRefused` (after generation resumed) if servers refused the directory."""
    refused: dict[str, str] = {}
    async with self.lock:
      t1 = time.perf_counter()
      if idle:
        failpoints.hit("handoff", version, servers=self.servers, urls=self.client.urls)
        loaded = await self._tolerant(
            lambda u: self.client.update_weights_from_disk(path, str(version), urls=u),
            self.client.urls, refused)
        if not refused:
          self._served = (path, version)
        t2 = time.perf_counter()
        if refused:
          raise VersionRefused(version, path, refused, loaded)
        return {"time/pause_s": 0.0, "time/load_s": t2 - t1, "time/resume_s": 0.0}
      urls = await self._tolerant(lambda u: self.client.pause(pause_mode, urls=u), self.client.urls)
      failpoints.hit("handoff", version, servers=self.servers, urls=urls)
      t2 = time.perf_counter()
      try:
        loaded = await self._tolerant(
            lambda u: self.client.update_weights_from_disk(path, str(version), urls=u), urls,
            refused)
        if not refused:
          self._served = (path, version)  # servers recovering from now on load this one
      finally:
        t3 = time.perf_counter()
        await self._tolerant(lambda u: self.client.continue_generation(urls=u), self.client.urls)
      t4 = time.perf_counter()
    if refused:
      raise VersionRefused(version, path, refused, loaded)
    return {"time/pause_s": t2 - t1, "time/load_s": t3 - t2, "time/resume_s": t4 - t3}

  async def _tolerant(self, op, urls: list[str],
                      refused: dict[str, str] | None = None) -> list[str]:
    """Runs a fan-out op on `urls`; failed servers go to recovery, servers that refused (only with
    `refused` given) are recorded there and stay. Returns those it worked on."""
    while True:
      try:
        await op(list(urls))
        return list(urls)
      except ServerOpError as error:
        for url, why in error.failures.items():
          if refused is not None and url in error.refused:
            refused[url] = error.refused[url]
          else:
            self._fail(url, f"{error.op} failed: {why}")
        urls = [u for u in urls if u not in error.failures]  # again, so the op's state is set

  # --- watching ----------------------------------------------------------------------------------

  async def _run(self) -> None:
    while True:
      await asyncio.sleep(self.config.poll_s)
      try:
        self._check()
      except Exception:  # noqa: BLE001 - the watcher must outlive any one bad check
        log.exception("supervisor check failed")

  def _check(self) -> None:
    now = time.monotonic()
    if self.servers is not None:
      for i, url in enumerate(self.servers.urls):
        if url not in self._recovering and self.servers.pid(i) is None:
          self._fail(url, "process exited")
    for s in self.client.stats().servers:
      if s.url in self._recovering:
        continue
      w = self._watch.setdefault(s.url, _Watch())
      bad = s.num_failures - s.num_malformed  # a malformed answer is not a sick server
      ok = s.num_requests - s.num_failures - s.in_flight
      if ok > w.ok:
        w.bad_since_ok = 0
      w.bad_since_ok += max(bad - w.bad, 0)
      w.ok, w.bad = ok, bad
      w.down_since = None if s.healthy else (w.down_since or now)
      if w.bad_since_ok >= self.config.hang_failures:
        self._fail(s.url, f"{w.bad_since_ok} requests in a row failed")
      elif not s.healthy and s.failed_probes >= self.config.sick_probes:
        self._fail(s.url, f"out of rotation and failed {s.failed_probes} /health probes in a row")
      elif w.down_since is not None and now - w.down_since > self.config.unhealthy_grace_s:
        self._fail(s.url, f"down for {now - w.down_since:.0f}s")

  def _fail(self, url: str, why: str) -> None:
    if url in self._recovering:
      return
    log.warning("rollout server %s failed (%s): out of rotation until it is back", url, why)
    self.failures += 1
    self.client.remove_server(url)
    self._watch.pop(url, None)
    self._recovering[url] = asyncio.create_task(self._recover(url))

  async def _recover(self, url: str) -> None:
    try:
      while True:
        try:
          await self._bring_back(url)
          return
        except asyncio.CancelledError:
          raise
        except Exception as error:  # noqa: BLE001 - keep trying; the run goes on without it
          log.error("could not bring %s back (%s); retrying", url, error)
          await asyncio.sleep(self.config.rejoin_poll_s)
    finally:
      self._recovering.pop(url, None)

  async def _bring_back(self, url: str) -> None:
    local = self.servers is not None and url in self.servers.urls
    if local:
      i = self.servers.urls.index(url)
      restart = asyncio.ensure_future(asyncio.to_thread(self.servers.restart, i))
      self._restarts.add(restart)
      restart.add_done_callback(self._restarts.discard)
      await asyncio.shield(restart)
      self.restarts += 1
      if self.pid_file:
        record_pids(self.pid_file, self.servers)
      log.info("restarted rollout server %d at %s", i, url)
    else:  # external: wait until it answers, without holding the lock meanwhile
      while not await asyncio.to_thread(_answers, url):
        await asyncio.sleep(self.config.rejoin_poll_s)
    while True:
      async with self.lock:  # no publish in between: the version loaded is the one served
        try:
          if self._served is not None:  # else the fleet serves what every server starts with
            path, version = self._served
            await self.client.update_weights_from_disk(path, str(version), urls=[url])
          self.client.add_server(url)
          break
        except ServerOpError as error:
          if url not in error.refused:
            raise  # the server failed again: restart it again
          # The directory is refused (damaged since it was served?): the server is fine. Wait for
          # the next publish (which replaces `_served`) rather than restarting it in a loop.
          log.error("%s refused to rejoin on %s: %s; waiting for the next version", url,
                    self._served, error.refused[url])
      await asyncio.sleep(self.config.rejoin_poll_s)
    log.info("rollout server %s rejoined at policy version %s", url,
             self._served[1] if self._served else "(initial)")


def _answers(url: str, timeout_s: float = 5.0) -> bool:
  try:
    with urllib.request.urlopen(url + "/health_generate", timeout=timeout_s) as r:
      return r.status == 200
  except (urllib.error.URLError, OSError):
    return False


# --- orphaned server processes of a killed controller --------------------------------------------

def record_pids(path: str, servers: LocalServers) -> None:
  """Writes `[{pid, url}]` of the running servers (atomically), for `reap_orphans`."""
  entries = [{"pid": servers.pid(i), "url": url} for i, url in enumerate(servers.urls)
             if servers.pid(i) is not None]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(entries, f)
  os.replace(tmp, path)


def reap_orphans(path: str) -> list[int]:
  """SIGKILLs the server process groups a previous controller recorded and left running.

  A pid is only killed if its command line still carries the recorded port, so a recycled pid that
  now belongs to some other program is left alone. Returns the pids killed.
  """
  if not os.path.exists(path):
    return []
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    return []
  killed = []
  for entry in entries:
    pid, port = int(entry["pid"]), entry["url"].rsplit(":", 1)[-1]
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
      continue
    if f"--port={port}" not in cmdline:
      continue
    try:
      os.killpg(pid, signal.SIGKILL)
      killed.append(pid)
      log.warning("killed rollout server %d (%s) left behind by a previous run", pid, entry["url"])
    except (ProcessLookupError, PermissionError):
      pass
  os.remove(path)
  return killed
