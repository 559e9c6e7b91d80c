"""The RL controller: async (ROLL Flash) and sync loops, weight handoff, metrics.

The scheduling rules it runs (staleness bound, sample buffer, pause modes) are
`flashrl_jax.scheduling`, shared with the simulator.

`run(RunConfig)` is the whole run; `experiments/train.py` is its absl front end. A run is a `Loop`
over a `Fleet` (rollout), a `Learner` (trainer, checkpoints, exported versions), a `PromptSource`,
a `SampleBuffer` and typed `Counters`.
"""

from flashrl_jax.controller._agentic import EnvGroupRunner, collect_lockstep
from flashrl_jax.controller._agent_episode import AgentEpisode, chat_agent
from flashrl_jax.controller._agent_proxy import AgentProxy
from flashrl_jax.controller._agentic_config import AgenticConfig, AgentPolicy, DropCause
from flashrl_jax.controller._agentic_episode import AgenticStats, EpisodeDeps, FixedLevel
from flashrl_jax.controller._config import (Mode, ResourceConfig, RolloutBackend, RolloutConfig,
                                            RunConfig, TaskConfig)
from flashrl_jax.controller._counters import Counters, EpisodeCounts
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.controller._learner import Learner
from flashrl_jax.controller._learner_process import LearnerProcess, LearnerProcessError
from flashrl_jax.controller._loops import Loop, to_trajectories
from flashrl_jax.controller._metrics import MetricsLogger, read_metrics, step_sample_metrics
from flashrl_jax.controller._overrides import (OverrideError, field_type, override,
                                               parse_assignment)
from flashrl_jax.controller._placement import Placement, plan_placement
from flashrl_jax.controller._progress import ProgressReporter
from flashrl_jax.controller._run import RunSummary, engine_server_args, run
from flashrl_jax.controller._samples import Group, Response
from flashrl_jax.controller._source import PromptSource, task_source

__all__ = [
    "AgentEpisode", "AgentPolicy", "AgentProxy", "AgenticConfig", "AgenticStats", "Counters",
    "DropCause", "EnvGroupRunner", "EpisodeCounts", "EpisodeDeps", "FixedLevel", "Group",
    "GroupRunner", "Learner", "LearnerProcess", "LearnerProcessError", "Loop", "MetricsLogger",
    "Mode", "OverrideError", "Placement",
    "ProgressReporter", "PromptSource", "ResourceConfig", "Response", "RolloutBackend",
    "RolloutConfig", "RunConfig", "RunSummary", "TaskConfig", "chat_agent", "collect_lockstep",
    "engine_server_args", "field_type", "override", "parse_assignment", "plan_placement",
    "plot_run", "read_metrics", "run", "step_sample_metrics", "task_source", "to_trajectories",
]


def plot_run(workdir: str, window: int = 11) -> list[str]:
  """PNG curves of a run's metrics (imported lazily: matplotlib is slow to import)."""
  from flashrl_jax.controller._plot import plot_run as _plot_run
  return _plot_run(workdir, window)
