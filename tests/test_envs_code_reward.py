"""Adaptive timeout (RollPacker formula, anchors, stats) and the sandboxed code reward."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashrl_jax.envs import (AdaptiveTimeout, AdaptiveTimeoutConfig, CodeReward, Isolation,
                              Sample, Sandbox, SandboxConfig, extract_code)


@pytest.mark.parametrize("anchor, expected", [
    (None, 30.0),   # nothing known: the fixed limit
    (0.1, 2.0),     # clamped up to T_min
    (4.0, 6.0),     # lambda * anchor
    (19.0, 28.5),
    (25.0, 30.0),   # clamped down to T_max
])
def test_default_formula(anchor, expected):
  assert AdaptiveTimeoutConfig().timeout(anchor) == pytest.approx(expected)


@given(t_min=st.floats(0.01, 10), span=st.floats(0, 100), lam=st.floats(0.1, 5),
       anchor=st.floats(0, 1000))
def test_formula_property(t_min, span, lam, anchor):
  cfg = AdaptiveTimeoutConfig(t_min=t_min, lam=lam, t_max=t_min + span)
  t = cfg.timeout(anchor)
  assert cfg.t_min <= t <= cfg.t_max
  assert t == min(max(t_min, lam * anchor), t_min + span)


def test_anchor_tracks_slowest_correct_run_only():
  at = AdaptiveTimeout(AdaptiveTimeoutConfig(t_min=1.0, lam=2.0, t_max=20.0))
  assert at.timeout_for("p") == 20.0
  assert at.timeout_for("p", reference_time=3.0) == 6.0  # dataset reference seeds the anchor
  at.record("p", 2.0, correct=True, timed_out=False, timeout_s=20.0)
  at.record("p", 9.0, correct=False, timed_out=False, timeout_s=20.0)  # wrong runs never anchor
  at.record("p", 1.0, correct=True, timed_out=False, timeout_s=4.0)    # never lowers it
  assert at.anchor("p") == 2.0 and at.timeout_for("p", reference_time=3.0) == 4.0
  at.record("p", 4.0, correct=False, timed_out=True, timeout_s=4.0)
  at.record("q", 20.0, correct=False, timed_out=True, timeout_s=20.0)  # at T_max: not "saved"
  s = at.stats
  assert (s.runs, s.correct, s.killed, s.prompts_anchored) == (5, 2, 1, 1)
  assert s.time_spent_s == pytest.approx(2 + 9 + 1 + 4 + 20)
  assert s.time_saved_s == pytest.approx(20.0 - 4.0)


def test_extract_code():
  assert extract_code("text\n```python\nx = 1\n```\nmore ```py\ny = 2\n```") == ("y = 2\n", True)
  assert extract_code("x = 1") == ("x = 1", False)


def _reward(adaptive=None, **kw):
  return CodeReward(Sandbox(SandboxConfig(timeout_s=5.0, memory_mb=256, isolation=Isolation.AUTO,
                                          **kw)), adaptive)


def test_code_reward_pass_fail():
  sample = Sample("write add", "", tests="assert add(2, 3) == 5", id="add")
  reward = _reward()
  good = reward.score_sync("", "```python\ndef add(a, b):\n    return a + b\n```", sample)
  bad = reward.score_sync("", "def add(a, b):\n    return a - b", sample)
  assert (good.reward, good.info["format_ok"], good.info["status"]) == (1.0, True, "passed")
  assert (bad.reward, bad.info["format_ok"], bad.info["status"]) == (0.0, False, "failed")


def test_adaptive_timeout_kills_slow_run_and_reports_savings():
  at = AdaptiveTimeout(AdaptiveTimeoutConfig(t_min=0.6, lam=1.5, t_max=5.0))
  reward = _reward(at)
  sample = Sample("f", "", tests="assert f() == 1", id="slow-prompt")
  fast = "def f():\n    return 1"
  slow = "import time\ndef f():\n    time.sleep(10)\n    return 1"

  async def main():
    first = await reward("", fast, sample)   # T = T_max: nothing known yet
    second = await reward("", slow, sample)  # T = max(0.6, 1.5 * fast time), well below 10 s
    return first, second

  first, second = asyncio.run(main())
  assert first.reward == 1.0 and first.info["timeout_s"] == 5.0
  assert second.info["timeout_s"] == pytest.approx(max(0.6, 1.5 * at.anchor("slow-prompt")))
  assert (second.reward, second.info["status"]) == (0.0, "timeout")
  assert second.info["elapsed_s"] < second.info["timeout_s"] + 1.0 < 5.0
  stats = at.stats
  assert (stats.runs, stats.correct, stats.killed) == (2, 1, 1)
  assert stats.time_saved_s == pytest.approx(5.0 - second.info["timeout_s"], abs=0.2)


def test_reference_time_sets_first_timeout():
  at = AdaptiveTimeout(AdaptiveTimeoutConfig(t_min=0.5, lam=2.0, t_max=10.0))
  sample = Sample("f", "", tests="pass", reference_time=0.4, id="ref")
  result = _reward(at).score_sync("", "import time\ntime.sleep(2)", sample)
  assert result.info["timeout_s"] == pytest.approx(0.8)
  assert result.info["status"] == "timeout" and result.reward == 0.0
