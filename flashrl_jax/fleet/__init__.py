"""The rollout fleet: N servers speaking SGLang's HTTP protocol, driven from the controller.

JAX-free on purpose: the controller host, a CPU-only launcher or a test imports it without pulling
in the engine. The servers behind it are ours (`python -m flashrl_jax.rollout.server`) or real
SGLang, alike.

- `Fleet` is the interface the controller uses: `generate`, `publish(path, version)` (pause ->
  update_weights_from_disk -> continue on every server, abort or in-place), `stats`, `close`.
- `SamplingParams`, `PauseMode`, `FinishKind`, `FinishReason`, `VersionSpan`: the protocol's values,
  shared with the server side.
- `RolloutClient` drives the servers (least-loaded routing, retries, continuations after aborts).
- `LocalServers` starts k server processes pinned to disjoint cores or devices;
  `exit_with_launcher` (called by our server) stops one once the process that started it is gone.
- `Supervisor` restarts dead or hung servers and runs the weight handoff (the one implementation
  behind `Fleet.publish`).
"""

from flashrl_jax.fleet._client import (ClientStats, GenerationError, GenerationResult,
                                       RequestRejected, RolloutClient)
from flashrl_jax.fleet._fleet import Fleet, FleetStats
from flashrl_jax.fleet._local import (LAUNCHER_PID_ENV, LocalServers, ServerSpec, device_env,
                                      exit_with_launcher, free_port, split_cpus)
from flashrl_jax.fleet._protocol import (FinishKind, FinishReason, MalformedResponse, PauseMode,
                                         SamplingParams, VersionSpan)
from flashrl_jax.fleet._servers import ServerOpError
from flashrl_jax.fleet._supervisor import (Supervisor, SupervisorConfig, VersionRefused,
                                           reap_orphans, record_pids)

__all__ = [
    "LAUNCHER_PID_ENV", "ClientStats", "FinishKind", "FinishReason", "Fleet", "FleetStats",
    "GenerationError", "GenerationResult", "LocalServers", "MalformedResponse", "PauseMode",
    "RequestRejected", "RolloutClient", "SamplingParams", "ServerOpError", "ServerSpec",
    "Supervisor", "SupervisorConfig", "VersionRefused", "VersionSpan", "device_env",
    "exit_with_launcher", "free_port", "reap_orphans", "record_pids", "split_cpus",
]
