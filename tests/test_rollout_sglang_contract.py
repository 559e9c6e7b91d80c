"""Our server against SGLang's own published contract, not against goldens we wrote.

Read from SGLang's sources (its JSON API schema `sglang/api/v1`, `srt/sampling/sampling_params.py`,
`srt/managers/io_struct.py`, and what its frontend `lang/backend/runtime_endpoint.py` sends): every
response below is checked field by field against the schema's types, the requests are the ones
SGLang's clients really send (neutral defaults such as `stop_regex: []`, `logit_bias: {}`), and the
frontend's `select()` flow (`max_new_tokens: 0`, `logprob_start_len`, `input_token_logprobs`) runs
end to end. Prompt log-probs are checked against HF transformers in float64, top log-probs against
the sampled token's own log-prob. One real server process (an HF-written tiny Qwen3) over loopback.
"""

import json
import math
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from tests.api_servers import start_servers, write_hf_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("contract_model"))
  hf = write_hf_checkpoint(path)
  with start_servers(path, 1, "--served_model_name=tiny-qwen3",
                     log_dir=str(tmp_path_factory.mktemp("contract_logs"))) as servers:
    yield servers.urls[0], hf


def call(url, path, body=None):
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=120) as resp:
      status, raw = resp.status, resp.read().decode()
  except urllib.error.HTTPError as e:
    status, raw = e.code, e.read().decode()
  try:
    return status, json.loads(raw)
  except ValueError:
    return status, raw


# --- the schema's types (sglang.api.v1), as checks ---------------------------------------------------

def is_int(x, minimum=None):
  return isinstance(x, int) and not isinstance(x, bool) and (minimum is None or x >= minimum)


def check_logprob_entry(e, *, nullable=False):
  """`LogprobEntry`: exactly `[logprob (float|null), token_id (int), text (str|null)]`."""
  assert isinstance(e, list) and len(e) == 3, e
  assert (e[0] is None and nullable) or (isinstance(e[0], float) and math.isfinite(e[0])), e
  assert is_int(e[1], 0) and (e[2] is None or isinstance(e[2], str)), e


def check_generate_response(obj):
  """`GenerateResponse` + `GenerateMetaInfo`, every field the schema types."""
  assert isinstance(obj, dict) and isinstance(obj.get("text", ""), str)
  assert all(is_int(t, 0) for t in obj["output_ids"])
  meta = obj["meta_info"]
  assert isinstance(meta["id"], str) and meta["id"]
  assert is_int(meta["prompt_tokens"], 0) and is_int(meta["completion_tokens"], 0)
  finish = meta["finish_reason"]
  assert finish is None or finish["type"] in ("stop", "length", "abort")
  if finish is not None and finish["type"] == "length":
    assert is_int(finish["length"], 0)
  if finish is not None and finish["type"] == "stop":
    assert finish["matched"] is None or isinstance(finish["matched"], (int, str))
  for key in ("output_token_logprobs", "input_token_logprobs"):
    for i, e in enumerate(meta.get(key) or []):
      check_logprob_entry(e, nullable=key == "input_token_logprobs" and i == 0)
  for key in ("output_top_logprobs", "input_top_logprobs"):
    for row in meta.get(key) or []:
      for e in row or []:
        check_logprob_entry(e)
  assert meta.get("e2e_latency") is None or isinstance(meta["e2e_latency"], float)
  return meta


# SGLang's frontend (`RuntimeEndpoint.generate`) sends every field of its `SglSamplingParams` with
# its default values, plus the two global detokenization flags.
FRONTEND_SAMPLING = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 6,
    "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}

# Neutral values of fields this engine does not implement: each must be accepted and change nothing.
NEUTRAL_SAMPLING = {
    "stop_regex": [], "logit_bias": {}, "custom_params": {}, "beam_width": None,
    "watermark": None, "choice": None, "repetition_penalty": 1.0, "ebnf": None,
    "structural_tag": None, "stream_interval": 2, "sampling_seed": None, "top_k": 1 << 30,
    "max_new_tokens": 6, "temperature": 0, "n": None, "no_stop_trim": None}
