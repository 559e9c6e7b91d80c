"""A recording OpenAI endpoint on the controller, for agent code trained as an RL policy.

Why a proxy instead of pointing agent code at a rollout server: agent code (anything written against
`openai.AsyncOpenAI(...).chat.completions.create`) knows nothing of training, yet every token it is
given must be recorded with its behaviour log-prob and weight version, survive a weight handoff (an
abort-mode pause must not hand the agent a cut-off reply), and respect the staleness bound. So each
episode gets its own base URL, `{proxy}/episodes/{key}/v1`; a chat request there is rendered with the
model directory's chat template (as the servers and transformers render it), tokenized, and
generated through the `Fleet` with the native protocol (least-loaded server, retries, continuation
across aborts, per-token weight versions), exactly like the controller's own episodes. The turn is
recorded under the episode's key and answered in OpenAI's shape, with SGLang's extra fields
(`token_ids`, `prompt_token_ids`, `meta_info.weight_version`) too.

The run's sampling wins over the agent's: the behaviour log-probs must be those of the trainer's
temperature and top-p, so an agent's `temperature`/`top_p` are ignored (and counted); its
`max_tokens` is honoured within the turn budget and the training row's room.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Callable

from aiohttp import web

from flashrl_jax.fleet import (FinishKind, Fleet, GenerationError, RequestRejected,
                               SamplingParams, free_port)
from flashrl_jax.rollout import ChatTemplate, TemplateError, parse_tool_calls

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Turn:
  """One chat completion of an episode, as the policy produced it."""

  prompt_ids: tuple[int, ...]
  output_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  versions: tuple[int, ...]  # policy version of each output token
  published: int  # the policy version published when the turn started


class Recording:
  """The turns of one episode, and how much room its training row has left."""

  def __init__(self, room: Callable[[list[Turn], list[int]], int]):
    self.turns: list[Turn] = []
    self.room = room  # (turns so far, next prompt) -> tokens the next turn may generate
    self.ignored_sampling = 0  # requests whose temperature/top_p the run's sampling overrode
    self.texts: list[str] = []  # each turn's rendered prompt text
    self.replies: list[tuple[str, tuple[int, ...]]] = []  # each turn's reply text and its ids
    self.errors: list[str] = []  # generation failures the agent was told about (HTTP 5xx)


def _version(v: str, fallback: int) -> int:
  try:
    return int(v)
  except (TypeError, ValueError):
    return fallback


class AgentProxy:
  """`async with AgentProxy(...)`; `open(key)` gives an episode its base URL, `close(key)` its turns."""

  def __init__(self, fleet: Fleet, tokenizer, template: ChatTemplate, sampling: SamplingParams,
               *, model_name: str = "policy"):
    self.fleet, self.tokenizer, self.template = fleet, tokenizer, template
    self.sampling, self.model_name = sampling, model_name
    self._episodes: dict[str, Recording] = {}
    self._runner: web.AppRunner | None = None
    self.url = ""

  async def __aenter__(self) -> AgentProxy:
    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/episodes/{key}/v1/chat/completions", self._chat)
    app.router.add_get("/episodes/{key}/v1/models", self._models)
    self._runner = web.AppRunner(app, access_log=None)
    await self._runner.setup()
    port = free_port()
    await web.TCPSite(self._runner, "127.0.0.1", port).start()
    self.url = f"http://127.0.0.1:{port}"
    return self

  async def __aexit__(self, *exc) -> None:
    if self._runner is not None:
      await self._runner.cleanup()

  def open(self, room: Callable[[list[Turn], list[int]], int]) -> tuple[str, Recording]:
    """A fresh episode: (its OpenAI base URL, its recording)."""
    key = uuid.uuid4().hex
    self._episodes[key] = Recording(room)
    return f"{self.url}/episodes/{key}/v1", self._episodes[key]

  def close(self, base_url: str) -> None:
    self._episodes.pop(base_url.rstrip("/").split("/")[-2], None)

  # --- routes --------------------------------------------------------------------------------------

  async def _models(self, request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "owned_by": "flashrl_jax"}]})

  async def _chat(self, request: web.Request) -> web.Response:
    recording = self._episodes.get(request.match_info["key"])
    if recording is None:
      return _error("no such episode (it has ended).", 404)
    try:
      body = json.loads(await request.read())
      text, prompt = self._prompt(body, recording)
    except (ValueError, TemplateError) as e:
      return _error(str(e))
    if body.get("stream"):
      return _error("stream=true is not supported by the training proxy.")
    if body.get("n", 1) != 1:
      return _error("n must be 1 (each call is one turn of one episode).")
    if body.get("temperature") is not None or body.get("top_p") is not None:
      recording.ignored_sampling += 1
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    budget = min(recording.room(recording.turns, prompt), self.sampling.max_new_tokens,
                 asked if isinstance(asked, int) and asked > 0 else self.sampling.max_new_tokens)
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    published = self.fleet.version
    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    finish = "length"
    if budget > 0:
      sampling = dataclasses.replace(self.sampling, max_new_tokens=budget, stop=stop)
      try:
        result = await self.fleet.generate(prompt, sampling)
      except RequestRejected as e:
        return _error(str(e))
      except GenerationError as e:
        recording.errors.append(str(e))
        return _error(f"generation failed: {e}", 503)
      ids, logprobs = result.output_ids, result.output_logprobs
      versions = tuple(_version(v, published) for v in result.token_versions)
      finish = "stop" if result.finish_reason is FinishKind.STOP else "length"
    answer, reply = self._answer(body, prompt, ids, logprobs, versions, finish)
    recording.turns.append(Turn(tuple(prompt), ids, logprobs, versions, published))
    recording.texts.append(text)
    recording.replies.append(reply)
    return web.json_response(answer)

  def _prompt(self, body: dict, recording: Recording) -> tuple[str, list[int]]:
    """The rendered prompt text and its token ids, token-in-token-out across turns.

    When the conversation continues the last turn (its text starts with that turn's prompt text
    and the reply as sent), the ids are that turn's prompt ids + the reply's exact generated ids +
    the rest re-tokenized: ids a text round trip would lose or change (ids past the tokenizer's
    vocabulary, merges that tokenize differently) stay as generated, so turns chain.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise ValueError("messages must be a non-empty list.")
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    text = self.template.render(messages, tools=tools, add_generation_prompt=True,
                                **(body.get("chat_template_kwargs") or {}))
    if recording.turns:
      last = recording.turns[-1]
      reply_text, reply_ids = recording.replies[-1]
      head = recording.texts[-1] + reply_text
      if text.startswith(head):
        return text, list(last.prompt_ids) + list(reply_ids) + self.tokenizer.encode(
            text[len(head):])
    return text, self.tokenizer.encode(text)

  def _answer(self, body, prompt, ids, logprobs, versions, finish
              ) -> tuple[dict[str, Any], tuple[str, tuple[int, ...]]]:
    """The OpenAI response, and the reply's (text, ids) as the next prompt will contain them."""
    # The reply keeps special tokens, but not a final stop token (the template writes the turn's
    # own end marker after the content).
    shown = list(ids)
    if finish == "stop" and shown and shown[-1] in self.sampling.stop_token_ids:
      shown = shown[:-1]
    text = self.tokenizer.decode(shown, skip_special_tokens=False)
    content, calls = parse_tool_calls(text) if body.get("tools") else (text, [])
    version = str(versions[-1]) if versions else str(self.fleet.version)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": self.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content,
                                             "tool_calls": calls or None},
                     "logprobs": None, "finish_reason": "tool_calls" if calls else finish,
                     "token_ids": list(ids), "prompt_token_ids": list(prompt),
                     "meta_info": {"weight_version": version,
                                   "output_token_logprobs": [[lp, t, None] for lp, t
                                                             in zip(logprobs, ids)]}}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                  "total_tokens": len(prompt) + len(ids)},
        "metadata": {"weight_version": version}}, (text, tuple(shown))


def _error(message: str, status: int = 400) -> web.Response:
  return web.json_response({"object": "error", "message": message, "type": "BadRequestError",
                            "param": None, "code": status}, status=status)
