"""`Fleet`: the one object the controller holds for its rollout servers.

Its interface is what an RL loop needs of rollout and nothing more: `generate` one sample (or
`generate_group`: a prompt's samples in one request),
`publish(path, version)` a new policy (pause -> update_weights_from_disk -> continue on every
server, in the fleet's pause mode), `stats`, and `close`. Behind it sit the client (routing,
retries, continuations across aborts) and the supervisor (restarts, rejoin at the served version),
so the loop never sees a server fail, and there is exactly one weight-handoff implementation
(`Supervisor.handoff`), used by the run and by its tests alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

from flashrl_jax.fleet._client import ClientStats, GenerationResult, RolloutClient
from flashrl_jax.fleet._local import LocalServers
from flashrl_jax.fleet._protocol import PauseMode, SamplingParams
from flashrl_jax.fleet._supervisor import Supervisor, SupervisorConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FleetStats:
  client: ClientStats
  version: int  # the policy version the fleet serves (the last publish's)
  server_failures: int  # servers taken out of rotation since the fleet started
  server_restarts: int  # local server processes restarted since the fleet started
  recovering: tuple[str, ...]  # servers out of rotation right now


class Fleet:
  """N rollout servers behind one client and one supervisor. Use `async with`.

  `servers`: local server processes the supervisor may restart (None: external servers, which it
  waits for instead). `version`: the policy version the servers serve before the first publish.
  """

  def __init__(self, client: RolloutClient, *, pause_mode: PauseMode = PauseMode.ABORT,
               servers: LocalServers | None = None, version: int = 0,
               supervisor: SupervisorConfig = SupervisorConfig(), pid_file: str | None = None):
    self.client, self.pause_mode = client, pause_mode
    self.version = version
    self._supervisor = Supervisor(client, servers=servers, config=supervisor, pid_file=pid_file)
    self._open = False

  async def __aenter__(self) -> Fleet:
    await self.client.start()
    await self._supervisor.__aenter__()
    self._open = True
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  async def wait_healthy(self, timeout_s: float) -> None:
    """Waits until every server answers `/health_generate` (servers that are still starting)."""
    await self.client.wait_healthy(timeout_s=timeout_s)

  async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                     rid: str | None = None) -> GenerationResult:
    """One sample to stop/length on the least-loaded server, continued across weight updates."""
    return await self.client.generate(input_ids, sampling, rid=rid)

  async def generate_group(self, input_ids: Sequence[int], sampling: SamplingParams, n: int, *,
                           rid: str | None = None) -> list[GenerationResult]:
    """`n` samples of one prompt in one request on the least-loaded server (sample j's rid is
    `{rid}-{j}`), each continued across weight updates."""
    return await self.client.generate_group(input_ids, sampling, n, rid=rid)

  async def publish(self, path: str, version: int, *, idle: bool = False) -> dict[str, float]:
    """Makes every server serve the HF directory `path` as `version`; returns the phase times.

    Servers that fail the handoff leave rotation and rejoin on this version once recovered;
    requests in flight survive (continued under the new weights in abort mode, kept in place in
    in_place mode). Raises `VersionRefused` if servers refused the directory: they go on serving
    their weights, and `version` stays what every server serves (the previous one). `idle`: nothing
    is in flight (the caller guarantees it), so the servers load without a pause.
    """
    times = await self._supervisor.handoff(path, version, self.pause_mode, idle=idle)
    self.version = version
    return times

  @property
  def urls(self) -> list[str]:
    """Every server, in launch order (local servers), whether in rotation or not."""
    servers = self._supervisor.servers
    return list(servers.urls) if servers is not None else list(self.client.urls)

  def stats(self) -> FleetStats:
    sup = self._supervisor
    return FleetStats(self.client.stats(), self.version, sup.failures, sup.restarts,
                      tuple(sup.recovering))

  async def close(self) -> None:
    """Aborts what is still generating, stops the supervisor, closes the connections."""
    if not self._open:
      return
    self._open = False
    try:
      await asyncio.wait_for(self.client.abort_all(), timeout=10)
    except Exception as error:  # noqa: BLE001 - best effort at shutdown
      log.warning("abort_all at shutdown failed: %s", error)
    await self._supervisor.__aexit__(None, None, None)
    await self.client.close()