NEUTRAL_REQUEST = {"return_hidden_states": False, "token_ids_logprob": None, "image_data": None,
                   "lora_path": None, "custom_logit_processor": None, "bootstrap_host": None,
                   "routed_dp_rank": None, "session_params": None, "stream": None,
                   "top_logprobs_num": None, "logprob_start_len": None, "rid": None}


def test_frontend_requests_and_neutral_values_generate(served):
  url, _ = served
  status, ref = call(url, "/generate", {"text": "2+2=", "sampling_params": FRONTEND_SAMPLING})
  assert status == 200, ref
  check_generate_response(ref)
  assert ref["meta_info"]["finish_reason"] in ({"type": "length", "length": 6},
                                               {"type": "stop", "matched": 2})
  status, out = call(url, "/generate", {"text": "2+2=", "sampling_params": NEUTRAL_SAMPLING,
                                        **NEUTRAL_REQUEST})
  assert status == 200, out
  check_generate_response(out)
  assert out["output_ids"] == ref["output_ids"]  # greedy both times: neutral values changed nothing


REFUSED = [
    ({"sampling_params": {"logit_bias": {"5": 3.0}}}, "logit_bias"),
    ({"sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"sampling_params": {"regex": "[0-9]+"}}, "regex"),
    ({"sampling_params": {"beam_width": 4}}, "beam_width"),
    ({"sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"image_data": "http://example/x.png"}, "image_data"),
    ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
    ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"return_logprob": True, "logprob_start_len": 9}, "logprob_start_len"),
    ({"return_logprob": [True, False]}, "return_logprob"),
]


@pytest.mark.parametrize("extra,field", REFUSED, ids=[f for _, f in REFUSED])
def test_values_the_engine_cannot_honour_are_refused_naming_the_field(served, extra, field):
  url, _ = served
  body = {"input_ids": [5, 6, 7], **extra}
  body["sampling_params"] = {"max_new_tokens": 2, **extra.get("sampling_params", {})}
  status, out = call(url, "/generate", body)
  assert status == 400 and field in out["error"]["message"], out


def hf_prompt_logprobs(hf, ids):
  """log p(token_i | tokens_<i) for i >= 1, from transformers in float64."""
  with torch.no_grad():
    logits = hf.double()(torch.tensor([ids])).logits[0].numpy()
  hf.float()
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  return np.array([logp[i - 1, ids[i]] for i in range(1, len(ids))]), logp


def test_frontend_select_flow_scores_prompts_like_transformers(served):
  """`select()`: cache the prefix (max_new_tokens 0), then score each choice from prompt_len - 2."""
  url, hf = served
  status, first = call(url, "/generate", {"text": "3*4=", "sampling_params": {"max_new_tokens": 0}})
  assert status == 200 and first["output_ids"] == []
  assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
  start = first["meta_info"]["prompt_tokens"] - 2
  choices = ["12", "7", "1x"]
  status, outs = call(url, "/generate", {
      "text": ["3*4=" + c for c in choices], "return_logprob": True,
      "return_text_in_logprobs": True, "logprob_start_len": start,
      "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
  assert status == 200 and len(outs) == 3
  for choice, out in zip(choices, outs):
    meta = check_generate_response(out)
    entries = meta["input_token_logprobs"]
    assert meta["output_token_logprobs"] == [] and len(entries) == 4 + len(choice) - start
    assert entries[0][0] is None  # the first returned position carries no log-prob, as in SGLang
    assert "".join(e[2] for e in entries) == ("3*4=" + choice)[start:]
    ids = [e[1] for e in entries]
    status, full = call(url, "/generate", {"text": "3*4=" + choice, "return_logprob": True,
                                           "logprob_start_len": 0,
                                           "sampling_params": {"max_new_tokens": 0}})
    all_ids = [e[1] for e in full["meta_info"]["input_token_logprobs"]]
    assert all_ids[start:] == ids
    want, _ = hf_prompt_logprobs(hf, all_ids)
    got = [e[0] for e in full["meta_info"]["input_token_logprobs"]]
    assert got[0] is None
    np.testing.assert_allclose(got[1:], want, atol=2e-4)


def test_top_logprobs_and_prompt_token_ids(served):
  url, hf = served
  prompt = [5, 6, 7, 8]
  status, out = call(url, "/generate", {
      "input_ids": prompt, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 1,
      "return_prompt_token_ids": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
  assert status == 200, out
  meta = check_generate_response(out)
  assert out["prompt_token_ids"] == prompt
  tops = meta["output_top_logprobs"]
  assert len(tops) == 5
  for (lp, tok, _), row in zip(meta["output_token_logprobs"], tops):
    assert len(row) == 3 and row[0][1] == tok and row[0][0] == pytest.approx(lp, abs=1e-5)
    assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
  input_tops = meta["input_top_logprobs"]
  assert len(input_tops) == len(prompt) - 1 and input_tops[0] is None
  _, logp = hf_prompt_logprobs(hf, prompt)
  for pos, row in enumerate(input_tops[1:], start=2):
    assert [e[1] for e in row] == list(np.argsort(-logp[pos - 1])[:3])
  # Sampled (T = 0.7): the top candidates are of the same tempered distribution as the token.
  status, out = call(url, "/generate", {
      "input_ids": prompt, "return_logprob": True, "top_logprobs_num": 20,
      "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "sampling_seed": 3}})
  meta = check_generate_response(out)
  for (lp, tok, _), row in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
    assert dict((t, p) for p, t, _ in row)[tok] == pytest.approx(lp, abs=1e-5)
    assert math.log(sum(math.exp(p) for p, _, _ in row)) <= 1e-5


def test_stop_regex_ends_generation_and_trims(served):
  url, _ = served
  status, ref = call(url, "/generate", {"text": "ab", "sampling_params": {
      "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
  text = ref["text"]
  assert len(text) >= 4
  pattern = "|".join(re.escape(c) for c in sorted(set(text[2:4])))
  status, out = call(url, "/generate", {"text": "ab", "sampling_params": {
      "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_regex": [pattern]}})
  assert status == 200
  finish = out["meta_info"]["finish_reason"]
  n = len(out["output_ids"])
  assert finish["type"] == "stop" and n < 12 and out["output_ids"] == ref["output_ids"][:n]
  assert out["text"] == text[:text.find(finish["matched"])]


def test_info_routes_follow_the_contract(served):
  url, _ = served
  status, info = call(url, "/server_info")
  assert status == 200
  for key in ("model_path", "served_model_name", "tokenizer_path", "version"):
    assert isinstance(info[key], str) and info[key], key
  assert info["served_model_name"] == "tiny-qwen3"
  assert is_int(info["max_context_length"], 1) and is_int(info["max_total_num_tokens"], 1)
  assert isinstance(info["internal_states"], list)
  status, model = call(url, "/model_info")
  for key in ("model_path", "served_model_name", "tokenizer_path"):
    assert isinstance(model[key], str)
  assert isinstance(model["is_generation"], bool) and isinstance(model["weight_version"], str)
  status, listed = call(url, "/v1/models")
  assert status == 200 and listed["object"] == "list"
  assert [m["id"] for m in listed["data"]] == ["tiny-qwen3"]
  status, load = call(url, "/get_load")
  assert status == 200 and is_int(load["load"], 0) and load["num_reqs"] == 0
  assert call(url, "/ready")[0] == 200 and call(url, "/ping")[0] == 200
  status, out = call(url, "/update_weight_version", {"new_version": "v7"})
  assert status == 200 and out == {"success": True, "message": "Weight version updated to v7",
                                   "new_version": "v7"}
  status, gen = call(url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
  assert gen["meta_info"]["weight_version"] == "v7"
  assert call(url, "/get_weight_version")[1] == {"weight_version": "v7"}
  assert call(url, "/update_weight_version", {"new_version": ""})[0] == 400
