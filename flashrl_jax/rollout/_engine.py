"""The in-process rollout engine: a continuous-batching scheduler loop around the device `Runner`.

Why a thread: device work blocks, and the HTTP server (or a test) must stay responsive while tokens
are produced, so one background thread owns every slot, the queue and the weights, and is the only
code that touches them. Other threads talk to it through `submit` (which only enqueues) and control
methods that run *on* the engine thread between steps and return a `concurrent.futures.Future`.

Scheduling: waiting requests are prefilled into free slots (FIFO, grouped up to a token budget) as
soon as a slot frees, then one decode step advances every occupied slot; a finished request frees its
slot at once, so a short request never waits for a long one. Pausing and weight updates follow
SGLang's semantics (see `PauseMode` and `update_weights_from_disk`).

Failure isolation: nothing a request carries may stop the engine thread. Requests are checked
against the engine's limits before they are queued (`validate`, including building their device
row); a device call that still fails is retried with its requests alone (a failed group prefill),
and only the request that fails on its own is ended, with an error (`Output.error`, answered 5xx).
A failed device call may have consumed the donated slot state, so the slots are rebuilt and the
running requests recomputed from prompt + output, as on a retract. Only a `BaseException` that is
not an `Exception` (an interpreter exit, or `kill` for fault tests) ends the thread; the engine then
refuses work with `EngineShutDown` and the server answers 503.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
import uuid
from typing import Callable, Sequence

import numpy as np

from flashrl_jax.model import load_tokenizer, read_config
from flashrl_jax.rollout._compiles import CompileCounts, compile_counts
from flashrl_jax.rollout._config import EngineConfig, EngineStats
from flashrl_jax.fleet import FinishKind, FinishReason, PauseMode
from flashrl_jax.rollout._request import (LogprobOptions, Output, Request, RequestFault,
                                          validate_request)
from flashrl_jax.rollout._runner import Runner, rollout_mesh
from flashrl_jax.rollout._sampling import MAX_TOP_LOGPROBS, RowSampling, Sampling
from flashrl_jax.rollout._scoring import PromptScorer

log = logging.getLogger(__name__)

# Decode calls that may fail in a row (each followed by a rebuild of the slots) before the requests
# running in them are failed: a failure that survives a rebuild is not transient.
MAX_DECODE_FAILURES = 2


class EngineShutDown(RuntimeError):
  """The engine thread has stopped (shutdown, or killed): nothing submitted would ever run."""


class _Killed(BaseException):
  """Raised on the engine thread by `kill` (fault tests): not an `Exception`, so nothing catches it."""


class Engine:
  """Continuous-batching generation over `max_running_requests` slots; see the module docstring."""

  def __init__(self, config: EngineConfig, *, devices=None):
    self.config = config
    self._compiles_at_start = compile_counts()
    self._compiles_at_warmup: CompileCounts | None = None
    model_config = read_config(config.model_path)
    self.context_length = config.context_length or min(model_config.max_position_embeddings, 4096)
    self.runner = Runner(config.model_path, num_slots=config.max_running_requests,
                         context_length=self.context_length, dtype=config.dtype,
                         mesh=rollout_mesh(config.tp, devices),
                         min_prefill_len=config.min_prefill_len,
                         max_prefill_batch=config.max_prefill_batch,
                         min_decode_batch=config.min_decode_batch,
                         min_decode_span=config.min_decode_span,
                         decode_block=config.num_continuous_decode_steps)
    self.model_config = self.runner.config
    self.scorer = PromptScorer(self.runner.graphdef)
    self.vocab_size = self.model_config.vocab_size
    self.tokenizer = None
    try:
      self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
    except FileNotFoundError:
      if config.tokenizer_path:
        raise
    eos = list(self.model_config.eos_token_ids)
    if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
      eos.append(self.tokenizer.eos_token_id)
    self.eos_ids = tuple(dict.fromkeys(eos))
    self.model_path = config.model_path
    self.weight_version = config.weight_version
    self.stats = EngineStats()
    self._rng = np.random.default_rng(config.seed)
    self._cv = threading.Condition()
    self._waiting: collections.deque[Request] = collections.deque()
    self._held: list[Request] = []  # arrived while a weight update waits for in-flight requests
    self._live: dict[str, Request] = {}
    self._slots: list[Request | None] = [None] * config.max_running_requests
    self._commands: collections.deque = collections.deque()
    self._paused: PauseMode | None = None
    self._pending_update: tuple[str, str | None, bool, concurrent.futures.Future] | None = None
    self._slots_dirty = True
    self._stopping = False
    self._decode_failures = 0
    self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
    self._thread.start()

  # --- public API (any thread) -------------------------------------------------------------------

  @property
  def paused(self) -> PauseMode | None:
    return self._paused

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def validate(self, prompt_ids: Sequence[int], sampling: Sampling,
               logprobs: LogprobOptions = LogprobOptions()) -> None:
    """Raises ValueError for a request this engine cannot serve (checked before queuing)."""
    validate_request(prompt_ids, sampling, vocab_size=self.vocab_size,
                     context_length=self.context_length, eos_ids=self.eos_ids, logprobs=logprobs)
    if self.tokenizer is None and (sampling.stop or sampling.stop_regex):
      raise ValueError("stop strings and stop_regex need a tokenizer; this server has none.")

  def submit(self, prompt_ids: Sequence[int], sampling: Sampling = Sampling(), *,
             rid: str | None = None, group: str | None = None,
             on_update: Callable[[Output], None] | None = None, stream: bool = False,
             logprobs: LogprobOptions = LogprobOptions()) -> Request:
    """Queues one sample (`sampling.n` is ignored here); returns its handle (`.result()` blocks)."""
    prompt_ids = [int(t) for t in prompt_ids]
    self.validate(prompt_ids, sampling, logprobs)
    seed = (sampling.sampling_seed if sampling.sampling_seed is not None
            else int(self._rng.integers(0, 2**63)))
    room = self.context_length - len(prompt_ids)
    max_new = room if sampling.max_new_tokens is None else min(sampling.max_new_tokens, room)
    request = Request(rid or uuid.uuid4().hex, prompt_ids, sampling, seed=seed,
                      max_new_tokens=max_new, eos_ids=self.eos_ids, group=group,
                      on_update=on_update, stream=stream, logprobs=logprobs)
    try:  # the row the device will see: anything that does not fit fails here, not on the thread
      RowSampling.host([self._sampling_row(request)], 1)
    except (ArithmeticError, ValueError, TypeError) as e:
      raise ValueError(f"sampling options do not fit the engine: {e}") from None
    with self._cv:
      if self._stopping:
        raise EngineShutDown("the engine is shut down.")
      if request.rid in self._live:
        raise ValueError(f"a request with rid {request.rid!r} is already running.")
      self._live[request.rid] = request
      (self._held if self._pending_update else self._waiting).append(request)
      self._cv.notify_all()
    return request

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: Sampling | Sequence[Sampling] = Sampling(),
               timeout: float | None = None) -> list[Output]:
    """Blocking convenience: all prompts (each `n` times, prompt-major), in order."""
    samplings = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
    requests = [self.submit(p, s) for p, s in zip(prompts, samplings) for _ in range(s.n)]
    return [r.result(timeout) for r in requests]

  def warmup(self) -> concurrent.futures.Future:
    """Compiles every shape a step can have (between steps); the future gets `compiles()`."""
    return self._call(self._do_warmup)

  def pause(self, mode: PauseMode = PauseMode.ABORT) -> concurrent.futures.Future:
    return self._call(self._do_pause, mode)

  def resume(self) -> concurrent.futures.Future:
    return self._call(setattr, self, "_paused", None)

  def set_weight_version(self, version: str) -> concurrent.futures.Future:
    """Relabels the current weights (between steps, so a token never sees half a change)."""
    return self._call(setattr, self, "weight_version", version)

  def abort(self, rid: str | None = None, abort_all: bool = False) -> concurrent.futures.Future:
    """Finishes matching requests (rid, or the samples of an n>1 group rid) with partial output."""
    return self._call(self._do_abort, rid, abort_all)

  def update_weights_from_disk(self, path: str, version: str | None = None,
                               abort_all: bool = False) -> concurrent.futures.Future:
    """Future of (success, message, num_paused_requests).

    Paused: applies at once (in-place requests keep their KV and continue on the new weights).
    Not paused: new requests are held and the update applies once in-flight requests finish.
    A directory that does not fit the running model is refused; the old weights keep serving.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._cv:  # set here, not on the engine thread, so requests submitted after us wait
      if self._stopping:
        future.set_exception(EngineShutDown("the engine is shut down."))
      elif self._pending_update is not None:
        future.set_result((False, "another weight update is still waiting for in-flight "
                                  "requests.", 0))
      else:
        self._pending_update = (path, version, abort_all, future)
        self._cv.notify_all()
    return future

  def flush_cache(self) -> concurrent.futures.Future:
    """Future of True (KV dropped) or False (requests are in flight)."""
    return self._call(self._do_flush)

  def compiles(self) -> dict[str, float | int | None]:
    """Programs built since this engine started, and since its warm-up ended (a warmed-up engine
    must show none: each one stalled a step)."""
    now = compile_counts()
    since_start = now - self._compiles_at_start
    after = None if self._compiles_at_warmup is None else (now - self._compiles_at_warmup).programs
    return {"num_compiles": since_start.programs,
            "num_compile_cache_hits": since_start.cache_hits,
            "compile_s": round(since_start.seconds, 3),
            "num_compiles_after_warmup": after,
            "warmup_shapes": self.stats.warmup_shapes, "warmup_s": self.stats.warmup_s}

  def loads(self) -> dict[str, int]:
    with self._cv:
      running = [r for r in self._slots if r is not None]
      return {"num_running_reqs": len(running),
              "num_waiting_reqs": len(self._waiting) + len(self._held),
              "num_used_tokens": sum(len(r.prompt_ids) + r.num_generated for r in running),
              "max_total_num_tokens": self.context_length * len(self._slots)}

  def kill(self) -> concurrent.futures.Future:
    """Ends the engine thread as a crash would (fault tests): in-flight requests fail, new ones are
    refused with `EngineShutDown`, and `alive` turns False."""
    return self._call(self._die)

  def shutdown(self, timeout: float = 30.0) -> None:
    with self._cv:
      self._stopping = True
      self._cv.notify_all()
    self._thread.join(timeout)

  def __enter__(self) -> "Engine":
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()

  # --- engine thread -----------------------------------------------------------------------------

  def _call(self, fn, *args) -> concurrent.futures.Future:
    """Runs `fn(*args)` on the engine thread between steps; the future gets its return value."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._cv:
      if self._stopping:
        future.set_exception(EngineShutDown("the engine is shut down."))
        return future
      self._commands.append((fn, args, future))
      self._cv.notify_all()
    return future

  def _running(self) -> list[tuple[int, Request]]:
    return [(i, r) for i, r in enumerate(self._slots) if r is not None]

  def _has_work(self) -> bool:
    if self._stopping or self._commands:
      return True
    busy = bool(self._waiting) or any(r is not None for r in self._slots)
    if self._pending_update and (self._paused or not busy):
      return True
    return self._paused is None and busy

  def _loop(self) -> None:
    try:
      while True:
        with self._cv:
          while not self._has_work():
            self._cv.wait()
          if self._stopping:
            break
        try:
          self._iterate()
        except Exception as error:  # noqa: BLE001 - a bug in one iteration must not end the thread
          self._on_unexpected(error)
    except _Killed:
      log.warning("rollout engine thread killed (fault injection)")
    except BaseException:
      log.exception("rollout engine loop crashed")
      raise
    finally:
      with self._cv:
        self._stopping = True  # refuse new work: nothing would ever run it
      self._abort_everything("the engine shut down", error=503)
      with self._cv:
        for _, _, future in self._commands:
          future.set_exception(EngineShutDown("the engine is shut down."))
        self._commands.clear()
        if self._pending_update is not None:
          self._pending_update[-1].set_exception(EngineShutDown("the engine is shut down."))
          self._pending_update = None

  def _iterate(self) -> None:
    with self._cv:
      commands = list(self._commands)
      self._commands.clear()
    for i, (fn, args, future) in enumerate(commands):
      try:
        future.set_result(fn(*args))
      except Exception as e:  # surfaced to the caller, never kills the loop
        future.set_exception(e)
      except BaseException:  # the thread ends: this and the later commands fail with it
        future.set_exception(EngineShutDown("the engine is shut down."))
        with self._cv:
          self._commands.extendleft(reversed(commands[i + 1:]))
        raise
    self._maybe_apply_update()
    if self._paused is None:
      self._admit()
      if any(r is not None for r in self._slots):
        self._step()

  def _on_unexpected(self, error: Exception) -> None:
    """A failure outside the guarded device calls: fail what was running, rebuild the slots."""
    log.exception("rollout engine iteration failed; failing its running requests")
    self.stats.engine_errors += 1
    for slot, request in self._running():
      self._fail(request, slot, f"internal engine error: {error!r:.300}")
    try:
      self.runner.reset()
    except Exception:  # noqa: BLE001 - the next device call will fail and be isolated again
      log.exception("could not rebuild the slot state")

  def _die(self) -> None:
    raise _Killed("engine killed on request (fault injection)")

  def _sampling_row(self, request: Request):
    return (request.sampling, request.seed, request.stop_ids)

  def _finish(self, request: Request, finish: FinishReason) -> None:
    with self._cv:
      self._live.pop(request.rid, None)
    request.complete(finish, self.weight_version)

  def _fail(self, request: Request, slot: int | None, message: str, status: int = 500) -> None:
    """Ends one request with an error (freeing its slot), leaving every other request alone."""
    log.error("request %s failed in the engine: %s", request.rid, message)
    if slot is not None:
      self._free(slot)
    with self._cv:
      self._live.pop(request.rid, None)
    request.fail(message, self.weight_version, status)

  def _rebuild_slots(self) -> None:
    """After a failed device call, whose donated slot state may be gone: every running request goes
    back to the front of the queue (recomputed from prompt + output, as on retract) and the slots
    start empty."""
    running = sorted((r for _, r in self._running()), key=lambda r: r.created)
    for slot, _ in self._running():
      self._free(slot)
    with self._cv:
      self._waiting.extendleft(reversed(running))
    self.runner.reset()

  def _free(self, slot: int) -> None:
    self._slots[slot] = None
    self._slots_dirty = True

  def _admit(self) -> None:
    """Prefills waiting requests into free slots, a group at a time, until one side runs out."""
    while True:
      free = [i for i, r in enumerate(self._slots) if r is None]
      group: list[Request] = []
      exhausted: list[Request] = []  # nothing left to generate (max_new_tokens == 0)
      with self._cv:
        while self._waiting and len(group) < min(len(free), self.config.max_prefill_batch):
          candidate = self._waiting[0]
          if candidate.num_generated >= candidate.max_new_tokens:
            exhausted.append(self._waiting.popleft())
            continue
          if group and (candidate.solo or group[0].solo):
            break
          lengths = [len(r.prompt_ids) + r.num_generated for r in group + [candidate]]
          g, t = self.runner.prefill_bucket(lengths)
          if group and g * t > self.config.prefill_token_budget:
            break
          group.append(self._waiting.popleft())
      self._score_prompts(group + exhausted)
      group = [r for r in group if not r.done]  # (scoring failed them)
      for request in exhausted:
        if not request.done:
          self._finish(request, FinishReason(FinishKind.LENGTH, length=request.num_generated))
      if not group:
        if not exhausted:
          return
        continue
      prompts = [r.all_ids() for r in group]
      start = time.perf_counter()
      try:
        tokens, logprobs, (top_ids, top_lps) = self.runner.prefill(
            prompts, free[:len(group)], [self._sampling_row(r) for r in group],
            [r.num_generated for r in group], top_n=self._top_n(group))
      except Exception as error:  # noqa: BLE001 - isolated to the requests of this group
        self._prefill_failed(group, error)
        continue
      self.stats.prefill_s += time.perf_counter() - start
      self.stats.prefill_calls += 1
      self.stats.prefill_tokens += sum(len(p) for p in prompts)
      for i, (slot, request) in enumerate(zip(free, group)):
        self._on_token(request, int(tokens[i]), float(logprobs[i]), slot=None,
                       top=(top_ids[i], top_lps[i]))
        if not request.done:
          self._slots[slot] = request
          self._slots_dirty = True

  def _prefill_failed(self, group: list[Request], error: Exception) -> None:
    """A group prefill raised: retry its requests one by one; one that fails alone is failed."""
    self.stats.engine_errors += 1
    log.error("prefill of %d request(s) failed: %r", len(group), error)
    if len(group) == 1 and (group[0].solo or self.config.max_prefill_batch == 1):
      self._fail(group[0], None, f"prefill failed: {error!r:.300}")
    else:
      for request in group:
        request.solo = True
      with self._cv:
        self._waiting.extendleft(reversed(group))
    self._rebuild_slots()

  def _step(self) -> None:
    """One decode call over the live slots, wherever they are (nothing is moved): a block of up to
    `num_continuous_decode_steps` tokens each, as many as the longest context leaves room for."""
    running = self._running()
    start = time.perf_counter()
    try:
      if self._slots_dirty:
        self.runner.set_slots([self._sampling_row(r) if r is not None else (None, 0, ())
                               for r in self._slots])
        self._slots_dirty = False
      longest = max(len(r.prompt_ids) + r.num_generated for _, r in running)
      # The block writes positions up to longest + steps - 2; the cache holds context + 1.
      steps = max(1, min(self.config.num_continuous_decode_steps,
                         self.context_length + 1 - longest))
      tokens, logprobs, (top_ids, top_lps) = self.runner.decode(
          [slot for slot, _ in running], top_n=self._top_n([r for _, r in running]), steps=steps)
    except Exception as error:  # noqa: BLE001 - the slots are rebuilt; the engine goes on
      self._decode_failed(error)
      return
    self._decode_failures = 0
    self.stats.decode_s += time.perf_counter() - start
    self.stats.decode_steps += steps
    self.stats.decode_calls += 1
    self.stats.computed_slot_steps += self.runner.decode_batch(len(running)) * steps
    for i, (slot, request) in enumerate(running):
      for j in range(steps):
        if request.done:  # it ended earlier in the block: the rest of its tokens are dropped
          break
        self.stats.busy_slot_steps += 1
        self._on_token(request, int(tokens[j, i]), float(logprobs[j, i]), slot=slot,
                       top=(top_ids[j, i], top_lps[j, i]))
    if self.config.decode_delay_s:
      time.sleep(self.config.decode_delay_s)

  @staticmethod
  def _top_n(requests: Sequence[Request]) -> int:
    """Top candidates to compute this step: none, or the cap (one extra program, not one per n)."""
    return MAX_TOP_LOGPROBS if any(r.logprob_options.top_n for r in requests) else 0

  def _score_prompts(self, requests: Sequence[Request]) -> None:
    """Prompt log-probs for the requests that asked, on the weights about to generate for them."""
    for request in requests:
      if request.wants_input_logprobs:
        try:
          logprobs, tops = self.scorer.score(self.runner.params, request.prompt_ids,
                                             request.logprob_options.top_n)
        except Exception as error:  # noqa: BLE001 - fails this request alone
          self.stats.engine_errors += 1
          self._fail(request, None, f"prompt scoring failed: {error!r:.300}")
          continue
        request.set_input_logprobs(logprobs, tops)

  def _decode_failed(self, error: Exception) -> None:
    self.stats.engine_errors += 1
    self._decode_failures += 1
    log.error("decode step failed (%d in a row): %r", self._decode_failures, error)
    if self._decode_failures >= MAX_DECODE_FAILURES:  # not transient: fail what it was running
      self._decode_failures = 0
      for slot, request in self._running():
        self._fail(request, slot, f"decode failed {MAX_DECODE_FAILURES} times: {error!r:.300}")
    self._slots_dirty = True
    self._rebuild_slots()

  def _on_token(self, request: Request, token: int, logprob: float, slot: int | None,
                top=None) -> None:
    if not math.isfinite(logprob):  # never sent: it is not JSON, and no ratio could use it
      self._fail(request, slot, f"the model produced a non-finite log-prob ({logprob}) at output "
                                f"position {request.num_generated} (non-finite logits?)")
      return
    request.append(token, logprob, self.weight_version, top)
    self.stats.generated_tokens += 1
    try:
      finish = request.check_finish(self.tokenizer)
    except RequestFault as error:
      self._fail(request, slot, str(error), status=400)
      return
    except Exception as error:  # noqa: BLE001 - e.g. a tokenizer failing on a stop-string check
      self._fail(request, slot, f"finish check failed: {error!r:.300}")
      return
    if finish is None:
      request.notify(self.weight_version)
      return
    if slot is not None:
      self._free(slot)
    self._finish(request, finish)

  # --- control commands (engine thread) ----------------------------------------------------------

  def _abort_everything(self, message: str, *, held_too: bool = True, error: int = 0) -> int:
    return self._abort_matching(lambda r: True, message, held_too=held_too, error=error)

  def _abort_matching(self, match, message: str, *, held_too: bool = True, error: int = 0) -> int:
    """Finishes every matching request (queued, held, running) with its partial output; with an
    `error` status, as failed (the server answers it: retry elsewhere, not a continuation here)."""
    with self._cv:
      victims = [r for r in self._waiting if match(r)]
      self._waiting = collections.deque(r for r in self._waiting if not match(r))
      if held_too:
        victims += [r for r in self._held if match(r)]
        self._held = [r for r in self._held if not match(r)]
    for slot, request in self._running():
      if match(request):
        self._free(slot)
        victims.append(request)
    for request in victims:
      if error:
        self._fail(request, None, message, status=error)
      else:
        self._finish(request, FinishReason(FinishKind.ABORT, message=message))
    return len(victims)

  def _do_pause(self, mode: PauseMode) -> None:
    if mode is PauseMode.ABORT:
      self._abort_everything("aborted by /pause_generation")
    elif mode is PauseMode.RETRACT:
      running = sorted((r for _, r in self._running()), key=lambda r: r.created)
      for slot, _ in self._running():
        self._free(slot)  # KV dropped; recomputed from prompt + output on continue
      with self._cv:
        self._waiting.extendleft(reversed(running))
    self._paused = mode

  def _do_abort(self, rid: str | None, abort_all: bool) -> int:
    if abort_all:
      return self._abort_everything("aborted by /abort_request")
    if rid is None:
      return 0
    return self._abort_matching(lambda r: rid in (r.rid, r.group), "aborted by /abort_request")

  def _maybe_apply_update(self) -> None:
    if self._pending_update is None:
      return
    path, version, abort_all, future = self._pending_update
    if abort_all:  # requests that arrived after the update call are not in flight: keep them
      self._abort_everything("aborted for a weight update", held_too=False)
    busy = bool(self._waiting) or any(r is not None for r in self._slots)
    if busy and self._paused is None:
      return
    num_paused = len(self._waiting) + len(self._running()) if self._paused else 0
    try:
      params = self.runner.load_params(path)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the directory, refuse it
      result = (False, f"Failed to update weights from {path}: {e} Still serving weight version "
                       f"{self.weight_version!r}.", num_paused)
    else:
      self.runner.set_params(params)
      self.model_path = path
      if version is not None:
        self.weight_version = version
      result = (True, f"Succeeded to update model weights (weight_version "
                      f"{self.weight_version!r}).", num_paused)
    with self._cv:
      self._pending_update = None
      self._waiting.extend(self._held)
      self._held.clear()
    future.set_result(result)

  def _do_warmup(self) -> dict:
    start = time.perf_counter()
    self.stats.warmup_shapes = self.runner.warmup(self.config.prefill_token_budget)
    self.stats.warmup_s = round(time.perf_counter() - start, 3)
    self._compiles_at_warmup = compile_counts()
    return self.compiles()

  def _do_flush(self) -> bool:
    if self._waiting or self._running() or self._held:
      return False
    self.runner.reset()
    return True

