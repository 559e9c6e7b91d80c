"""No request and no weight directory kills the engine or gets a 5xx, against a real
`python -m flashrl_jax.rollout.server` subprocess over loopback.

- Fuzz: 300 malformed or adversarial requests (`tests/fuzz_requests.py`, seeded) over every route
  (native and OpenAI-compatible),
  8 at a time, with a valid greedy request in every round whose answer must not change: no answer
  is 5xx, every JSON answer is strict JSON, every 200 from /generate passes the client's protocol
  validator (finite log-probs, ids in the vocabulary), and the engine is alive and clean at the end.
- Corrupt checkpoints: ~60 damaged weight directories (truncated, garbled or re-headed safetensors,
  non-finite or int weights, wrong config types, malformed indexes and manifests, FIFOs, path
  traversal): each update is refused with `success: false` and a reason, and the old weights keep
  serving; an intact export then loads. Then 150 random damages (flipped bits, truncations,
  inserted or cut bytes in any file): never a 5xx, a refusal keeps the old weights.
- Limits: each one (body, inflated gzip body, text length, n, samples) refused at the edge naming
  it, `/health` answering meanwhile; a bad `stream_options` refused before its stream starts.
- A killed engine thread (`--enable_fault_injection`): the process stays up and answers 503 on
  generation, health and updates, which the client takes as a server failure.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import shutil

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flashrl_jax.fleet import _protocol as proto
from flashrl_jax.model import save_hf
from flashrl_jax.testing import tiny_config, tiny_model, write_tiny_checkpoint
from flashrl_jax.trainer import export_version
from tests import fuzz_requests
from tests.server_process import server_process

CONFIG = tiny_config(max_position_embeddings=512)
VALID = {"input_ids": [5, 6, 7], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


def _strict_json(text: str):
  return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("robust")
  write_tiny_checkpoint(str(root / "model"), CONFIG, seed=0)
  save_hf(tiny_model(CONFIG, seed=0), str(root / "sharded"), max_shard_bytes=20_000)
  export_version(tiny_model(CONFIG, seed=1), 1, str(root / "versions"), config=CONFIG)
  return root


@pytest.fixture(scope="module")
def url(dirs):
  with server_process(f"--model_path={dirs / 'model'}", "--port=0", "--max_running_requests=4",
                      "--context_length=128", "--weight_version=0", "--max_body_bytes=1048576",
                      "--max_text_chars=4096", "--max_n=8", "--max_samples_per_request=16",
                      "--enable_fault_injection") as address:
    yield address


async def _send(s: aiohttp.ClientSession, url: str, case: fuzz_requests.Case) -> tuple[int, str]:
  headers = {"Content-Type": "application/json", **dict(case.headers)}
  async with asyncio.timeout(60):  # every request is answered
    async with s.request(case.method, url + case.path, data=case.body, headers=headers) as r:
      return r.status, (await r.read()).decode(errors="replace")


async def _valid(s, url) -> tuple:
  async with s.post(url + "/generate", json=VALID) as r:
    assert r.status == 200, await r.text()
    out = proto.parse_generate_output(_strict_json(await r.text()), vocab_size=CONFIG.vocab_size)
  return out.output_ids, out.output_logprobs


def _no_internal_error(event, where: str) -> None:
  """A stream's 200 is sent before it fails: a failure (a 500 had it not started) is an event."""
  error = event.get("error") if isinstance(event, dict) else None
  assert "internal server error" not in json.dumps(error), f"{where}: {error}"


