"""The typed configuration of an RL run: mode, async ratio, rollout backend, resources, task.

Strings from flags become enums here, once; a contradictory combination (sync mode with an async
ratio, SGLang without URLs, more cores than the machine has) fails before anything starts.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

from flashrl_jax import envs
from flashrl_jax._enums import parse_enum
from flashrl_jax._overrides import apply_overrides
from flashrl_jax.controller._agentic_config import AgenticConfig, AgentPolicy
from flashrl_jax.fleet import PauseMode
from flashrl_jax.trainer import TrainConfig


class Mode(enum.Enum):
  SYNC = "sync"    # generate the whole batch, wait for the longest, reward, train, update weights
  ASYNC = "async"  # rollout-train decoupling with the per-sample staleness bound α


class RolloutBackend(enum.Enum):
  EMBEDDED = "embedded"  # our JAX engine, started as local server processes
  SGLANG = "sglang"      # external SGLang-compatible servers at `sglang_urls`
  STUB = "stub"          # the protocol stub (fake model), local processes: fault drills


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Rollout servers and sampling. `temperature` must equal the trainer's (behaviour log-probs).

  `num_servers = 0` starts one local server per rollout core (CPU) or rollout device: on a CPU two
  servers sharing a core give the same tokens/s as one with their slots, but every token waits for
  both servers' decode steps (twice the latency a long response spends generating).
  """

  backend: RolloutBackend = RolloutBackend.EMBEDDED
  num_servers: int = 2
  sglang_urls: tuple[str, ...] = ()
  # An sglang-router in front of `sglang_urls`: generation goes through it, the weight handoff
  # (which it does not forward) goes to the workers.
  router_url: str | None = None
  max_running_requests: int = 16
  # A prompt's n responses as n requests spread over the servers (ROLL's prompt replication), or
  # as one request per prompt (less work per response on the controller's and servers' cores).
  prompt_replication: bool = True
  # Decode steps per device call of the local JAX engine servers (SGLang's flag of that name).
  num_continuous_decode_steps: int = 4
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  pause_mode: PauseMode = PauseMode.ABORT
  request_timeout_s: float = 300.0
  max_retries: int = 3

  def __post_init__(self):
    object.__setattr__(self, "backend", parse_enum(RolloutBackend, self.backend, "backend"))
    object.__setattr__(self, "pause_mode", parse_enum(PauseMode, self.pause_mode, "pause_mode"))
    object.__setattr__(self, "sglang_urls", tuple(u for u in self.sglang_urls if u))
    if self.backend is RolloutBackend.SGLANG and not self.sglang_urls:
      raise ValueError("--rollout=sglang needs --sglang_urls (comma-separated server URLs).")
    if self.backend is not RolloutBackend.SGLANG and self.sglang_urls:
      raise ValueError("--sglang_urls is only used with --rollout=sglang.")
    if self.router_url and self.backend is not RolloutBackend.SGLANG:
      raise ValueError("--router_url needs --rollout=sglang and the router's workers in "
                       "--sglang_urls (the handoff addresses them directly).")
    if (self.num_servers < 0 or self.max_running_requests < 1 or self.max_new_tokens < 1
        or self.num_continuous_decode_steps < 1):
      raise ValueError("num_servers must be >= 0 (0: one per rollout core or device), "
                       "max_running_requests, num_continuous_decode_steps and max_new_tokens "
                       ">= 1.")
    if self.pause_mode is PauseMode.RETRACT and self.backend is RolloutBackend.EMBEDDED:
      pass  # supported by our engine too

  @property
  def server_count(self) -> int:
    """Servers used; 0 when started one per rollout core or device (`num_servers = 0`)."""
    return len(self.sglang_urls) if self.backend is RolloutBackend.SGLANG else self.num_servers


