"""One multi-turn episode of one environment worker, kept as one training sample.

The episode is a small state machine with three awaitable phases, `reset`, `act` (one model turn,
generated through the rollout client on the least-loaded server) and `observe` (one environment
step). The env-level async loop awaits them in a row per episode, each episode its own task; the
synchronous baseline awaits each phase for all episodes at once, with a barrier in between. Same
code, different scheduling, so the comparison between the two measures scheduling only.

The trajectory: prompt = the first observation; response = model turn tokens (trained, with their
behaviour log-probs and per-token policy versions) interleaved with the following observations'
tokens (`response_mask` False, log-prob 0, not trained). Reward = the sum of the environment's step
rewards. Staleness counts from the first turn: `start_version` is the policy version published when
the first turn started (or older, if a server still answered with older weights). A weight update in
the middle of a turn follows the pause mode: in abort mode the client continues the turn under the
new weights, and its tokens say which version produced them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol

import numpy as np

from flashrl_jax import envs
from flashrl_jax.controller._agentic_config import ID_STRIDE, DropCause
from flashrl_jax.controller._counters import EpisodeCounts
from flashrl_jax.controller._samples import Group, Response
from flashrl_jax.fleet import Fleet, GenerationError, RequestRejected, SamplingParams
from flashrl_jax.scheduling import LengthDistribution

log = logging.getLogger(__name__)


class EpisodeDropped(Exception):
  """An episode that cannot become training data; `cause` says why (counted by the caller)."""

  def __init__(self, cause: DropCause, detail: str):
    super().__init__(f"{cause.value}: {detail}")
    self.cause = cause


class EnvFactory(Protocol):
  """Makes candidate `candidate`'s environment worker for the level `level_seed`."""

  def __call__(self, level_seed: int, candidate: int) -> envs.AsyncEnvironment:
    ...


class FixedLevel:
  """An `Environment` that always resets to one level, whatever seed `reset` is given.

  `AsyncEnv` seeds its latency and failure noise from the reset seed. Candidates of a group play the
  same level but on independent workers, so their noise must differ: each worker is reset with its
  own noise seed while the level stays the group's.
  """

  def __init__(self, env: envs.Environment, level_seed: int):
    self.env, self.level_seed = env, level_seed

  def reset(self, seed: int) -> str:
    del seed
    return self.env.reset(self.level_seed)

  def step(self, action_text: str) -> envs.StepResult:
    return self.env.step(action_text)


def env_factory(config: envs.EnvConfig) -> EnvFactory:
  """Workers with the configured game, latency distribution and failure injection."""
  def make(level_seed: int, candidate: int) -> envs.AsyncEnvironment:
    del candidate
    return envs.AsyncEnv(FixedLevel(envs.make_env(config), level_seed), config.latency,
                         config.failure)
  return make


def noise_seed(level_seed: int, candidate: int) -> int:
  return int(np.random.SeedSequence([level_seed, candidate, 0x5EED]).generate_state(1)[0])


class AgenticStats:
  """Environment-step latencies (per reporting window) and episode counts (cumulative).

  The counts are the run's `Counters.episodes`, so they are checkpointed and restored with the run
  and logged as `total/episodes_...`.
  """

  def __init__(self, counts: EpisodeCounts | None = None):
    self.counts = counts if counts is not None else EpisodeCounts()
    self._latencies: list[float] = []

  def drop(self, cause: DropCause, count: int = 1) -> None:
    self.counts.dropped[cause] += count

  def finished(self) -> None:
    self.counts.finished += 1

  def env_step(self, seconds: float) -> None:
    self.counts.env_steps += 1
    self._latencies.append(seconds)

  def report(self) -> dict[str, float]:
    """Latency percentiles of the env steps since the last report (then starts a new window)."""
    lat, self._latencies = np.asarray(self._latencies), []
    if not lat.size:
      return {"env_step_s/count": 0}
    return {"env_step_s/count": int(lat.size), "env_step_s/p50": float(np.percentile(lat, 50)),
            "env_step_s/p90": float(np.percentile(lat, 90)), "env_step_s/max": float(lat.max()),
            "env_step_s/mean": float(lat.mean())}


@dataclasses.dataclass
class EpisodeDeps:
  """What every episode of a run shares."""

  fleet: Fleet  # generates each turn; `fleet.version` is the policy version published now
  tokenizer: object  # encode(str) -> list[int], decode(ids) -> str
  sampling: SamplingParams  # one turn; max_new_tokens is the turn budget
  make_env: EnvFactory
  stats: AgenticStats
  row_length: int  # prompt + response must fit one packed training row (and the server context)
  max_response_length: int
  step_timeout_s: float = 0.0  # 0: none
  turn_budget: LengthDistribution | None = None  # turns a level allows (None: the env's own)


def level_turns(budget: LengthDistribution | None, level_seed: int) -> int | None:
  """The turns level `level_seed` allows, drawn once from `budget` (the same for its candidates)."""
  if budget is None:
    return None
  return int(budget.sample(np.random.default_rng([level_seed, 0x7E57]), 1)[0])


