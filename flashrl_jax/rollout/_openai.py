"""OpenAI-compatible routes on the rollout server: `/v1/completions` and `/v1/chat/completions`.

Why: agent code and agentic RL frameworks drive rollouts through the OpenAI client, and SGLang serves
this API beside its native one. Requests become the same `GenerateItem`s `/generate` runs (sampling
through `Sampling.from_json`, so neutral values and refusals are the native ones), so both APIs share
one engine path. Chat prompts are rendered with the model directory's own chat template
(`ChatTemplate`, as transformers renders it); `tools` and tool messages go through the template, and
Hermes-style `<tool_call>` blocks in the output come back as `tool_calls`.

For RL every choice also carries what training needs, under SGLang's and vLLM's names: `token_ids`
(the output tokens), `prompt_token_ids`, and `meta_info` (SGLang's: `weight_version`, the
`weight_versions` spans and the behaviour log-probs `output_token_logprobs`); the response's
`metadata.weight_version` is SGLang's too. They are always sent (the OpenAI client keeps unknown
fields), so agent code need not ask for them.

Requests are held to the native API's `Limits` (text length before tokenizing, `n`, samples, stop
strings), and parsed, rendered and tokenized on a worker thread, as `/generate` is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, Callable, Sequence

from aiohttp import web

from flashrl_jax.fleet import FinishKind
from flashrl_jax.rollout._chat import ChatTemplate, TemplateError, parse_tool_calls
from flashrl_jax.rollout._request import LogprobOptions, Output
from flashrl_jax.rollout._sampling import MAX_TOP_LOGPROBS, Sampling
from flashrl_jax.rollout._server import (_ARGS, _ENGINE, _LIMITS, _body, _decoder, _failure,
                                         _json, engine_outputs, served_model_name, sse_event,
                                         start_stream)
from flashrl_jax.rollout._wire import (BadRequest, GenerateItem, GenerateJob, Limits, check_samples,
                                       check_sampling, encode_text, output_json, output_text)

_TEMPLATE = web.AppKey("chat_template", dict)


def _error(message: str, status: int = 400, param: str | None = None) -> web.Response:
  """OpenAI's error body (SGLang's `ErrorResponse` shape, which the openai client reads)."""
  return _json({"object": "error", "message": message, "type": "BadRequestError",
                "param": param, "code": status}, status=status)


def _get(body: dict, key: str, check: Callable[[Any], bool], what: str, default: Any = None):
  value = body.get(key)
  if value is None:
    return default
  if not check(value):
    raise BadRequest(f"{key} must be {what}, got {value!r:.100}.")
  return value


_INT = lambda v: isinstance(v, int) and not isinstance(v, bool)
_BOOL = lambda v: isinstance(v, bool)


def _include_usage(body: dict) -> bool:
  """`stream_options.include_usage`; checked while parsing, before a stream starts."""
  options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
  return _get(options, "include_usage", _BOOL, "a boolean", False)


def _refuse(body: dict) -> None:
  """OpenAI fields this server cannot honour beyond their neutral values."""
  if body.get("echo"):
    raise BadRequest("echo=true is not supported by this server.")
  if body.get("suffix") is not None:
    raise BadRequest("suffix is not supported by this server.")
  best_of = body.get("best_of")
  if best_of is not None and best_of != body.get("n", 1):
    raise BadRequest("best_of (other than n) is not supported by this server.")
  response_format = body.get("response_format")
  if response_format is not None and response_format != {"type": "text"}:
    raise BadRequest("response_format other than text (constrained decoding) is not supported "
                     "by this server.")
  choice = body.get("tool_choice")
  if choice not in (None, "auto", "none"):
    raise BadRequest("tool_choice other than auto/none (forced calls need constrained decoding) "
                     "is not supported by this server.")


def _sampling(body: dict, max_tokens: int | None) -> Sampling:
  """OpenAI sampling fields (plus SGLang's extensions) as the native `sampling_params`."""
  params = {"max_new_tokens": max_tokens, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "stop": body.get("stop"),
            "sampling_seed": body.get("seed"), "min_new_tokens": body.get("min_tokens")}
  for key in ("top_k", "min_p", "stop_token_ids", "stop_regex", "ignore_eos",
              "skip_special_tokens", "no_stop_trim", "frequency_penalty", "presence_penalty",
              "repetition_penalty", "logit_bias", "regex", "ebnf", "json_schema", "custom_params"):
    params[key] = body.get(key)
  try:
    return Sampling.from_json({k: v for k, v in params.items() if v is not None})
  except ValueError as e:
    raise BadRequest(str(e)) from None


def _items(engine, prompts: Sequence[list[int]], sampling: Sampling, n: int,
           top_n: int, limits: Limits) -> list[GenerateItem]:
  """n samples of each prompt, prompt-major (choice index = prompt * n + sample). With a seed and
  n > 1, sample j uses seed + j so the choices differ yet stay reproducible."""
  if n > limits.max_n:
    raise BadRequest(f"n={n} is above this server's limit ({limits.max_n}).")
  check_samples(len(prompts) * n, limits)
  check_sampling(sampling, limits)
  options = LogprobOptions(top_n=top_n)
  items = []
  for prompt in prompts:
    group = uuid.uuid4().hex if n > 1 else None
    for j in range(n):
      s = sampling
      if n > 1 and sampling.sampling_seed is not None:
        s = dataclasses.replace(sampling, sampling_seed=sampling.sampling_seed + j)
      try:
        engine.validate(prompt, s, options)
      except ValueError as e:
        raise BadRequest(str(e)) from None
      items.append(GenerateItem(prompt, s, uuid.uuid4().hex, group, True, options))
  return items


def _finish_reason(out: Output, has_calls: bool = False) -> str | None:
  if out.finish is None:
    return None
  if has_calls:
    return "tool_calls"
  return {FinishKind.STOP: "stop", FinishKind.LENGTH: "length",
          FinishKind.ABORT: "abort"}[out.finish.kind]


def _matched(out: Output):
  return out.finish.matched if out.finish is not None and out.finish.kind is FinishKind.STOP \
      else None


def _rl_fields(out: Output, item: GenerateItem, job: GenerateJob) -> dict[str, Any]:
  """What RL needs from a choice, under SGLang's/vLLM's names (always sent)."""
  return {"token_ids": list(out.output_ids), "prompt_token_ids": list(out.prompt_ids),
          "meta_info": output_json(out, item, job, None)["meta_info"]}


def _usage(outs: Sequence[Output], items: Sequence[GenerateItem], n: int) -> dict[str, int]:
  prompt = sum(len(item.prompt_ids) for item in items[::n])
  completion = sum(len(o.output_ids) for o in outs)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


class _Texts:
  """Turns cumulative snapshots into text deltas. While running, the tail that could still be cut
  by a stop string (or is a half-decoded character) is held back, so sent text is never retracted."""

  def __init__(self, decode, items: Sequence[GenerateItem]):
    self._decode, self._items = decode, items
    self._sent = [""] * len(items)

  def delta(self, index: int, out: Output) -> str:
    item = self._items[index]
    if out.finish is not None:
      text = output_text(out, item.sampling, self._decode)
    else:
      text = self._decode(list(out.output_ids), item.sampling.skip_special_tokens)
      hold = max((len(s) for s in item.sampling.stop), default=0)
      text = text[:max(0, len(text) - hold)].rstrip("\ufffd")
    sent = self._sent[index]
    if len(text) <= len(sent):
      return ""
    self._sent[index] = text
    return text[len(sent):]


async def _collect(engine, items) -> list[Output] | web.Response:
  """Every sample's final output, or the error answer if some failed inside the engine."""
  final: dict[int, Output] = {}
  async for done in engine_outputs(engine, items, stream=False):
    final.update(done)
  outs = [final[i] for i in range(len(items))]
  return _failure(engine, outs) or outs


async def _send(response: web.StreamResponse, obj: Any) -> None:
  await response.write(sse_event(obj))


# --- /v1/completions ---------------------------------------------------------------------------------

def _completion_prompts(body: dict, encode, limits: Limits) -> list[list[int]]:
  prompt = body.get("prompt")
  is_int = lambda t: isinstance(t, int) and not isinstance(t, bool)
  if isinstance(prompt, str):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
    prompts = prompt
  elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
    return [list(prompt)]
  elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
        and all(is_int(t) for p in prompt for t in p)):
    return [list(p) for p in prompt]
  else:
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list "
                     "of such lists.")
  if encode is None:
    raise BadRequest("this server has no tokenizer; send the prompt as token ids.")
  check_samples(len(prompts), limits)
  return [encode_text(p, encode, limits) for p in prompts]


