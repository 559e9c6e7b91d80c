"""The rollout fleet: N servers speaking SGLang's HTTP protocol, driven from the controller.

JAX-free on purpose: the controller host, a CPU-only launcher or a test imports it without pulling
in the engine. The servers behind it are ours (`python -m flashrl_jax.rollout.server`) or real
SGLang, alike.

- `SamplingParams`, `PauseMode`, `FinishKind`, `FinishReason`, `VersionSpan`: the protocol's values,
  shared with the server side.
- `RolloutClient` drives the servers (least-loaded routing, retries, continuations after aborts).
- `LocalServers` starts k server processes pinned to disjoint cores or devices.
- `Supervisor` restarts dead or hung servers and runs the weight handoff
  (pause -> update_weights_from_disk -> continue) across the fleet.
"""

from flashrl_jax.fleet._client import (ClientStats, GenerationError, GenerationResult,
                                       RequestRejected, RolloutClient)
from flashrl_jax.fleet._local import LocalServers, ServerSpec, free_port, split_cpus
from flashrl_jax.fleet._protocol import (FinishKind, FinishReason, MalformedResponse, PauseMode,
                                         SamplingParams, VersionSpan)
from flashrl_jax.fleet._servers import ServerOpError
from flashrl_jax.fleet._supervisor import Supervisor, SupervisorConfig, reap_orphans, record_pids

__all__ = [
    "ClientStats", "FinishKind", "FinishReason", "GenerationError", "GenerationResult",
    "LocalServers", "MalformedResponse", "PauseMode", "RequestRejected", "RolloutClient",
    "SamplingParams", "ServerOpError", "ServerSpec", "Supervisor", "SupervisorConfig",
    "VersionSpan", "free_port", "reap_orphans", "record_pids", "split_cpus",
]
