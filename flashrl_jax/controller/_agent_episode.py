"""An episode whose policy is ordinary agent code talking to the model through the OpenAI API.

The agent (`chat_agent` here, or any coroutine `agent(base_url, env, seed)`) gets a base URL of the
controller's `AgentProxy` and an environment; it calls `chat.completions.create(...)` as it would
against any OpenAI-compatible server. The proxy records every turn (prompt ids, output ids,
behaviour log-probs, per-token weight versions); afterwards the turns are assembled into one
training sample, as the controller's own episodes are: prompt = the first turn's prompt, response =
the model's tokens (trained) interleaved with what the conversation added between turns (the
environment's observations, the template's turn markers: `response_mask` False, not trained).

Turn k+1's prompt must extend turn k's prompt + output token for token (the proxy's replies are
built so that re-rendering them gives back the generated tokens); if an agent edits its history so
that it does not, the sample ends at the last turn that does (counted as `prefix_break`). The reward
is the sum of the environment's step rewards, read by the controller's own wrapper around the
environment, not taken from the agent. Environment failures and time-outs drop the episode as for
the controller's own episodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable

import openai

from flashrl_jax import envs
from flashrl_jax.controller._agent_proxy import AgentProxy, Turn
from flashrl_jax.controller._agentic_config import ID_STRIDE, DropCause
from flashrl_jax.controller._agentic_episode import (EpisodeDeps, EpisodeDropped, level_turns,
                                                     noise_seed)
from flashrl_jax.controller._samples import Group, Response

# An agent: (OpenAI base URL, environment, reset seed) -> anything; it plays one episode.
AgentFn = Callable[[str, envs.AsyncEnvironment, int], Awaitable[object]]


async def chat_agent(base_url: str, env: envs.AsyncEnvironment, seed: int, *,
                     max_tokens: int = 16) -> float:
  """Plain agent code: the observation as the user's message, the reply as the action."""
  client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
  try:
    messages = [{"role": "user", "content": await env.areset(seed)}]
    total = 0.0
    while True:
      reply = await client.chat.completions.create(model="policy", messages=messages,
                                                   max_tokens=max_tokens)
      action = reply.choices[0].message.content or ""
      messages.append({"role": "assistant", "content": action})
      step = await env.astep(action)
      total += step.reward
      if step.done:
        return total
      messages.append({"role": "user", "content": step.observation})
  finally:
    await client.close()


class _WatchedEnv:
  """The environment as the agent sees it: time limits, latency stats, the reward ledger."""

  def __init__(self, env: envs.AsyncEnvironment, deps: EpisodeDeps, sample_id: int,
               max_turns: int | None):
    self.env, self.deps, self.sample_id = env, deps, sample_id
    self.max_turns = max_turns  # the level's turn budget: the episode ends there, as for `Episode`
    self.reward, self.steps, self.success, self.done = 0.0, 0, False, False

  async def _guard(self, call):
    timeout = self.deps.step_timeout_s or None
    try:
      return await asyncio.wait_for(call, timeout)
    except TimeoutError:
      raise EpisodeDropped(DropCause.ENV_TIMEOUT, f"episode {self.sample_id}: env call took "
                           f"longer than {timeout}s") from None
    except Exception as error:  # noqa: BLE001 - any environment crash drops only this episode
      raise EpisodeDropped(DropCause.ENV_FAILURE, f"episode {self.sample_id}: {error!r}") from None

  async def areset(self, seed: int) -> str:
    return await self._guard(self.env.areset(seed))

  async def astep(self, action: str) -> envs.StepResult:
    start = time.perf_counter()
    result = await self._guard(self.env.astep(action))
    self.deps.stats.env_step(time.perf_counter() - start)
    self.steps += 1
    self.reward += float(result.reward)
    self.success = self.success or bool(result.info.get("success", False))
    if not result.done and self.max_turns is not None and self.steps >= self.max_turns:
      result = dataclasses.replace(result, done=True, info={**result.info, "truncated": True})
    self.done = self.done or bool(result.done)
    return result


class AgentEpisode:
  """Candidate `candidate` of `group`, played by `agent` through `proxy`."""

  def __init__(self, deps: EpisodeDeps, group: Group, candidate: int, level_seed: int,
               proxy: AgentProxy, agent: AgentFn):
    self.deps, self.group, self.candidate = deps, group, candidate
    self.proxy, self.agent = proxy, agent
    self.sample_id = group.prompt_index * ID_STRIDE + candidate
    self.env = _WatchedEnv(deps.make_env(level_seed, candidate), deps, self.sample_id,
                           level_turns(deps.turn_budget, level_seed))
    self._seed = noise_seed(level_seed, candidate)

  def _room(self, turns: list[Turn], prompt: list[int]) -> int:
    """Tokens the next turn may generate so that the whole sample fits one training row."""
    first = len(turns[0].prompt_ids) if turns else len(prompt)
    used = len(prompt) - first  # response so far, observations included (if turns chain)
    return max(0, min(self.deps.max_response_length, self.deps.row_length - first) - used)

  async def play(self) -> Response:
    base_url, recording = self.proxy.open(self._room)
    try:
      await self.agent(base_url, self.env, self._seed)
    except EpisodeDropped:
      raise
    except openai.APIStatusError as error:
      cause = DropCause.GENERATION if error.status_code >= 500 else DropCause.REJECTED
      raise EpisodeDropped(cause, f"episode {self.sample_id}: {error}") from None
    except openai.APIError as error:
      raise EpisodeDropped(DropCause.GENERATION, f"episode {self.sample_id}: {error}") from None
    finally:
      self.proxy.close(base_url)
    if not recording.turns or not recording.turns[0].output_ids:
      raise EpisodeDropped(DropCause.REJECTED, f"episode {self.sample_id}: the agent got no "
                           "tokens (its first prompt leaves no room to answer)")
    return self._response(recording.turns, recording.ignored_sampling)

  def _response(self, turns: list[Turn], ignored_sampling: int) -> Response:
    prompt = list(turns[0].prompt_ids)
    if not self.group.prompt_ids:  # the first candidate to finish sets the group's prompt
      self.group.prompt_ids = prompt
    elif prompt != self.group.prompt_ids:
      raise ValueError(f"candidates of group {self.group.prompt_index} started from different "
                       "prompts")
    ids, logp, versions, mask = [], [], [], []
    full, kept, finish = list(prompt), 0, "done" if self.env.done else "agent_stopped"
    for turn in turns:
      if kept:
        if list(turn.prompt_ids[:len(full)]) != full:
          finish = "prefix_break"  # the agent rewrote its history: keep the turns that chain
          break
        between = list(turn.prompt_ids[len(full):])
        ids += between
        logp += [0.0] * len(between)
        versions += [versions[-1] if versions else turn.published] * len(between)
        mask += [False] * len(between)
        full += between
      ids += turn.output_ids
      logp += turn.logprobs
      versions += turn.versions
      mask += [True] * len(turn.output_ids)
      full += turn.output_ids
      kept += 1
    first = turns[0]
    start = min([first.published] + list(first.versions[:1]))  # staleness from the first turn
    self.deps.stats.finished()
    return Response(
        sample_id=str(self.sample_id), output_ids=ids, behavior_logp=logp,
        token_versions=versions, start_version=start, finish_reason=finish,
        reward=self.env.reward,
        reward_info={"turns": kept, "success": self.env.success, "candidate": self.candidate,
                     "agent_calls": len(turns), "ignored_sampling": ignored_sampling},
        generate_s=0.0, response_mask=mask)
