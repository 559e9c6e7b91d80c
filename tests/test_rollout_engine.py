"""Rollout engine invariants, in-process on a tiny random Qwen3: greedy == argmax of the full forward,
behaviour log-probs == the model's log-softmax at T, sampling frequencies == softmax (chi-square),
continuous batching, weight swaps without recompiles, every pause mode keeping every token, and
tensor-parallel (2 fake CPU devices) == single device."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from scipy import stats

from flashrl_jax.fleet import FinishKind, PauseMode
from flashrl_jax.rollout import Engine, EngineConfig, Sampling
from flashrl_jax.rollout._request import LogprobOptions
from flashrl_jax.rollout._runner import bucket_ladder
from flashrl_jax.rollout._sampling import RowSampling, sample
from flashrl_jax.testing import write_tiny_checkpoint

GREEDY = Sampling(temperature=0, max_new_tokens=12, ignore_eos=True)
PAD = 64


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("rollout_ckpts")
  paths = {name: str(root / name) for name in ("a", "b")}
  models = {"a": write_tiny_checkpoint(paths["a"], seed=0),
            "b": write_tiny_checkpoint(paths["b"], seed=1)}
  return paths, models


@pytest.fixture(scope="module")
def logits_fns(ckpts):
  return {name: full_logits(model) for name, model in ckpts[1].items()}


@pytest.fixture(scope="module")
def engine(ckpts):
  paths, _ = ckpts
  eng = Engine(EngineConfig(paths["a"], max_running_requests=4, context_length=PAD,
                            max_prefill_batch=1, min_decode_batch=2))
  yield eng
  eng.shutdown()


def full_logits(model):
  """Next-token logits of `ids` from one full (uncached) forward, padded to one static shape."""
  forward = jax.jit(lambda ids: model(ids)[0])

  def at_end(ids):
    padded = np.zeros((1, PAD), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(forward(jnp.asarray(padded))[len(ids) - 1], np.float64)
  return at_end


def log_softmax(x):
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def greedy_reference(logits_fn, prompt, n):
  ids, logps = list(prompt), []
  for _ in range(n):
    logits = logits_fn(ids)
    ids.append(int(np.argmax(logits)))
    logps.append(log_softmax(logits)[ids[-1]])
  return ids[len(prompt):], logps


def submit_and_pause_after(engine, prompt, sampling, tokens, mode):
  """Submits a request and pauses the engine from its own thread once the request holds `tokens`
  output tokens: the pause lands at the end of that decode block whatever the test thread's timing
  (polling for the count let the request finish first on a loaded machine)."""
  paused = []

  def on_update(out):
    if not paused and len(out.output_ids) >= tokens and out.finish is None:
      paused.append(engine.pause(mode))  # queued: runs before the next decode call
  request = engine.submit(prompt, sampling, on_update=on_update, stream=True)
  wait_for(lambda: paused or request.done)
  assert paused, "the request finished before it reached the pause point"
  paused[0].result(30)
  return request


def wait_for(cond, timeout=60.0):
  deadline = time.monotonic() + timeout
  while not cond():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.002)


def test_greedy_equals_full_forward_argmax(engine, logits_fns):
  logits_fn = logits_fns["a"]
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20]]
  outs = engine.generate(prompts, GREEDY)
  for prompt, out in zip(prompts, outs):
    tokens, logps = greedy_reference(logits_fn, prompt, 12)
    assert list(out.output_ids) == tokens
    np.testing.assert_allclose(out.logprobs, logps, atol=1e-4)
    assert out.finish.kind is FinishKind.LENGTH and out.finish.length == 12
    assert [(s.version, s.start, s.end) for s in out.versions] == [("default", 0, 12)]


def test_tail_requests_decode_in_a_smaller_batch_from_their_own_slots(engine, logits_fns):
  prompts = [[5, 6], [7, 8, 9], [10], [11, 12, 13, 14]]
  lengths = [2, 14, 3, 14]  # the short ones finish; slots 1 and 3 then decode as a batch of 2
  computed = engine.stats.computed_slot_steps
  outs = engine.generate(prompts, [Sampling(temperature=0, max_new_tokens=n, ignore_eos=True)
                                   for n in lengths])
  for prompt, n, out in zip(prompts, lengths, outs):
    tokens, logps = greedy_reference(logits_fns["a"], prompt, n)
    assert list(out.output_ids) == tokens
    np.testing.assert_allclose(out.logprobs, logps, atol=1e-4)
  assert engine.runner.decode_sizes == [2, 3, 4]
  assert engine.stats.computed_slot_steps - computed < 4 * 13  # some steps ran on 2 slots


@pytest.mark.parametrize("lo, hi, expected", [
    (1, 32, [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]),
    (2, 4, [2, 3, 4]),
    (5, 16, [6, 8, 12, 16]),  # lo rounds up to a rung
    (4, 20, [4, 6, 8, 12, 16, 20]),  # hi itself is the last bucket, a rung or not
    (1, 1, [1]), (1, 2, [1, 2]), (3, 3, [3])])
def test_bucket_ladder_is_powers_of_two_and_halfway_points(lo, hi, expected):
  assert bucket_ladder(lo, hi) == expected


def test_decode_blocks_give_the_tokens_of_one_step_per_call(engine, logits_fns):
  """Several decode steps in one program (`num_continuous_decode_steps`) against one step per call
  (each step's input token and sampling counter carried on the host between calls, as before the
  blocks; the greedy and log-prob tests above check the engine against a full forward): the same
  tokens, log-probs and top candidates, for what a block can cut short — seeded sampling under top-k/top-p, stop tokens,
  EOS, max_new_tokens not a multiple of the block, min_new_tokens banning a stop id across a block
  edge, top log-probs, more requests than slots (admissions between blocks) and a request decoding
  to the end of the context, where the block must shrink (its cache has one spare position)."""
  prompt = [30, 31, 32]
  ref = greedy_reference(logits_fns["a"], prompt, 12)[0]
  requests = [
      ([5, 6, 7], Sampling(temperature=0.9, max_new_tokens=13, ignore_eos=True, sampling_seed=1)),
      ([8, 9], Sampling(temperature=1.3, top_k=5, max_new_tokens=30, sampling_seed=2)),
      ([10, 11, 12], Sampling(temperature=0.7, top_p=0.9, max_new_tokens=11, ignore_eos=True,
                              sampling_seed=3)),
      (prompt, Sampling(temperature=0, max_new_tokens=12, ignore_eos=True,
                        stop_token_ids=[ref[5]])),
      (prompt, Sampling(temperature=0, max_new_tokens=9, ignore_eos=True, min_new_tokens=3,
                        stop_token_ids=[ref[0], ref[4]])),
      ([40 + i % 7 for i in range(PAD - 7)], Sampling(temperature=1.0, ignore_eos=True,
                                                     sampling_seed=4)),
      ([13, 14], Sampling(temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=5)),
  ]

  def run(eng):
    before = dataclasses.replace(eng.stats)
    handles = [eng.submit(p, s, logprobs=LogprobOptions(top_n=3 if i == 2 else 0))
               for i, (p, s) in enumerate(requests)]
    outs = [h.result(120) for h in handles]
    after = eng.stats
    return outs, {k: getattr(after, k) - getattr(before, k)
                  for k in ("decode_calls", "decode_steps", "busy_slot_steps")}

  assert engine.config.num_continuous_decode_steps == 4  # the default: the module's engine
  blocks, block_stats = run(engine)
  with Engine(dataclasses.replace(engine.config, num_continuous_decode_steps=1)) as one_step:
    single, single_stats = run(one_step)
  for one, block in zip(single, blocks):
    assert block.output_ids == one.output_ids
    np.testing.assert_allclose(block.logprobs, one.logprobs, atol=1e-5)
    assert block.finish == one.finish
    assert [[i for i, _ in row] for row in block.output_top] == [[i for i, _ in row] for row in one.output_top]
  lengths = [len(o.output_ids) for o in single]
  assert single[3].finish.kind is FinishKind.STOP and lengths[3] == ref.index(ref[5]) + 1
  assert lengths[5] == 7  # to the end of the context: prompt of PAD - 7, and the last position
  assert any(n % 4 for n in lengths)  # some ended inside a block
  assert len(single[2].output_top) == 11 and len(single[2].output_top[0]) == 3
  assert single_stats["decode_calls"] == single_stats["decode_steps"]
  assert block_stats["decode_calls"] < block_stats["decode_steps"] / 2
  # Tokens dropped after a request ended inside its block are not counted as busy slot-steps.
  assert block_stats["busy_slot_steps"] == single_stats["busy_slot_steps"]


@pytest.mark.parametrize("options", [dict(temperature=0.7, top_p=0.8),
                                     dict(temperature=1.3, top_k=5, min_p=0.05)])
def test_logprobs_are_log_softmax_at_temperature_before_truncation(engine, logits_fns, options):
  logits_fn = logits_fns["a"]
  prompt = [3, 4, 5, 6]
  s = Sampling(max_new_tokens=10, ignore_eos=True, sampling_seed=11, **options)
  out, again = engine.generate([prompt, prompt], s)
  assert out.output_ids == again.output_ids  # same seed, same tokens
  ids = list(prompt)
  for token, logp in zip(out.output_ids, out.logprobs):
    scaled = log_softmax(logits_fn(ids) / options["temperature"])
    assert logp == pytest.approx(scaled[token], abs=1e-4)
    order = np.argsort(-scaled)
    rank = int(np.nonzero(order == token)[0][0])
    probs = np.exp(scaled[order])
    assert probs[:rank].sum() < options.get("top_p", 1.0) + 1e-6  # inside the nucleus
    assert rank < options.get("top_k", 10**9)
    assert probs[rank] >= options.get("min_p", 0.0) * probs[0] - 1e-9
    ids.append(token)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, -1, 1.0), (1.0, 4, 1.0), (1.5, -1, 0.7)])
def test_sampling_frequencies_match_softmax(temperature, top_k, top_p):
  vocab, draws = 10, 20000
  logits = jnp.asarray(np.random.default_rng(0).normal(size=vocab) * 1.5, jnp.float32)
  rows = RowSampling.host([(Sampling(temperature=temperature, top_k=top_k, top_p=top_p), seed, ())
                           for seed in range(draws)], draws)
  tokens, _ = jax.jit(sample)(jnp.broadcast_to(logits, (draws, vocab)), rows,
                              jnp.zeros(draws, jnp.int32))
  counts = np.bincount(np.asarray(tokens), minlength=vocab)
  probs = np.exp(log_softmax(np.asarray(logits, np.float64) / temperature))
  order = np.argsort(-probs)
  keep = np.zeros(vocab, bool)
  mass_before = np.cumsum(probs[order]) - probs[order]
  keep[order] = (np.arange(vocab) < (top_k if top_k > 0 else vocab)) & (mass_before < top_p)
  assert counts[~keep].sum() == 0
  expected = probs[keep] / probs[keep].sum() * draws
  assert stats.chisquare(counts[keep], expected).pvalue > 1e-3


def test_short_request_finishes_before_earlier_long_one(engine):
  slow = Sampling(temperature=0, max_new_tokens=60, ignore_eos=True)
  # Queued while paused, so the long request is admitted first whatever the test thread's timing
  # (waiting for its first token let it finish all 40 tokens first once, on a loaded CI machine).
  engine.pause(PauseMode.IN_PLACE).result(30)
  long = engine.submit([5, 6, 7], slow)
  # More short requests than free slots: the queued ones join as soon as a slot frees.
  shorts = [engine.submit([9, i], Sampling(temperature=0, max_new_tokens=3, ignore_eos=True))
            for i in range(6)]
  engine.resume().result(30)
  for r in shorts:
    r.result(60)
  assert long.result(60).finish.length == 60
  assert max(r.finished_at for r in shorts) < long.finished_at
  assert min(r.created for r in shorts) > long.created


def test_stop_token_stop_string_and_min_new_tokens(engine):
  prompt = [30, 31, 32]
  ref = engine.generate([prompt], GREEDY)[0].output_ids
  stop_id = ref[4]
  out = engine.generate([prompt], Sampling(temperature=0, max_new_tokens=12, ignore_eos=True,
                                           stop_token_ids=[stop_id]))[0]
  first = ref.index(stop_id)
  assert out.output_ids == ref[:first + 1]
  assert out.finish.kind is FinishKind.STOP and out.finish.matched == stop_id
  text = engine.tokenizer.decode(ref)
  stop = text[5:7]
  out = engine.generate([prompt], Sampling(temperature=0, max_new_tokens=12, ignore_eos=True,
                                           stop=[stop]))[0]
  assert out.finish.matched == stop and engine.tokenizer.decode(out.output_ids).endswith(stop)
  assert len(out.output_ids) <= 7
  banned = Sampling(temperature=0, max_new_tokens=6, ignore_eos=True, min_new_tokens=3,
                    stop_token_ids=[ref[0]])
  out = engine.generate([prompt], banned)[0]
  assert ref[0] not in out.output_ids[:3] and len(out.output_ids) >= 3


def test_n_and_bad_requests(engine):
  outs = engine.generate([[5, 6]], Sampling(n=3, max_new_tokens=4, ignore_eos=True))
  assert len(outs) == 3 and len({o.rid for o in outs}) == 3
  for prompt, message in [([], "empty"), ([5, 96], "outside the vocabulary"),
                          (list(range(1, PAD + 1)), "context length")]:
    with pytest.raises(ValueError, match=message):
      engine.submit(prompt, GREEDY)
  with pytest.raises(ValueError, match="max_new_tokens"):
    Sampling(max_new_tokens=-1)
  with pytest.raises(ValueError, match="unknown sampling param"):
    Sampling.from_json({"temprature": 1.0})
  assert engine.generate([[5]], Sampling(max_new_tokens=0))[0].output_ids == ()


@pytest.mark.parametrize("mode", list(PauseMode))
def test_pause_modes_keep_every_token(engine, mode):
  s = Sampling(temperature=0, max_new_tokens=55, ignore_eos=True)
  ref = engine.generate([[40, 41]], s)[0]
  request = submit_and_pause_after(engine, [40, 41], s, 5, mode)
  held = engine.submit([42], Sampling(temperature=0, max_new_tokens=2))  # waits while paused
  at_pause = request.num_generated
  time.sleep(0.2)
  assert not held.done and request.num_generated == at_pause
  engine.resume().result(30)
  out = request.result(60)
  assert held.result(60).finish.kind is not FinishKind.ABORT
  n = len(out.output_ids)
  assert len(out.logprobs) == n
  assert out.output_ids == ref.output_ids[:n]
  np.testing.assert_allclose(out.logprobs, ref.logprobs[:n], atol=1e-4)
  if mode is PauseMode.ABORT:
    assert out.finish.kind is FinishKind.ABORT and 5 <= n < 55
  else:
    assert n == 55 and out.finish.kind is FinishKind.LENGTH


def test_weight_update_in_place_spans_and_no_recompile(engine, ckpts, logits_fns):
  paths, _ = ckpts
  s = Sampling(temperature=0, max_new_tokens=40, ignore_eos=True)
  before = engine.generate([[50, 51]], s)[0]
  compiled = engine.runner.compiled_count()
  request = submit_and_pause_after(engine, [50, 51], s, 4, PauseMode.IN_PLACE)
  k = request.num_generated
  assert engine.update_weights_from_disk(paths["b"], "v1").result(60)[0]
  engine.resume().result(30)
  out = request.result(60)
  assert [(v.version, v.start, v.end) for v in out.versions] == [("default", 0, k), ("v1", k, 40)]
  assert out.output_ids[:k] == before.output_ids[:k]
  after = engine.generate([[50, 51]], s)[0]
  assert after.output_ids == tuple(greedy_reference(logits_fns["b"], [50, 51], 40)[0])
  assert after.output_ids != before.output_ids and after.weight_version == "v1"
  assert engine.runner.compiled_count() == compiled  # the swap reused every compiled program
  # Not paused: the update waits for in-flight requests, whose tokens keep the old version.
  request = engine.submit([50, 51], s)
  wait_for(lambda: request.num_generated >= 2)
  update = engine.update_weights_from_disk(paths["a"], "v2")
  late = engine.submit([50, 51], s)
  assert request.result(60).versions[-1].version == "v1"
  assert update.result(60)[0]
  assert late.result(60).output_ids == before.output_ids and late.result().weight_version == "v2"


def test_retract_recomputes_with_new_weights(engine, ckpts, logits_fns):
  paths, _ = ckpts
  s = Sampling(temperature=0, max_new_tokens=50, ignore_eos=True)
  request = submit_and_pause_after(engine, [60, 61, 62], s, 4, PauseMode.RETRACT)
  k = request.num_generated
  assert engine.update_weights_from_disk(paths["b"], "b").result(60)[0]
  engine.resume().result(30)
  out = request.result(60)
  assert out.versions[-1].start == k and out.versions[-1].version == "b"
  # KV was recomputed from prompt + prefix with the new weights: the continuation is the new
  # model's greedy continuation of that prefix.
  prefix = [60, 61, 62] + list(out.output_ids[:k])
  assert list(out.output_ids[k:]) == greedy_reference(logits_fns["b"], prefix, 50 - k)[0]
  assert engine.update_weights_from_disk(paths["a"], "default").result(60)[0]


def test_mismatched_weights_are_refused_and_old_ones_keep_serving(engine, ckpts, tmp_path):
  paths, _ = ckpts
  wide, misshapen = str(tmp_path / "wide"), str(tmp_path / "misshapen")
  shutil.copytree(paths["a"], wide)
  with open(os.path.join(wide, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(wide, "config.json"), "w") as f:
    json.dump({**config, "hidden_size": 48}, f)
  shutil.copytree(paths["a"], misshapen)
  file = os.path.join(misshapen, "model.safetensors")
  tensors = load_file(file)
  tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((65, 32), np.float32)
  save_file(tensors, file)
  before = engine.generate([[70, 71]], GREEDY)[0]
  version = engine.weight_version
  for path, message in [(wide, "hidden_size"), (misshapen, "up_proj.weight"),
                        (str(tmp_path), "config.json")]:
    ok, error, _ = engine.update_weights_from_disk(path, "bad").result(60)
    assert not ok and message in error
  assert engine.weight_version == version
  assert engine.generate([[70, 71]], GREEDY)[0].output_ids == before.output_ids


_TP_SCRIPT = """
import sys, numpy as np, jax
from flashrl_jax.rollout import Engine, EngineConfig, Sampling
assert len(jax.devices()) == 2
prompts, s = [[5, 6, 7], [8, 9]], Sampling(temperature=0, max_new_tokens=6, ignore_eos=True)
outs = {}
for tp in (1, 2):
  with Engine(EngineConfig(sys.argv[1], max_running_requests=2, context_length=32,
                           max_prefill_batch=1, tp=tp)) as engine:
    if tp == 2:
      spec = engine.runner.params["layers"][0]["mlp"]["up_proj"].get_value().sharding.spec
      assert spec == jax.sharding.PartitionSpec(None, "tensor"), spec
    outs[tp] = engine.generate(prompts, s)
