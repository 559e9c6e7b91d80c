"""The per-sample rollout lifecycle: a prompt's n responses, each scored on completion.

Prompt replication (the default): a prompt's `n` responses are `n` separate requests, which the
client spreads over servers least-loaded first, and each is rewarded as soon as it is back (rewards
overlap generation). Without it a prompt's responses are one request (`Fleet.generate_group`): one
HTTP round trip, one admission and one batched prefill for the group instead of `n` of each, on the
controller's core and the server's (on a CPU that per-request work is a large part of a short
response's cost), with the group's responses on one server, rewarded when the group is back. The
synchronous baseline uses the same code with scoring deferred until every response of the batch is
back.
"""

from __future__ import annotations

import asyncio
import time

from flashrl_jax import envs
from flashrl_jax.controller._samples import Group, Response
from flashrl_jax.fleet import Fleet, GenerationResult, SamplingParams


def _version(v: str, fallback: int) -> int:
  try:
    return int(v)
  except (TypeError, ValueError):
    return fallback


class GroupRunner:
  """Plays prompt groups of a single-turn task on the fleet; `EnvGroupRunner` is its multi-turn twin
  (`new_group`, `run`, `report`)."""

  def __init__(self, fleet: Fleet, reward_fn: envs.AsyncRewardFn, tokenizer,
               sampling: SamplingParams, group_size: int, *, prompt_replication: bool = True):
    self.fleet, self.reward_fn, self.tokenizer = fleet, reward_fn, tokenizer
    self.sampling, self.group_size = sampling, group_size
    self.prompt_replication = prompt_replication

  def new_group(self, index: int, sample: envs.Sample) -> Group:
    return Group(prompt_index=index, sample=sample, prompt_ids=self.tokenizer.encode(sample.prompt),
                 n=self.group_size, dispatched_version=self.fleet.version)

  def report(self) -> dict[str, float]:
    """Per-step metrics of the rollout itself (none for single-turn tasks)."""
    return {}

  async def run(self, group: Group, *, score: bool = True) -> Group:
    """Generates (and, with `score`, rewards) every response of `group`."""
    if self.prompt_replication or group.n == 1:
      await asyncio.gather(*(self._one(group, j, score) for j in range(group.n)))
    else:
      await self._together(group, score)
    return group

  async def score(self, group: Group) -> Group:
    await asyncio.gather(*(self._reward(group, r) for r in group.responses))
    return group

  async def _one(self, group: Group, replica: int, score: bool) -> None:
    dispatched = self.fleet.version
    start = time.perf_counter()
    result: GenerationResult = await self.fleet.generate(
        group.prompt_ids, self.sampling, rid=f"p{group.prompt_index}-r{replica}-{id(group):x}")
    response = self._response(group, replica, result, dispatched, start)
    if score:
      await self._reward(group, response)
    group.responses.append(response)

  async def _together(self, group: Group, score: bool) -> None:
    dispatched = self.fleet.version
    start = time.perf_counter()
    results = await self.fleet.generate_group(group.prompt_ids, self.sampling, group.n,
                                              rid=f"p{group.prompt_index}-{id(group):x}")
    group.responses.extend(self._response(group, j, r, dispatched, start)
                           for j, r in enumerate(results))
    if score:
      await self.score(group)

  def _response(self, group: Group, replica: int, result: GenerationResult, dispatched: int,
                start: float) -> Response:
    versions = [_version(v, dispatched) for v in result.token_versions]
    return Response(
        sample_id=str(group.prompt_index * self.group_size + replica),
        output_ids=list(result.output_ids), behavior_logp=list(result.output_logprobs),
        token_versions=versions, start_version=min([dispatched] + versions[:1]),
        finish_reason=result.finish_reason.value if result.finish_reason else "unknown",
        generate_s=time.perf_counter() - start)

  async def _reward(self, group: Group, response: Response) -> None:
    text = self.tokenizer.decode(response.output_ids)
    result = await self.reward_fn(group.sample.prompt, text, group.sample)
    response.reward, response.reward_info = float(result.reward), dict(result.info)