def _part(out: Output, new: slice) -> Output:
  """The tokens of `out` in `new` (a stream chunk's), with their log-probs and top candidates."""
  return dataclasses.replace(out, output_ids=out.output_ids[new], logprobs=out.logprobs[new],
                             output_top=out.output_top[new])


def _completion_logprobs(out: Output, top_n: int, token: Callable[[int], str]) -> dict[str, Any]:
  tokens = [token(t) for t in out.output_ids]
  offsets, at = [], 0
  for t in tokens:
    offsets.append(at)
    at += len(t)
  tops = [{token(t): lp for t, lp in row} for row in out.output_top] if top_n else None
  return {"tokens": tokens, "token_logprobs": list(out.logprobs), "top_logprobs": tops,
          "text_offset": offsets}


def _parse_completion(app: web.Application, body: dict) -> tuple:
  engine, limits = app[_ENGINE], app[_LIMITS]
  _refuse(body)
  prompts = _completion_prompts(
      body, engine.tokenizer.encode if engine.tokenizer is not None else None, limits)
  n = _get(body, "n", lambda v: _INT(v) and v >= 1, "an integer >= 1", 1)
  top_n = _get(body, "logprobs", lambda v: _INT(v) and 0 <= v <= MAX_TOP_LOGPROBS,
               f"an integer in [0, {MAX_TOP_LOGPROBS}]")
  stream = _get(body, "stream", _BOOL, "a boolean", False)
  _include_usage(body)
  sampling = _sampling(body, _get(body, "max_tokens", _INT, "an integer", 16))
  return n, top_n, stream, _items(engine, prompts, sampling, n, top_n or 0, limits)


