"""The engine thread never dies of a request, in-process on a tiny random Qwen3.

Options that do not fit the device arrays are refused before they are queued. Device calls that fail
are injected by wrapping the runner's `prefill` / `decode` (a stand-in for a device error, which no
valid request can trigger once it is validated): a failing group prefill fails only the request
that fails again alone, and its group mates finish with exactly the tokens of a clean run; a
transient decode failure loses nothing (the slots are rebuilt and recomputed); a persistent one
fails the requests it ran and the engine serves the next ones. Non-finite log-probs are never
returned, and a killed engine refuses new work and fails what it held."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashrl_jax.fleet import FinishKind, PauseMode
from flashrl_jax.rollout import Engine, EngineConfig, Sampling, _request
from flashrl_jax.rollout._engine import MAX_DECODE_FAILURES, EngineShutDown
from flashrl_jax.testing import tiny_config, write_tiny_checkpoint

GREEDY = Sampling(temperature=0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6], [7, 8, 9], [77, 3], [10]]
POISON = 77  # a prompt holding this token makes the injected prefill fail


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("engine_faults"))
  write_tiny_checkpoint(path, tiny_config(eos_token_ids=(), max_position_embeddings=128))
  eng = Engine(EngineConfig(path, max_running_requests=4, context_length=64, max_prefill_batch=4,
                            min_decode_batch=4))
  yield eng
  eng.shutdown()


@pytest.fixture(scope="module")
def clean(engine):
  """Each prompt's greedy output, generated alone before any fault."""
  return {tuple(p): engine.generate([p], GREEDY)[0] for p in PROMPTS}


def _together(engine, prompts, sampling=GREEDY):
  """Submits while paused, so that all prompts are admitted (and prefilled) as one group."""
  engine.pause(PauseMode.IN_PLACE).result(30)
  requests = [engine.submit(p, sampling) for p in prompts]
  engine.resume().result(30)
  return [r.result(60) for r in requests]


def _same(out, ref):
  assert out.error is None and out.finish.kind is FinishKind.LENGTH
  assert out.output_ids == ref.output_ids
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)


