"""The server side of SGLang's `/generate` JSON: request bodies into engine work, outputs into JSON.

Why on its own: every malformed request must be turned into an HTTP 400 *before* any of its samples
reaches the engine (so a bad request never disturbs others), and the response shapes must match
`shared/SGLANG_PROTOCOL.md` field for field. Both are plain functions over dicts, kept apart from the
aiohttp routes so they read (and fail) on their own.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Callable, Sequence

from flashrl_jax.fleet import FinishKind, FinishReason
from flashrl_jax.rollout._request import LogprobOptions, Output
from flashrl_jax.rollout._sampling import Sampling


class BadRequest(ValueError):
  """A request the server answers with HTTP 400 `{"error": {"message": ...}}`."""


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
    raise BadRequest(f"{key} must be a boolean, got {value!r}.")
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


def _prompts(body: dict, encode: Callable[[str], list[int]] | None) -> tuple[list[list[int]], bool]:
  text, ids = body.get("text"), body.get("input_ids")
  if (text is None) == (ids is None):
    raise BadRequest("Either text or input_ids should be provided, not both and not neither.")
  if text is not None:
    if encode is None:
      raise BadRequest("this server has no tokenizer (no tokenizer.json); send input_ids.")
    if isinstance(text, str):
      return [encode(text)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
      return [encode(t) for t in text], True
    raise BadRequest("text must be a string or a non-empty list of strings.")
  if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
    return [list(ids)], False
  if (isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids)
      and all(_is_int(t) for p in ids for t in p)):
    return [list(p) for p in ids], True
  raise BadRequest("input_ids must be a non-empty list of ints or a list of such lists.")


def parse_generate(body: Any, *, encode: Callable[[str], list[int]] | None,
                   validate: Callable[[list[int], Sampling, LogprobOptions], None]
                   ) -> GenerateJob:
  """Turns a `/generate` body into samples; raises BadRequest for anything the engine can't serve."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object.")
  _refuse_unsupported(body)
  prompts, batch = _prompts(body, encode)
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


def _text(out: Output, sampling: Sampling,
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
    entry = lambda lp, tok: [lp, tok, text(tok)]
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
    result["text"] = _text(out, item.sampling, decode)
  result["output_ids"] = list(out.output_ids)
  if job.return_prompt_token_ids:
    result["prompt_token_ids"] = list(out.prompt_ids)
  result["meta_info"] = meta
  if index is not None:
    result["index"] = index
  return result