def _check_answer(case: fuzz_requests.Case, status: int, text: str) -> None:
  where = f"{case.label} {case.method} {case.path} {case.body[:300] if case.body else b''!r}"
  assert status < 500, f"{status} for {where}: {text[:500]}"
  if case.label.startswith("extreme#"):
    assert status == 200, f"a valid request was refused: {status} for {where}: {text[:500]}"
  if case.path.startswith("/v1/") and status == 200:  # strict JSON, or strict JSON events
    for line in text.splitlines() if text.startswith("data:") else [text]:
      line = line[len("data:"):].strip() if line.startswith("data:") else line
      if line and line != "[DONE]":
        _no_internal_error(_strict_json(line), where)
    return
  if case.path != "/generate" or status != 200:
    if text.lstrip().startswith(("{", "[")):
      _strict_json(text)
    return
  if text.startswith("data:"):  # a stream: every event strict JSON, ending with [DONE]
    events = [line[len("data:"):].strip() for line in text.splitlines() if line.strip()]
    assert events[-1] == "[DONE]", where
    for event in events[:-1]:
      _no_internal_error(_strict_json(event), where)
    return
  body = json.loads(case.body)
  results = _strict_json(text)
  for result in results if isinstance(results, list) else [results]:
    if body.get("return_logprob") is True and body.get("logprob_start_len", -1) in (-1, None):
      proto.parse_generate_output(result, vocab_size=CONFIG.vocab_size)
    assert all(0 <= t < CONFIG.vocab_size for t in result["output_ids"]), where


async def _server_state(s, url) -> tuple[dict, dict]:
  async with s.get(url + "/server_info") as r:
    internal = (await r.json())["internal_states"][0]
  async with s.get(url + "/v1/loads") as r:
    load = (await r.json())["loads"][0]
  return internal, load


def test_fuzzed_requests_never_kill_the_engine_or_get_a_5xx(url, dirs):
  bad_dirs = [str(dirs / "model" / "model.safetensors"), str(dirs / "versions")]
  cases = fuzz_requests.cases(seed=16, count=300, bad_weight_dirs=bad_dirs,
                              vocab=CONFIG.vocab_size)

  async def campaign():
    async with aiohttp.ClientSession() as s:
      baseline = await _valid(s, url)
      for start in range(0, len(cases), 8):
        batch = cases[start:start + 8]
        answers = await asyncio.gather(_valid(s, url), *(_send(s, url, c) for c in batch))
        assert answers[0] == baseline, f"the valid request changed after {batch[-1].label}"
        for case, (status, text) in zip(batch, answers[1:]):
          _check_answer(case, status, text)
      async with s.get(url + "/health_generate") as r:
        assert r.status == 200
      return await _server_state(s, url)

  internal, load = asyncio.run(campaign())
  assert internal["engine_alive"] and internal["engine_errors"] == 0
  assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0  # nothing left behind


# --- corrupt weight directories ---------------------------------------------------------------------

def _header(file: str, edit) -> None:
  """Rewrites a safetensors header (JSON after an 8-byte length) with `edit`, keeping the data."""
  data = open(file, "rb").read()
  n = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + n])
  edit(header)
  new = json.dumps(header).encode()
  new += b" " * (-len(new) % 8)
  open(file, "wb").write(len(new).to_bytes(8, "little") + new + data[8 + n:])


def _first(header: dict) -> dict:
  return header[sorted(k for k in header if k != "__metadata__")[0]]


def _tensors(file: str, edit) -> None:
  tensors = load_file(file)
  edit(tensors)
  save_file(tensors, file)


def _config(path: str, edit) -> None:
  file = os.path.join(path, "config.json")
  config = json.load(open(file))
  edit(config)
  json.dump(config, open(file, "w"))


def _write(path: str, name: str, data: bytes) -> None:
  open(os.path.join(path, name), "wb").write(data)


def _truncate(size_of):
  def go(path):
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
      f.truncate(size_of(os.path.getsize(file)))
  return go


def _flip(offset_of):
  def go(path):
    file = os.path.join(path, "model.safetensors")
    data = bytearray(open(file, "rb").read())
    data[offset_of(len(data))] ^= 0xFF
    open(file, "wb").write(bytes(data))
  return go


def _replace(name: str, make):
  def go(path):
    file = os.path.join(path, name)
    os.remove(file)
    make(file)
  return go


def _index(edit):
  def go(path):
    file = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(file))
    edit(index)
    json.dump(index, open(file, "w"))
  return go


def _st(path):
  return os.path.join(path, "model.safetensors")


def _weights(path):
  return os.path.join(path, "weight_v000001", "model.safetensors")


def _nan(tensors):
  name = sorted(tensors)[0]
  tensors[name] = tensors[name].copy()
  tensors[name].flat[0] = np.nan