async def completions(request: web.Request) -> web.StreamResponse:
  engine = request.app[_ENGINE]
  try:
    body = await _body(request)
    n, top_n, stream, items = await asyncio.to_thread(_parse_completion, request.app, body)
  except BadRequest as e:
    return _error(str(e), e.status)
  decode = _decoder(engine)
  token = lambda t: decode([t], False) if decode else ""
  job = GenerateJob(items, True, False, stream)
  rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), served_model_name(request.app)
  head = {"id": rid, "object": "text_completion", "created": created, "model": model}

  def choice(i: int, out: Output, text: str, new: slice = slice(None)) -> dict[str, Any]:
    return {"index": i, "text": text,
            "logprobs": _completion_logprobs(_part(out, new), top_n, token)
                        if top_n is not None else None,
            "finish_reason": _finish_reason(out), "matched_stop": _matched(out),
            **(_rl_fields(out, items[i], job) if out.finish is not None else {})}

  if not stream:
    try:
      outs = await _collect(engine, items)
    except BadRequest as e:
      return _error(str(e), e.status)
    if isinstance(outs, web.Response):
      return outs
    texts = [output_text(o, it.sampling, decode) if decode else "" for o, it in zip(outs, items)]
    return _json({**head, "choices": [choice(i, o, t) for i, (o, t)
                                                  in enumerate(zip(outs, texts))],
                              "usage": _usage(outs, items, n),
                              "metadata": {"weight_version": outs[0].weight_version}})
  return await _stream_completions(request, engine, items, n, head, choice, body, decode)


