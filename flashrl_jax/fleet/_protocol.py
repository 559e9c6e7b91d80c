"""Typed values for SGLang's native HTTP protocol, and the validators that guard them.

Rollout servers (real SGLang on GPUs, our JAX server elsewhere, the test stub) all speak the JSON of
`shared/SGLANG_PROTOCOL.md`. This module is the one place that turns typed requests into that JSON
and turns response JSON back into typed values, rejecting anything malformed (`MalformedResponse`):
a response whose log-prob count differs from its token count, or whose token ids fall outside the
vocabulary, would silently corrupt off-policy correction downstream, so it must never get past here.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

# The pause mode is a protocol value and a scheduling cost: defined once, with the policy.
from flashrl_jax.scheduling import PauseMode  # noqa: F401 (re-exported by the fleet)

# Version string used when a server reports neither `weight_versions` spans nor `weight_version`
# (an older SGLang); callers can tell "unknown" from any real version.
UNKNOWN_VERSION = ""


class MalformedResponse(ValueError):
  """A server answered with something that does not follow the protocol."""


class FinishKind(enum.Enum):
  STOP = "stop"
  LENGTH = "length"
  ABORT = "abort"


@dataclasses.dataclass(frozen=True)
class FinishReason:
  kind: FinishKind
  matched: int | str | None = None  # stop token id or stop string (STOP)
  length: int | None = None         # (LENGTH)
  message: str | None = None        # (ABORT)

  @classmethod
  def from_json(cls, obj: Any) -> FinishReason:
    if not isinstance(obj, Mapping) or "type" not in obj:
      raise MalformedResponse(f"finish_reason must be an object with a type, got {obj!r}")
    try:
      kind = FinishKind(obj["type"])
    except ValueError:
      raise MalformedResponse(f"unknown finish_reason type {obj['type']!r}") from None
    return cls(kind, matched=obj.get("matched"), length=obj.get("length"),
               message=obj.get("message"))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling; turned into the protocol's `sampling_params` object only at the edge.

  `seed` maps to SGLang's `sampling_seed`. `n` is deliberately absent: RL rollouts send n separate
  requests (prompt replication) so each sample is load-balanced and retried on its own.
  """
  max_new_tokens: int = 128
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  seed: int | None = None
  ignore_eos: bool = False
  min_new_tokens: int = 0
  skip_special_tokens: bool = True

  def __post_init__(self):
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    object.__setattr__(self, "stop", tuple(self.stop))
    if self.max_new_tokens < 0 or self.min_new_tokens < 0:
      raise ValueError(f"token counts must be >= 0: {self}")
    if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
      raise ValueError(f"invalid temperature/top_p/min_p: {self}")
    if self.top_k == 0 or self.top_k < -1:
      raise ValueError(f"top_k must be -1 (all) or >= 1: {self}")

  def to_json(self) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
        "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
        "ignore_eos": self.ignore_eos, "min_new_tokens": self.min_new_tokens,
        "skip_special_tokens": self.skip_special_tokens,
        # Keep stop tokens/strings in the output so tokens and log-probs stay aligned for training.
        "no_stop_trim": True,
    }
    if self.stop_token_ids:
      out["stop_token_ids"] = list(self.stop_token_ids)
    if self.stop:
      out["stop"] = list(self.stop)
    if self.seed is not None:
      out["sampling_seed"] = self.seed
    return out


def generate_request(input_ids: Sequence[int], sampling: SamplingParams, rid: str, *,
                     stream: bool = False) -> dict[str, Any]:
  """The `/generate` body the client sends for one sample (always with output log-probs)."""
  body: dict[str, Any] = {"input_ids": [int(t) for t in input_ids],
                          "sampling_params": sampling.to_json(), "rid": rid,
                          "return_logprob": True, "logprob_start_len": -1}
  if stream:
    body["stream"] = True
  return body


def generate_batch_request(input_ids: Sequence[int], sampling: SamplingParams,
                           rids: Sequence[str]) -> dict[str, Any]:
  """The `/generate` body for `len(rids)` samples of one prompt in one request: SGLang's batch form
  (the prompt once per sample, one rid each, shared sampling params); the answer is a list in the
  same order."""
  ids = [int(t) for t in input_ids]
  return {"input_ids": [ids] * len(rids), "sampling_params": sampling.to_json(),
          "rid": list(rids), "return_logprob": True, "logprob_start_len": -1}


@dataclasses.dataclass(frozen=True)
class VersionSpan:
  version: str
  start: int
  end: int


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """One validated `/generate` result object (one sample)."""
  rid: str | None
  output_ids: tuple[int, ...]
  output_logprobs: tuple[float, ...]
  token_versions: tuple[str, ...]
  finish: FinishReason | None  # None only in a stream chunk before the last
  weight_version: str
  prompt_tokens: int | None
  e2e_latency_s: float | None


