"""Golden-file contract tests: the documented JSON of every route, read by the client's parsers and
answered by a live server (the stub here; our JAX server when it is importable)."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from flashrl_jax.fleet import _protocol as proto
from tests import golden_contract as gc
from tests import rollout_stubs

GOLDENS = gc.load_goldens()
# Every route of SGLANG_PROTOCOL.md must have at least one golden example.
DOC_ROUTES = {"/generate", "/update_weights_from_disk", "/pause_generation",
              "/continue_generation", "/abort_request", "/flush_cache", "/health",
              "/health_generate", "/model_info", "/get_model_info", "/server_info",
              "/get_server_info", "/v1/loads"}
DOC_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                     "stop_token_ids", "ignore_eos", "min_new_tokens", "n", "skip_special_tokens",
                     "spaces_between_special_tokens", "no_stop_trim", "sampling_seed"}


def test_every_documented_route_has_a_golden():
  assert {g["route"] for g in GOLDENS.values()} == DOC_ROUTES
  assert len(GOLDENS) >= 29


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_response_passes_client_parsers(name):
  g = GOLDENS[name]
  parsed = gc.parse_golden_kind(g, g["response"])
  if g["kind"] != "stream":
    gc.assert_shape(g["response"], g["response"])
  if g["kind"] == "generate":
    (out,) = parsed
    assert len(out.output_ids) == len(out.output_logprobs) == len(out.token_versions)


def test_golden_generate_request_is_what_the_client_sends():
  g = GOLDENS["generate_single"]["request"]
  sampling = proto.SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(2,), seed=7)
  assert proto.generate_request(g["input_ids"], sampling, g["rid"]) == g
  for golden in GOLDENS.values():
    params = (golden["request"] or {}).get("sampling_params", {})
    for p in params if isinstance(params, list) else [params]:
      if golden["kind"] != "error":
        assert set(p) <= DOC_SAMPLING_KEYS, golden["doc"]


def test_golden_weight_spans_expand_per_token():
  (out,) = proto.parse_generate_response(GOLDENS["generate_weight_spans"]["response"])
  assert out.token_versions == ("3", "3", "4", "4", "4") and out.weight_version == "4"
  (queued,) = proto.parse_generate_response(GOLDENS["generate_abort_queued"]["response"])
  assert queued.output_ids == () and queued.finish.kind is proto.FinishKind.ABORT


def _mutations():
  """Malformed variants of generate_single's response, each of which must be rejected."""
  def drop_logprob(r): r["meta_info"]["output_token_logprobs"].pop()
  def bad_id(r): r["output_ids"][1] = r["meta_info"]["output_token_logprobs"][1][1] = 10**6
  def negative_id(r): r["output_ids"][0] = r["meta_info"]["output_token_logprobs"][0][1] = -1
  def ids_disagree(r): r["output_ids"][0] += 1
  def no_meta(r): del r["meta_info"]
  def no_finish(r): del r["meta_info"]["finish_reason"]
  def bad_finish(r): r["meta_info"]["finish_reason"] = {"type": "exploded"}
  def no_logprobs(r): del r["meta_info"]["output_token_logprobs"]
  def nan_logprob(r): r["meta_info"]["output_token_logprobs"][0][0] = float("nan")
  def positive_logprob(r): r["meta_info"]["output_token_logprobs"][0][0] = 0.5
  def string_logprob(r): r["meta_info"]["output_token_logprobs"][0][0] = "-0.5"
  def spans_gap(r): r["meta_info"]["weight_versions"] = [{"version": "3", "start": 1, "end": 4}]
  def spans_short(r): r["meta_info"]["weight_versions"][0]["end"] = 3
  def version_not_str(r): r["meta_info"]["weight_version"] = 3
  def is_list(r): return [r]
  return [drop_logprob, bad_id, negative_id, ids_disagree, no_meta, no_finish, bad_finish,
          no_logprobs, nan_logprob, positive_logprob, string_logprob, spans_gap, spans_short,
          version_not_str, is_list]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_malformed_generate_responses_are_rejected(mutate):
  r = copy.deepcopy(GOLDENS["generate_single"]["response"])
  r = mutate(r) or r
  with pytest.raises(proto.MalformedResponse):
    proto.parse_generate_response(r, vocab_size=96)


def test_malformed_streams_and_bodies_are_rejected():
  chunks = GOLDENS["generate_stream"]["response"]
  lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}" for c in chunks]
  assert len(proto.parse_stream(lines)) == 3
  with pytest.raises(proto.MalformedResponse):  # no [DONE]
    proto.parse_stream(lines[:-1])
  with pytest.raises(proto.MalformedResponse):  # not cumulative
    proto.parse_stream([lines[1], lines[0], lines[2], lines[3]])
  with pytest.raises(proto.MalformedResponse):
    proto.loads_json("<html>502</html>")
  with pytest.raises(proto.MalformedResponse):
    proto.StatusResult.from_json({"status": "error"})
  with pytest.raises(proto.MalformedResponse):
    proto.ServerLoad.list_from_json({"loads": [{"num_running_reqs": "3"}]})


def test_stub_passes_golden_contract(tmp_path):
  with rollout_stubs.start_stubs(1, str(tmp_path), "--token_latency_s=0.002",
                                 log_dir=str(tmp_path / "logs")) as servers:
    checked = gc.check_server_against_golden(servers.urls[0])
  assert set(checked) == set(GOLDENS)


@pytest.mark.slow  # ~30 s on 2 cores: one JAX server process (startup + warmup compile)
@pytest.mark.skipif(importlib.util.find_spec("flashrl_jax.rollout.server") is None,
                    reason="the JAX rollout server is not there yet")
def test_jax_server_passes_golden_contract(tmp_path):
  from flashrl_jax.testing._tiny import write_tiny_checkpoint
  from flashrl_jax.fleet import LocalServers
  model = tmp_path / "model"
  write_tiny_checkpoint(str(model))
  with LocalServers.start(str(model), 1, extra_args=["--max_running_requests=4"],
                          log_dir=str(tmp_path / "logs"), startup_timeout_s=300) as servers:
    checked = gc.check_server_against_golden(servers.urls[0], long_max_new_tokens=200)
  assert set(checked) == set(GOLDENS)