async def _stream_completions(request, engine, items, n, head, choice, body, decode):
  texts = _Texts(decode or (lambda ids, skip=True: ""), items)
  outputs = engine_outputs(engine, items, stream=True)
  final: dict[int, Output] = {}
  sent_tokens = [0] * len(items)
  try:
    try:
      first = await outputs.__anext__()
    except BadRequest as e:
      return _error(str(e), e.status)
    response = await start_stream(request)

    async def every():
      yield first
      async for latest in outputs:
        yield latest

    async for latest in every():
      for i, out in sorted(latest.items()):
        if out.error is not None:  # as the native stream: an error object, then the end
          await _send(response, {"error": {"message": f"sample failed in the engine: {out.error}"}})
          final[i] = out
          continue
        delta = texts.delta(i, out)
        if delta or out.finish is not None:
          new = slice(sent_tokens[i], len(out.output_ids))
          sent_tokens[i] = len(out.output_ids)
          await _send(response, {**head, "choices": [choice(i, out, delta, new)]})
        if out.finish is not None:
          final[i] = out
    if _include_usage(body):
      outs = [final[i] for i in range(len(items))]
      await _send(response, {**head, "choices": [], "usage": _usage(outs, items, n)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
  finally:
    await outputs.aclose()


# --- /v1/chat/completions ----------------------------------------------------------------------------

def _template(app: web.Application) -> ChatTemplate:
  cache = app[_TEMPLATE]
  if "template" not in cache:
    engine = app[_ENGINE]
    path = app[_ARGS].get("tokenizer_path") or engine.config.model_path
    try:
      cache["template"] = ChatTemplate.from_model_dir(path)
    except (TemplateError, OSError, ValueError) as e:
      cache["template"] = e
  template = cache["template"]
  if template is None:
    raise BadRequest("this model has no chat template (tokenizer_config.json chat_template); use "
                     "/v1/completions.")
  if isinstance(template, Exception):
    raise BadRequest(f"this model's chat template cannot be used: {template}")
  return template


def _chat_prompt(app: web.Application, body: dict) -> list[int]:
  engine = app[_ENGINE]
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
    raise BadRequest("messages must be a non-empty list of objects with a role.")
  ids = body.get("input_ids")  # SGLang's extension: pre-computed prompt ids bypass the template
  if ids is not None:
    if not isinstance(ids, list) or not ids or not all(_INT(t) for t in ids):
      raise BadRequest("input_ids must be a non-empty list of token ids.")
    return list(ids)
  if engine.tokenizer is None:
    raise BadRequest("this server has no tokenizer; send input_ids.")
  kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
  tools = _get(body, "tools", lambda v: isinstance(v, list), "a list")
  if body.get("tool_choice") == "none":
    tools = None
  try:
    text = _template(app).render(
        messages, tools=tools,
        add_generation_prompt=_get(body, "add_generation_prompt", _BOOL, "a boolean", True),
        continue_final_message=_get(body, "continue_final_message", _BOOL, "a boolean", False),
        **kwargs)
  except TemplateError as e:
    raise BadRequest(str(e)) from None
  return encode_text(text, engine.tokenizer.encode, app[_LIMITS])


def _chat_logprobs(out: Output, top_n: int, token: Callable[[int], str]) -> dict[str, Any]:
  entry = lambda t, lp: {"token": token(t), "bytes": list(token(t).encode()), "logprob": lp}
  tops = out.output_top if top_n else [()] * len(out.output_ids)
  return {"content": [{**entry(t, lp), "top_logprobs": [entry(c, clp) for c, clp in row]}
                      for t, lp, row in zip(out.output_ids, out.logprobs, tops)]}


def _parse_chat(app: web.Application, body: dict) -> tuple:
  _refuse(body)
  prompt = _chat_prompt(app, body)
  n = _get(body, "n", lambda v: _INT(v) and v >= 1, "an integer >= 1", 1)
  want_logprobs = _get(body, "logprobs", _BOOL, "a boolean", False)
  top_n = _get(body, "top_logprobs", lambda v: _INT(v) and 0 <= v <= MAX_TOP_LOGPROBS,
               f"an integer in [0, {MAX_TOP_LOGPROBS}]", 0)
  stream = _get(body, "stream", _BOOL, "a boolean", False)
  _include_usage(body)
  max_tokens = _get(body, "max_completion_tokens", _INT, "an integer")
  if max_tokens is None:
    max_tokens = _get(body, "max_tokens", _INT, "an integer")
  items = _items(app[_ENGINE], [prompt], _sampling(body, max_tokens), n,
                 top_n if want_logprobs else 0, app[_LIMITS])
  return n, want_logprobs, top_n, stream, items


async def chat_completions(request: web.Request) -> web.StreamResponse:
  engine = request.app[_ENGINE]
  try:
    body = await _body(request)
    n, want_logprobs, top_n, stream, items = await asyncio.to_thread(_parse_chat, request.app,
                                                                     body)
  except BadRequest as e:
    return _error(str(e), e.status)
  parse_calls = bool(body.get("tools")) and body.get("tool_choice") != "none"
  decode = _decoder(engine)
  token = lambda t: decode([t], False) if decode else ""
  job = GenerateJob(items, True, False, stream)
  head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
          "model": served_model_name(request.app)}

  def message(out: Output, text: str) -> tuple[dict[str, Any], bool]:
    content, calls = parse_tool_calls(text) if parse_calls else (text, [])
    return {"role": "assistant", "content": content, "tool_calls": calls or None,
            "reasoning_content": None}, bool(calls)

  if not stream:
    try:
      outs = await _collect(engine, items)
    except BadRequest as e:
      return _error(str(e), e.status)
    if isinstance(outs, web.Response):
      return outs
    choices = []
    for i, (out, item) in enumerate(zip(outs, items)):
      msg, has_calls = message(out, output_text(out, item.sampling, decode))
      choices.append({"index": i, "message": msg,
                      "logprobs": _chat_logprobs(out, top_n, token) if want_logprobs else None,
                      "finish_reason": _finish_reason(out, has_calls),
                      "matched_stop": _matched(out), **_rl_fields(out, item, job)})
    return _json({**head, "object": "chat.completion", "choices": choices,
                              "usage": _usage(outs, items, n),
                              "metadata": {"weight_version": outs[0].weight_version}})

  head = {**head, "object": "chat.completion.chunk"}
  texts = _Texts(decode, items)
  outputs = engine_outputs(engine, items, stream=True)
  try:
    try:
      first = await outputs.__anext__()
    except BadRequest as e:
      return _error(str(e), e.status)
    response = await start_stream(request)
    for i in range(len(items)):
      await _send(response, {**head, "choices": [{"index": i, "delta": {
          "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
    sent_tokens = [0] * len(items)
    final: dict[int, Output] = {}

    async def every():
      yield first
      async for latest in outputs:
        yield latest

    async for latest in every():
      for i, out in sorted(latest.items()):
        if out.error is not None:  # as the native stream: an error object, then the end
          await _send(response, {"error": {"message": f"sample failed in the engine: {out.error}"}})
          final[i] = out
          continue
        if parse_calls and out.finish is None:
          continue  # a call is only known once the turn is complete: send it whole at the end
        delta_text = texts.delta(i, out)
        new = slice(sent_tokens[i], len(out.output_ids))
        sent_tokens[i] = len(out.output_ids)
        delta: dict[str, Any] = {"content": delta_text}
        has_calls = False
        if parse_calls:
          msg, has_calls = message(out, delta_text)
          delta = {"content": msg["content"], "tool_calls": [
              {**c, "index": k} for k, c in enumerate(msg["tool_calls"] or [])] or None}
        chunk = {"index": i, "delta": delta, "finish_reason": _finish_reason(out, has_calls),
                 "matched_stop": _matched(out), "token_ids": list(out.output_ids[new]),
                 "logprobs": None}
        if want_logprobs:
          chunk["logprobs"] = _chat_logprobs(_part(out, new), top_n, token)
        if out.finish is not None:
          final[i] = out
          chunk.update({k: v for k, v in _rl_fields(out, items[i], job).items()
                        if k != "token_ids"})
        if delta_text or chunk["token_ids"] or out.finish is not None:
          await _send(response, {**head, "choices": [chunk]})
    if _include_usage(body):
      outs = [final[i] for i in range(len(items))]
      await _send(response, {**head, "choices": [], "usage": _usage(outs, items, n)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
  finally:
    await outputs.aclose()


def add_openai_routes(app: web.Application) -> web.Application:
  """Adds the OpenAI routes to an app made by `build_app` (`/v1/models` is already there)."""
  app[_TEMPLATE] = {}
  app.router.add_post("/v1/completions", completions)
  app.router.add_post("/v1/chat/completions", chat_completions)
  return app
