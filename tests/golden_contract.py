"""The protocol contract, executable: golden request/response JSON written from SGLANG_PROTOCOL.md.

`tests/golden/*.json` hold one documented example per route and case (request, status, response,
and which response keys a conforming server may omit). This module (1) validates every golden
response with the client's own parsers, and (2) replays the goldens against a live server and checks
that each answer has the golden's status and JSON shape and passes the same parsers:
`check_server_against_golden(url)` is what any server (the stub, our JAX server, real SGLang) must
pass for `RolloutClient` to work against it unchanged.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import uuid
from typing import Any

import aiohttp

from flashrl_jax.fleet import _protocol as proto

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
_AS_GOLDEN = object()  # "send the golden's own request"


def load_goldens() -> dict[str, dict[str, Any]]:
  return {p.stem: json.loads(p.read_text()) for p in sorted(GOLDEN_DIR.glob("*.json"))}


def _num_outputs(request: dict[str, Any]) -> int:
  ids = request["input_ids"]
  prompts = len(ids) if ids and isinstance(ids[0], list) else 1
  params = request.get("sampling_params") or {}
  n = params.get("n", 1) if isinstance(params, dict) else 1
  return prompts * n


def parse_golden_kind(g: dict[str, Any], body: Any) -> Any:
  """Parses a response body (decoded JSON, text, or stream objects) with the client's parser."""
  kind = g["kind"]
  if kind == "generate":
    return proto.parse_generate_response(body)
  if kind == "generate_batch":
    return proto.parse_generate_response(body, expect_batch=_num_outputs(g["request"]))
  if kind == "stream":
    lines = [f"data: {o if isinstance(o, str) else json.dumps(o)}" for o in body]
    return proto.parse_stream(lines)
  if kind == "error":
    return proto.parse_error(body)
  if kind == "update_weights":
    return proto.UpdateWeightsResult.from_json(body)
  if kind == "status":
    return proto.StatusResult.from_json(body)
  if kind == "loads":
    return proto.ServerLoad.list_from_json(body)
  if kind == "model_info":
    return proto.ModelInfo.from_json(body)
  if kind == "server_info":
    return proto.parse_server_info(body)
  if kind in ("empty", "text"):
    assert isinstance(body, str), body
    return body
  raise ValueError(f"unknown golden kind {kind!r}")


def _scalar_ok(golden: Any, actual: Any) -> bool:
  if isinstance(golden, bool):
    return isinstance(actual, bool)
  if isinstance(golden, int):
    return isinstance(actual, int) and not isinstance(actual, bool)
  if isinstance(golden, float):
    return isinstance(actual, (int, float)) and not isinstance(actual, bool)
  return isinstance(actual, type(golden))


def assert_shape(golden: Any, actual: Any, optional: frozenset[str] = frozenset(),
                 path: str = "$") -> None:
  """`actual` has every non-optional key of `golden`, recursively, with compatible types.

  Lists whose golden elements share one type are homogeneous (each actual element is compared with
  the first golden one); mixed scalar lists such as `[logprob, token_id, text]` are positional.
  `null` in the golden matches anything, as does `null` for an optional key; `finish_reason` only
  needs to be an object or null.
  """
  if golden is None:
    return
  if isinstance(golden, dict):
    assert isinstance(actual, dict), f"{path}: expected an object, got {actual!r:.200}"
    for key, value in golden.items():
      if key not in actual:
        assert key in optional, f"{path}.{key} missing in {actual!r:.300}"
      elif actual[key] is None and key in optional:  # an optional key may also be null
        continue
      elif key == "finish_reason":
        assert actual[key] is None or isinstance(actual[key], dict), f"{path}.{key}"
      else:
        assert_shape(value, actual[key], optional, f"{path}.{key}")
  elif isinstance(golden, list):
    assert isinstance(actual, list), f"{path}: expected a list, got {actual!r:.200}"
    if golden and len({type(x) for x in golden}) > 1 and not isinstance(golden[0], (dict, list)):
      assert len(actual) == len(golden), f"{path}: expected {len(golden)} items, got {actual!r}"
      for i, (g, a) in enumerate(zip(golden, actual)):
        assert_shape(g, a, optional, f"{path}[{i}]")
    elif golden:
      for i, a in enumerate(actual):
        assert_shape(golden[0], a, optional, f"{path}[{i}]")
  else:
    assert _scalar_ok(golden, actual), f"{path}: {actual!r} is not like {golden!r}"


