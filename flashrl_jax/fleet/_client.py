"""The asyncio client that drives N SGLang-protocol rollout servers for the controller.

Rollout is most of an RL step, so servers must stay busy and no sample may be lost: the client
sends each sample to the server with the fewest outstanding requests, times requests out, retries a
request on another server when one dies, hangs, answers 5xx (a dead engine answers 503) or answers
with a malformed response (validated in `_protocol`), and takes such servers out of rotation
(`_servers`; a background `GET /health` puts them back). Only a 4xx answer means the request itself
is bad (`RequestRejected`), unless it says the engine has stopped (a server failure): that is the
one case a prompt may be dropped. When a server aborts a request (pause in abort mode, e.g. around
a weight update) the client continues it: it re-submits `prompt + generated prefix` with the
remaining `max_new_tokens`, keeping the tokens, behaviour log-probs and per-token weight versions
already produced. Nothing here depends on which implementation answers (real SGLang, our JAX
server, or the test stub).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from flashrl_jax.fleet import _protocol as proto
from flashrl_jax.fleet._protocol import FinishKind, PauseMode, SamplingParams
from flashrl_jax.fleet._servers import (AttemptFailed, Fault, HTTPStatusError, Server, ServerPool,
                                        ServerStats, json_parser)

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
  """A request could not be completed within its retry budget."""


class RequestRejected(GenerationError):
  """A server refused the request as invalid (HTTP 400, 413 or 422): it is not retried elsewhere.

  Any other failure (5xx, refused connection, timeout, malformed answer, an answer saying the engine
  is shut down whatever its status) is the server's, and the request is retried on another server
  instead."""


# Answers that mean "this request is invalid", whichever server is asked.
REJECTED_STATUSES = frozenset({400, 413, 422})


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  rid: str
  output_ids: tuple[int, ...]
  output_logprobs: tuple[float, ...]  # behaviour log-probs, log_softmax(logits / temperature)
  token_versions: tuple[str, ...]     # weight version that produced each output token
  finish_reason: FinishKind | None    # None only for a partial result yielded by `stream`
  server_url: str                     # the server that produced the last segment
  num_attempts: int                   # HTTP generate calls made, over all segments
  num_continuations: int              # times an aborted partial output was re-submitted


@dataclasses.dataclass(frozen=True)
class ClientStats:
  num_generate_calls: int
  num_retries: int
  num_malformed: int
  num_timeouts: int
  num_connection_errors: int
  num_continuations: int
  servers: tuple[ServerStats, ...]


class RolloutClient:
  """Least-outstanding-requests client over SGLang-protocol servers. Use `async with`."""

  def __init__(self, urls: Iterable[str], *, request_timeout_s: float = 600.0,
               max_retries: int = 3, health_interval_s: float = 5.0,
               vocab_size: int | None = None, health_timeout_s: float = 30.0,
               op_timeout_s: float = 600.0, max_continuations: int = 16,
               no_server_wait_s: float | None = None, router_url: str | None = None):
    """`urls` are the workers. With `router_url` (an sglang-router in front of them) generation goes
    through the router, which balances it, while everything the router does not forward (pause,
    continue, weight updates, aborts, loads) is addressed to the workers directly."""
    self._pool = ServerPool(urls, health_interval_s=health_interval_s,
                            health_timeout_s=health_timeout_s)
    self._gen = self._pool if router_url is None else ServerPool(
        [router_url], health_interval_s=health_interval_s, health_timeout_s=health_timeout_s)
    self.router_url = None if router_url is None else router_url.rstrip("/")
    self.request_timeout_s, self.max_retries = request_timeout_s, max_retries
    self.vocab_size, self.op_timeout_s = vocab_size, op_timeout_s
    self.max_continuations = max_continuations
    self.no_server_wait_s = request_timeout_s if no_server_wait_s is None else no_server_wait_s
    self._abort_epoch = 0  # bumped by abort_all(): requests it aborts are not continued
    self._cancelled: set[str] = set()
    self._active: dict[str, tuple[Server, str]] = {}  # rid → (server, wire rid) in flight
    self._background: set[asyncio.Task] = set()
    self._counts = dict(generate=0, retries=0, malformed=0, timeouts=0, connection=0,
                        continuations=0)

  async def start(self) -> RolloutClient:
    await self._pool.start()
    await self._gen.start()
    return self

  async def close(self) -> None:
    await self._gen.close()
    await self._pool.close()

  async def __aenter__(self) -> RolloutClient:
    return await self.start()

  async def __aexit__(self, *exc) -> None:
    await self.close()

  @property
  def urls(self) -> list[str]:
    return list(self._pool.servers)

  def add_server(self, url: str) -> None:
    """Adds (or re-adds, e.g. after a restart) a server; it takes requests at once."""
    self._pool.add(url)

  def remove_server(self, url: str) -> None:
    """No new requests go to `url`; requests already there finish (or fail over) normally."""
    self._pool.remove(url)

  def stats(self) -> ClientStats:
    c = self._counts
    return ClientStats(c["generate"], c["retries"], c["malformed"], c["timeouts"],
                       c["connection"], c["continuations"],
                       tuple(s.stats() for s in self._pool.servers.values()))

  # --- generation -------------------------------------------------------------------------------

  async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                     rid: str | None = None,
                     resume_from: GenerationResult | None = None) -> GenerationResult:
    """Generates one sample to stop/length, continuing it across server-side aborts.

    `resume_from` continues an earlier partial result (e.g. one stopped by `abort_all`).
    Raises `RequestRejected` on HTTP 400 and `GenerationError` when retries run out.
    """
    rid = rid or (resume_from.rid if resume_from else uuid.uuid4().hex)
    ids: list[int] = []
    lps: list[float] = []
    versions: list[str] = []
    attempts = conts = 0
    if resume_from is not None:
      ids, lps = list(resume_from.output_ids), list(resume_from.output_logprobs)
      versions, attempts = list(resume_from.token_versions), resume_from.num_attempts
      conts = resume_from.num_continuations + 1
    self._cancelled.discard(rid)
    while True:
      epoch = self._abort_epoch
      seg = dataclasses.replace(sampling, max_new_tokens=max(sampling.max_new_tokens - len(ids), 0),
                                min_new_tokens=max(sampling.min_new_tokens - len(ids), 0))
      (out,), server, tries = await self._segment(list(input_ids) + ids, seg, [rid], attempts)
      attempts += tries
      ids += out.output_ids
      lps += out.output_logprobs
      versions += out.token_versions
      kind = out.finish.kind
      if kind is FinishKind.ABORT and len(ids) >= sampling.max_new_tokens:
        kind = FinishKind.LENGTH
      stopped = epoch != self._abort_epoch or rid in self._cancelled
      if kind is not FinishKind.ABORT or stopped or conts >= self.max_continuations:
        self._cancelled.discard(rid)
        return GenerationResult(rid, tuple(ids), tuple(lps), tuple(versions), kind, server.url,
                                attempts, conts)
      conts += 1
      self._counts["continuations"] += 1
      log.info("request %s aborted after %d tokens on %s; continuing", rid, len(ids), server.url)

  async def generate_group(self, input_ids: Sequence[int], sampling: SamplingParams, n: int, *,
                           rid: str | None = None) -> list[GenerationResult]:
    """`n` samples of one prompt in one `/generate` request (SGLang's batch form), in order; sample
    j's rid is `{rid}-{j}`. The request is retried whole on another server like `generate`'s; a
    sample the server aborted (a handoff in abort mode) is continued on its own, as `generate`
    continues one. One request instead of `n` saves each side its per-request work (HTTP, parsing,
    an admission and a prefill each), at the price of the samples staying on one server."""
    if n < 1:
      raise ValueError(f"a group needs n >= 1 samples, got {n}.")
    rid = rid or uuid.uuid4().hex
    rids = [f"{rid}-{j}" for j in range(n)]
    self._cancelled.difference_update(rids)
    epoch = self._abort_epoch
    outs, server, tries = await self._segment(list(input_ids), sampling, rids, 0)
    results = []
    for sample_rid, out in zip(rids, outs):
      kind = out.finish.kind
      if kind is FinishKind.ABORT and len(out.output_ids) >= sampling.max_new_tokens:
        kind = FinishKind.LENGTH
      results.append(GenerationResult(sample_rid, out.output_ids, out.output_logprobs,
                                      out.token_versions, kind, server.url, tries, 0))
    stopped = epoch != self._abort_epoch
    resumed = [i for i, r in enumerate(results) if r.finish_reason is FinishKind.ABORT
               and not stopped and r.rid not in self._cancelled and self.max_continuations > 0]
    self._cancelled.difference_update(rids)
    if resumed:
      self._counts["continuations"] += len(resumed)
      log.info("group %s: %d sample(s) aborted on %s; continuing", rid, len(resumed), server.url)
      continued = await asyncio.gather(*(self.generate(input_ids, sampling,
                                                       resume_from=results[i]) for i in resumed))
      for i, result in zip(resumed, continued):
        results[i] = result
    return results

  async def _segment(self, prompt: list[int], sampling: SamplingParams, rids: list[str],
                     attempt_base: int) -> tuple[list[proto.GenerateOutput], Server, int]:
    """One stop/length/abort segment of each of `rids` (one request: a single sample, or a batch
    of samples of `prompt`), retried on other servers; returns (outputs, server, tries)."""
    tried: set[str] = set()
    errors = []
    for i in range(self.max_retries + 1):
      try:
        server = await self._gen.pick(tried, self.no_server_wait_s)
      except AttemptFailed as e:
        errors.append(str(e))
        break
      # A fresh wire id per attempt: a server that timed out may still hold the old one.
      wire = [r if attempt_base + i == 0 else f"{r}.{attempt_base + i}" for r in rids]
      body = (proto.generate_request(prompt, sampling, wire[0]) if len(rids) == 1 else
              proto.generate_batch_request(prompt, sampling, wire))
      self._active.update((r, (server, w)) for r, w in zip(rids, wire))
      self._counts["generate"] += 1
      self._counts["retries"] += int(i > 0)
      try:
        with self._gen.track(server):
          outs = await self._attempt(server, body, sampling.max_new_tokens, len(rids))
        server.consecutive_failures = 0
        return outs, server, i + 1
      except AttemptFailed as e:
        tried.add(server.url)
        errors.append(f"{server.url}: {e}")
        self._record_failure(server, wire, e)
      except asyncio.CancelledError:
        for w in wire:
          self._spawn(self._abort_on(server.url, w))
        raise
      finally:
        for r in rids:
          self._active.pop(r, None)
    raise GenerationError(f"request {rids[0] if len(rids) == 1 else rids} failed {len(errors)} "
                          "time(s): " + " | ".join(errors))

  async def _attempt(self, server: Server, body: dict[str, Any], max_new_tokens: int,
                     count: int) -> list[proto.GenerateOutput]:
    status, text = await self._gen.http(server.url, "POST", "/generate", body,
                                        self.request_timeout_s)
    if status in REJECTED_STATUSES and not proto.says_engine_down(text):
      raise RequestRejected(f"{server.url} rejected request {body['rid']} (HTTP {status}): "
                            f"{text[:500]}")
    if status != 200:
      raise AttemptFailed(Fault.SERVER_ERROR, f"HTTP {status}: {text[:200]}")
    try:
      answer = proto.loads_json(text)
      if count > 1 and (not isinstance(answer, list) or len(answer) != count):
        raise proto.MalformedResponse(f"a batch of {count} samples needs a list of {count} "
                                      f"results, got {type(answer).__name__}"
                                      f"{f' of {len(answer)}' if isinstance(answer, list) else ''}")
      outs = [proto.parse_generate_output(obj, vocab_size=self.vocab_size)
              for obj in (answer if count > 1 else [answer])]
      for out in outs:
        if len(out.output_ids) > max_new_tokens:
          raise proto.MalformedResponse(f"{len(out.output_ids)} tokens > max_new_tokens "
                                        f"{max_new_tokens}")
    except proto.MalformedResponse as e:
      raise AttemptFailed(Fault.MALFORMED, str(e)) from None
    return outs

  def _record_failure(self, server: Server, wire_rids: list[str], e: AttemptFailed) -> None:
    server.num_failures += 1
    server.consecutive_failures += 1  # routed to only when no server without failures is left
    if e.fault is Fault.MALFORMED:  # the server is up; only this answer is rejected
      server.num_malformed += 1
      self._counts["malformed"] += 1
      log.error("rejected malformed response from %s for %s: %s", server.url, wire_rids, e)
      return
    self._counts["timeouts" if e.fault is Fault.TIMEOUT else "connection"] += 1
    if e.fault is Fault.TIMEOUT:  # free the slots the hung request may still hold
      for wire_rid in wire_rids:
        self._spawn(self._abort_on(server.url, wire_rid))
    self._gen.mark_down(server, str(e))

  async def stream(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                   rid: str | None = None) -> AsyncIterator[GenerationResult]:
    """Yields cumulative partial results from one server (no retry or continuation)."""
    rid = rid or uuid.uuid4().hex
    server = await self._gen.pick(set(), self.no_server_wait_s)
    body = proto.generate_request(input_ids, sampling, rid, stream=True)
    lines = []
    with self._gen.track(server):
      async with self._gen.session().post(server.url + "/generate", json=body) as resp:
        if resp.status != 200:
          text = await resp.text()
          rejected = resp.status in REJECTED_STATUSES and not proto.says_engine_down(text)
          error = RequestRejected if rejected else GenerationError
          raise error(f"{server.url}: HTTP {resp.status}: {text[:500]}")
        async for raw in resp.content:
          line = raw.decode().strip()
          if line:
            lines.append(line)
          if not line or line == "data: [DONE]":
            continue
          out = proto.parse_generate_output(proto.loads_json(line[len("data:"):]),
                                            vocab_size=self.vocab_size, unfinished_ok=True)
          yield GenerationResult(rid, out.output_ids, out.output_logprobs, out.token_versions,
                                 out.finish.kind if out.finish else None, server.url, 1, 0)
    proto.parse_stream(lines, vocab_size=self.vocab_size)  # the whole stream must be well formed

  # --- controller operations, fanned out to every server (or `urls`) ----------------------------

  async def pause(self, mode: PauseMode = PauseMode.ABORT, *,
                  urls: Sequence[str] | None = None) -> dict[str, proto.StatusResult]:
    self._pool.paused = self._gen.paused = True
    return await self._op("pause_generation", "POST", "/pause_generation", {"mode": mode.value},
                          json_parser(proto.StatusResult.from_json), urls)

  async def continue_generation(self, *, urls: Sequence[str] | None = None
                                ) -> dict[str, proto.StatusResult]:
    out = await self._op("continue_generation", "POST", "/continue_generation", {},
                         json_parser(proto.StatusResult.from_json), urls)
    self._pool.paused = self._gen.paused = False
    return out

  async def update_weights_from_disk(self, model_path: str, version: str | int, *,
                                     abort_all_requests: bool = False, flush_cache: bool = True,
                                     urls: Sequence[str] | None = None
                                     ) -> dict[str, proto.UpdateWeightsResult]:
    """Raises `ServerOpError` if any server did not load it; its `refused` holds the servers that
    answered `success: false` (they keep serving their weights: the directory is at fault)."""
    def parse(text: str) -> proto.UpdateWeightsResult:
      res = proto.UpdateWeightsResult.from_json(proto.loads_json(text))
      if not res.success:
        raise RuntimeError(f"update failed: {res.message}")
      return res
    body = {"model_path": model_path, "weight_version": str(version),
            "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}
    return await self._pool.fan_out("update_weights_from_disk", "POST",
                                    "/update_weights_from_disk", body, parse, urls,
                                    self.op_timeout_s, refusal=_update_refusal)

  async def abort_all(self, *, urls: Sequence[str] | None = None) -> dict[str, None]:
    """Aborts every request; their callers get partial results (finish ABORT), not continuations."""
    self._abort_epoch += 1
    return await self._op("abort_request", "POST", "/abort_request",
                          {"rid": "", "abort_all": True}, lambda _: None, urls)

  async def abort(self, rid: str) -> bool:
    """Aborts one in-flight request; its `generate` returns the partial result. False if idle."""
    if rid not in self._active:
      return False
    self._cancelled.add(rid)
    server, wire_rid = self._active[rid]
    await self._abort_on(server.url, wire_rid)
    return True

  async def loads(self) -> dict[str, tuple[proto.ServerLoad, ...]]:
    return await self._op("loads", "GET", "/v1/loads", None,
                          json_parser(proto.ServerLoad.list_from_json))

  async def model_info(self) -> dict[str, proto.ModelInfo]:
    return await self._op("model_info", "GET", "/model_info", None,
                          json_parser(proto.ModelInfo.from_json))

  async def server_info(self) -> dict[str, Any]:
    return await self._op("server_info", "GET", "/server_info", None,
                          json_parser(proto.parse_server_info))

  async def flush_cache(self) -> dict[str, str]:
    return await self._op("flush_cache", "POST", "/flush_cache", None, str)

  async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> None:
    """Polls `/v1/loads` until no server has running or waiting requests."""
    deadline = time.monotonic() + timeout_s
    while True:
      busy = [u for u, loads in (await self.loads()).items()
              if any(x.num_running_reqs or x.num_waiting_reqs for x in loads)]
      if not busy:
        return
      if time.monotonic() > deadline:
        raise TimeoutError(f"servers still busy after {timeout_s}s: {busy}")
      await asyncio.sleep(poll_s)

  async def wait_healthy(self, timeout_s: float, poll_s: float = 0.1) -> None:
    """Waits until every server answers `/health_generate` 200, and puts them all in rotation."""
    deadline = time.monotonic() + timeout_s
    pending = list(self._pool.servers.values())
    while pending:
      ok = await asyncio.gather(*(self._pool.probe(s.url, "/health_generate") for s in pending))
      for s, good in zip(pending, ok):
        s.healthy = s.healthy or good
      pending = [s for s, good in zip(pending, ok) if not good]
      if pending and time.monotonic() > deadline:
        raise TimeoutError(f"servers not healthy after {timeout_s}s: {[s.url for s in pending]}")
      if pending:
        await asyncio.sleep(poll_s)

  async def _op(self, op, method, path, body, parse, urls=None):
    return await self._pool.fan_out(op, method, path, body, parse, urls, self.op_timeout_s)

  async def _abort_on(self, url: str, wire_rid: str) -> None:
    """Aborts `wire_rid` where it runs; behind a router (which does not forward aborts, nor say
    which worker it chose) on every worker: rids are unique, so only the one holding it acts."""
    targets = list(self._pool.servers) if url == self.router_url else [url]
    await asyncio.gather(*(self._pool.http(u, "POST", "/abort_request", {"rid": wire_rid}, 5.0)
                           for u in targets), return_exceptions=True)

  def _spawn(self, coro) -> None:
    task = asyncio.ensure_future(coro)
    self._background.add(task)  # keep a reference until done
    task.add_done_callback(self._background.discard)


def _update_refusal(error: BaseException) -> str | None:
  """The server's reason when it answered a weight update with `success: false` (HTTP 400 with
  SGLang's JSON); None when the server itself failed (no answer, 5xx, garbage)."""
  if (not isinstance(error, HTTPStatusError) or error.status != 400
      or proto.says_engine_down(error.text)):
    return None
  try:
    answer = proto.loads_json(error.text)
  except proto.MalformedResponse:
    return None
  if isinstance(answer, dict) and answer.get("success") is False:
    return str(answer.get("message") or "refused")
  return None
