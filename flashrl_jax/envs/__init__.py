"""Rewards and environments: what turns a response (or an episode) into a verifiable number.

Single-turn: `MathReward`, `ExactMatchReward` (sync, run them through `PooledReward`) and
`CodeReward` (async, sandboxed, with RollPacker's adaptive timeout). Multi-turn: `FrozenLakeEnv`,
`SokobanEnv`, wrapped by `AsyncEnv` for per-step latency and fail-slow/fail-stop injection.
Data: `load_dataset` (JSONL/Parquet) and `generate_synthetic` (long-tail answer lengths).
Build from configs with `make_env` / `make_async_env` / `make_reward_fn`.
"""

from flashrl_jax.envs._actions import Move, format_move, parse_move
from flashrl_jax.envs._adaptive_timeout import AdaptiveTimeout, AdaptiveTimeoutConfig, TimeoutStats
from flashrl_jax.envs._code_grader import CodeTests, Grade, TestCase, Verdict, grade, same
from flashrl_jax.envs._code_reward import CodeReward, extract_code
from flashrl_jax.envs._code_tasks import (CodeFamily, CodeTaskConfig, CodeTaskSource,
                                          code_task_prompt, generate_code_tasks)
from flashrl_jax.envs._datasets import (DatasetError, DatasetFormat, LoadedDataset, RowError,
                                        load_dataset, save_jsonl)
from flashrl_jax.envs._factory import (EnvConfig, EnvKind, RewardConfig, RewardKind, make_async_env,
                                       make_env, make_reward_fn)
from flashrl_jax.envs._frozen_lake import FrozenLakeConfig, FrozenLakeEnv
from flashrl_jax.envs._grid import EpisodeConfig
from flashrl_jax.envs._latency import AsyncEnv, FailureConfig, LatencyConfig, LatencyKind
from flashrl_jax.envs._math_equiv import equivalent
from flashrl_jax.envs._math_extract import AnswerSource, extract_answer
from flashrl_jax.envs._math_reward import (ExactMatchReward, MathReward, VerifierBackend,
                                           math_verify_available)
from flashrl_jax.envs._pool import PooledReward, make_process_pool
from flashrl_jax.envs._sandbox import (Isolation, IsolationMode, Sandbox, SandboxConfig,
                                       SandboxResult, SandboxStatus, SandboxUnavailable)
from flashrl_jax.envs._sokoban import SokobanConfig, SokobanEnv
from flashrl_jax.envs._synthetic import (SyntheticConfig, SyntheticTask, answer_length,
                                         generate_synthetic)
from flashrl_jax.envs._types import (AsyncEnvironment, AsyncRewardFn, Environment,
                                     EnvironmentFailure, RewardFn, RewardResult, Sample, StepResult)

# The synthetic tasks' length law (a field of `SyntheticConfig`) is the scheduling policy's own.
from flashrl_jax.scheduling import LengthDistribution, LengthLaw  # noqa: E402

__all__ = [
    "AdaptiveTimeout", "AdaptiveTimeoutConfig", "AnswerSource", "AsyncEnv", "AsyncEnvironment",
    "AsyncRewardFn", "CodeFamily", "CodeReward", "CodeTaskConfig", "CodeTaskSource", "CodeTests",
    "DatasetError", "DatasetFormat", "EnvConfig", "EnvKind", "Environment", "EnvironmentFailure",
    "EpisodeConfig", "ExactMatchReward", "FailureConfig", "FrozenLakeConfig", "FrozenLakeEnv",
    "Grade", "Isolation", "IsolationMode", "LatencyConfig", "LatencyKind", "LengthDistribution",
    "LengthLaw", "LoadedDataset", "MathReward", "Move", "PooledReward", "RewardConfig", "RewardFn",
    "RewardKind", "RewardResult", "RowError", "Sample", "Sandbox", "SandboxConfig", "SandboxResult",
    "SandboxStatus", "SandboxUnavailable", "SokobanConfig", "SokobanEnv", "StepResult",
    "SyntheticConfig", "SyntheticTask", "TestCase", "TimeoutStats", "Verdict", "VerifierBackend",
    "answer_length", "code_task_prompt", "equivalent", "extract_answer", "extract_code",
    "format_move", "generate_code_tasks", "generate_synthetic", "grade", "load_dataset",
    "make_async_env", "make_env", "make_process_pool", "make_reward_fn", "math_verify_available",
    "parse_move", "same", "save_jsonl",
]
