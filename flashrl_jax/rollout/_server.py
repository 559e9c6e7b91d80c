"""The aiohttp application that serves an `Engine` with SGLang's native HTTP routes.

Why it is thin: all state lives in the engine (its own thread); a handler parses, hands work over
with `submit` or a control future, and awaits the outcome on the event loop, so one slow generation
never blocks `/health`, `/v1/loads` or a pause. A client that disconnects has its requests aborted,
freeing their slots (a controller that timed out and retried elsewhere must not leave work behind).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from flashrl_jax.rollout._engine import Engine
from flashrl_jax.fleet import FinishKind, PauseMode
from flashrl_jax.rollout._request import Output
from flashrl_jax.rollout._runner import describe
from flashrl_jax.rollout._sampling import Sampling
from flashrl_jax.rollout._wire import BadRequest, GenerateJob, output_json, parse_generate

log = logging.getLogger(__name__)

VERSION = "flashrl_jax-0.1"
HEALTH_TIMEOUT_S = 20.0
_ENGINE = web.AppKey("engine", Engine)
_ARGS = web.AppKey("server_args", dict)


def _error(message: str, status: int = 400) -> web.Response:
  return web.json_response({"error": {"message": message}}, status=status)


async def _body(request: web.Request, *, required: bool = True) -> dict:
  raw = await request.read()
  if not raw.strip():
    if required:
      raise BadRequest("the request body must be a JSON object.")
    return {}
  try:
    body = json.loads(raw)
  except ValueError as e:
    raise BadRequest(f"the request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object.")
  return body


def _decoder(engine: Engine):
  if engine.tokenizer is None:
    return None
  return lambda ids, skip=True: engine.tokenizer.decode(ids, skip_special_tokens=skip)


# --- /generate ---------------------------------------------------------------------------------------

def _submit(engine: Engine, job: GenerateJob, on_update) -> list:
  submitted = []
  try:
    for index, item in enumerate(job.items):
      submitted.append(engine.submit(
          item.prompt_ids, item.sampling, rid=item.rid, group=item.group, stream=job.stream,
          on_update=lambda out, index=index: on_update(index, out), logprobs=item.logprobs))
  except (ValueError, RuntimeError):
    for request in submitted:
      engine.abort(request.rid)
    raise
  return submitted


async def generate(request: web.Request) -> web.StreamResponse:
  engine = request.app[_ENGINE]
  encode = engine.tokenizer.encode if engine.tokenizer is not None else None
  try:
    job = parse_generate(await _body(request), encode=encode, validate=engine.validate)
  except BadRequest as e:
    return _error(str(e))
  loop = asyncio.get_running_loop()
  updates: asyncio.Queue = asyncio.Queue()
  on_update = lambda index, out: loop.call_soon_threadsafe(updates.put_nowait, (index, out))
  try:
    submitted = _submit(engine, job, on_update)
  except (ValueError, RuntimeError) as e:
    return _error(str(e))
  decode = _decoder(engine)
  try:
    if job.stream:
      return await _stream(request, job, updates, decode)
    final: dict[int, Output] = {}
    while len(final) < len(job.items):
      index, out = await updates.get()
      if out.finish is not None:
        final[index] = out
    results = [output_json(final[i], item, job, decode) for i, item in enumerate(job.items)]
    return web.json_response(results if job.batch else results[0])
  finally:  # the client went away (or we failed): free the slots of whatever is still running
    for r in submitted:
      if not r.done:
        engine.abort(r.rid)


async def _stream(request: web.Request, job: GenerateJob, updates: asyncio.Queue,
                  decode) -> web.StreamResponse:
  response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                         "Cache-Control": "no-cache"})
  await response.prepare(request)
  finished: set[int] = set()
  while len(finished) < len(job.items):
    latest = {}
    index, out = await updates.get()
    latest[index] = out
    while not updates.empty():  # coalesce: each event is cumulative, only the newest matters
      index, out = updates.get_nowait()
      latest[index] = out
    for index, out in sorted(latest.items()):
      if out.finish is not None:
        finished.add(index)
      obj = output_json(out, job.items[index], job, decode,
                        index=index if job.batch else None)
      await response.write(f"data: {json.dumps(obj)}\n\n".encode())
  await response.write(b"data: [DONE]\n\n")
  await response.write_eof()
  return response


# --- weights and pausing -----------------------------------------------------------------------------

async def update_weights_from_disk(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  try:
    body = await _body(request)
  except BadRequest as e:
    return _error(str(e))
  path = body.get("model_path")
  if not isinstance(path, str) or not path:
    return web.json_response({"success": False, "message": "model_path (str) is required.",
                              "num_paused_requests": 0}, status=400)
  version = body.get("weight_version")
  version = None if version is None else str(version)
  future = engine.update_weights_from_disk(path, version,
                                           abort_all=bool(body.get("abort_all_requests", False)))
  success, message, num_paused = await asyncio.wrap_future(future)
  return web.json_response({"success": success, "message": message,
                            "num_paused_requests": num_paused}, status=200 if success else 400)


async def pause_generation(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  try:
    body = await _body(request, required=False)
    mode = PauseMode(body.get("mode") or "abort")
  except (BadRequest, ValueError) as e:
    return _error(f"bad pause request: {e}; mode must be one of abort, retract, in_place.")
  await asyncio.wrap_future(engine.pause(mode))
  return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
  await asyncio.wrap_future(request.app[_ENGINE].resume())
  return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
  try:
    body = await _body(request, required=False)
  except BadRequest as e:
    return _error(str(e))
  rid, abort_all = body.get("rid") or None, bool(body.get("abort_all", False))
  if rid is not None and not isinstance(rid, str):
    return _error("rid must be a string.")
  if rid is not None or abort_all:
    await asyncio.wrap_future(request.app[_ENGINE].abort(rid, abort_all))
  return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
  if await asyncio.wrap_future(request.app[_ENGINE].flush_cache()):
    return web.Response(text="Cache flushed.\n")
  return web.Response(text="Cache not flushed: requests are running or waiting.\n", status=400)


# --- health, info, load ------------------------------------------------------------------------------

async def health_generate(request: web.Request) -> web.Response:
  """200 once a one-token generation finishes, or the engine is visibly making progress."""
  engine = request.app[_ENGINE]
  if not engine.alive:
    return web.Response(text="engine is not running", status=503)
  if engine.paused is not None:  # paused on purpose: alive, but nothing would be generated
    return web.Response(status=200)
  progress = engine.stats.decode_steps + engine.stats.prefill_calls
  try:
    probe = engine.submit([0], Sampling(max_new_tokens=1, temperature=0),
                          rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
  except RuntimeError as e:
    return web.Response(text=str(e), status=503)
  deadline = time.monotonic() + HEALTH_TIMEOUT_S
  try:
    while time.monotonic() < deadline:
      # Done (even if aborted by a concurrent pause) or other work advancing: the engine is alive.
      if probe.done or engine.stats.decode_steps + engine.stats.prefill_calls > progress + 1:
        return web.Response(status=200)
      await asyncio.sleep(0.01)
    return web.Response(text="health check generation timed out", status=503)
  finally:
    if not probe.done:
      engine.abort(probe.rid)


def served_model_name(app: web.Application) -> str:
  """The name `/v1/models` lists and OpenAI responses carry (default: the model path)."""
  return app[_ARGS].get("served_model_name") or app[_ENGINE].config.model_path


def _tokenizer_path(app: web.Application) -> str:
  return app[_ARGS].get("tokenizer_path") or app[_ENGINE].config.model_path


def _model_info(app: web.Application) -> dict[str, Any]:
  engine = app[_ENGINE]
  return {"model_path": engine.model_path, "served_model_name": served_model_name(app),
          "tokenizer_path": _tokenizer_path(app),
          "is_generation": True, "preferred_sampling_params": None,
          "weight_version": engine.weight_version, "has_image_understanding": False,
          "has_audio_understanding": False, "model_type": engine.model_config.family.value,
          "architectures": [engine.model_config.family.architecture],
          "vocab_size": engine.vocab_size, "context_length": engine.context_length}


async def model_info(request: web.Request) -> web.Response:
  return web.json_response(_model_info(request.app))


async def server_info(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  stats = engine.stats
  info = {**request.app[_ARGS], **describe(engine.runner), "model_path": engine.model_path,
          "served_model_name": served_model_name(request.app),
          "tokenizer_path": _tokenizer_path(request.app),
          "max_context_length": engine.context_length,
          "max_total_num_tokens": engine.context_length * engine.runner.num_slots,
          "weight_version": engine.weight_version, "version": VERSION,
          "internal_states": [{"decode_steps": stats.decode_steps,
                               "prefill_calls": stats.prefill_calls,
                               "generated_tokens": stats.generated_tokens,
                               "slot_idle_fraction": stats.idle_fraction(engine.runner.num_slots),
                               "paused": engine.paused.value if engine.paused else None,
                               **engine.compiles()}]}
  return web.json_response(info)


async def loads(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  load = engine.loads()
  load["token_usage"] = load["num_used_tokens"] / max(load["max_total_num_tokens"], 1)
  return web.json_response({"timestamp": time.time(), "version": VERSION, "dp_rank_count": 1,
                            "loads": [{"dp_rank": 0, **load}]})


async def get_load(request: web.Request) -> web.Response:
  """Legacy `/get_load`. sglang-router reads an object's `load` (the tokens held by running
  requests, as SGLang's own load once was); the per-rank fields of SGLang's newer list form sit
  beside it, flattened (this server is one data-parallel rank)."""
  load = request.app[_ENGINE].loads()
  return web.json_response({
      "load": load["num_used_tokens"], "dp_rank": 0,
      "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
      "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_used_tokens"],
      "ts_tic": time.perf_counter()})


async def weight_version(request: web.Request) -> web.Response:
  return web.json_response({"weight_version": request.app[_ENGINE].weight_version})


async def update_weight_version(request: web.Request) -> web.Response:
  """Relabels the weights being served (no weights change), SGLang's `/update_weight_version`."""
  engine = request.app[_ENGINE]
  try:
    body = await _body(request)
  except BadRequest as e:
    return _error(str(e))
  version = body.get("new_version")
  if not isinstance(version, (str, int)) or isinstance(version, bool) or version == "":
    return web.json_response({"success": False, "message": "new_version (str) is required."},
                             status=400)
  abort_all = body.get("abort_all_requests", False)
  if not isinstance(abort_all, bool):
    return _error("abort_all_requests must be a boolean.")
  if abort_all:
    await asyncio.wrap_future(engine.abort(abort_all=True))
  await asyncio.wrap_future(engine.set_weight_version(str(version)))
  return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                            "new_version": str(version)})


