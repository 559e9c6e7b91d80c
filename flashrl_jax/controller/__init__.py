"""The RL controller: async (ROLL Flash) and sync loops, weight handoff, metrics.

The scheduling rules it runs (staleness bound, sample buffer, pause modes) are
`flashrl_jax.scheduling`, shared with the simulator.

`run(RunConfig)` is the whole run; `experiments/train.py` is its absl front end.
"""

from flashrl_jax.controller._agentic_config import AgenticConfig, DropCause
from flashrl_jax.controller._config import (Mode, ResourceConfig, RolloutBackend, RolloutConfig,
                                            RunConfig, TaskConfig)
from flashrl_jax.controller._metrics import MetricsLogger, read_metrics, step_sample_metrics
from flashrl_jax.controller._samples import Group, Response
from flashrl_jax.controller._source import PromptSource

__all__ = [
    "AgenticConfig", "DropCause", "Group", "MetricsLogger", "Mode", "PromptSource", "ResourceConfig", "Response",
    "RolloutBackend", "RolloutConfig", "RunConfig", "TaskConfig", "read_metrics", "run",
    "step_sample_metrics",
]


def run(config, **kwargs):
  """Runs one RL job (imported lazily: it pulls in the trainer, the client and orbax)."""
  from flashrl_jax.controller._run import run as _run
  return _run(config, **kwargs)
