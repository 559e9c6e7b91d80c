"""The server side of SGLang's `/generate` JSON: request bodies into engine work, outputs into JSON.

Why on its own: every malformed request must be turned into an HTTP 400 *before* any of its samples
reaches the engine (so a bad request never disturbs others), and the response shapes must match
`shared/SGLANG_PROTOCOL.md` field for field. Both are plain functions over dicts, kept apart from the
aiohttp routes so they read (and fail) on their own.

This is the one place requests are validated: `Limits` bounds what a request may cost before any
work is done (body bytes, text characters before tokenizing, prompts, `n`, stop strings), strict
JSON (`parse_json`: no NaN/Infinity, no nesting that exhausts the parser), the sampling options'
types and device ranges (`Sampling.from_json`), and the engine's own limits (vocabulary, context,
stop ids: `validate`). Every refusal names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from typing import Any, Callable, Sequence

import numpy as np
import orjson

from flashrl_jax.fleet import FinishKind, FinishReason
from flashrl_jax.rollout._request import LogprobOptions, Output
from flashrl_jax.rollout._sampling import Sampling


class BadRequest(ValueError):
  """A request the server answers with HTTP 400 (or `status`) `{"error": {"message": ...}}`."""

  def __init__(self, message: str, status: int = 400):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask of this server, checked before anything is parsed further,
  tokenized or queued (so no request can stall the event loop or the engine by its size)."""

  max_body_bytes: int = 32 << 20  # answered 413
  max_text_chars: int = 1 << 20  # per prompt, before tokenizing (else send input_ids)
  max_n: int = 1024  # samples per prompt
  max_samples: int = 4096  # prompts x n in one /generate
  max_stop_strings: int = 64
  max_stop_chars: int = 1024  # per stop string: each is searched in a decoded tail every step
  max_rid_chars: int = 1024

  def __post_init__(self):
    if min(dataclasses.astuple(self)) < 1:
      raise ValueError(f"every limit must be >= 1: {self}")


def _plain(obj: Any) -> Any:
  """Numbers orjson leaves to the caller: int and float subclasses (and, on the standard library's
  path, NumPy scalars)."""
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, float):
    return float(obj)
  if isinstance(obj, int):
    return int(obj)
  raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
  """An answer as JSON. orjson, because the standard library's encoding of a response's per-token
  log-probs took ~15% of the server's HTTP thread, which shares its core with decoding
  (docs/benchmarks.md). Non-finite floats are written as null (strict JSON: the engine sends no
  NaN it means, and a banned candidate's -inf is null by design). An integer beyond 64 bits, which
  orjson cannot hold, falls back to the standard library."""
  try:
    return orjson.dumps(obj, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY)
  except orjson.JSONEncodeError:
    return json.dumps(obj, allow_nan=False, default=_plain).encode()


def _no_constant(name: str):
  raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number.")


def parse_json(raw: bytes, *, required: bool = True) -> dict:
  """A request body as a JSON object (strict JSON: NaN and Infinity are refused)."""
  if not raw.strip():
    if required:
      raise BadRequest("the request body must be a JSON object.")
    return {}
  try:
    body = json.loads(raw, parse_constant=_no_constant)
  except RecursionError:
    raise BadRequest("the request body is not valid JSON: nested too deeply.") from None
  except ValueError as e:  # includes invalid UTF-8 and integers of more than 4300 digits
    if isinstance(e, BadRequest):
      raise
    raise BadRequest(f"the request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object.")
  return body


@dataclasses.dataclass(frozen=True)
class GenerateItem:
  """One sample to run: a prompt, its options, its id (n > 1 samples share a `group`)."""

  prompt_ids: list[int]
  sampling: Sampling
  rid: str
  group: str | None
  return_logprob: bool = False
  logprobs: LogprobOptions = LogprobOptions()


@dataclasses.dataclass(frozen=True)
class GenerateJob:
  items: list[GenerateItem]  # prompt-major: all samples of prompt 0, then prompt 1, ...
  batch: bool  # answer with a JSON list (a batch input, or n > 1)
  return_text_in_logprobs: bool
  stream: bool
  return_prompt_token_ids: bool = False


