"""Rollout: a continuous-batching JAX engine served over SGLang's HTTP protocol, and one client.

- `Engine` generates in-process; `python -m flashrl_jax.rollout.server` serves it over HTTP with the
  routes of `shared/SGLANG_PROTOCOL.md` (`Sampling` is the server side's full `sampling_params`).
- `RolloutClient` drives N such servers (ours or real SGLang, alike); `SamplingParams` is what it
  sends per sample. `LocalServers` starts k of our servers pinned to disjoint cores or devices.
- `PauseMode`, `FinishReason`, `VersionSpan` are the protocol's values, shared by both sides.
"""

from flashrl_jax.rollout._client import (ClientStats, GenerationError, GenerationResult,
                                         RequestRejected, RolloutClient)
from flashrl_jax.rollout._config import EngineConfig, EngineStats
from flashrl_jax.rollout._engine import Engine
from flashrl_jax.rollout._local import LocalServers, ServerSpec
from flashrl_jax.rollout._protocol import (FinishKind, FinishReason, MalformedResponse, PauseMode,
                                           SamplingParams, VersionSpan)
from flashrl_jax.rollout._request import Output
from flashrl_jax.rollout._runner import ROLLOUT_RULES, rollout_mesh
from flashrl_jax.rollout._sampling import Sampling

__all__ = [
    "ROLLOUT_RULES", "ClientStats", "Engine", "EngineConfig", "EngineStats", "FinishKind",
    "FinishReason", "GenerationError", "GenerationResult", "LocalServers", "MalformedResponse",
    "Output", "PauseMode", "RequestRejected", "RolloutClient", "Sampling", "SamplingParams",
    "ServerSpec", "VersionSpan", "rollout_mesh",
]