async def models(request: web.Request) -> web.Response:
  """OpenAI's `/v1/models`: the one model this server serves."""
  engine = request.app[_ENGINE]
  return web.json_response({"object": "list", "data": [{
      "id": served_model_name(request.app), "object": "model", "created": int(time.time()),
      "owned_by": "flashrl_jax", "root": engine.config.model_path, "parent": None,
      "max_model_len": engine.context_length}]})


async def ready(request: web.Request) -> web.Response:
  """Readiness without a generation: the engine loop is running (warm-up is done before listen)."""
  if not request.app[_ENGINE].alive:
    return web.json_response({"status": "not ready", "message": "engine is not running"},
                             status=503)
  return web.json_response({"status": "ready"})


async def ping(request: web.Request) -> web.Response:
  return web.Response(status=200) if request.app[_ENGINE].alive else web.Response(status=503)


def build_app(engine: Engine, server_args: dict[str, Any] | None = None) -> web.Application:
  """The application; `server_args` (resolved flags) are echoed by `/server_info`."""
  app = web.Application(client_max_size=64 << 20)
  app[_ENGINE] = engine
  app[_ARGS] = server_args if server_args is not None else {}
  app.router.add_post("/generate", generate)
  app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
  app.router.add_post("/pause_generation", pause_generation)
  app.router.add_post("/continue_generation", continue_generation)
  app.router.add_post("/abort_request", abort_request)
  app.router.add_route("GET", "/flush_cache", flush_cache)
  app.router.add_route("POST", "/flush_cache", flush_cache)
  for path in ("/health", "/health_generate"):
    app.router.add_get(path, health_generate)
  for path in ("/model_info", "/get_model_info"):
    app.router.add_get(path, model_info)
  for path in ("/server_info", "/get_server_info"):
    app.router.add_get(path, server_info)
  app.router.add_get("/v1/loads", loads)
  app.router.add_get("/get_weight_version", weight_version)
  app.router.add_post("/update_weight_version", update_weight_version)
  app.router.add_get("/get_load", get_load)
  app.router.add_get("/v1/models", models)
  app.router.add_get("/ready", ready)
  app.router.add_get("/ping", ping)
  return app