# Top-level `/generate` keys of SGLang's request that this server does not implement, each with the
# test for its neutral value (accepted, changes nothing). Any other value asks for behaviour this
# server cannot give (hidden states, LoRA, images, disaggregated KV transfer, ...): HTTP 400 naming
# the key. Keys SGLang does not define are ignored, as SGLang ignores them.
_NEUTRAL_REQUEST = {
    "token_ids_logprob": lambda v: v == [], "return_hidden_states": lambda v: v is False,
    "return_routed_experts": lambda v: v is False, "return_entropy": lambda v: v is False,
    "input_embeds": lambda v: False, "image_data": lambda v: v == [], "video_data": lambda v: v == [],
    "audio_data": lambda v: v == [], "lora_path": lambda v: False, "lora_id": lambda v: False,
    "custom_logit_processor": lambda v: False, "session_params": lambda v: False,
    "bootstrap_host": lambda v: False, "bootstrap_port": lambda v: False,
    "bootstrap_room": lambda v: False, "bootstrap_pair_key": lambda v: False,
    "decode_tp_size": lambda v: False,
    # One data-parallel rank here: rank 0 is this server.
    "routed_dp_rank": lambda v: v == 0, "data_parallel_rank": lambda v: v == 0,
}


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _flag(body: dict, key: str, default: bool = False) -> bool:
  value = body.get(key, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise BadRequest(f"{key} must be a boolean, got {value!r:.100}.")
  return value


def _per_prompt(body: dict, key: str, n: int, batch: bool, default: Any, check) -> list[Any]:
  """A field SGLang takes as one value or (for a batch) one per prompt, as a list of n values."""
  value = body.get(key)
  if value is None:
    return [default] * n
  if isinstance(value, list):
    if not batch or len(value) != n:
      raise BadRequest(f"{key} must be one value, or for a batch a list with one per prompt "
                       f"({n}), got {value!r:.100}.")
    values = [default if v is None else v for v in value]
  else:
    values = [value] * n
  for v in values:
    if not check(v):
      raise BadRequest(f"{key} has an invalid value {v!r:.100}.")
  return values


def _refuse_unsupported(body: dict) -> None:
  for key, neutral in _NEUTRAL_REQUEST.items():
    value = body.get(key)
    if value is not None and not neutral(value):
      raise BadRequest(f"{key}={value!r:.100} is not supported by this server (only a null or "
                       "neutral value is).")


def encode_text(text: str, encode: Callable[[str], list[int]], limits: Limits) -> list[int]:
  """Tokenizes one prompt, refusing (400) text over the limit, invalid Unicode, or text the
  tokenizer fails on. Run it off the event loop."""
  if len(text) > limits.max_text_chars:
    raise BadRequest(f"text has {len(text)} characters, more than this server's limit "
                     f"({limits.max_text_chars}); send input_ids.")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") is valid JSON, not valid text
    raise BadRequest(f"text is not valid Unicode: {e.reason} at index {e.start}.") from None
  try:
    return list(encode(text))
  except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the request's fault
    raise BadRequest(f"text could not be tokenized: {e!r:.300}") from None


def _prompts(body: dict, encode: Callable[[str], list[int]] | None,
             limits: Limits) -> tuple[list[list[int]], bool]:
  text, ids = body.get("text"), body.get("input_ids")
  if (text is None) == (ids is None):
    raise BadRequest("Either text or input_ids should be provided, not both and not neither.")
  many = text if text is not None else ids
  if (isinstance(many, list) and many and isinstance(many[0], (str, list))
      and len(many) > limits.max_samples):
    raise BadRequest(f"{len(many)} prompts in one request, more than this server's limit "
                     f"({limits.max_samples}).")
  if text is not None:
    if encode is None:
      raise BadRequest("this server has no tokenizer (no tokenizer.json); send input_ids.")
    if isinstance(text, str):
      return [encode_text(text, encode, limits)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
      for t in text:  # every length first: refuse before spending time on any tokenization
        if len(t) > limits.max_text_chars:
          encode_text(t, encode, limits)
      return [encode_text(t, encode, limits) for t in text], True
    raise BadRequest("text must be a string or a non-empty list of strings.")
  if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
    return [list(ids)], False
  if (isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids)
      and all(_is_int(t) for p in ids for t in p)):
    return [list(p) for p in ids], True
  raise BadRequest("input_ids must be a non-empty list of ints or a list of such lists.")


def check_samples(count: int, limits: Limits) -> None:
  """Refuses more samples (prompts x n) in one request than `limits` allows."""
  if count > limits.max_samples:
    raise BadRequest(f"{count} samples (prompts x n) in one request, more than this server's "
                     f"limit ({limits.max_samples}).")


def check_sampling(sampling: Sampling, limits: Limits) -> None:
  """Refuses options within their types and ranges that would still cost too much here."""
  if sampling.n > limits.max_n:
    raise BadRequest(f"sampling_params.n={sampling.n} is above this server's limit "
                     f"({limits.max_n}).")
  for key in ("stop", "stop_regex"):
    values = getattr(sampling, key)
    if len(values) > limits.max_stop_strings:
      raise BadRequest(f"sampling_params.{key} has {len(values)} entries, more than this server's "
                       f"limit ({limits.max_stop_strings}).")
    if any(len(s) > limits.max_stop_chars for s in values):
      raise BadRequest(f"a sampling_params.{key} entry is longer than this server's limit "
                       f"({limits.max_stop_chars} characters).")


def parse_generate(body: Any, *, encode: Callable[[str], list[int]] | None,
                   validate: Callable[[list[int], Sampling, LogprobOptions], None],
                   limits: Limits = Limits()) -> GenerateJob:
  """Turns a `/generate` body into samples; raises BadRequest for anything the engine can't serve.

  Tokenizes `text`: run it off the event loop."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object.")
  _refuse_unsupported(body)
  prompts, batch = _prompts(body, encode, limits)
  raw = body.get("sampling_params")
  if isinstance(raw, list):
    if len(raw) != len(prompts):
      raise BadRequest(f"{len(raw)} sampling_params for {len(prompts)} prompts.")
  else:
    raw = [raw] * len(prompts)
  try:
    samplings = [Sampling.from_json(r) for r in raw]
  except ValueError as e:
    raise BadRequest(str(e)) from None
  for sampling in samplings:
    check_sampling(sampling, limits)
  check_samples(sum(s.n for s in samplings), limits)
  rids = body.get("rid")
  if rids is None:
    rids = [None] * len(prompts)
  elif batch and isinstance(rids, list) and len(rids) == len(prompts):
    pass
  elif not batch and isinstance(rids, str):
    rids = [rids]
  else:
    raise BadRequest("rid must be a string (or, for a batch, a list with one per prompt).")
  if any(r is not None and not isinstance(r, str) for r in rids):
    raise BadRequest("every rid must be a string.")
  if any(r is not None and len(r) > limits.max_rid_chars for r in rids):
    raise BadRequest(f"a rid is longer than this server's limit ({limits.max_rid_chars}).")
  if len(set(r for r in rids if r is not None)) < sum(r is not None for r in rids):
    raise BadRequest("rids within a batch must be distinct.")
  n = len(prompts)
  return_logprob = _per_prompt(body, "return_logprob", n, batch, False,
                               lambda v: isinstance(v, bool))
  starts = _per_prompt(body, "logprob_start_len", n, batch, -1, _is_int)
  tops = _per_prompt(body, "top_logprobs_num", n, batch, 0, _is_int)
  items = []
  for prompt, sampling, rid, want, start, top in zip(prompts, samplings, rids, return_logprob,
                                                     starts, tops):
    try:
      # As in SGLang, logprob_start_len and top_logprobs_num only matter with return_logprob.
      options = LogprobOptions(input_start=start, top_n=top) if want else LogprobOptions()
      validate(prompt, sampling, options)
    except ValueError as e:
      raise BadRequest(str(e)) from None
    if sampling.n == 1:
      items.append(GenerateItem(prompt, sampling, rid or uuid.uuid4().hex, None, want, options))
    else:
      group = rid or uuid.uuid4().hex
      items += [GenerateItem(prompt, sampling, uuid.uuid4().hex, group, want, options)
                for _ in range(sampling.n)]
  return GenerateJob(items=items, batch=batch or len(items) > 1,
                     return_text_in_logprobs=_flag(body, "return_text_in_logprobs"),
                     stream=_flag(body, "stream"),
                     return_prompt_token_ids=_flag(body, "return_prompt_token_ids"))


def output_text(out: Output, sampling: Sampling,
          decode: Callable[[Sequence[int], bool], str]) -> str:
  ids = list(out.output_ids)
  finish = out.finish
  trim = finish is not None and finish.kind is FinishKind.STOP and not sampling.no_stop_trim
  if trim and isinstance(finish.matched, int) and ids:
    ids = ids[:-1]
  text = decode(ids, sampling.skip_special_tokens)
  if trim and isinstance(finish.matched, str):
    at = text.find(finish.matched)
    text = text[:at] if at >= 0 else text
  return text


def finish_json(finish: FinishReason) -> dict[str, Any]:
  if finish.kind is FinishKind.STOP:
    return {"type": "stop", "matched": finish.matched}
  if finish.kind is FinishKind.LENGTH:
    return {"type": "length", "length": finish.length}
  return {"type": "abort", "message": finish.message or "aborted"}


def output_json(out: Output, item: GenerateItem, job: GenerateJob,
                decode: Callable[[Sequence[int], bool], str] | None,
                index: int | None = None) -> dict[str, Any]:
  """One result object; `decode=None` when the server has no tokenizer (then no `text`)."""
  meta: dict[str, Any] = {
      "id": out.rid,
      "finish_reason": finish_json(out.finish) if out.finish is not None else None,
      "prompt_tokens": len(out.prompt_ids),
      "completion_tokens": len(out.output_ids),
      "cached_tokens": 0,
      "weight_version": out.weight_version,
      "weight_versions": [{"version": s.version, "start": s.start, "end": s.end}
                          for s in out.versions],
      "e2e_latency": out.latency_s,
  }
  if item.return_logprob:
    with_text = job.return_text_in_logprobs and decode is not None
    text = (lambda tok: decode([tok], False)) if with_text else (lambda tok: None)
    # Output log-probs are finite (the engine fails a request rather than produce another); a
    # prompt or top candidate's may be -inf (a banned token) and is sent as null: strict JSON.
    entry = lambda lp, tok: [lp if lp is None or math.isfinite(lp) else None, tok, text(tok)]
    meta["output_token_logprobs"] = [entry(lp, tok) for lp, tok in zip(out.logprobs,
                                                                        out.output_ids)]
    start = item.logprobs.input_start
    if start >= 0 and out.input_logprobs is not None:
      meta["input_token_logprobs"] = [entry(lp, tok) for lp, tok in zip(out.input_logprobs,
                                                                         out.prompt_ids[start:])]
    if item.logprobs.top_n:
      # SGLang's rows: None where a position has no candidates (the first prompt position).
      rows = lambda tops: [[entry(lp, tok) for tok, lp in row] if row else None for row in tops]
      meta["output_top_logprobs"] = rows(out.output_top)
      if start >= 0 and out.input_logprobs is not None:
        meta["input_top_logprobs"] = rows(out.input_top)
  result: dict[str, Any] = {}
  if decode is not None:
    result["text"] = output_text(out, item.sampling, decode)
  result["output_ids"] = list(out.output_ids)
  if job.return_prompt_token_ids:
    result["prompt_token_ids"] = list(out.prompt_ids)
  result["meta_info"] = meta
  if index is not None:
    result["index"] = index
  return result