SINGLE = {  # applied to a copy of the model directory (no manifest: structural checks only)
    "truncated to 0": _truncate(lambda n: 0), "truncated to 7": _truncate(lambda n: 7),
    "truncated to 100": _truncate(lambda n: 100), "truncated by half": _truncate(lambda n: n // 2),
    "truncated by 1": _truncate(lambda n: n - 1),
    "header length 2^63": lambda p: _write(p, "model.safetensors", (2**63).to_bytes(8, "little")
                                           + open(_st(p), "rb").read()[8:]),
    "header garbled": _flip(lambda n: 20),  # (a changed weight byte: only a manifest tells)
    "dtype I32": lambda p: _header(_st(p), lambda h: _first(h).update(dtype="I32")),
    "dtype F64": lambda p: _header(_st(p), lambda h: _first(h).update(dtype="F64")),
    "dtype BOOL": lambda p: _header(_st(p), lambda h: _first(h).update(dtype="BOOL")),
    "shape flattened": lambda p: _header(_st(p), lambda h: _first(h).update(
        shape=[int(np.prod(_first(h)["shape"]))])),
    "offsets past the end": lambda p: _header(_st(p), lambda h: _first(h).update(
        data_offsets=[0, 10**9])),
    "header not JSON": lambda p: _write(p, "model.safetensors", (16).to_bytes(8, "little")
                                        + b"{not json at all" + open(_st(p), "rb").read()[24:]),
    "NaN weight": lambda p: _tensors(_st(p), _nan),
    "inf weights": lambda p: _tensors(_st(p), lambda t: t.update(
        {k: np.full_like(v, np.inf) for k, v in list(t.items())[:1]})),
    "int weights": lambda p: _tensors(_st(p), lambda t: t.update(
        {k: v.astype(np.int32) for k, v in list(t.items())[:1]})),
    "missing tensor": lambda p: _tensors(_st(p), lambda t: t.pop(sorted(t)[0])),
    "extra tensor": lambda p: _tensors(_st(p), lambda t: t.update(bogus=np.zeros(3, np.float32))),
    "config not JSON": lambda p: _write(p, "config.json", b"{oops"),
    "config a list": lambda p: _write(p, "config.json", b"[1, 2]"),
    "config nested 100000 deep": lambda p: _write(p, "config.json", b"[" * 100000 + b"]" * 100000),
    "config vocab_size a string": lambda p: _config(p, lambda c: c.update(vocab_size="96")),
    "config vocab_size a list": lambda p: _config(p, lambda c: c.update(vocab_size=[96])),
    "config hidden_size a float": lambda p: _config(p, lambda c: c.update(hidden_size=32.5)),
    "config layers negative": lambda p: _config(p, lambda c: c.update(num_hidden_layers=-2)),
    "config layers 3": lambda p: _config(p, lambda c: c.update(num_hidden_layers=3)),
    "config rope_theta changed": lambda p: _config(p, lambda c: c.update(
        rope_theta=5.0, rope_parameters={"rope_type": "default", "rope_theta": 5.0})),
    "config eos a dict": lambda p: _config(p, lambda c: c.update(eos_token_id={"a": 1})),
    "config no heads": lambda p: _config(p, lambda c: c.pop("num_attention_heads")),
    "config unknown architecture": lambda p: _config(p, lambda c: c.update(
        architectures=["GPT9ForCausalLM"])),
    "config 17 MB": lambda p: _write(p, "config.json", b" " * (17 << 20) + b"{}"),
    "config a directory": _replace("config.json", os.mkdir),
    "config a FIFO": _replace("config.json", os.mkfifo),
    "config missing": lambda p: os.remove(os.path.join(p, "config.json")),
    "safetensors a directory": _replace("model.safetensors", os.mkdir),
    "safetensors a FIFO": _replace("model.safetensors", os.mkfifo),
    "safetensors -> /dev/zero": _replace("model.safetensors", lambda f: os.symlink("/dev/zero", f)),
    "safetensors -> /dev/urandom": _replace("model.safetensors",
                                            lambda f: os.symlink("/dev/urandom", f)),
    "only a .bin": _replace("model.safetensors", lambda f: _write(os.path.dirname(f), "model.bin",
                                                                    b"\x80\x04K\x01.")),
}
SHARDED = {  # applied to a copy of a sharded directory (an index and several files)
    "index not JSON": lambda p: _write(p, "model.safetensors.index.json", b"{"),
    "index weight_map a list": _index(lambda i: i.update(weight_map=[1])),
    "index to a missing file": _index(lambda i: i["weight_map"].update(
        {k: "gone.safetensors" for k in list(i["weight_map"])[:1]})),
    "index path traversal": _index(lambda i: i["weight_map"].update(
        {k: "../model/model.safetensors" for k in i["weight_map"]})),
    "index absolute path": _index(lambda i: i["weight_map"].update(
        {k: "/etc/passwd" for k in list(i["weight_map"])[:1]})),
    "index file an int": _index(lambda i: i["weight_map"].update(
        {k: 7 for k in list(i["weight_map"])[:1]})),
    "index missing a tensor": _index(lambda i: i["weight_map"].pop(sorted(i["weight_map"])[0])),
    "index to a FIFO": lambda p: (os.mkfifo(os.path.join(p, "pipe.safetensors")), _index(
        lambda i: i["weight_map"].update({k: "pipe.safetensors" for k in i["weight_map"]}))(p)),
}
EXPORTED = {  # applied to a copy of a trainer export (its manifest holds every file's sha256)
    "one weight byte changed": lambda p: _tensors(_weights(p), lambda t: t.update(
        {k: v + np.float32(1e-3) for k, v in list(t.items())[:1]})),
    "manifest not JSON": lambda p: _write(os.path.join(p, "weight_v000001"), "manifest.json", b"{"),
    "manifest files a list": lambda p: _write(os.path.join(p, "weight_v000001"), "manifest.json",
                                              b'{"files": []}'),
    "manifest sha not hex": lambda p: _manifest(p, lambda m: [
        e.update(sha256="zz" * 32) for e in m["files"].values()]),
    "manifest names ../x": lambda p: _manifest(p, lambda m: m["files"].update(
        {"../x": {"sha256": "0" * 64, "bytes": 1}})),
    "manifest misses a file": lambda p: _manifest(p, lambda m: m["files"].pop("config.json")),
    "file not in manifest": lambda p: _write(os.path.join(p, "weight_v000001"), "extra.txt", b"x"),
    "file resized": lambda p: _truncate(lambda n: n - 8)(os.path.join(p, "weight_v000001")),
}
OTHER_PATHS = ("/nonexistent/dir", "/", "/dev/null", "/proc/self")


def _manifest(path: str, edit) -> None:
  file = os.path.join(path, "weight_v000001", "manifest.json")
  manifest = json.load(open(file))
  edit(manifest)
  json.dump(manifest, open(file, "w"))


def _corrupt_dirs(dirs, tmp_path) -> dict[str, str]:
  out = {}
  for group, base, suffix in ((SINGLE, "model", ""), (SHARDED, "sharded", ""),
                              (EXPORTED, "versions", "weight_v000001")):
    for i, (name, corrupt) in enumerate(group.items()):
      path = str(tmp_path / f"{base}-{i}")
      shutil.copytree(dirs / base, path)
      corrupt(path)
      out[name] = os.path.join(path, suffix)
  out["a plain file"] = str(dirs / "model" / "config.json")
  out.update({p: p for p in OTHER_PATHS})
  return out


def test_corrupt_weight_directories_are_refused_and_old_weights_keep_serving(url, dirs, tmp_path):
  corrupt = _corrupt_dirs(dirs, tmp_path)

  async def campaign():
    async with aiohttp.ClientSession() as s:
      baseline = await _valid(s, url)
      for i, (name, path) in enumerate(corrupt.items()):
        async with asyncio.timeout(60):
          async with s.post(url + "/update_weights_from_disk",
                            json={"model_path": path, "weight_version": "bad"}) as r:
            status, answer = r.status, _strict_json(await r.text())
        assert status == 400 and answer["success"] is False and answer["message"], (name, answer)
        if i % 10 == 0:
          assert await _valid(s, url) == baseline, name
      assert await _valid(s, url) == baseline
      async with s.get(url + "/model_info") as r:
        assert (await r.json())["weight_version"] == "0"
      intact = str(dirs / "versions" / "weight_v000001")
      for path, version in ((intact, "1"), (str(dirs / "model"), "0")):
        async with s.post(url + "/update_weights_from_disk",
                          json={"model_path": path, "weight_version": version}) as r:
          assert r.status == 200 and (await r.json())["success"], await r.text()
        after = await _valid(s, url)
        assert (after == baseline) == (version == "0")  # the export's other weights, then back
      return await _server_state(s, url)

  internal, _ = asyncio.run(campaign())
  assert internal["engine_alive"] and internal["engine_errors"] == 0
  assert len(corrupt) >= 60


def _damage(rng: random.Random, path: str) -> str:
  """One random damage to one file under `path`: bits flipped (mostly in the first 4 KiB, where the
  headers and JSON are), truncated, bytes inserted or cut. Returns what was done."""
  files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
  file = rng.choice(files)
  data = bytearray(open(file, "rb").read())
  kind = rng.choice(["flip", "truncate", "insert", "cut"])
  if kind == "flip":
    for _ in range(rng.randint(1, 4)):
      i = rng.randrange(min(len(data), 4096) if rng.random() < 0.7 else len(data))
      data[i] ^= 1 << rng.randrange(8)
  elif kind == "truncate":
    del data[rng.randrange(len(data) + 1):]
  elif kind == "insert":
    i = rng.randrange(len(data) + 1)
    data[i:i] = rng.randbytes(rng.randint(1, 16))
  else:
    i = rng.randrange(len(data) + 1)
    del data[i:i + rng.randint(1, 64)]
  open(file, "wb").write(data)
  return f"{kind} {os.path.relpath(file, path)}"


def test_randomly_damaged_weight_directories_never_hurt_the_server(url, dirs, tmp_path):
  """150 random damages (seeded) to a checkpoint, a sharded one and an export with its manifest:
  each update answers 400 (refused: the old weights keep serving) or 200 (damage to weight bytes
  that nothing but a manifest could see: a plain checkpoint loads them), never a 5xx; an export's
  weight files never load damaged. 3,000 such damages (seeds 1-5 of this generator) were all
  answered this way."""
  rng = random.Random(16)
  bases = [(dirs / "model", ""), (dirs / "sharded", ""), (dirs / "versions", "weight_v000001")]

  async def campaign():
    refused = 0
    async with aiohttp.ClientSession() as s:
      baseline = await _valid(s, url)
      for i in range(150):
        base, suffix = bases[i % 3]
        path = str(tmp_path / f"damaged-{i}")
        shutil.copytree(base, path)
        what = _damage(rng, os.path.join(path, suffix))
        async with s.post(url + "/update_weights_from_disk", json={
            "model_path": os.path.join(path, suffix), "weight_version": f"d{i}"}) as r:
          status, text = r.status, await r.text()
        assert status in (200, 400), (what, status, text)
        if status == 400:
          refused += 1
          assert await _valid(s, url) == baseline, what
          continue
        assert not suffix or what.endswith("manifest.json"), (what, text)  # only its metadata
        async with s.post(url + "/update_weights_from_disk",
                          json={"model_path": str(dirs / "model"), "weight_version": "0"}) as r:
          assert r.status == 200, await r.text()
      return refused, await _server_state(s, url)

  refused, (internal, _) = asyncio.run(campaign())
  assert refused >= 50 and internal["engine_alive"] and internal["engine_errors"] == 0


def _message(text: str) -> str:
  """The error message of a native (`{"error": {"message"}}`) or OpenAI (`{"message"}`) answer."""
  answer = _strict_json(text)
  return answer.get("error", answer)["message"]


def test_each_limit_is_refused_at_the_edge_naming_it(url):
  """A request over a limit (this server: body 1 MiB, text 4096 characters, n 8, 16 samples) is
  refused before it is tokenized or queued, naming the limit: 413 for the body (also a gzip body
  that inflates past it), 400 for the rest, on the native and the OpenAI routes; `/health`, asked at
  the same time, answers."""
  big_text = json.dumps({"text": "a" * (1 << 20)}).encode()
  cases = [  # (path, body bytes, extra headers, status, words the error names)
      ("/generate", big_text, {}, 413, "1048576 bytes"),
      ("/generate", gzip.compress(json.dumps({"text": "a" * (8 << 20)}).encode()),
       {"Content-Encoding": "gzip"}, 413, "1048576 bytes"),
      ("/generate", json.dumps({"text": "a" * 4097}).encode(), {}, 400, "4096"),
      ("/generate", json.dumps({"text": ["a", "b" * 4097]}).encode(), {}, 400, "4096"),
      ("/generate", json.dumps({"input_ids": [5], "sampling_params": {"n": 9}}).encode(), {}, 400,
       "(8)"),
      ("/generate", json.dumps({"input_ids": [[5]] * 3, "sampling_params": {"n": 8}}).encode(), {},
       400, "(16)"),
      ("/v1/completions", json.dumps({"prompt": "a" * 4097, "max_tokens": 1}).encode(), {}, 400,
       "4096"),
      ("/v1/completions", json.dumps({"prompt": "ab", "n": 9, "max_tokens": 1}).encode(), {}, 400,
       "(8)"),
  ]

  async def go():
    async with aiohttp.ClientSession() as s:
      async def one(path, body, headers):
        async with s.post(url + path, data=body,
                          headers={"Content-Type": "application/json", **headers}) as r:
          return r.status, await r.text()

      async def health():
        async with s.get(url + "/health") as r:
          return r.status

      return await asyncio.gather(health(), *(one(p, b, h) for p, b, h, _, _ in cases))

  health, *answers = asyncio.run(go())
  assert health == 200
  for (path, _, headers, status, words), (got, text) in zip(cases, answers):
    assert got == status, (path, headers, got, text)
    assert words in _message(text), (path, headers, got, text)


def test_bad_stream_options_are_refused_before_the_stream_starts(url):
  """Found by the fuzz: `stream_options: 1e308` with `stream: true` failed after the stream's 200
  was sent, and aiohttp wrote a raw 500 into the body (the client saw a broken chunked stream or
  hung). It is refused with a 400 before the stream starts; a valid one still streams its usage."""
  chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
  completion = {"prompt": "hi", "max_tokens": 2, "stream": True}

  async def go():
    async with aiohttp.ClientSession() as s:
      async def one(path, body):
        async with s.post(url + path, json=body) as r:
          return r.status, await r.text()

      bad = [one(path, {**body, "stream_options": options})
             for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion))
             for options in (1e308, "x", [], {"include_usage": 1})]
      return await asyncio.gather(one("/v1/chat/completions", {**chat, "stream_options": {
          "include_usage": True}}), *bad)

  (status, text), *refused = asyncio.run(go())
  assert status == 200 and '"usage"' in text and text.rstrip().endswith("data: [DONE]")
  for status, text in refused:
    assert status == 400, text
    message = _message(text)
    assert "stream_options" in message or "include_usage" in message, message


# Last: it stops the module server's engine.
def test_killed_engine_answers_503_and_the_process_stays_up(url):
  """Last: it kills the module server's engine."""
  async def go():
    async with aiohttp.ClientSession() as s:
      async with s.post(url + "/debug/kill_engine") as r:
        assert r.status == 200 and (await r.json())["engine_alive"] is False
      async with s.post(url + "/generate", json=VALID) as r:
        assert r.status == 503 and "shut down" in (await r.json())["error"]["message"]
      for path in ("/health", "/health_generate"):  # what the supervisor probes to restart it
        async with s.get(url + path) as r:
          assert r.status == 503, path
      async with s.post(url + "/update_weights_from_disk", json={"model_path": "/x"}) as r:
        assert r.status == 503 and (await r.json())["success"] is False
      async with s.get(url + "/v1/loads") as r:
        assert r.status == 200  # the process and its HTTP server are up
  asyncio.run(go())