class Episode:
  """Candidate `candidate` of `group`: reset, then act/observe until done."""

  def __init__(self, deps: EpisodeDeps, group: Group, candidate: int, level_seed: int):
    self.deps, self.group, self.candidate = deps, group, candidate
    self.sample_id = group.prompt_index * ID_STRIDE + candidate
    self.env = deps.make_env(level_seed, candidate)
    self._noise_seed = noise_seed(level_seed, candidate)
    self.max_turns = level_turns(deps.turn_budget, level_seed)
    self.ids: list[int] = []
    self.logp: list[float] = []
    self.versions: list[int] = []
    self.mask: list[bool] = []
    self.start_version: int | None = None
    self.reward = 0.0
    self.turns = 0
    self.done = False
    self.finish = "running"
    self.success = False
    self.generate_s = 0.0
    self._action = ""

  async def _env_call(self, call):
    timeout = self.deps.step_timeout_s or None
    try:
      return await asyncio.wait_for(call, timeout)
    except TimeoutError:
      raise EpisodeDropped(DropCause.ENV_TIMEOUT, f"episode {self.sample_id}: env call took "
                           f"longer than {timeout}s") from None
    except Exception as error:  # noqa: BLE001 - any environment crash drops only this episode
      raise EpisodeDropped(DropCause.ENV_FAILURE, f"episode {self.sample_id}: {error!r}") from None

  async def reset(self) -> None:
    observation = await self._env_call(self.env.areset(self._noise_seed))
    prompt = self.deps.tokenizer.encode(observation)
    if not self.group.prompt_ids:  # the first worker to come up sets the group's prompt
      self.group.prompt_ids = prompt
    elif prompt != self.group.prompt_ids:
      raise ValueError(f"candidates of group {self.group.prompt_index} got different levels")

  def _budget(self) -> int:
    room = min(self.deps.max_response_length, self.deps.row_length - len(self.group.prompt_ids))
    return room - len(self.ids)

  def _end(self, finish: str) -> None:
    self.done, self.finish = True, finish

  async def act(self) -> None:
    """One model turn on the least-loaded server (continued across an abort-mode weight update)."""
    budget = min(self._budget(), self.deps.sampling.max_new_tokens)
    if budget < 1:
      if not self.ids:
        raise EpisodeDropped(DropCause.REJECTED, f"episode {self.sample_id}: first observation "
                             f"({len(self.group.prompt_ids)} tokens) leaves no room to answer")
      self._end("context_full")
      return
    published = self.deps.fleet.version
    sampling = dataclasses.replace(self.deps.sampling, max_new_tokens=budget)
    start = time.perf_counter()
    try:
      result = await self.deps.fleet.generate(
          list(self.group.prompt_ids) + self.ids, sampling,
          rid=f"ep{self.sample_id}-t{self.turns}-{id(self):x}")
    except RequestRejected as error:
      raise EpisodeDropped(DropCause.REJECTED, str(error)) from None
    except GenerationError as error:
      raise EpisodeDropped(DropCause.GENERATION, str(error)) from None
    self.generate_s += time.perf_counter() - start
    versions = [_version(v, published) for v in result.token_versions]
    if self.start_version is None:  # staleness counts from the first turn
      self.start_version = min([published] + versions[:1])
    self.ids += result.output_ids
    self.logp += result.output_logprobs
    self.versions += versions
    self.mask += [True] * len(result.output_ids)
    self._action = self.deps.tokenizer.decode(result.output_ids)

  async def observe(self) -> None:
    """One environment step with the last turn's text; appends the observation (not trained)."""
    start = time.perf_counter()
    result = await self._env_call(self.env.astep(self._action))
    self.deps.stats.env_step(time.perf_counter() - start)
    self.turns += 1
    self.reward += float(result.reward)
    self.success = self.success or bool(result.info.get("success", False))
    if result.done:
      self._end("success" if self.success else
                "max_turns" if result.info.get("truncated") else "done")
      return
    if self.max_turns is not None and self.turns >= self.max_turns:
      self._end("max_turns")  # the level's own turn budget
      return
    obs = self.deps.tokenizer.encode(f"\n{result.observation}\n")
    if len(obs) >= self._budget():  # no room for the observation and one more turn
      self._end("context_full")
      return
    version = self.versions[-1] if self.versions else self.deps.fleet.version
    self.ids += obs
    self.logp += [0.0] * len(obs)
    self.versions += [version] * len(obs)
    self.mask += [False] * len(obs)

  async def play(self) -> Response:
    """The whole episode with no barrier: what each env-level async worker runs."""
    await self.reset()
    while True:
      await self.act()
      if self.done:
        break
      await self.observe()
      if self.done:
        break
    return self.response()

  def response(self) -> Response:
    self.deps.stats.finished()
    start = self.start_version if self.start_version is not None else \
        self.deps.fleet.version
    return Response(
        sample_id=str(self.sample_id), output_ids=list(self.ids), behavior_logp=list(self.logp),
        token_versions=list(self.versions), start_version=start, finish_reason=self.finish,
        reward=self.reward, reward_info={"turns": self.turns, "success": self.success,
                                         "candidate": self.candidate},
        generate_s=self.generate_s, response_mask=list(self.mask))


def _version(v: str, fallback: int) -> int:
  try:
    return int(v)
  except (TypeError, ValueError):
    return fallback