def _int(x: Any, what: str) -> int:
  if isinstance(x, bool) or not isinstance(x, int):
    raise MalformedResponse(f"{what} must be an int, got {x!r}")
  return x


def expand_versions(spans: Sequence[VersionSpan], num_tokens: int) -> tuple[str, ...]:
  """Per-token versions from spans that must tile `[0, num_tokens)` in order."""
  out: list[str] = []
  for span in spans:
    if span.start != len(out) or span.end < span.start:
      raise MalformedResponse(f"weight_versions spans do not tile the output: {spans}")
    out.extend([span.version] * (span.end - span.start))
  if len(out) != num_tokens:
    raise MalformedResponse(f"weight_versions cover {len(out)} tokens, output has {num_tokens}")
  return tuple(out)


def _token_versions(meta: Mapping[str, Any], num_tokens: int) -> tuple[str, tuple[str, ...]]:
  version = meta.get("weight_version", UNKNOWN_VERSION)
  if not isinstance(version, str):
    raise MalformedResponse(f"weight_version must be a string, got {version!r}")
  raw = meta.get("weight_versions")
  if raw is None:
    return version, (version,) * num_tokens
  if not isinstance(raw, list):
    raise MalformedResponse(f"weight_versions must be a list, got {raw!r}")
  spans = []
  for s in raw:
    if not isinstance(s, Mapping) or not isinstance(s.get("version"), str):
      raise MalformedResponse(f"bad weight_versions span {s!r}")
    spans.append(VersionSpan(s["version"], _int(s.get("start"), "span start"),
                             _int(s.get("end"), "span end")))
  return version, expand_versions(spans, num_tokens)


def parse_generate_output(obj: Any, *, vocab_size: int | None = None,
                          unfinished_ok: bool = False) -> GenerateOutput:
  """Validates one result object of a `/generate` request sent with `return_logprob: true`."""
  if not isinstance(obj, Mapping):
    raise MalformedResponse(f"generate result must be an object, got {type(obj).__name__}")
  meta = obj.get("meta_info")
  if not isinstance(meta, Mapping):
    raise MalformedResponse("generate result has no meta_info object")
  raw_finish = meta.get("finish_reason")
  finish = None if unfinished_ok and raw_finish is None else FinishReason.from_json(raw_finish)
  ids = obj.get("output_ids")
  if ids is not None and not isinstance(ids, list):
    raise MalformedResponse(f"output_ids must be a list, got {ids!r}")
  entries = meta.get("output_token_logprobs")
  if entries is None:
    # An abort of a still-queued request carries no output at all; anything else must have both.
    if ids or finish is None or finish.kind is not FinishKind.ABORT:
      raise MalformedResponse("meta_info.output_token_logprobs missing (return_logprob was set)")
    entries = []
  if not isinstance(entries, list):
    raise MalformedResponse(f"output_token_logprobs must be a list, got {type(entries).__name__}")
  token_ids, logprobs = [], []
  for e in entries:
    if not isinstance(e, list) or len(e) < 2:
      raise MalformedResponse(f"output_token_logprobs entry must be [logprob, id, text], got {e!r}")
    lp = e[0]
    finite = isinstance(lp, (int, float)) and not isinstance(lp, bool) and math.isfinite(lp)
    if not finite or lp > 1e-4:
      raise MalformedResponse(f"output log-prob must be a finite number <= 0, got {lp!r}")
    logprobs.append(float(lp))
    token_ids.append(_int(e[1], "output token id"))
  if ids is not None:
    if len(ids) != len(token_ids):
      raise MalformedResponse(f"{len(token_ids)} log-probs for {len(ids)} output tokens")
    if [_int(t, "output id") for t in ids] != token_ids:
      raise MalformedResponse("output_ids disagree with the ids in output_token_logprobs")
  for t in token_ids:
    if t < 0 or (vocab_size is not None and t >= vocab_size):
      raise MalformedResponse(f"output token id {t} outside [0, {vocab_size})")
  version, versions = _token_versions(meta, len(token_ids))
  rid = meta.get("id")
  prompt_tokens = meta.get("prompt_tokens")
  latency = meta.get("e2e_latency")
  return GenerateOutput(
      rid=rid if isinstance(rid, str) else None, output_ids=tuple(token_ids),
      output_logprobs=tuple(logprobs), token_versions=versions, finish=finish,
      weight_version=version,
      prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
      e2e_latency_s=float(latency) if isinstance(latency, (int, float)) else None)


def parse_generate_response(obj: Any, *, vocab_size: int | None = None,
                            expect_batch: int | None = None) -> list[GenerateOutput]:
  """A single object → one output; a JSON list (batch or n > 1) → one output per item."""
  if expect_batch is None:
    if isinstance(obj, list):
      raise MalformedResponse("expected one result object, got a list")
    return [parse_generate_output(obj, vocab_size=vocab_size)]
  if not isinstance(obj, list) or len(obj) != expect_batch:
    raise MalformedResponse(f"expected a list of {expect_batch} results, got {obj!r:.200}")
  return [parse_generate_output(o, vocab_size=vocab_size) for o in obj]


