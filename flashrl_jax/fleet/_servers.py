"""The client's view of its rollout servers: membership, health, load accounting and HTTP calls.

Kept apart from `_client` (what a generation *means*: retries, continuations, controller ops) so
that load balancing and health tracking read on their own: a server is picked by fewest outstanding
requests among those whose last request did not fail (a server that fails fast would otherwise
always look least loaded), taken out of rotation on a connection error, timeout or 5xx, and put
back by a background `GET /health` when it answers again. Every HTTP call goes through `ServerPool.http`, which turns
connection problems and timeouts into `AttemptFailed` with a typed `Fault`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import aiohttp

from flashrl_jax.fleet import _protocol as proto

log = logging.getLogger(__name__)
T = TypeVar("T")


class Fault(enum.Enum):
  CONNECTION = "connection error"
  TIMEOUT = "timeout"
  SERVER_ERROR = "server error"
  MALFORMED = "malformed response"


class AttemptFailed(Exception):
  """One HTTP call failed in a way that another server might not."""

  def __init__(self, fault: Fault, detail: str):
    super().__init__(f"{fault.value}: {detail}")
    self.fault = fault


class HTTPStatusError(RuntimeError):
  """A server answered a controller operation with a status other than 200."""

  def __init__(self, status: int, text: str):
    super().__init__(f"HTTP {status}: {text[:300]}")
    self.status, self.text = status, text


class ServerOpError(RuntimeError):
  """A controller operation failed on some servers; `failures` maps url → reason.

  `refused`: the failures that were answers refusing the operation (the server is up and kept its
  state, e.g. a weight directory it would not load), as opposed to servers that failed."""

  def __init__(self, op: str, failures: dict[str, str], results: dict[str, Any],
               refused: dict[str, str] | None = None):
    self.op, self.failures, self.results = op, failures, results
    self.refused = refused or {}
    lines = "; ".join(f"{url}: {why}" for url, why in failures.items())
    super().__init__(f"{op} failed on {len(failures)}/{len(failures) + len(results)} "
                     f"server(s): {lines}")


@dataclasses.dataclass(frozen=True)
class ServerStats:
  url: str
  healthy: bool
  in_flight: int
  num_requests: int
  num_failures: int
  num_malformed: int
  busy_s: float  # wall time with at least one request in flight
  failed_probes: int = 0  # background /health probes failed in a row (reset by one success)


@dataclasses.dataclass(eq=False)
class Server:
  """Mutable bookkeeping for one server (owned by `ServerPool`, mutated on the event loop only)."""
  url: str
  healthy: bool = True
  in_flight: int = 0
  num_requests: int = 0
  num_failures: int = 0
  num_malformed: int = 0
  busy_s: float = 0.0
  busy_since: float = 0.0
  consecutive_failures: int = 0  # requests failed since its last success
  failed_probes: int = 0

  def stats(self) -> ServerStats:
    busy = self.busy_s + (time.monotonic() - self.busy_since if self.in_flight else 0.0)
    return ServerStats(self.url, self.healthy, self.in_flight, self.num_requests,
                       self.num_failures, self.num_malformed, busy, self.failed_probes)


class ServerPool:
  """Servers by url, the HTTP session, and the health loop. Create and use on one event loop."""

  def __init__(self, urls: Iterable[str], *, health_interval_s: float, health_timeout_s: float):
    self.servers: dict[str, Server] = {}
    for url in urls:
      self.add(url)
    self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
    self.paused = False  # while paused, a failing /health does not take a server out
    self._session: aiohttp.ClientSession | None = None
    self._health_task: asyncio.Task | None = None

  async def start(self) -> None:
    if self._session is None:
      self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
      self._health_task = asyncio.create_task(self._health_loop())

  async def close(self) -> None:
    if self._health_task is not None:
      self._health_task.cancel()
      await asyncio.gather(self._health_task, return_exceptions=True)
    if self._session is not None:
      await self._session.close()
    self._session, self._health_task = None, None

  def add(self, url: str) -> None:
    url = url.rstrip("/")
    server = self.servers.setdefault(url, Server(url))
    server.healthy, server.consecutive_failures, server.failed_probes = True, 0, 0

  def remove(self, url: str) -> None:
    self.servers.pop(url.rstrip("/"), None)

  def mark_down(self, server: Server, why: str) -> None:
    if server.healthy:
      log.warning("taking %s out of rotation (%s)", server.url, why)
    server.healthy = False

  async def pick(self, tried: set[str], wait_s: float) -> Server:
    """Least outstanding requests among healthy servers, preferring ones not tried yet.

    A server whose last request failed comes after every server whose last one did not, whatever
    its load: a server that fails at once has nothing in flight, so it would look least loaded.
    Ties go to the server that has had the fewest requests, so sequential calls spread too. With no
    healthy server it waits up to `wait_s` for the health loop to bring one back.
    """
    deadline = time.monotonic() + wait_s
    while True:
      healthy = [s for s in self.servers.values() if s.healthy]
      pool = [s for s in healthy if s.url not in tried] or healthy
      if pool:
        return min(pool, key=lambda s: (s.consecutive_failures > 0, s.in_flight, s.num_requests))
      if time.monotonic() > deadline:
        raise AttemptFailed(Fault.CONNECTION, f"no healthy server among {list(self.servers)}")
      await asyncio.sleep(min(0.05, self.health_interval_s))

  @contextlib.contextmanager
  def track(self, server: Server):
    """Counts a request as outstanding on `server` (load balancing and busy time)."""
    if server.in_flight == 0:
      server.busy_since = time.monotonic()
    server.in_flight += 1
    server.num_requests += 1
    try:
      yield
    finally:
      server.in_flight -= 1
      if server.in_flight == 0:
        server.busy_s += time.monotonic() - server.busy_since

  def session(self) -> aiohttp.ClientSession:
    if self._session is None:
      raise RuntimeError("RolloutClient not started: use `async with` or `await client.start()`")
    return self._session

  async def http(self, url: str, method: str, path: str, body: Any,
                 timeout_s: float) -> tuple[int, str]:
    """(status, body text); connection problems and timeouts become `AttemptFailed`."""
    try:
      async with asyncio.timeout(timeout_s):
        async with self.session().request(method, url + path, json=body) as resp:
          return resp.status, (await resp.read()).decode(errors="replace")
    except TimeoutError:
      raise AttemptFailed(Fault.TIMEOUT, f"{method} {url}{path} after {timeout_s}s") from None
    except (aiohttp.ClientError, OSError) as e:
      raise AttemptFailed(Fault.CONNECTION, f"{method} {url}{path}: {e!r}") from None

  async def fan_out(self, op: str, method: str, path: str, body: Any, parse: Callable[[str], T],
                    urls: Sequence[str] | None, timeout_s: float,
                    refusal: Callable[[BaseException], str | None] = lambda e: None
                    ) -> dict[str, T]:
    """Runs one call on every server (or `urls`) at once; raises `ServerOpError` on any failure
    (`refusal(error)` names the failures that are a refusal, not a failed server)."""
    targets = [u.rstrip("/") for u in (urls if urls is not None else self.servers)]

    async def one(url: str) -> T:
      status, text = await self.http(url, method, path, body, timeout_s)
      if status != 200:
        raise HTTPStatusError(status, text)
      return parse(text)

    got = await asyncio.gather(*(one(u) for u in targets), return_exceptions=True)
    results = {u: r for u, r in zip(targets, got) if not isinstance(r, BaseException)}
    errors = {u: r for u, r in zip(targets, got) if isinstance(r, BaseException)}
    if errors:
      refused = {u: why for u, e in errors.items() if (why := refusal(e)) is not None}
      raise ServerOpError(op, {u: str(e) for u, e in errors.items()}, results, refused)
    return results

  async def probe(self, url: str, path: str = "/health") -> bool:
    try:
      status, _ = await self.http(url, "GET", path, None, self.health_timeout_s)
      return status == 200
    except AttemptFailed:
      return False

  async def _health_loop(self) -> None:
    while True:
      await asyncio.sleep(self.health_interval_s)
      servers = list(self.servers.values())
      ok = await asyncio.gather(*(self.probe(s.url) for s in servers))
      for s, good in zip(servers, ok):
        if good:
          s.failed_probes = 0
        if good and not s.healthy:  # (our /health generates a token: generation works again)
          log.info("%s answers /health again: back in rotation", s.url)
          s.healthy, s.consecutive_failures = True, 0
        elif not good and not self.paused:  # a paused SGLang may fail /health legitimately
          s.failed_probes += 1
          self.mark_down(s, "fails /health")


def json_parser(parse: Callable[[Any], T]) -> Callable[[str], T]:
  """Adapts a parser of decoded JSON to one of response text."""
  return lambda text: parse(proto.loads_json(text))
