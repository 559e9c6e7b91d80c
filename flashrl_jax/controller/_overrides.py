"""How a run's config is changed from outside: by dotted field paths.

`override(config, {"rollout.num_servers": 4, ...})` is the only way the command line
(`experiments.train`) and the experiment sweeps (`experiments._runs`) change a `RunConfig`; the
mechanism (`flashrl_jax._overrides`) locks the config, so a misspelt field fails, and converts
command-line strings to each field's annotated type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashrl_jax._overrides import OverrideError, apply_overrides, parse_assignment
from flashrl_jax._overrides import field_type as _field_type
from flashrl_jax.controller._config import Mode, RunConfig


def override(config: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
  """`config` with `overrides` (dotted path -> value) applied and validated.

  `mode=sync` without an `async_ratio` also sets α = 0: a config's α belongs to its async mode.
  """
  overrides = dict(overrides)
  if overrides.get("mode") in (Mode.SYNC, Mode.SYNC.value) and "async_ratio" not in overrides:
    overrides["async_ratio"] = 0
  return apply_overrides(config, overrides)


def field_type(path: str) -> Any:
  """The type of the `RunConfig` field at `path` (bool, int, float, str, an enum, a tuple...)."""
  return _field_type(RunConfig, path)
