"""The aiohttp application that serves an `Engine` with SGLang's native HTTP routes.

Why it is thin: all state lives in the engine (its own thread); a handler parses, hands work over
with `submit` or a control future, and awaits the outcome on the event loop, so one slow generation
never blocks `/health`, `/v1/loads` or a pause. A client that disconnects has its requests aborted,
freeing their slots (a controller that timed out and retried elsewhere must not leave work behind).

Status codes say whose fault a failure is, because the client acts on them: 4xx means the request
is bad (`_wire` names the field; the client drops it), 5xx means the server is (503 once the engine
thread has stopped, 500 for a request that failed inside the engine: the client retries elsewhere).
Parsing and tokenizing run on a worker thread, so a large body never blocks `/health`; every JSON
answer is strict (no NaN/Infinity), and a bug in a handler is answered 500 in JSON, never a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from aiohttp import web

from flashrl_jax.rollout._engine import Engine, EngineShutDown
from flashrl_jax.fleet import PauseMode
from flashrl_jax.rollout._request import Output
from flashrl_jax.rollout._runner import describe
from flashrl_jax.rollout._sampling import Sampling
from flashrl_jax.rollout._wire import (BadRequest, GenerateItem, GenerateJob, Limits, dumps,
                                       output_json, parse_generate, parse_json)

log = logging.getLogger(__name__)

VERSION = "flashrl_jax-0.1"
HEALTH_TIMEOUT_S = 20.0
_ENGINE = web.AppKey("engine", Engine)
_ARGS = web.AppKey("server_args", dict)
_LIMITS = web.AppKey("limits", Limits)


def _json(obj: Any, status: int = 200) -> web.Response:
  return web.Response(body=dumps(obj), status=status, content_type="application/json",
                      charset="utf-8")


def sse_event(obj: Any) -> bytes:
  """One server-sent event carrying `obj` as JSON."""
  return b"data: " + dumps(obj) + b"\n\n"


def _error(message: str, status: int = 400) -> web.Response:
  return _json({"error": {"message": message}}, status=status)


# The request's event stream, once its 200 and headers are sent.
_STREAM = web.RequestKey("stream", web.StreamResponse)


async def start_stream(request: web.Request) -> web.StreamResponse:
  """An event stream with its headers sent; from here an error can only be an event (`_errors`)."""
  response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                         "Cache-Control": "no-cache"})
  await response.prepare(request)
  request[_STREAM] = response
  return response


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
  """Refusals become their status; a stopped engine 503; anything else (a bug) a logged 500."""
  try:
    return await handler(request)
  except BadRequest as e:
    return await _failed(request, str(e), e.status)
  except EngineShutDown as e:
    return await _failed(request, str(e), 503)
  except web.HTTPException:
    raise
  except Exception as e:  # noqa: BLE001
    log.exception("%s %s failed", request.method, request.path)
    return await _failed(request, f"internal server error: {e!r:.300}", 500)


async def _failed(request: web.Request, message: str, status: int) -> web.StreamResponse:
  stream = request.get(_STREAM)
  if stream is None:
    return _error(message, status)
  # The stream's 200 is already sent: it ends with the error as an event, as a sample that fails
  # in the engine does (aiohttp would write a raw 500 into the stream's body instead).
  try:
    await stream.write(sse_event({"error": {"message": message}}))
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()
  except (ConnectionError, RuntimeError):  # the client is gone
    pass
  return stream


async def _read(request: web.Request) -> bytes:
  limit = request.app[_LIMITS].max_body_bytes
  try:
    return await request.read()
  except web.HTTPRequestEntityTooLarge:
    raise BadRequest(f"the request body is larger than this server's limit ({limit} bytes).",
                     413) from None
  except web.RequestPayloadError as e:  # e.g. a body that does not match its Content-Encoding
    raise BadRequest(f"could not read the request body: {e}") from None


async def _body(request: web.Request, *, required: bool = True) -> dict:
  return parse_json(await _read(request), required=required)


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
  except (ValueError, EngineShutDown) as e:
    for request in submitted:
      engine.abort(request.rid)
    if isinstance(e, ValueError):
      raise BadRequest(str(e)) from None
    raise
  return submitted


# Bodies up to this size are parsed and queued on the event loop: a rollout request (a prompt of a
# few hundred token ids) parses in tens of microseconds, while the hop to a worker thread and back
# costs two wake-ups of a loop that shares its core with decoding (on a one-core server with
# requests of one new token: 0.48-0.54 against 0.64-0.78 ms of server CPU per request,
# docs/benchmarks.md, "Why the iteration grows in async's stream"). Larger
# bodies (long prompts as text, big batches) still go to a thread so the loop stays responsive.
_INLINE_PARSE_BYTES = 16 * 1024


def _parse_and_submit(raw: bytes, engine: Engine, limits: Limits, on_update) -> tuple:
  """JSON, validation, tokenization and queuing: the request's CPU work (on a worker thread for a
  body over `_INLINE_PARSE_BYTES`, else on the event loop)."""
  encode = engine.tokenizer.encode if engine.tokenizer is not None else None
  job = parse_generate(parse_json(raw), encode=encode, validate=engine.validate, limits=limits)
  return job, _submit(engine, job, on_update)


def _failure(engine: Engine, outputs: list[Output]) -> web.Response | None:
  """The error answer for samples that failed in the engine: 400 when every failure was the
  request's own doing, else 5xx (the server's: the client retries them elsewhere)."""
  failed = [out for out in outputs if out.error is not None]
  if not failed:
    return None
  statuses = {out.error_status for out in failed}
  status = 400 if statuses == {400} else 503 if 503 in statuses or not engine.alive else 500
  return _error(f"{len(failed)} of {len(outputs)} sample(s) failed in the engine: "
                f"{failed[0].error}", status)


async def engine_outputs(engine: Engine, items: Sequence[GenerateItem], *, stream: bool
                         ) -> AsyncIterator[dict[int, Output]]:
  """Submits `items` (for the OpenAI routes) and yields {index: newest snapshot} as they progress,
  until all finished (without `stream`, the final snapshots). Whatever still runs when the caller
  stops (its client went away, or it failed) is aborted, freeing its slot. A refusal raises
  `BadRequest` (or `EngineShutDown`) before anything is yielded."""
  loop = asyncio.get_running_loop()
  updates: asyncio.Queue = asyncio.Queue()
  on_update = lambda index, out: loop.call_soon_threadsafe(updates.put_nowait, (index, out))
  job = GenerateJob(items=list(items), batch=True, return_text_in_logprobs=False, stream=stream)
  submitted = _submit(engine, job, on_update)
  try:
    finished: set[int] = set()
    while len(finished) < len(items):
      latest = {}
      index, out = await updates.get()
      latest[index] = out
      while not updates.empty():  # coalesce: each snapshot is cumulative, only the newest matters
        index, out = updates.get_nowait()
        latest[index] = out
      done = {i: o for i, o in latest.items() if o.finish is not None}
      finished.update(done)
      if stream or done:
        yield latest if stream else done
  finally:
    for r in submitted:
      if not r.done:
        engine.abort(r.rid)


async def generate(request: web.Request) -> web.StreamResponse:
  engine = request.app[_ENGINE]
  raw = await _read(request)
  loop = asyncio.get_running_loop()
  updates: asyncio.Queue = asyncio.Queue()
  on_update = lambda index, out: loop.call_soon_threadsafe(updates.put_nowait, (index, out))
  if len(raw) <= _INLINE_PARSE_BYTES:  # an RL rollout's request: cheaper here than a thread hop
    job, submitted = _parse_and_submit(raw, engine, request.app[_LIMITS], on_update)
    return await _answer(request, engine, job, submitted, updates)
  work = asyncio.ensure_future(asyncio.to_thread(_parse_and_submit, raw, engine,
                                                 request.app[_LIMITS], on_update))
  try:
    job, submitted = await asyncio.shield(work)
  except asyncio.CancelledError:  # the client left while we parsed: whatever got queued is freed
    work.add_done_callback(lambda w: w.cancelled() or w.exception() or
                           [engine.abort(r.rid) for r in w.result()[1]])
    raise
  return await _answer(request, engine, job, submitted, updates)


async def _answer(request: web.Request, engine: Engine, job: GenerateJob, submitted: list,
                  updates: asyncio.Queue) -> web.StreamResponse:
  """Waits for a submitted job's samples and answers (streamed or whole)."""
  decode = _decoder(engine)
  try:
    if job.stream:
      return await _stream(request, job, updates, decode)
    final: dict[int, Output] = {}
    while len(final) < len(job.items):
      index, out = await updates.get()
      if out.finish is not None:
        final[index] = out
    failed = _failure(engine, list(final.values()))
    if failed is not None:
      return failed
    results = [output_json(final[i], item, job, decode) for i, item in enumerate(job.items)]
    return _json(results if job.batch else results[0])
  finally:  # the client went away (or we failed): free the slots of whatever is still running
    for r in submitted:
      if not r.done:
        engine.abort(r.rid)


