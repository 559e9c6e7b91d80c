"""The HTTP server, as a real `python -m flashrl_jax.rollout.server` subprocess over loopback: every
route's shape, bad requests answered 400 without disturbing a
concurrent good one, pause modes, abort, weight updates with version spans, and refused updates."""

import asyncio
import json
import os
import shutil
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from flashrl_jax.testing import tiny_config, write_tiny_checkpoint
from tests.server_process import server_process

LONG = 400  # tokens: long enough (~0.5 s) that pausing or aborting lands mid-generation


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("server_ckpts")
  paths = {name: str(root / name) for name in ("a", "b", "bad")}
  # No eos token at all, so sampled requests run to max_new_tokens (the golden checker pauses and
  # aborts requests it expects to be still running).
  config = tiny_config(eos_token_ids=(), max_position_embeddings=512)
  for name, seed in (("a", 0), ("b", 1)):
    write_tiny_checkpoint(paths[name], config, seed=seed)
    with open(os.path.join(paths[name], "tokenizer_config.json"), "w") as f:
      json.dump({"eos_token": None, "pad_token": "<pad>", "bos_token": "<bos>"}, f)
  shutil.copytree(paths["a"], paths["bad"])
  with open(os.path.join(paths["bad"], "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(paths["bad"], "config.json"), "w") as f:
    json.dump({**hf, "num_hidden_layers": 3}, f)
  return paths


@pytest.fixture(scope="module")
def url(ckpts):
  with server_process(f"--model_path={ckpts['a']}", "--port=0", "--max_running_requests=4",
                      "--max_prefill_batch=2", "--num_continuous_decode_steps=3") as address:
    assert address.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    yield address


def call(url, path, body=None, method=None):
  """(status, parsed JSON or text) of one request."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + path, data=data, method=method or ("GET" if body is None
                                                                        else "POST"))
  try:
    with urllib.request.urlopen(req, timeout=120) as resp:
      status, raw = resp.status, resp.read().decode()
  except urllib.error.HTTPError as e:
    status, raw = e.code, e.read().decode()
  try:
    return status, json.loads(raw)
  except ValueError:
    return status, raw


def generate(url, **body):
  status, out = call(url, "/generate", body)
  assert status == 200, out
  return out


def spans(out):
  return [(s["version"], s["start"], s["end"]) for s in out["meta_info"]["weight_versions"]]


async def _while_running(url, body, action, *, min_tokens=8):
  """Sends `body` to /generate, runs `action(session)` once it has produced tokens, returns both."""
  async with aiohttp.ClientSession() as s:
    task = asyncio.create_task(s.post(url + "/generate", json=body))
    prompt = len(body["input_ids"])
    while True:
      async with s.get(url + "/v1/loads") as r:
        load = (await r.json())["loads"][0]
      if load["num_used_tokens"] >= prompt + min_tokens:
        break
      assert not task.done(), "the request finished before the action"
      await asyncio.sleep(0.005)
    acted = await action(s)
    resp = await task
    return resp.status, await resp.json(), acted


def while_running(url, body, action, **kw):
  return asyncio.run(_while_running(url, body, action, **kw))


def post(url, path, body=None):
  """An action for `while_running`: POST `body` to `path`, giving (status, text)."""
  async def act(s):
    async with s.post(url + path, json=body or {}) as r:
      return r.status, await r.text()
  return act


def test_info_routes(url):
  for path in ("/health", "/health_generate"):
    assert call(url, path)[0] == 200
  for path in ("/model_info", "/get_model_info"):
    status, info = call(url, path)
    assert status == 200 and info["is_generation"] and info["weight_version"] == "default"
  for path in ("/server_info", "/get_server_info"):
    status, info = call(url, path)
    assert status == 200 and info["max_running_requests"] == 4 and info["host"] == "127.0.0.1"
  status, loads = call(url, "/v1/loads")
  assert status == 200 and loads["loads"][0]["num_running_reqs"] == 0
  assert call(url, "/flush_cache")[0] == 200


def test_generate_single_text_batch_n_and_stream(url):
  out = generate(url, input_ids=[5, 6, 7], return_logprob=True, rid="single",
                 sampling_params={"max_new_tokens": 6, "temperature": 0})
  meta = out["meta_info"]
  assert meta["id"] == "single" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
  assert meta["finish_reason"] == {"type": "length", "length": 6}
  assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
  assert all(e[0] <= 0 and e[2] is None for e in meta["output_token_logprobs"])
  assert spans(out) == [("default", 0, 6)] and isinstance(out["text"], str)
  by_text = generate(url, text="abc", sampling_params={"max_new_tokens": 3, "temperature": 0})
  assert by_text["meta_info"]["prompt_tokens"] == 3 and "output_token_logprobs" not in \
      by_text["meta_info"]
  batch = generate(url, input_ids=[[5, 6, 7], [8]], sampling_params=[
      {"max_new_tokens": 6, "temperature": 0}, {"max_new_tokens": 2}])
  assert batch[0]["output_ids"] == out["output_ids"] and len(batch[1]["output_ids"]) == 2
  samples = generate(url, input_ids=[9, 9], sampling_params={"max_new_tokens": 4, "n": 3})
  assert len(samples) == 3 and len({s["meta_info"]["id"] for s in samples}) == 3
  body = json.dumps({"input_ids": [5, 6, 7], "stream": True, "return_logprob": True,
                     "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).encode()
  with urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body)) as resp:
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    lines = [ln for ln in resp.read().decode().splitlines() if ln]
  assert lines[-1] == "data: [DONE]"
  chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
  for prev, cur in zip(chunks, chunks[1:]):
    assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert prev["meta_info"]["finish_reason"] is None
  assert chunks[-1]["output_ids"] == out["output_ids"]


def test_a_body_parsed_on_a_worker_thread_answers_as_one_parsed_inline(url):
  # Bodies up to 16 KiB are parsed on the server's event loop, larger ones on a worker thread
  # (`_INLINE_PARSE_BYTES`); JSON's whitespace makes the same request cross that line.
  from flashrl_jax.rollout import _server
  body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
  compact = json.dumps(body).encode()
  padded = compact + b" " * (_server._INLINE_PARSE_BYTES + 1)
  assert len(compact) <= _server._INLINE_PARSE_BYTES < len(padded)

  def send(data):
    req = urllib.request.Request(url + "/generate", data=data)
    try:
      with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())
  (s1, inline), (s2, threaded) = send(compact), send(padded)
  assert s1 == s2 == 200 and inline["output_ids"] == threaded["output_ids"]
  assert len(inline["output_ids"]) == 5
  bad = json.dumps({"input_ids": [5, 96]}).encode()  # outside the tiny model's vocabulary
  (s3, e1), (s4, e2) = send(bad), send(bad + b" " * (_server._INLINE_PARSE_BYTES + 1))
  assert s3 == s4 == 400 and e1 == e2 and "vocabulary" in json.dumps(e1)


BAD = [
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "temprature": 1}}, "temprature"),
    ({"input_ids": [5], "text": "a"}, "not both"),
    ({"sampling_params": {}}, "Either text or input_ids"),
    ({"input_ids": [5, 96]}, "vocabulary"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [5] * 512}, "context length"),
    ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p"),
]


def test_bad_requests_get_400_while_a_good_request_succeeds(url):
  async def send_bad(s):
    results = []
    for body, message in BAD:
      async with s.post(url + "/generate", json=body) as r:
        results.append((r.status, (await r.json())["error"]["message"], message))
    async with s.post(url + "/generate", data=b"{not json") as r:
      results.append((r.status, (await r.json())["error"]["message"], "JSON"))
    async with s.post(url + "/pause_generation", json={"mode": "sideways"}) as r:
      results.append((r.status, (await r.json())["error"]["message"], "mode"))
    return results

  good = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": LONG}}
  status, out, results = while_running(url, good, send_bad)
  for code, message, expected in results:
    assert code == 400 and expected in message
  assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}


def test_pause_abort_returns_partial_output_and_new_requests_wait(url):
  body = {"input_ids": [5, 6], "return_logprob": True, "sampling_params": {"max_new_tokens": LONG}}
  status, out, _ = while_running(url, body, post(url, "/pause_generation", {"mode": "abort"}))
  n = len(out["output_ids"])
  assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort" and 8 <= n < LONG
  assert len(out["meta_info"]["output_token_logprobs"]) == n

  async def waits_until_continue():
    async with aiohttp.ClientSession() as s:
      task = asyncio.create_task(s.post(url + "/generate", json={"input_ids": [5]}))
      await asyncio.sleep(0.3)
      assert not task.done()
      await post(url, "/continue_generation")(s)
      return await (await task).json()
  assert len(asyncio.run(waits_until_continue())["output_ids"]) == 128


def test_abort_request_by_rid_and_all(url):
  for abort in ({"rid": "victim"}, {"abort_all": True}):
    body = {"input_ids": [5, 6], "rid": "victim", "sampling_params": {"max_new_tokens": LONG}}
    status, out, (code, _) = while_running(url, body, post(url, "/abort_request", abort))
    assert code == 200 and status == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < LONG


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_update_continue_keeps_every_token_with_two_spans(url, ckpts, mode):
  body = {"input_ids": [5, 6], "return_logprob": True,
          "sampling_params": {"max_new_tokens": LONG, "temperature": 0}}

  async def pause_update_continue(s):
    await post(url, "/pause_generation", {"mode": mode})(s)
    async with s.get(url + "/v1/loads") as r:
      load = (await r.json())["loads"][0]
    result = await post(url, "/update_weights_from_disk",
                        {"model_path": ckpts["b"], "weight_version": f"{mode}-1"})(s)
    await post(url, "/continue_generation")(s)
    return load, result

  status, out, (load, (code, text)) = while_running(url, body, pause_update_continue)
  assert code == 200 and json.loads(text)["success"], text
  assert len(out["output_ids"]) == LONG and len(out["meta_info"]["output_token_logprobs"]) == LONG
  (v0, s0, e0), (v1, s1, e1) = spans(out)
  assert (v0, s0, v1, s1, e1) == ("default", 0, f"{mode}-1", e0, LONG) and 8 <= e0 < LONG
  assert out["meta_info"]["weight_version"] == f"{mode}-1"
  assert call(url, "/model_info")[1]["weight_version"] == f"{mode}-1"
  # Idle and not paused: the update applies at once.
  status, result = call(url, "/update_weights_from_disk", {"model_path": ckpts["a"],
                                                           "weight_version": "default"})
  assert status == 200 and result["success"]


def test_update_waits_for_in_flight_requests_when_not_paused(url, ckpts):
  body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": LONG}}
  update = post(url, "/update_weights_from_disk", {"model_path": ckpts["a"],
                                                   "weight_version": "later"})

  async def update_then_load(s):
    result = await update(s)
    async with s.get(url + "/v1/loads") as r:
      return result, (await r.json())["loads"][0]["num_running_reqs"]
  status, out, ((code, _), running) = while_running(url, body, update_then_load)
  assert code == 200 and running == 0  # it answered only once the request had finished
  assert spans(out) == [("default", 0, LONG)]
  assert call(url, "/model_info")[1]["weight_version"] == "later"
  call(url, "/update_weights_from_disk", {"model_path": ckpts["a"], "weight_version": "default"})


def test_mismatched_weights_are_refused_and_old_weights_keep_serving(url, ckpts):
  greedy = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
  before = generate(url, **greedy)
  for path in (ckpts["bad"], ckpts["bad"] + "-missing"):
    status, result = call(url, "/update_weights_from_disk", {"model_path": path,
                                                             "weight_version": "bad"})
    assert status == 400 and not result["success"] and path in result["message"]
  after = generate(url, **greedy)
  assert after["output_ids"] == before["output_ids"]
  assert after["meta_info"]["weight_version"] == "default"


def test_server_info_counts_decode_work_and_its_time(url):
  """The counters a benchmark reads to price a decode iteration: every generated token but each
  request's first (its prefill's) is one busy slot in one decode step, and the decode and prefill
  times are real wall time inside this call."""
  info = lambda: call(url, "/server_info")[1]["internal_states"][0]
  before = info()
  start = time.perf_counter()
  out = generate(url, input_ids=[[5, 6, 7], [8, 9]],
                 sampling_params={"max_new_tokens": 12, "ignore_eos": True})
  wall = time.perf_counter() - start
  after = info()
  delta = {k: after[k] - before[k] for k in ("decode_steps", "busy_slot_steps", "generated_tokens",
                                             "prefill_calls", "decode_s", "prefill_s",
                                             "decode_calls")}
  assert [o["meta_info"]["completion_tokens"] for o in out] == [12, 12]
  assert delta["generated_tokens"] == 24
  assert delta["busy_slot_steps"] == 24 - 2  # two first tokens came from prefill
  assert 11 <= delta["decode_steps"] <= 22  # together (11) or one after the other (22)
  # Blocks of up to 3 steps per call (the server's --num_continuous_decode_steps).
  assert call(url, "/server_info")[1]["num_continuous_decode_steps"] == 3
  assert -(-delta["decode_steps"] // 3) <= delta["decode_calls"] < delta["decode_steps"]
  assert delta["prefill_calls"] >= 1
  assert 0 < delta["decode_s"] < wall and 0 < delta["prefill_s"] < wall
  assert delta["decode_s"] + delta["prefill_s"] < wall


def test_client_disconnect_aborts_its_request(url):
  tokens = lambda: call(url, "/server_info")[1]["internal_states"][0]["generated_tokens"]
  before = tokens()

  async def send_and_hang_up():
    async with aiohttp.ClientSession() as s:
      post = asyncio.create_task(s.post(url + "/generate", json={
          "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 500}}))
      while (await (await s.get(url + "/v1/loads")).json())["loads"][0]["num_used_tokens"] < 10:
        await asyncio.sleep(0.005)
      post.cancel()  # closes its connection
      await asyncio.gather(post, return_exceptions=True)
  asyncio.run(send_and_hang_up())
  deadline = time.monotonic() + 30
  while call(url, "/v1/loads")[1]["loads"][0]["num_running_reqs"]:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  assert tokens() - before < 500  # aborted, not run to the end
