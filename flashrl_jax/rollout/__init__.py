"""Rollout: a continuous-batching JAX engine served over SGLang's HTTP protocol.

- `Engine` generates in-process; `python -m flashrl_jax.rollout.server` serves it over HTTP with the
  routes of `shared/SGLANG_PROTOCOL.md` (`Sampling` is the server side's full `sampling_params`) and
  an OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`; chat prompts rendered by
  `ChatTemplate` from the model directory, as transformers renders them).
- The protocol's values (`PauseMode`, `FinishKind`, ...) and everything that drives servers from the
  controller (client, local server processes, supervisor) live in the JAX-free `flashrl_jax.fleet`.
"""

from flashrl_jax.rollout._chat import ChatTemplate, TemplateError, parse_tool_calls
from flashrl_jax.rollout._compiles import DEFAULT_CACHE_DIR, enable_compilation_cache
from flashrl_jax.rollout._config import EngineConfig, EngineStats
from flashrl_jax.rollout._engine import Engine
from flashrl_jax.rollout._request import Output
from flashrl_jax.rollout._runner import ROLLOUT_RULES, rollout_mesh
from flashrl_jax.rollout._sampling import Sampling

__all__ = [
    "DEFAULT_CACHE_DIR", "ROLLOUT_RULES", "ChatTemplate", "Engine", "EngineConfig", "EngineStats",
    "Output", "Sampling", "TemplateError", "enable_compilation_cache", "parse_tool_calls",
    "rollout_mesh",
]
