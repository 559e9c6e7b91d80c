"""Rollout: a continuous-batching JAX engine served over SGLang's HTTP protocol.

`Engine` generates in-process; `python -m flashrl_jax.rollout.server` serves it over HTTP with the
routes of `shared/SGLANG_PROTOCOL.md`, so the controller talks to our servers and to real SGLang alike.
"""

from flashrl_jax.rollout._config import EngineConfig, EngineStats
from flashrl_jax.rollout._engine import Engine
from flashrl_jax.rollout._request import FinishKind, FinishReason, Output, PauseMode, VersionSpan
from flashrl_jax.rollout._runner import ROLLOUT_RULES, rollout_mesh
from flashrl_jax.rollout._sampling import Sampling

__all__ = [
    "ROLLOUT_RULES", "Engine", "EngineConfig", "EngineStats", "FinishKind", "FinishReason", "Output",
    "PauseMode", "Sampling", "VersionSpan", "rollout_mesh",
]
