"""A bounded, seeded generator of malformed and adversarial HTTP requests for the rollout server.

Most cases are a valid request with one to three mutations (a field set to a hostile value, removed,
or given a hostile type), or a raw body no JSON encoder would produce (NaN, 1e400, 5,000-digit
integers, nesting thousands deep, invalid UTF-8, lone surrogates, a bad Content-Encoding), spread
over the server's routes (the native ones and the OpenAI-compatible ones); some are valid requests
with every option at an extreme (`extreme#`), which must be served (200). It never produces a
request that legitimately stops other work (a valid pause, `abort_all`, a weight update from a good
directory), so a valid request interleaved with the cases must get the same answer throughout.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

MODES = ("abort", "retract", "in_place")


@dataclasses.dataclass(frozen=True)
class Raw:
  """A JSON text spliced into the body as is."""
  text: str


@dataclasses.dataclass(frozen=True)
class Case:
  method: str
  path: str
  body: bytes | None
  headers: tuple[tuple[str, str], ...] = ()
  label: str = ""


RAWS = (Raw("1e400"), Raw("-1e400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"),
        Raw("9" * 5000), Raw("1" + "0" * 400), Raw("[" * 3000 + "]" * 3000),
        Raw('{"a":' * 3000 + "1" + "}" * 3000), Raw('"\\ud800"'), Raw('"\\udfff\\ud800x"'),
        Raw('"\\u0000"'), Raw("-0"), Raw("1E-400"))
VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2, 127, 2**31 - 1, 2**31, -2**31 - 1, 2**53 + 1, 2**63, 2**64,
    10**30, 0.5, -0.0, 1e-12, 1e-45, 1e308, 3.0, -3.5, "", "x", "abort", "\ud800", "\x00", "a" * 5000,
    [], [None], [1, "a"], [2**31], [[]], [[5, 6], [7]], [-1], [95, 96], {}, {"a": 1},
    {"max_new_tokens": 1}) + RAWS
TOP_KEYS = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
            "top_logprobs_num", "stream", "return_text_in_logprobs", "image_data", "lora_path",
            "bogus")
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                 "stop_token_ids", "ignore_eos", "min_new_tokens", "n", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "sampling_seed",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "json_schema",
                 "regex", "stream_interval", "logit_bias", "bogus")
OPENAI_KEYS = ("prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "stop", "seed", "logprobs", "top_logprobs", "stream", "echo", "suffix",
               "best_of", "response_format", "tool_choice", "tools", "min_tokens",
               "stop_token_ids", "stop_regex", "chat_template_kwargs", "add_generation_prompt",
               "continue_final_message", "input_ids", "stream_options", "bogus")
TEXTS = ("hello", "", "\ud800", "a\udc00b", "\x00\x01\x7f", "\U0001F600" * 50, "x" * 5000,
         "y" * 4096, "\u202e\ufeff", "<|endoftext|>" * 10)


def encode(obj: Any) -> bytes:
  """JSON with `Raw` pieces spliced in (and lone surrogates kept, as `\\ud800` escapes)."""
  raws: list[str] = []

  def mark(x: Any) -> Any:
    if isinstance(x, Raw):
      raws.append(x.text)
      return f"@@RAW{len(raws) - 1}@@"
    if isinstance(x, dict):
      return {k: mark(v) for k, v in x.items()}
    if isinstance(x, list):
      return [mark(v) for v in x]
    return x

  text = json.dumps(mark(obj))
  for i, raw in enumerate(raws):
    text = text.replace(f'"@@RAW{i}@@"', raw, 1)
  return text.encode()


def _value(rng: random.Random) -> Any:
  return rng.choice(VALUES)


def _generate_body(rng: random.Random) -> dict:
  if rng.random() < 0.3:
    body: dict[str, Any] = {"text": rng.choice(TEXTS[:1] + TEXTS)}
  else:
    body = {"input_ids": [rng.randrange(3, 90) for _ in range(rng.randint(1, 6))]}
  body["sampling_params"] = {"max_new_tokens": rng.choice([1, 4, 8]), "temperature": 0}
  body["return_logprob"] = rng.random() < 0.7
  for _ in range(rng.randint(1, 3)):
    kind = rng.random()
    sampling = body.get("sampling_params")
    if kind < 0.4 and isinstance(sampling, dict):
      sampling[rng.choice(SAMPLING_KEYS)] = _value(rng)
    elif kind < 0.6:
      key = rng.choice(TOP_KEYS)
      if rng.random() < 0.2:
        body.pop(key, None)
      else:
        body[key] = _value(rng)
    elif kind < 0.75 and isinstance(body.get("input_ids"), list):
      ids = body["input_ids"]
      choice = rng.random()
      if choice < 0.5 and ids:
        ids[rng.randrange(len(ids))] = _value(rng)
      elif choice < 0.75:
        body["input_ids"] = [5] * rng.choice([127, 128, 500])
      else:
        body["input_ids"] = [[5, 6]] * rng.choice([2, 17, 40])
    elif kind < 0.85:
      body["text"] = rng.choice(TEXTS) if rng.random() < 0.7 else [rng.choice(TEXTS)] * 3
    elif kind < 0.95 and isinstance(sampling, dict):
      body["sampling_params"] = [dict(sampling)] * rng.randint(0, 3)
    else:
      body["stream"] = True
  return body


def _openai_body(rng: random.Random) -> tuple[str, dict]:
  if rng.random() < 0.5:
    path, body = "/v1/completions", {"prompt": rng.choice(TEXTS[:1] + TEXTS)}
  else:
    message = {"role": "user", "content": rng.choice(TEXTS[:1] + TEXTS)}
    path, body = "/v1/chat/completions", {"messages": [message]}
  body.update(max_tokens=rng.choice([1, 4]), temperature=0)
  for _ in range(rng.randint(1, 3)):
    kind = rng.random()
    if kind < 0.7:
      body[rng.choice(OPENAI_KEYS)] = _value(rng)
    elif kind < 0.85 and isinstance(body.get("messages"), list) and body["messages"] and \
        isinstance(body["messages"][0], dict):
      body["messages"] = [{rng.choice(["role", "content", "name", "tool_calls"]): _value(rng),
                           **body["messages"][0]}] * rng.randint(1, 3)
    else:
      body["stream"] = True
  return path, body


def _extreme_body(rng: random.Random, vocab: int) -> dict:
  """A valid request whose every option sits at an extreme: the server must serve it (200)."""
  max_new = rng.choice([0, 1, 50, 127, 10**9, None])
  sampling = {
      "max_new_tokens": max_new,
      "min_new_tokens": rng.choice([0, min(5, max_new if max_new is not None else 5)]),
      "temperature": rng.choice([0, 1e-9, 1e-6, 0.5, 1.0, 100.0, 1e300]),
      "top_p": rng.choice([1e-9, 0.5, 1.0]), "top_k": rng.choice([-1, 1, 5, vocab, 2**31 - 1]),
      "min_p": rng.choice([0.0, 0.5, 1.0]), "n": rng.randint(1, 8),
      "stop": rng.choice([[], ["\x00"], ["a", "\U0001F600"], ["x" * 1024]]),
      "stop_token_ids": rng.sample(range(vocab), rng.randint(0, 8)),
      "stop_regex": rng.choice([[], ["a+"], ["."], ["(?:a|b)*#", "\\d"]]),
      "ignore_eos": rng.random() < 0.5, "skip_special_tokens": rng.random() < 0.5,
      "no_stop_trim": rng.random() < 0.5, "sampling_seed": rng.choice([None, 0, -1, 2**63, 10**30])}
  prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 100))]
  return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
          "top_logprobs_num": rng.choice([0, 5, 20]),
          "logprob_start_len": rng.choice([-1, 0, len(prompt) - 1]),  # < the prompt's length
          "return_text_in_logprobs": rng.random() < 0.5, "stream": rng.random() < 0.3}


def cases(seed: int, count: int, bad_weight_dirs: list[str], vocab: int) -> list[Case]:
  """`count` cases; update requests point only at `bad_weight_dirs` or at hostile paths."""
  rng = random.Random(seed)
  out = []
  for i in range(count):
    r = rng.random()
    if r < 0.12:
      out.append(Case("POST", "/generate", encode(_extreme_body(rng, vocab)), label=f"extreme#{i}"))
    elif r < 0.45:
      out.append(Case("POST", "/generate", encode(_generate_body(rng)), label=f"generate#{i}"))
    elif r < 0.6:
      path, body = _openai_body(rng)
      out.append(Case("POST", path, encode(body), label=f"openai#{i}"))
    elif r < 0.68:
      raw = rng.choice([b"{not json", b"\xff\xfe\x00{", b"[1,2]", b"null", b'"str"', b"{}",
                        b"{" * 100_000, b'{"text": "\xed\xa0\x80"}', b"\x00" * 64,
                        encode({"input_ids": Raw("[" * 3000 + "]" * 3000)})])
      path = rng.choice(["/generate", "/update_weights_from_disk", "/abort_request",
                         "/pause_generation", "/flush_cache"])
      if path == "/pause_generation" and raw.startswith(b"{") and raw[1:2] != b"{":
        raw = b"{not json"  # an object without a mode would be a valid pause (mode abort)
      out.append(Case("POST", path, raw, label=f"raw#{i}"))
    elif r < 0.78:
      path = rng.choice(bad_weight_dirs + ["", "/", "/dev/null", "/dev/zero", "/proc/self",
                                           "/nonexistent", "x" * 5000, "a\x00b"])
      body = {"model_path": rng.choice([path, path, _value(rng)]),
              "weight_version": rng.choice(["bad", _value(rng)])}
      if rng.random() < 0.3:
        body["abort_all_requests"] = rng.choice([False, "yes", 1, None])
      out.append(Case("POST", "/update_weights_from_disk", encode(body), label=f"update#{i}"))
    elif r < 0.84:
      body = {"rid": rng.choice(["nope", _value(rng)]),
              "abort_all": rng.choice([False, 1, "true", None, [True]])}  # never a real True
      out.append(Case("POST", "/abort_request", encode(body), label=f"abort#{i}"))
    elif r < 0.9:
      mode = _value(rng)
      if mode is None or mode in MODES:  # a valid (or null, = abort) mode would really pause
        mode = "sideways"
      out.append(Case("POST", "/pause_generation", encode({"mode": mode}), label=f"pause#{i}"))
    elif r < 0.95:
      path = rng.choice(["/v1/loads", "/model_info", "/server_info", "/get_weight_version",
                         "/health", "/flush_cache", "/no_such_route"])
      out.append(Case("GET", path, None, label=f"get#{i}"))
    else:
      body = encode({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
      encoding = rng.choice(["gzip", "deflate", "br", "zstd", "bogus", "gzip, gzip"])
      out.append(Case("POST", "/generate", body, (("Content-Encoding", encoding),),
                      label=f"encoding#{i}"))
  return out
