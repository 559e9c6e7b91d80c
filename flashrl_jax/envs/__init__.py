"""Tasks, rewards and environments: what a prompt is, and what turns a response (or an episode)
into a verifiable number.

Tasks (`TaskSource`: training prompt `i` is a pure function of `i`, plus held-out sets):
`ReasoningGymSource` (reasoning-gym's generators), `SampleListSource` over `load_dataset` (JSONL /
Parquet files in the GSM8K, MATH, DAPO or generic layout), `SyntheticSource` (long-tail lengths),
`CodeTaskSource` (procedural write-a-function tasks). Single-turn rewards: `ReasoningGymReward`
(the library's scorers), `MathReward` (math-verify), `ExactMatchReward` (sync; run them through
`PooledReward`, or `InlineReward` for ones costing microseconds) and `CodeReward` (async,
sandboxed, with RollPacker's adaptive timeout). Multi-turn:
gymnasium's FrozenLake and Taxi, our Sokoban, wrapped by `AsyncEnv` for per-step latency and
fail-slow/fail-stop injection. Build from configs with `make_env` / `make_async_env` /
`make_reward_fn`.
"""

from flashrl_jax.envs._actions import MOVE_WORDS, Move, format_action, parse_action, parse_move
from flashrl_jax.envs._adaptive_timeout import AdaptiveTimeout, AdaptiveTimeoutConfig, TimeoutStats
from flashrl_jax.envs._code_grader import CodeTests, Grade, TestCase, Verdict, grade, same
from flashrl_jax.envs._code_reward import CodeReward, extract_code
from flashrl_jax.envs._code_tasks import (CodeFamily, CodeTaskConfig, CodeTaskSource,
                                          code_task_prompt, generate_code_tasks)
from flashrl_jax.envs._datasets import (DatasetError, DatasetFileConfig, DatasetFormat,
                                        DatasetLayout, LoadedDataset, RowError, load_dataset,
                                        save_jsonl)
from flashrl_jax.envs._episode import EpisodeConfig, Outcome, TextGame
from flashrl_jax.envs._factory import (EnvConfig, EnvKind, RewardConfig, RewardKind, make_async_env,
                                       make_env, make_reward_fn)
from flashrl_jax.envs._gym import FrozenLakeConfig, FrozenLakeEnv, TaxiConfig, TaxiEnv
from flashrl_jax.envs._latency import AsyncEnv, FailureConfig, LatencyConfig, LatencyKind
from flashrl_jax.envs._math_equiv import equivalent
from flashrl_jax.envs._math_extract import AnswerSource, extract_answer
from flashrl_jax.envs._math_reward import (ExactMatchReward, MathReward, VerifierBackend,
                                           math_verify_available)
from flashrl_jax.envs._pool import InlineReward, PooledReward, make_process_pool
from flashrl_jax.envs._reasoning_gym import (AnswerFormat, ReasoningGymConfig, ReasoningGymDataset,
                                             ReasoningGymReward, ReasoningGymSource)
from flashrl_jax.envs._sandbox import (Isolation, IsolationMode, Sandbox, SandboxConfig,
                                       SandboxResult, SandboxStatus, SandboxUnavailable,
                                       remove_orphaned_scratch_dirs)
from flashrl_jax.envs._sokoban import SokobanConfig, SokobanEnv
from flashrl_jax.envs._sources import SampleListSource, SyntheticSource, TaskSource
from flashrl_jax.envs._synthetic import (SyntheticConfig, SyntheticTask, answer_length,
                                         generate_synthetic)
from flashrl_jax.envs._types import (AsyncEnvironment, AsyncRewardFn, Environment,
                                     EnvironmentFailure, RewardFn, RewardResult, Sample, StepResult)

# The synthetic tasks' length law (a field of `SyntheticConfig`) is the scheduling policy's own.
from flashrl_jax.scheduling import LengthDistribution, LengthLaw  # noqa: E402

__all__ = [
    "AdaptiveTimeout", "AdaptiveTimeoutConfig", "AnswerFormat", "AnswerSource", "AsyncEnv",
    "AsyncEnvironment", "AsyncRewardFn", "CodeFamily", "CodeReward", "CodeTaskConfig",
    "CodeTaskSource", "CodeTests", "DatasetError", "DatasetFileConfig", "DatasetFormat",
    "DatasetLayout", "EnvConfig", "EnvKind", "Environment", "EnvironmentFailure", "EpisodeConfig",
    "ExactMatchReward", "FailureConfig", "FrozenLakeConfig", "FrozenLakeEnv", "Grade", "Isolation",
    "IsolationMode", "LatencyConfig", "LatencyKind", "LengthDistribution", "LengthLaw",
    "InlineReward", "LoadedDataset", "MOVE_WORDS", "MathReward", "Move", "Outcome", "PooledReward",
    "ReasoningGymConfig", "ReasoningGymDataset", "ReasoningGymReward", "ReasoningGymSource",
    "RewardConfig", "RewardFn", "RewardKind", "RewardResult", "RowError", "Sample",
    "SampleListSource", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxStatus",
    "SandboxUnavailable", "SokobanConfig", "SokobanEnv", "StepResult", "SyntheticConfig",
    "SyntheticSource", "SyntheticTask", "TaskSource", "TaxiConfig", "TaxiEnv", "TestCase",
    "TextGame", "TimeoutStats", "Verdict", "VerifierBackend", "answer_length", "code_task_prompt",
    "equivalent", "extract_answer", "extract_code", "format_action", "generate_code_tasks",
    "generate_synthetic", "grade", "load_dataset", "make_async_env", "make_env",
    "make_process_pool", "make_reward_fn", "math_verify_available", "parse_action", "parse_move",
    "remove_orphaned_scratch_dirs", "same", "save_jsonl",
]