@pytest.mark.parametrize("options,field", [
    ({"top_k": 2**31}, "top_k"), ({"min_new_tokens": 2**31, "max_new_tokens": None},
                                  "min_new_tokens"),
    ({"stop_token_ids": (2**31,)}, "stop_token_ids"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature")])
def test_options_beyond_the_device_ranges_are_refused(options, field):
  with pytest.raises(ValueError, match=field):
    Sampling(**options)
  with pytest.raises(ValueError, match=field):
    Sampling.from_json({k: list(v) if isinstance(v, tuple) else v for k, v in options.items()})


def test_engine_limits_are_checked_before_queuing(engine, clean):
  with pytest.raises(ValueError, match="stop_token_ids .* outside the vocabulary"):
    engine.submit([5], Sampling(stop_token_ids=(96,)))
  with pytest.raises(ValueError, match="finite"):
    Sampling.from_json({"max_new_tokens": 1e400})
  for key in ("temperature", "top_p", "min_p"):  # an integer no float holds (found by fuzzing)
    with pytest.raises(ValueError, match=f"{key} is out of range"):
      Sampling.from_json({key: 10**400})
  _same(engine.generate([[5, 6]], GREEDY)[0], clean[(5, 6)])


def test_tiny_temperature_samples_greedily_with_finite_logprobs(engine, clean):
  out = engine.generate([[5, 6]], Sampling(temperature=1e-12, max_new_tokens=10,
                                           ignore_eos=True))[0]
  assert all(math.isfinite(x) for x in out.logprobs)
  _same(out, clean[(5, 6)])


def test_huge_temperature_with_banned_tokens_gives_finite_logprobs(engine):
  """T = 1e300 is a valid number; on the device it was inf, and a banned (min_new_tokens) logit's
  -inf / inf was NaN. It samples as T = 1e30: uniform over the allowed tokens."""
  out = engine.generate([[5, 6]], Sampling(temperature=1e300, min_new_tokens=3, max_new_tokens=6,
                                           stop_token_ids=(7,), sampling_seed=1))[0]
  assert out.error is None and len(out.output_ids) >= 3
  np.testing.assert_allclose(out.logprobs[:3], -np.log(96 - 2), atol=1e-4)  # 7 and eos 2 banned


def test_failing_prefill_fails_only_its_request(engine, clean, monkeypatch):
  prefill, errors = engine.runner.prefill, engine.stats.engine_errors

  def poisoned(prompts, *args, **kwargs):
    if any(POISON in p for p in prompts):
      raise RuntimeError("injected device failure")
    return prefill(prompts, *args, **kwargs)
  monkeypatch.setattr(engine.runner, "prefill", poisoned)
  outs = _together(engine, PROMPTS)
  for prompt, out in zip(PROMPTS, outs):
    if POISON in prompt:
      assert out.finish.kind is FinishKind.ABORT and "injected device failure" in out.error
    else:
      _same(out, clean[tuple(prompt)])
  assert engine.stats.engine_errors - errors == 2  # the group, then the poisoned prompt alone
  assert engine.alive


def test_transient_decode_failure_loses_nothing(engine, clean, monkeypatch):
  decode, calls = engine.runner.decode, []

  def flaky(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:  # mid-generation: 10 tokens take a prefill and 3 decode calls of <= 4
      raise RuntimeError("injected transient decode failure")
    return decode(*args, **kwargs)
  monkeypatch.setattr(engine.runner, "decode", flaky)
  safe = [p for p in PROMPTS if POISON not in p]
  for prompt, out in zip(safe, _together(engine, safe)):
    _same(out, clean[tuple(prompt)])  # recomputed from prompt + output: same tokens
  assert len(calls) > 2


def test_persistent_decode_failure_fails_its_requests_and_the_engine_goes_on(engine, clean,
                                                                             monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("injected persistent decode failure")
  errors = engine.stats.engine_errors
  with monkeypatch.context() as patch:
    patch.setattr(engine.runner, "decode", broken)
    outs = _together(engine, [[5, 6], [10]])
  assert all("injected persistent decode failure" in out.error for out in outs)
  assert engine.stats.engine_errors - errors == MAX_DECODE_FAILURES
  _same(engine.generate([[5, 6]], GREEDY)[0], clean[(5, 6)])


def test_non_finite_logprobs_fail_the_request_and_are_never_returned(engine, clean):
  good = engine.runner.params
  engine.runner.set_params(jax.tree.map(lambda x: x * jnp.nan, good))
  try:
    out = engine.generate([[5, 6]], GREEDY)[0]
  finally:
    engine.runner.set_params(good)
  assert out.output_ids == () and "non-finite log-prob" in out.error
  _same(engine.generate([[5, 6]], GREEDY)[0], clean[(5, 6)])


def test_stop_regex_past_its_time_budget_fails_only_its_request_as_a_bad_request(engine, clean,
                                                                               monkeypatch):
  """The `regex` module refuses the textbook catastrophic patterns on its own, so the budget is
  forced down to make this search run out of it."""
  monkeypatch.setattr(_request, "STOP_REGEX_TIMEOUT_S", 1e-9)
  slow = Sampling(temperature=0, max_new_tokens=10, ignore_eos=True, stop_regex=("(?:a|b)*#",))
  engine.pause(PauseMode.IN_PLACE).result(30)
  requests = [engine.submit([5, 6], slow), engine.submit([5, 6], GREEDY)]
  engine.resume().result(30)
  bad, good = (r.result(60) for r in requests)
  assert bad.error_status == 400 and "stop_regex" in bad.error
  _same(good, clean[(5, 6)])


def test_killed_engine_refuses_new_work_and_fails_what_it_held(engine):
  """Last: it ends the module's engine."""
  engine.pause(PauseMode.IN_PLACE).result(30)
  held = engine.submit([5, 6], GREEDY)
  with pytest.raises(EngineShutDown):
    engine.kill().result(30)
  out = held.result(30)
  assert out.error is not None and out.error_status == 503 and not engine.alive
  with pytest.raises(EngineShutDown):
    engine.submit([5, 6], GREEDY)
  with pytest.raises(EngineShutDown):
    engine.pause().result(5)