@dataclasses.dataclass(frozen=True)
class ResourceConfig:
  """How the machine's devices are split between rollout servers and the trainer.

  On CPU a "device" is a core: async mode pins rollout servers and the trainer to disjoint cores
  (`rollout_devices` + `train_devices` must fit the machine); sync mode time-shares all of them,
  which is the same total budget. On GPU/TPU the launcher sets the visible-device variables:
  in async mode the trainer sees the accelerators after the rollout ones, unless
  `share_accelerators` (GPU only), when it sees the first `train_devices` of them, as sync mode
  does, and the servers and the trainer time-share them (one GPU for both: the same resources as
  sync; a TPU chip takes one process at a time).
  """

  rollout_devices: int = 1
  train_devices: int = 1
  platform: str = "cpu"
  share_accelerators: bool = False

  def __post_init__(self):
    if self.rollout_devices < 1 or self.train_devices < 1:
      raise ValueError("rollout_devices and train_devices must be >= 1.")
    if self.platform not in ("cpu", "gpu", "tpu"):
      raise ValueError(f"platform must be cpu, gpu or tpu, got {self.platform!r}.")
    if self.share_accelerators and self.platform == "cpu":
      raise ValueError("share_accelerators is for GPUs; on CPU, sync mode shares the cores.")
    if self.share_accelerators and self.platform == "tpu":
      raise ValueError("share_accelerators is for GPUs: a TPU chip is opened by one process at a "
                       "time, so the servers and the trainer cannot share it; give them disjoint "
                       "chips (rollout_devices + train_devices).")

  def cpu_split(self, available: list[int]) -> tuple[list[int], list[int]]:
    """(rollout cores, trainer cores); overlapping only when the machine is too small."""
    need = self.rollout_devices + self.train_devices
    if need <= len(available):
      return available[:self.rollout_devices], available[self.rollout_devices:need]
    if self.rollout_devices > len(available) or self.train_devices > len(available):
      raise ValueError(f"resource split {self.rollout_devices}+{self.train_devices} needs more "
                       f"than the {len(available)} cores available.")
    return available[:self.rollout_devices], available[-self.train_devices:]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Where prompts come from, and how responses are rewarded: exactly one of

  `synthetic` (long-tail generators, exact-match reward), `dataset` (a JSONL/Parquet file, math-verify
  reward), `reasoning_gym` (reasoning-gym generators, their own scorers), `code` (procedural
  write-a-function tasks with hidden tests, the sandboxed code reward) or `env` (a multi-turn
  environment: prompt `i` is the level with seed `(seed, i)`, an episode's reward comes from the
  environment). `reward` defaults to the task's natural one; `seed` seeds the synthetic stream, the
  code tasks and the environment levels (reasoning-gym and dataset files have their own).
  `sandbox` and `adaptive_timeout` are the code reward's limits (`code` tasks, or a dataset file
  with `reward='code'`); None for `adaptive_timeout` is the sandbox's fixed limit.
  """

  synthetic: envs.SyntheticConfig | None = None
  dataset: envs.DatasetFileConfig | None = None
  reasoning_gym: envs.ReasoningGymConfig | None = None
  code: envs.CodeTaskConfig | None = None
  env: envs.EnvConfig | None = None
  reward: envs.RewardKind | None = None
  seed: int = 0
  sandbox: envs.SandboxConfig = envs.SandboxConfig()
  adaptive_timeout: envs.AdaptiveTimeoutConfig | None = envs.AdaptiveTimeoutConfig()

  def __post_init__(self):
    kinds = (self.synthetic, self.dataset, self.reasoning_gym, self.code, self.env)
    if sum(x is not None for x in kinds) != 1:
      raise ValueError("TaskConfig needs exactly one of `synthetic`, `dataset`, `reasoning_gym`, "
                       "`code` or `env`.")
    natural = (envs.RewardKind.MATH if self.dataset is not None else
               envs.RewardKind.REASONING_GYM if self.reasoning_gym is not None else
               envs.RewardKind.CODE if self.code is not None else
               envs.RewardKind.EXACT_MATCH)  # synthetic; unused by env tasks
    reward = natural if self.reward is None else parse_enum(envs.RewardKind, self.reward, "reward")
    if (reward is envs.RewardKind.REASONING_GYM) != (self.reasoning_gym is not None):
      raise ValueError("a reasoning_gym task is scored by reasoning-gym (reward='reasoning_gym'), "
                       "and that reward needs a reasoning_gym task.")
    if self.code is not None and reward is not envs.RewardKind.CODE:
      raise ValueError("code tasks are scored by running their hidden tests (reward='code').")
    object.__setattr__(self, "reward", reward)

  def reward_config(self) -> envs.RewardConfig:
    return envs.RewardConfig(kind=self.reward, reasoning_gym=self.reasoning_gym,
                             sandbox=self.sandbox, adaptive_timeout=self.adaptive_timeout)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One RL run. α (`async_ratio`) bounds staleness per sample: t - v <= α."""

  model_path: str
  workdir: str
  task: TaskConfig
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  resources: ResourceConfig = dataclasses.field(default_factory=ResourceConfig)
  mode: Mode = Mode.ASYNC
  async_ratio: int = 2
  agentic: AgenticConfig = dataclasses.field(default_factory=AgenticConfig)  # with `task.env`
  steps: int = 20
  batch_size: int = 8  # B: prompt groups per training step
  group_size: int = 4  # n: responses per prompt (prompt replication)
  dynamic_filter: bool = False  # drop groups whose rewards are all equal, over-sample to refill
  mesh: str = "data:1,fsdp:1,tensor:1"
  seed: int = 0
  # Steps between checkpoints (and at the end): a killed run resumes losing at most this many
  # steps of work. 0 = only at the end.
  checkpoint_every: int = 5
  keep_checkpoints: int = 2
  keep_versions: int = 4
  plot: bool = True
  eval_every: int = 5  # steps between exact expected-accuracy evaluations (exact-match tasks); 0 = off
  eval_samples: int = 256
  # Compile the train step for every micro-batch count before step 1 (benchmarks: no compile
  # inside the timed steps; costs start-up time when most counts never occur).
  precompile: bool = False
  # The trainer runs in a process of its own (`LearnerProcess`): sharing the controller's
  # interpreter, its step waited for the GIL behind the event loop (3x slower in async runs).
  # Off: in this process (debugging; a multi-process run's process 0 always trains in-process).
  learner_process: bool = True

  def __post_init__(self):
    object.__setattr__(self, "mode", parse_enum(Mode, self.mode, "mode"))
    if self.steps < 1 or self.batch_size < 1 or self.group_size < 1:
      raise ValueError("steps, batch_size and group_size must be >= 1.")
    if self.async_ratio < 0:
      raise ValueError(f"async_ratio must be >= 0, got {self.async_ratio}.")
    if self.mode is Mode.SYNC and self.async_ratio != 0:
      raise ValueError(f"--mode=sync is strictly on-policy; --async_ratio={self.async_ratio} "
                       "contradicts it (use --mode=async, or --async_ratio=0).")
    if abs(self.train.temperature - self.rollout.temperature) > 1e-9:
      raise ValueError(f"trainer temperature {self.train.temperature} != rollout temperature "
                       f"{self.rollout.temperature}: behaviour log-probs would not be comparable.")
    if not self.model_path:
      raise ValueError("model_path is required (an HF directory).")
    self.agentic.validate(self.batch_size, self.group_size)
    if self.agentic.policy is AgentPolicy.OPENAI and (self.task.env is None
                                                     or self.mode is not Mode.ASYNC):
      raise ValueError("agentic.policy=openai (agent code through the OpenAI API) needs an "
                       "environment task and --mode=async (agent code has no turn barrier for "
                       "the lock-step baseline).")

  @property
  def samples_per_step(self) -> int:
    return self.batch_size * self.group_size

  def replace(self, **changes) -> "RunConfig":
    return dataclasses.replace(self, **changes)

  def resolved_workdir(self) -> str:
    return os.path.abspath(self.workdir)


def config_to_json(config: Any) -> Any:
  """A config tree as JSON values (enums by value); `config_from_json` inverts it for a RunConfig."""
  if dataclasses.is_dataclass(config):
    return {f.name: config_to_json(getattr(config, f.name)) for f in dataclasses.fields(config)}
  if isinstance(config, enum.Enum):
    return config.value
  if isinstance(config, (list, tuple)):
    return [config_to_json(v) for v in config]
  return config


def config_from_json(data: dict[str, Any]) -> RunConfig:
  """The RunConfig that `config_to_json` wrote: every field set through the one override path (a
  dict for a config-typed field is a whole new value of it), onto a placeholder naming each."""
  base = RunConfig(model_path=data["model_path"], workdir=data["workdir"],
                   task=TaskConfig(synthetic=envs.SyntheticConfig()))
  return apply_overrides(base, data)
