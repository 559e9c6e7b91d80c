"""The rollout server's JSON encoder (`_wire.dumps`, orjson) against the standard library's.

Tried: `/generate` answers with per-token log-probs (1, 40 and 368 tokens); numbers orjson does not
write by itself (float subclasses, NumPy scalars, integers beyond 64 bits, which take the standard
library's path); non-finite floats; an object neither encoder writes.
"""

from __future__ import annotations

import enum
import json
import math

import numpy as np
import pytest

from flashrl_jax.rollout._wire import dumps


class _Mode(str, enum.Enum):
  IN_PLACE = "in_place"


class _Seconds(float):
  pass


def _answer(rng: np.random.Generator, tokens: int) -> list[dict]:
  logprobs = [float(x) for x in rng.normal(-2.0, 1.5, tokens)]
  return [{"text": "dcba\u00e9\U0001F600", "output_ids": list(range(tokens)),
           "meta_info": {"id": f"g-{j}", "finish_reason": {"type": "length", "length": tokens},
                         "prompt_tokens": 20, "completion_tokens": tokens, "cached_tokens": 0,
                         "weight_version": "7", "mode": _Mode.IN_PLACE,
                         "weight_versions": [{"version": "7", "start": 0, "end": tokens}],
                         "e2e_latency": 0.0123456789,
                         "output_token_logprobs": [[lp, i, None] for i, lp in
                                                   enumerate(logprobs)],
                         "output_top_logprobs": [[(lp, i, "x")] for i, lp in
                                                 enumerate(logprobs)]}}
          for j in range(2)]


def test_an_answer_reads_back_as_the_standard_librarys_does():
  rng = np.random.default_rng(0)
  for tokens in (1, 40, 368):
    answer = _answer(rng, tokens)
    ours = dumps(answer)
    assert isinstance(ours, bytes)
    assert json.loads(ours) == json.loads(json.dumps(answer, allow_nan=False))


def test_numbers_are_written_exactly_numpy_scalars_and_subclasses_too():
  values = {"f64": np.float64(-1.25), "f32": np.float32(0.5), "i64": np.int64(-3),
            "subclass": _Seconds(2.75), "tiny": 1e-45, "big": 2**63, "negative_zero": -0.0}
  expected = {"f64": -1.25, "f32": 0.5, "i64": -3, "subclass": 2.75, "tiny": 1e-45, "big": 2**63,
              "negative_zero": 0.0}
  # orjson's path, then the standard library's (an integer orjson cannot hold sends it there).
  for extra in ({}, {"beyond": 2**70 + 1}):
    back = json.loads(dumps(values | extra))
    assert back == expected | extra
    assert math.copysign(1.0, back["negative_zero"]) == -1.0


def test_non_finite_floats_are_null_so_the_answer_stays_strict_json():
  text = dumps({"lp": [float("-inf"), float("nan"), float("inf"), -0.5]})
  assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the answer")) == {
      "lp": [None, None, None, -0.5]}


def test_an_object_neither_encoder_writes_is_an_error():
  with pytest.raises(TypeError):
    dumps({"engine": object()})