async def _stream(request: web.Request, job: GenerateJob, updates: asyncio.Queue,
                  decode) -> web.StreamResponse:
  response = await start_stream(request)
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
      if out.error is not None:  # as SGLang streams errors: an error object, then the end
        obj = {"error": {"message": f"sample failed in the engine: {out.error}"}}
      else:
        obj = output_json(out, job.items[index], job, decode,
                          index=index if job.batch else None)
      await response.write(sse_event(obj))
  await response.write(b"data: [DONE]\n\n")
  await response.write_eof()
  return response


# --- weights and pausing -----------------------------------------------------------------------------

def _update_answer(success: bool, message: str, status: int, num_paused: int = 0) -> web.Response:
  return _json({"success": success, "message": message, "num_paused_requests": num_paused},
               status=status)


async def update_weights_from_disk(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  try:
    body = await _body(request)
  except BadRequest as e:
    return _update_answer(False, str(e), e.status)
  path = body.get("model_path")
  if not isinstance(path, str) or not path or "\0" in path:
    return _update_answer(False, "model_path (a non-empty str) is required.", 400)
  version = body.get("weight_version")
  if version is not None and (isinstance(version, (dict, list, bool)) or len(str(version)) > 256):
    return _update_answer(False, "weight_version must be a short string or number.", 400)
  version = None if version is None else str(version)
  abort_all = body.get("abort_all_requests", False)
  if not isinstance(abort_all, bool):
    return _update_answer(False, "abort_all_requests must be a boolean.", 400)
  try:
    success, message, num_paused = await asyncio.wrap_future(
        engine.update_weights_from_disk(path, version, abort_all=abort_all))
  except EngineShutDown as e:
    return _update_answer(False, str(e), 503)
  return _update_answer(success, message, 200 if success else 400, num_paused)


async def pause_generation(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  try:
    body = await _body(request, required=False)
    mode = body.get("mode")  # absent or null: SGLang's default; anything else must be a mode
    mode = PauseMode.ABORT if mode is None else PauseMode(mode)
  except (BadRequest, ValueError, TypeError) as e:
    return _error(f"bad pause request: {e}; mode must be one of abort, retract, in_place.")
  await asyncio.wrap_future(engine.pause(mode))
  return _json({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
  await asyncio.wrap_future(request.app[_ENGINE].resume())
  return _json({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
  body = await _body(request, required=False)
  rid, abort_all = body.get("rid") or None, body.get("abort_all", False)
  if rid is not None and not isinstance(rid, str):
    return _error("rid must be a string.")
  if not isinstance(abort_all, bool):
    return _error("abort_all must be a boolean.")
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
  except EngineShutDown as e:
    return web.Response(text=str(e), status=503)
  deadline = time.monotonic() + HEALTH_TIMEOUT_S
  try:
    while time.monotonic() < deadline:
      if probe.done and probe.error is not None:  # generation itself fails: not healthy
        return web.Response(text=f"health check generation failed: {probe.error}", status=503)
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
  return _json(_model_info(request.app))


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
                               "decode_calls": stats.decode_calls,
                               "busy_slot_steps": stats.busy_slot_steps,
                               "decode_s": round(stats.decode_s, 6),
                               "prefill_calls": stats.prefill_calls,
                               "prefill_s": round(stats.prefill_s, 6),
                               "generated_tokens": stats.generated_tokens,
                               "slot_idle_fraction": stats.idle_fraction(engine.runner.num_slots),
                               "engine_errors": stats.engine_errors, "engine_alive": engine.alive,
                               "paused": engine.paused.value if engine.paused else None,
                               **engine.compiles()}]}
  return _json(info)


async def loads(request: web.Request) -> web.Response:
  engine = request.app[_ENGINE]
  load = engine.loads()
  load["token_usage"] = load["num_used_tokens"] / max(load["max_total_num_tokens"], 1)
  return _json({"timestamp": time.time(), "version": VERSION, "dp_rank_count": 1,
                "loads": [{"dp_rank": 0, **load}]})


async def get_load(request: web.Request) -> web.Response:
  """Legacy `/get_load`. sglang-router reads an object's `load` (the tokens held by running
  requests, as SGLang's own load once was); the per-rank fields of SGLang's newer list form sit
  beside it, flattened (this server is one data-parallel rank)."""
  load = request.app[_ENGINE].loads()
  return _json({
      "load": load["num_used_tokens"], "dp_rank": 0,
      "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
      "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_used_tokens"],
      "ts_tic": time.perf_counter()})


async def weight_version(request: web.Request) -> web.Response:
  return _json({"weight_version": request.app[_ENGINE].weight_version})


async def update_weight_version(request: web.Request) -> web.Response:
  """Relabels the weights being served (no weights change), SGLang's `/update_weight_version`."""
  engine = request.app[_ENGINE]
  body = await _body(request)
  version = body.get("new_version")
  if (not isinstance(version, (str, int)) or isinstance(version, bool) or version == ""
      or len(str(version)) > 256):
    return _json({"success": False, "message": "new_version (a short str) is required."},
                 status=400)
  abort_all = body.get("abort_all_requests", False)
  if not isinstance(abort_all, bool):
    return _error("abort_all_requests must be a boolean.")
  if abort_all:
    await asyncio.wrap_future(engine.abort(abort_all=True))
  await asyncio.wrap_future(engine.set_weight_version(str(version)))
  return _json({"success": True, "message": f"Weight version updated to {version}",
                "new_version": str(version)})


async def models(request: web.Request) -> web.Response:
  """OpenAI's `/v1/models`: the one model this server serves."""
  engine = request.app[_ENGINE]
  return _json({"object": "list", "data": [{
      "id": served_model_name(request.app), "object": "model", "created": int(time.time()),
      "owned_by": "flashrl_jax", "root": engine.config.model_path, "parent": None,
      "max_model_len": engine.context_length}]})


async def ready(request: web.Request) -> web.Response:
  """Readiness without a generation: the engine loop is running (warm-up is done before listen)."""
  if not request.app[_ENGINE].alive:
    return _json({"status": "not ready", "message": "engine is not running"}, status=503)
  return _json({"status": "ready"})


async def ping(request: web.Request) -> web.Response:
  return web.Response(status=200) if request.app[_ENGINE].alive else web.Response(status=503)


async def kill_engine(request: web.Request) -> web.Response:
  """Fault injection (`--enable_fault_injection` only): stops the engine thread as a crash would,
  leaving the process and its HTTP server up, to test that clients and the supervisor cope."""
  engine = request.app[_ENGINE]
  try:
    await asyncio.wrap_future(engine.kill())
  except BaseException:  # noqa: BLE001 - the future fails with the shutdown: that is the point
    pass
  for _ in range(1000):  # the thread is unwinding (failing what it held): answer once it is gone
    if not engine.alive:
      break
    await asyncio.sleep(0.01)
  return _json({"engine_alive": engine.alive})


def build_app(engine: Engine, server_args: dict[str, Any] | None = None, *,
              limits: Limits = Limits(), fault_injection: bool = False) -> web.Application:
  """The application; `server_args` (resolved flags) are echoed by `/server_info`."""
  app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[_errors])
  app[_ENGINE] = engine
  app[_ARGS] = server_args if server_args is not None else {}
  app[_LIMITS] = limits
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
  if fault_injection:
    app.router.add_post("/debug/kill_engine", kill_engine)
  return app