def parse_stream(lines: Sequence[str], *, vocab_size: int | None = None) -> list[GenerateOutput]:
  """Parses `data: {...}` event lines (cumulative outputs) up to `data: [DONE]`."""
  outs, done = [], False
  for line in lines:
    line = line.strip()
    if not line:
      continue
    if done or not line.startswith("data:"):
      raise MalformedResponse(f"unexpected stream line {line!r:.200}")
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
      done = True
      continue
    outs.append(parse_generate_output(loads_json(payload), vocab_size=vocab_size,
                                      unfinished_ok=True))
  if not done or not outs or outs[-1].finish is None:
    raise MalformedResponse("stream ended without a finished result and [DONE]")
  for prev, cur in zip(outs, outs[1:]):
    if cur.output_ids[:len(prev.output_ids)] != prev.output_ids:
      raise MalformedResponse("stream chunks are not cumulative")
  return outs


def loads_json(text: str | bytes) -> Any:
  try:
    return json.loads(text)
  except ValueError as e:
    raise MalformedResponse(f"response is not JSON: {text[:200]!r}") from e


@dataclasses.dataclass(frozen=True)
class StatusResult:
  """`/pause_generation`, `/continue_generation`."""
  status: str
  message: str

  @classmethod
  def from_json(cls, obj: Any) -> StatusResult:
    if not isinstance(obj, Mapping) or obj.get("status") != "ok":
      raise MalformedResponse(f"expected {{'status': 'ok', ...}}, got {obj!r:.200}")
    return cls(obj["status"], str(obj.get("message", "")))


@dataclasses.dataclass(frozen=True)
class UpdateWeightsResult:
  success: bool
  message: str
  num_paused_requests: int

  @classmethod
  def from_json(cls, obj: Any) -> UpdateWeightsResult:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("success"), bool):
      raise MalformedResponse(f"expected {{'success': bool, ...}}, got {obj!r:.200}")
    return cls(obj["success"], str(obj.get("message", "")),
               int(obj.get("num_paused_requests", 0)))


@dataclasses.dataclass(frozen=True)
class ServerLoad:
  """One data-parallel rank's entry of `/v1/loads`."""
  num_running_reqs: int
  num_waiting_reqs: int
  num_used_tokens: int

  @classmethod
  def list_from_json(cls, obj: Any) -> tuple[ServerLoad, ...]:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("loads"), list):
      raise MalformedResponse(f"expected {{'loads': [...]}}, got {obj!r:.200}")
    out = []
    for entry in obj["loads"]:
      if not isinstance(entry, Mapping):
        raise MalformedResponse(f"bad load entry {entry!r}")
      out.append(cls(*(_int(entry.get(k), k) for k in
                       ("num_running_reqs", "num_waiting_reqs", "num_used_tokens"))))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  model_path: str
  weight_version: str
  is_generation: bool
  raw: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)

  @classmethod
  def from_json(cls, obj: Any) -> ModelInfo:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("model_path"), str):
      raise MalformedResponse(f"model_info needs a model_path, got {obj!r:.200}")
    version = obj.get("weight_version", UNKNOWN_VERSION)
    return cls(obj["model_path"], version if isinstance(version, str) else str(version),
               bool(obj.get("is_generation", True)), dict(obj))


def parse_server_info(obj: Any) -> Mapping[str, Any]:
  """Server arguments are implementation specific: only the shape is part of the contract."""
  if not isinstance(obj, Mapping) or not obj:
    raise MalformedResponse(f"server_info must be a non-empty object, got {obj!r:.200}")
  return obj


# What a server whose engine has stopped answers, whatever the status (ours answered HTTP 400 with
# it before it answered 503): the server failed, the request did not. Matched against the whole
# error message, never a substring, so a prompt echoed inside a 400 cannot pass for it.
_ENGINE_DOWN = re.compile(r"(the )?(engine|server) (is|has) (shut down|shutting down|stopped)\.?",
                          re.IGNORECASE)


def says_engine_down(text: str) -> bool:
  """Whether an error answer (`{"error": {"message": ...}}`, `{"message": ...}` or plain text)
  says the server's engine has stopped."""
  try:
    obj = json.loads(text)
  except ValueError:
    obj = text
  if isinstance(obj, Mapping):
    err = obj.get("error")
    obj = err.get("message") if isinstance(err, Mapping) else obj.get("message", err)
  return isinstance(obj, str) and _ENGINE_DOWN.fullmatch(obj.strip()) is not None


def parse_error(obj: Any) -> str:
  """The message of an HTTP 400 `{"error": {"message": ...}}` body."""
  err = obj.get("error") if isinstance(obj, Mapping) else None
  if isinstance(err, Mapping) and isinstance(err.get("message"), str):
    return err["message"]
  raise MalformedResponse(f"expected {{'error': {{'message': str}}}}, got {obj!r:.200}")