for a, b in zip(outs[1], outs[2]):
  assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
print("TP_OK")
"""


@pytest.mark.slow
def test_tensor_parallel_engine_matches_single_device(ckpts):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  root = os.path.dirname(os.path.dirname(__file__))
  proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, ckpts[0]["a"]], env=env, cwd=root,
                        capture_output=True, text=True, timeout=300)
  assert "TP_OK" in proc.stdout, proc.stdout + proc.stderr


def test_decode_delay_sleeps_after_each_decode_call_outside_decode_time(ckpts):
  """`decode_delay_s` (a server slow on purpose: the router test's handoff needs samples still
  running when its pause lands) sleeps after every decode call and is not counted as decode time;
  a negative or NaN delay is refused."""
  for bad in (-0.1, float("nan")):
    with pytest.raises(ValueError, match="decode_delay_s"):
      EngineConfig(ckpts[0]["a"], decode_delay_s=bad)
  delay = 0.1
  with Engine(EngineConfig(ckpts[0]["a"], max_running_requests=1, context_length=PAD,
                           num_continuous_decode_steps=4, decode_delay_s=delay)) as eng:
    eng.generate([[1, 2, 3]], GREEDY)  # compiles
    calls, decode_s = eng.stats.decode_calls, eng.stats.decode_s
    start = time.perf_counter()
    [out] = eng.generate([[4, 5, 6]], GREEDY)
    elapsed = time.perf_counter() - start
    calls, decode_s = eng.stats.decode_calls - calls, eng.stats.decode_s - decode_s
  assert len(out.output_ids) == 12 and calls == 3  # 12 tokens, 4 a call
  # Decode calls and the sleeps between them are disjoint spans of the request's wall time (the
  # last sleep follows its finishing token).
  assert decode_s + (calls - 1) * delay <= elapsed, (decode_s, calls, elapsed)