class _Live:
  """Replays goldens against one server."""

  def __init__(self, url: str, session: aiohttp.ClientSession, goldens: dict[str, Any]):
    self.url, self.s, self.g = url.rstrip("/"), session, goldens
    self.checked: list[str] = []

  async def call(self, name: str, request: Any = _AS_GOLDEN) -> Any:
    """Sends golden `name`'s request (or `request`), checks status/shape/parse, returns body."""
    g = self.g[name]
    body = g["request"] if request is _AS_GOLDEN else request
    if "expand_input_ids_to" in g:
      body = dict(body, input_ids=body["input_ids"] * g["expand_input_ids_to"])
    async with self.s.request(g["method"], self.url + g["route"], json=body) as resp:
      status, text = resp.status, await resp.text()
    assert status == g["status"], f"{name}: HTTP {status} (expected {g['status']}): {text[:300]}"
    if g["kind"] in ("empty", "text"):
      got: Any = text
    elif g["kind"] == "stream":
      lines = [ln for ln in text.splitlines() if ln.strip()]
      proto.parse_stream(lines)
      got = [ln[len("data:"):].strip() for ln in lines]
      got = [x if x == "[DONE]" else json.loads(x) for x in got]
    else:
      got = json.loads(text)
    if g["kind"] in ("empty", "text"):
      parse_golden_kind(g, got)
    elif g["kind"] == "stream":
      for chunk in got[:-1]:
        assert_shape(g["response"][0], chunk, frozenset(g.get("optional_keys", ())), name)
    else:
      parse_golden_kind(dict(g, request=body), got)
      assert_shape(g["response"], got, frozenset(g.get("optional_keys", ())), name)
    self.checked.append(name)
    return got

  async def wait_running(self, task: asyncio.Task, timeout_s: float = 60.0) -> bool:
    """True once the server reports a running request; False if `task` finished first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and not task.done():
      async with self.s.get(self.url + "/v1/loads") as resp:
        loads = proto.ServerLoad.list_from_json(json.loads(await resp.text()))
      if sum(x.num_running_reqs for x in loads) >= 1:
        return True
      await asyncio.sleep(0.002)
    assert task.done(), f"{self.url}: no request started running within {timeout_s}s"
    return False

  async def interrupt(self, name: str, request: dict[str, Any], action, undo=None,
                      tries: int = 5) -> Any:
    """Runs golden `name` with `request`, applies `action(rid)` while it runs, returns the response.

    A fast server may finish a request before the action lands; then `undo()` and the scenario is
    retried.
    """
    for i in range(tries):
      rid = f"{request['rid']}-{i}"
      task = asyncio.create_task(self.call(name, dict(request, rid=rid)))
      if await self.wait_running(task):
        await action(rid)
        out = await task
        if out["meta_info"]["finish_reason"]["type"] == "abort":
          return out
        if undo is not None:
          await undo()
      else:
        await task
    raise AssertionError(f"{name}: could not interrupt a running request in {tries} tries")

  def request(self, name: str, **overrides: Any) -> dict[str, Any]:
    rid = f"{name}-{uuid.uuid4().hex[:8]}"
    return dict(self.g[name]["request"], rid=rid, **overrides)


def _finish(out: Any) -> str:
  return out["meta_info"]["finish_reason"]["type"]


async def _check(url: str, long_max_new_tokens: int) -> list[str]:
  goldens = load_goldens()
  async with aiohttp.ClientSession() as session:
    live = _Live(url, session, goldens)
    for name in ["health", "health_generate", "model_info", "get_model_info", "server_info",
                 "get_server_info", "v1_loads", "flush_cache", "generate_single", "generate_stop",
                 "generate_batch", "generate_n", "generate_stream",
                 "generate_error_unknown_sampling_key", "generate_error_text_and_ids",
                 "generate_error_out_of_vocab", "generate_error_negative_max_new_tokens",
                 "generate_error_oversized_prompt", "continue_generation"]:
      await live.call(name)
    long = {"max_new_tokens": long_max_new_tokens, "ignore_eos": True}

    # abort_request (one rid, then all) → the running /generate returns partial output, HTTP 200.
    async def abort_one(rid):
      await live.call("abort_request", {"rid": rid, "abort_all": False})

    async def abort_all(rid):
      await live.call("abort_request_all")

    async def pause_abort(rid):
      await live.call("pause_generation_abort")

    async def resume():
      await live.call("continue_generation")

    req = live.request("generate_abort", sampling_params=long)
    for action in (abort_one, abort_all):
      await live.interrupt("generate_abort", req, action)
    # pause in abort mode → partial output with finish abort; new requests wait until continue.
    await live.interrupt("generate_abort", req, pause_abort, undo=resume)
    # While paused, a new request waits; aborting it gives the 'aborted before running' shape.
    queued = live.request("generate_abort_queued")
    task = asyncio.create_task(live.call("generate_abort_queued", queued))
    await asyncio.sleep(0.3)
    assert not task.done(), "a request sent while paused must wait for continue_generation"
    await live.call("abort_request", {"rid": queued["rid"], "abort_all": False})
    assert _finish(await task) == "abort"
    await live.call("continue_generation")

    # in_place / retract: the request survives the pause and finishes normally after continue.
    for mode in ["in_place", "retract"]:
      req = live.request("generate_weight_spans", sampling_params=long)
      task = asyncio.create_task(live.call("generate_weight_spans", req))
      await live.wait_running(task)
      await live.call(f"pause_generation_{mode}")
      await asyncio.sleep(0.2)
      await live.call("continue_generation")
      out = await task
      assert _finish(out) in ("length", "stop"), f"pause({mode}) lost the request: {out}"

    # Weight update from the server's own checkpoint, with a new version string.
    info = await live.call("model_info")
    version = f"golden-{uuid.uuid4().hex[:6]}"
    await live.call("update_weights_from_disk", dict(
        goldens["update_weights_from_disk"]["request"], model_path=info["model_path"],
        weight_version=version))
    assert (await live.call("get_model_info"))["weight_version"] == version
    out = await live.call("generate_single", live.request("generate_single"))
    assert out["meta_info"]["weight_version"] == version
    assert {s["version"] for s in out["meta_info"]["weight_versions"]} <= {version}
    await live.call("update_weights_from_disk_error")
    assert (await live.call("model_info"))["weight_version"] == version, "failed update changed it"
    await live.call("generate_weight_spans")
    return sorted(set(live.checked))


def check_server_against_golden(url: str, *, long_max_new_tokens: int = 200) -> list[str]:
  """Replays every golden against the server at `url`; returns the golden names it exercised.

  Needs an idle server whose `model_info.model_path` it can reload. `long_max_new_tokens` must be
  long enough that a request is still running when the checker aborts or pauses it.
  """
  return asyncio.run(_check(url, long_max_new_tokens))
