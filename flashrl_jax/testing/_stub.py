"""A pure-Python SGLang-protocol server with a fake deterministic model, for client and fault tests.

The rollout client must be tested against real processes dying, hanging and lying, without paying
for a JAX model per process. This stub answers every route of `shared/SGLANG_PROTOCOL.md` with the
same JSON shapes. It generates `token = (last + 1) % vocab_size` with log-prob `stub_logprob(token)`
(so a continued generation equals an uninterrupted one) and honours max_new_tokens, stop_token_ids,
n, batches, streaming, the pause modes, weight versions and spans, `/v1/loads` and HTTP 400 errors.
Flags (or `POST /_stub/configure` at run time) make it slow or misbehave (`Misbehave`):

  python -m flashrl_jax.testing._stub --port=N [--misbehave=non_json|die_after=3] [--latency_s=0.1]

It imports nothing from flashrl_jax, so tests start it as a script (`python .../_stub.py`), skipping
the package's JAX import: fault tests start and kill many stubs, each in well under a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import signal
import threading
import time
import uuid
from typing import Any

from absl import app as absl_app
from absl import flags
from aiohttp import web


# The protocol's pause modes (as `_protocol.PauseMode`, which this module must not import).
_Pause = enum.Enum("_Pause", {"ABORT": "abort", "RETRACT": "retract", "IN_PLACE": "in_place"})


class Misbehave(enum.Enum):
  NONE = "none"
  WRONG_LOGPROB_COUNT = "wrong_logprob_count"  # one log-prob fewer than tokens
  BAD_TOKEN_IDS = "bad_token_ids"              # ids shifted past the vocabulary
  NON_JSON = "non_json"                        # a 200 whose body is not JSON
  MISSING_FIELDS = "missing_fields"            # no meta_info
  HANG = "hang"                                # /generate never answers (/health still does)
  DIE_AFTER = "die_after"                      # the process exits when request die_after+1 arrives
  DEAD_ENGINE = "dead_engine"  # as our server once its engine thread died: 503 at once, /health too
  DEAD_ENGINE_400 = "dead_engine_400"  # the same, said with HTTP 400 (as our server once did)


def parse_misbehave(spec: str) -> tuple[Misbehave, int]:
  """'non_json' → (NON_JSON, 0); 'die_after=3' → (DIE_AFTER, 3)."""
  name, _, arg = spec.partition("=")
  mode = Misbehave(name or "none")
  if (mode is Misbehave.DIE_AFTER) != bool(arg):
    raise ValueError(f"only die_after takes (and needs) '=K': {spec!r}")
  return mode, int(arg or 0)


@dataclasses.dataclass(frozen=True)
class StubConfig:
  vocab_size: int = 1000
  model_path: str = "stub-model"
  weight_version: str = "0"
  max_running_requests: int = 256
  context_length: int = 4096
  latency_s: float = 0.0        # before the first token of each request
  token_latency_s: float = 0.0  # per output token
  misbehave: Misbehave = Misbehave.NONE
  die_after: int = 0


def stub_next_token(last: int, vocab_size: int) -> int:
  return (last + 1) % vocab_size


def stub_logprob(token: int) -> float:
  return -0.01 * (1 + token % 50)


_SAMPLING_KEYS = frozenset(  # the documented ones; anything else is an HTTP 400
    "max_new_tokens temperature top_p top_k min_p stop stop_token_ids ignore_eos min_new_tokens n "
    "skip_special_tokens spaces_between_special_tokens no_stop_trim sampling_seed".split())


class _BadRequest(Exception):  # → HTTP 400 {"error": {"message": ...}}
  pass


@dataclasses.dataclass(eq=False)
class _Req:
  rid: str
  input_ids: list[int]
  max_new_tokens: int
  stop_ids: frozenset[int]
  aborted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
  output: list[int] = dataclasses.field(default_factory=list)
  versions: list[str] = dataclasses.field(default_factory=list)
  running: bool = False


def _spans(versions: list[str]) -> list[dict[str, Any]]:
  spans: list[dict[str, Any]] = []
  for i, v in enumerate(versions):
    if spans and spans[-1]["version"] == v:
      spans[-1]["end"] = i + 1
    else:
      spans.append({"version": v, "start": i, "end": i + 1})
  return spans


async def _body(request: web.Request) -> dict[str, Any]:
  """The JSON object body, `{}` when empty; raises `_BadRequest` otherwise."""
  raw = await request.read()
  try:
    body = json.loads(raw) if raw.strip() else {}
  except ValueError as e:
    raise _BadRequest(f"body is not JSON: {e}") from None
  if not isinstance(body, dict):
    raise _BadRequest("request body must be a JSON object")
  return body


@web.middleware
async def _bad_request_to_400(request: web.Request, handler) -> web.StreamResponse:
  try:
    return await handler(request)
  except _BadRequest as e:
    return web.json_response({"error": {"message": str(e)}}, status=400)


class StubServer:
  """The routes; one instance per process (state lives here, not in module globals)."""

  def __init__(self, config: StubConfig):
    self.config = config
    self.version = config.weight_version
    self.model_path = config.model_path
    self.live: dict[str, _Req] = {}
    self.resumed = asyncio.Event()
    self.resumed.set()
    self.updating = False
    self.slots = asyncio.Semaphore(config.max_running_requests)
    self.num_generate = 0

  def app(self) -> web.Application:
    a = web.Application(middlewares=[_bad_request_to_400])
    a.add_routes([web.get(p, h) for p, h in [
        ("/health", self.health), ("/health_generate", self.health), ("/v1/loads", self.loads),
        ("/model_info", self.model_info), ("/get_model_info", self.model_info),
        ("/server_info", self.server_info), ("/get_server_info", self.server_info)]])
    a.add_routes([web.post(p, h) for p, h in [
        ("/generate", self.generate), ("/update_weights_from_disk", self.update_weights),
        ("/pause_generation", self.pause), ("/continue_generation", self.resume),
        ("/abort_request", self.abort_request), ("/_stub/configure", self.configure)]])
    a.router.add_route("*", "/flush_cache", self.flush_cache)
    return a

  # --- generation -------------------------------------------------------------------------------

  async def _run(self, req: _Req, on_token=None) -> None:
    """Generates into `req` until stop/length/abort; pauses and weight updates interleave."""
    self.live[req.rid] = req
    try:
      while (not self.resumed.is_set() or self.updating) and not req.aborted.is_set():
        await asyncio.sleep(0.005)
      async with self.slots:
        req.running = True
        await self._sleep(req, self.config.latency_s)
        last = req.input_ids[-1]
        while len(req.output) < req.max_new_tokens and not req.aborted.is_set():
          if not self.resumed.is_set():  # in_place / retract: hold state until continue
            await asyncio.sleep(0.005)
            continue
          last = stub_next_token(last, self.config.vocab_size)
          req.output.append(last)
          req.versions.append(self.version)
          if on_token:
            await on_token(req)
          if last in req.stop_ids:
            break
          await self._sleep(req, self.config.token_latency_s)
    finally:
      req.running = False
      self.live.pop(req.rid, None)

  @staticmethod
  async def _sleep(req: _Req, seconds: float) -> None:
    if seconds > 0:  # an abort cuts the sleep short
      try:
        await asyncio.wait_for(req.aborted.wait(), seconds)
      except asyncio.TimeoutError:
        pass

  def _result(self, req: _Req, *, final: bool, logprob: bool) -> dict[str, Any]:
    out = list(req.output)
    if not final:
      finish = None
    elif out and out[-1] in req.stop_ids:
      finish = {"type": "stop", "matched": out[-1]}
    elif len(out) >= req.max_new_tokens:
      finish = {"type": "length", "length": len(out)}
    else:
      finish = {"type": "abort", "message": "Abort request."}
    meta: dict[str, Any] = {
        "id": req.rid, "prompt_tokens": len(req.input_ids), "completion_tokens": len(out),
        "cached_tokens": 0, "finish_reason": finish, "weight_version": self.version,
        "weight_versions": _spans(req.versions[:len(out)]), "e2e_latency": 0.0}
    if logprob:
      meta["output_token_logprobs"] = [[stub_logprob(t), t, None] for t in out]
    return self._mangle({"output_ids": out, "meta_info": meta})

  def _mangle(self, obj: dict[str, Any]) -> dict[str, Any]:
    mode, v = self.config.misbehave, self.config.vocab_size
    meta = obj["meta_info"]
    if mode is Misbehave.WRONG_LOGPROB_COUNT:
      lps = meta.setdefault("output_token_logprobs", [])
      meta["output_token_logprobs"] = lps[:-1] if lps else [[-0.5, 0, None]]
    elif mode is Misbehave.BAD_TOKEN_IDS:
      obj["output_ids"] = [t + v for t in obj["output_ids"]] or [v]
      meta["output_token_logprobs"] = [[-0.5, t, None] for t in obj["output_ids"]]
      meta.pop("weight_versions")
    elif mode is Misbehave.MISSING_FIELDS:
      del obj["meta_info"]
    return obj

  def _parse(self, body: dict[str, Any]) -> tuple[list[_Req], bool, bool]:
    """Request JSON → one `_Req` per sample (prompt-major for n > 1); raises `_BadRequest`."""
    if ("text" in body) == ("input_ids" in body):
      raise _BadRequest("exactly one of text and input_ids must be given")
    if "text" in body:
      raise _BadRequest("this server has no tokenizer; send input_ids")
    ids = body["input_ids"]
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = body.get("rid")
    rids = rids if isinstance(rids, list) else [rids] * len(prompts)
    if len(params) != len(prompts) or len(rids) != len(prompts):
      raise _BadRequest("sampling_params / rid lists must match the batch size")
    reqs = []
    for prompt, p, rid in zip(prompts, params, rids):
      if not isinstance(p, dict):
        raise _BadRequest("sampling_params must be an object")
      if set(p) - _SAMPLING_KEYS:
        raise _BadRequest(f"unknown sampling params: {sorted(set(p) - _SAMPLING_KEYS)}")
      if (not isinstance(prompt, list) or not prompt
          or not all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in prompt)):
        raise _BadRequest(f"input_ids must be non-empty ids in [0, {self.config.vocab_size})")
      max_new, n = p.get("max_new_tokens", 128), p.get("n", 1)
      if not isinstance(max_new, int) or max_new < 0 or not isinstance(n, int) or n < 1:
        raise _BadRequest("max_new_tokens must be an int >= 0 and n an int >= 1")
      if len(prompt) + max_new > self.config.context_length:
        raise _BadRequest(f"prompt + max_new_tokens exceeds {self.config.context_length} tokens")
      reqs += [_Req(rid if n == 1 and isinstance(rid, str) else uuid.uuid4().hex, list(prompt),
                    max_new, frozenset(p.get("stop_token_ids") or ())) for _ in range(n)]
    return reqs, batch or len(reqs) > 1, bool(body.get("return_logprob"))

  async def generate(self, request: web.Request) -> web.StreamResponse:
    c = self.config
    self.num_generate += 1
    if c.misbehave is Misbehave.DIE_AFTER and self.num_generate > c.die_after:
      os._exit(1)
    if c.misbehave in (Misbehave.DEAD_ENGINE, Misbehave.DEAD_ENGINE_400):
      return web.json_response({"error": {"message": "the engine is shut down."}},
                               status=503 if c.misbehave is Misbehave.DEAD_ENGINE else 400)
    body = await _body(request)
    try:
      reqs, many, logprob = self._parse(body)
    except (ValueError, TypeError) as e:
      raise _BadRequest(f"bad request: {e}") from None
    if c.misbehave is Misbehave.HANG:
      await asyncio.Event().wait()
    if body.get("stream") and many:
      raise _BadRequest("this server streams single requests only")
    if body.get("stream"):
      return await self._stream(request, reqs[0], logprob)
    await asyncio.gather(*(self._run(r) for r in reqs))
    results = [self._result(r, final=True, logprob=logprob) for r in reqs]
    if c.misbehave is Misbehave.NON_JSON:
      return web.Response(text="<html>502 upstream hiccup</html>", content_type="text/html")
    return web.json_response(results if many else results[0])

  async def _stream(self, request: web.Request, req: _Req, logprob: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def emit(r: _Req, final: bool = False) -> None:
      await resp.write(f"data: {json.dumps(self._result(r, final=final, logprob=logprob))}\n\n"
                       .encode())

    await self._run(req, on_token=emit)
    await emit(req, final=True)
    await resp.write(b"data: [DONE]\n\n")
    return resp

  # --- control ----------------------------------------------------------------------------------

  def _abort(self, rid: str | None = None) -> None:
    for r in self.live.values():
      if rid is None or r.rid == rid:
        r.aborted.set()

  async def pause(self, request: web.Request) -> web.Response:
    body = await _body(request)
    try:
      mode = _Pause(body.get("mode", "abort"))
    except ValueError:
      raise _BadRequest(f"unknown pause mode {body.get('mode')!r}") from None
    self.resumed.clear()
    if mode is _Pause.ABORT:
      self._abort()
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

  async def resume(self, request: web.Request) -> web.Response:
    self.resumed.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

  async def abort_request(self, request: web.Request) -> web.Response:
    body = await _body(request)
    self._abort(None if body.get("abort_all") else body.get("rid"))
    return web.Response(status=200)

  async def update_weights(self, request: web.Request) -> web.Response:
    body = await _body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not os.path.isdir(path):
      return web.json_response({"success": False, "num_paused_requests": 0,
                                "message": f"model_path {path!r} is not a directory"}, status=400)
    if body.get("abort_all_requests"):
      self._abort()
    if self.resumed.is_set():  # not paused: let in-flight requests finish, hold new ones
      self.updating = True
      while any(r.running for r in self.live.values()):
        await asyncio.sleep(0.005)
    self.model_path, self.version = path, str(body.get("weight_version") or self.version)
    self.updating = False
    return web.json_response({"success": True,
                              "num_paused_requests": 0 if self.resumed.is_set() else len(self.live),
                              "message": "Succeeded to update model weights."})

  async def flush_cache(self, request: web.Request) -> web.Response:
    if self.live:
      return web.Response(text="Cache not flushed: requests are running.\n", status=400)
    return web.Response(text="Cache flushed.\n")

  async def health(self, request: web.Request) -> web.Response:
    if self.config.misbehave in (Misbehave.DEAD_ENGINE, Misbehave.DEAD_ENGINE_400):
      return web.Response(text="engine is not running", status=503)
    return web.Response()

  async def model_info(self, request: web.Request) -> web.Response:
    return web.json_response({
        "model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
        "weight_version": self.version, "model_type": "stub",
        "architectures": ["StubForCausalLM"]})

  async def server_info(self, request: web.Request) -> web.Response:
    return web.json_response({
        **dataclasses.asdict(self.config), "misbehave": self.config.misbehave.value,
        "model_path": self.model_path, "weight_version": self.version, "host": request.host,
        "skip_tokenizer_init": True, "version": "flashrl_jax-stub"})

  async def loads(self, request: web.Request) -> web.Response:
    running = [r for r in self.live.values() if r.running]
    used = sum(len(r.input_ids) + len(r.output) for r in running)
    return web.json_response({
        "timestamp": time.time(), "version": "flashrl_jax-stub", "dp_rank_count": 1,
        "loads": [{"dp_rank": 0, "num_running_reqs": len(running), "num_used_tokens": used,
                   "num_waiting_reqs": len(self.live) - len(running)}]})

  async def configure(self, request: web.Request) -> web.Response:
    """Test hook: change knobs at run time (`{"misbehave": "non_json", "latency_s": 0.1}`)."""
    body = await _body(request)
    if "misbehave" in body:
      body["misbehave"], body["die_after"] = parse_misbehave(body["misbehave"])
    self.config = dataclasses.replace(self.config, **body)
    return web.json_response({"status": "ok"})


def _exit_with_launcher(poll_s: float = 0.5) -> None:
  """SIGTERMs this stub once `LocalServers`' launcher (its parent) is gone, as
  `flashrl_jax.fleet.exit_with_launcher` does for our JAX server (repeated here, in four lines, so
  the stub imports nothing from the package): a SIGKILLed test or run leaves no stub behind.
  `FLASHRL_STUB_OUTLIVES_LAUNCHER=1` turns it off: the stub then stands in for a server that does
  not watch its launcher (real SGLang), which the next run's reap of `server_pids.json` stops."""
  launcher = os.environ.get("FLASHRL_LAUNCHER_PID")
  if not launcher or os.environ.get("FLASHRL_STUB_OUTLIVES_LAUNCHER") == "1":
    return

  def watch() -> None:
    while os.getppid() == int(launcher):
      time.sleep(poll_s)
    print(f"launcher {launcher} is gone: stopping this stub", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def main(argv: list[str]) -> None:
  del argv
  _exit_with_launcher()
  f = flags.FLAGS
  misbehave, die_after = parse_misbehave(f.misbehave)
  knobs = ("model_path weight_version vocab_size max_running_requests context_length latency_s "
           "token_latency_s")
  config = StubConfig(misbehave=misbehave, die_after=die_after,
                      **{k: f[k].value for k in knobs.split()})

  async def build() -> web.Application:  # asyncio objects must be made inside the server's loop
    return StubServer(config).app()

  web.run_app(build(), host=f.host, port=f.port, print=None, access_log=None,
              shutdown_timeout=0.5)


if __name__ == "__main__":
  # Flags exist only when run as a program, so importing this module never clashes with
  # another entry point's flags of the same name (e.g. the JAX server's --port).
  flags.DEFINE_integer("port", 30000, "Port to listen on.")
  flags.DEFINE_string("host", "127.0.0.1", "Interface to bind.")
  flags.DEFINE_string("model_path", StubConfig.model_path, "Reported model path.")
  flags.DEFINE_string("weight_version", StubConfig.weight_version, "Initial weight version.")
  flags.DEFINE_integer("vocab_size", StubConfig.vocab_size, "Fake vocabulary size.")
  flags.DEFINE_integer("max_running_requests", StubConfig.max_running_requests, "Running at once.")
  flags.DEFINE_integer("context_length", StubConfig.context_length,
                       "Longest prompt + max_new_tokens (a longer request gets HTTP 400).")
  flags.DEFINE_float("latency_s", 0.0, "Delay before each request's first token.")
  flags.DEFINE_float("token_latency_s", 0.0, "Delay per output token.")
  flags.DEFINE_string("misbehave", "none", "|".join(m.value for m in Misbehave) + " (die_after=K)")
  absl_app.run(main)
