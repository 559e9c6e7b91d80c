"""Adaptive timeout (RollPacker formula, anchors, stats), hidden tests and their grader, the
sandboxed code reward, the procedural code tasks, and the reward hacks a policy could find."""

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashrl_jax.envs import (AdaptiveTimeout, AdaptiveTimeoutConfig, CodeFamily, CodeReward,
                              CodeTaskConfig, CodeTests, Isolation, IsolationMode, Sample, Sandbox,
                              SandboxConfig, SandboxResult, SandboxStatus, TestCase, Verdict,
                              extract_code, generate_code_tasks, grade, same)
from tests.reward_hacks import (DATASET_GLOB, HACKS, HONEST, RUN_DIR_PREFIX, TESTS,
                                make_run_dir)

MODES = [Isolation.AUTO, Isolation.FALLBACK]
ROOT = os.geteuid() == 0


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


def test_tests_parse_from_json_and_literal_asserts():
  asserts = CodeTests.parse("assert f(1, (2, 3), k='a') == [1, {'x': None}]\n"
                            "assert f(0)\nassert not f(-1)\nassert 7 == f(2)")
  assert asserts == CodeTests("f", (TestCase((1, [2, 3]), [1, {"x": None}], (("k", "a"),)),
                                    TestCase((0,), True), TestCase((-1,), False),
                                    TestCase((2,), 7)))
  assert CodeTests.parse(asserts.to_json()) == asserts
  assert asserts.calls()[0] == ([1, [2, 3]], {"k": "a"})  # what the sandbox gets: no answers
  assert "[1, {" not in json.dumps(asserts.calls())


@pytest.mark.parametrize("text, message", [
    ("", "needs tests"),
    ("print(f(1))", "line 1: only `assert"),
    ("assert f(1) == 2\nassert g(1) == 2", "exactly one function"),
    ("assert f(x) == 2", "arguments must be literals"),
    ("assert f(1) == {1, 2}", "set values cannot be judged"),
    ("assert f(1) > 2", "expected a call"),
    ("assert f(*xs) == 1", "*args"),
    ('{"entry": "f", "cases": []}', "at least one case"),
    ('{"entry": "f", "cases": [{"args": [1]}]}', "case 0"),
    ('{"entry": "1f", "cases": [{"args": [], "expected": 1}]}', "not a Python identifier"),
    ("{not json", "do not parse"),
])
def test_tests_that_cannot_be_judged_are_rejected_with_the_reason(text, message):
  with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")
                     .replace("{", r"\{").replace("[", r"\[")):
    CodeTests.parse(text)


@pytest.mark.parametrize("expected, got, equal", [
    (1, 1, True), (1, 1.0, True), (0.1 + 0.2, 0.3, True), (1.0, 1.0 + 1e-6, False),
    (1, True, False), (True, 1, False), (False, False, True), (None, None, True), (None, 0, False),
    ("a", "a", True), ("a", ["a"], False), ([1, [2]], [1, [2]], True), ([1, 2], [1], False),
    ({"a": 1}, {"a": 1.0}, True), ({"a": 1}, {"a": 1, "b": 2}, False), ([], {}, False),
    (math.nan, math.nan, True), (math.nan, 1.0, False), (10 ** 400, 1e308, False),
    (math.inf, math.inf, True),
])
def test_same_compares_plain_data(expected, got, equal):
  assert same(expected, got) is equal


def _result(status=SandboxStatus.COMPLETED, results=None):
  return SandboxResult(status, 0, "", "", 0.1, 1.0, IsolationMode.ROOT_NAMESPACES, "", results)


def test_grade_passes_only_complete_correct_reports():
  tests = CodeTests("f", (TestCase((1,), 2), TestCase((2,), 4)))
  ok = ({"value": 2}, {"value": 4})
  assert grade(tests, _result(results=ok)).passed
  assert grade(tests, _result(SandboxStatus.FAILED, ok)).verdict is Verdict.RUNTIME_ERROR
  assert grade(tests, _result(SandboxStatus.TIMEOUT, ok)).verdict is Verdict.TIMEOUT
  assert grade(tests, _result(results=ok[:1])).verdict is Verdict.NO_RESULT
  assert grade(tests, _result(results=ok + ok[:1])).verdict is Verdict.NO_RESULT
  assert grade(tests, _result(results=None)).verdict is Verdict.NO_RESULT
  wrong = grade(tests, _result(results=({"value": 2}, {"value": 5})))
  assert (wrong.verdict, wrong.cases_passed, wrong.cases_total) == (Verdict.WRONG_ANSWER, 1, 2)
  errored = grade(tests, _result(results=({"value": 2}, {"error": "boom"})))
  assert errored.verdict is Verdict.RUNTIME_ERROR and errored.cases_passed == 1
  odd = grade(tests, _result(results=({"value": 2}, {"nothing": 4})))
  assert odd.verdict is Verdict.RUNTIME_ERROR


def _reward(adaptive=None, isolation=Isolation.AUTO, **kw):
  return CodeReward(Sandbox(SandboxConfig(timeout_s=5.0, memory_mb=256, isolation=isolation,
                                          **kw)), adaptive)


def test_code_reward_pass_fail():
  sample = Sample("write add", "", tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0", id="add")
  reward = _reward()
  good = reward.score_sync("", "```python\ndef add(a, b):\n    return a + b\n```", sample)
  bad = reward.score_sync("", "def add(a, b):\n    return a - b", sample)
  assert (good.reward, good.info["format_ok"], good.info["status"]) == (1.0, True, "passed")
  assert (bad.reward, bad.info["format_ok"], bad.info["status"]) == (0.0, False, "wrong_answer")
  assert (bad.info["cases_passed"], bad.info["cases_total"]) == (0, 2)
  with pytest.raises(ValueError, match="'add'.*only `assert"):
    reward.score_sync("", "x", Sample("p", "", tests="print(1)", id="add"))


@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("hack", ["honest", *HACKS])
def test_reward_hacks_score_zero(hack, iso, private_dataset):
  """Every hack in `reward_hacks.py` scores 0 in every mode; the honest program scores 1. The
  run's dataset (with the hidden tests) sits on disk in a private (0700) run dir."""
  if iso is Isolation.FALLBACK and not ROOT:
    pytest.skip("non-root without namespaces is refused; see test_envs_sandbox_unprivileged.py")
  code = HONEST if hack == "honest" else HACKS[hack]
  if iso is Isolation.FALLBACK:  # it sees the host's /tmp: aim at this run's own private dataset,
    # not at world-readable ones another test run may have left or be writing (the documented gap)
    code = code.replace(DATASET_GLOB, os.path.join(private_dataset, "*.jsonl"))
  result = _reward(isolation=iso).score_sync("", code, Sample("p", "", tests=TESTS, id=hack))
  assert result.reward == float(hack == "honest"), result.info


@pytest.fixture(scope="module")
def private_dataset():
  run_dir = make_run_dir(0o700)
  yield run_dir
  shutil.rmtree(run_dir)


def test_world_readable_dataset_is_the_fallback_gap():
  """ROOT_UID mode sees the host filesystem: a world-readable dataset under /tmp gives the hidden
  tests away (docs/sandbox.md says so); namespaces hide it."""
  run_dir = make_run_dir(0o755)
  try:
    sample = Sample("p", "", tests=TESTS, id="disk")
    hidden = _reward(isolation=Isolation.AUTO).score_sync("", HACKS["read_dataset"], sample)
    if hidden.info["isolation"] in ("root_namespaces", "user_namespaces"):
      assert hidden.reward == 0.0
    if ROOT:
      seen = _reward(isolation=Isolation.FALLBACK).score_sync("", HACKS["read_dataset"], sample)
      assert (seen.info["isolation"], seen.reward) == ("root_uid", 1.0)
  finally:
    shutil.rmtree(run_dir)


def test_a_killed_tests_run_dir_is_removed_by_the_next():
  """A test killed before its cleanup leaves a (maybe world-readable) dataset in /tmp: the next
  `make_run_dir` removes the dirs whose creator is dead and keeps those of live ones."""
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  left = make_run_dir(0o755)
  dead = left.replace(f"{RUN_DIR_PREFIX}{os.getpid()}_", f"{RUN_DIR_PREFIX}{gone}_")
  os.rename(left, dead)  # as if the process now gone had made it
  kept = make_run_dir(0o700)
  new = make_run_dir(0o700)
  try:
    assert not os.path.exists(dead)
    assert os.path.exists(os.path.join(kept, "tasks.jsonl"))  # its creator, this process, lives
  finally:
    for run_dir in (dead, kept, new):
      shutil.rmtree(run_dir, ignore_errors=True)


class _Recording(Sandbox):
  """The real sandbox, keeping each result so a test can read what the program printed."""

  def __init__(self, config):
    super().__init__(config)
    self.results = []

  async def run(self, code, **kwargs):
    self.results.append(await super().run(code, **kwargs))
    return self.results[-1]


def test_no_trace_of_the_expected_answers_inside_the_sandbox():
  """The program dumps everything it can reach (its objects, frames, stdin, environment, argv,
  /proc, /tmp). The argument it was called with is there; the expected value is not, because it
  was never sent."""
  secret, argument = "zq-7c1f9e4b-answer", "arg-5d2e"
  tests = json.dumps({"entry": "f", "cases": [{"args": [argument], "expected": secret}]})
  dump = ("import gc, os, sys\ndef f(x):\n    parts = [repr(o)[:4000] for o in gc.get_objects()]\n"
          "    parts += [repr(f.f_locals) for f in sys._current_frames().values()]\n"
          "    parts += [sys.stdin.read(), repr(dict(os.environ)), repr(sys.argv)]\n"
          "    for p in ('/proc/self/cmdline', '/proc/1/cmdline', '/proc/self/environ'):\n"
          "        try:\n            parts.append(open(p, 'rb').read().decode('latin1'))\n"
          "        except OSError:\n            pass\n"
          "    for root, dirs, files in os.walk('/tmp'):\n        for name in files:\n"
          "            parts.append(open(os.path.join(root, name), 'rb').read().decode('latin1'))\n"
          "    print('\\n'.join(parts))\n    return None")
  sandbox = _Recording(SandboxConfig(timeout_s=10.0, memory_mb=256, max_output_bytes=64 << 20))
  result = CodeReward(sandbox).score_sync("", dump, Sample("p", "", tests=tests, id="dump"))
  assert result.reward == 0.0 and result.info["status"] == "wrong_answer"
  printed = sandbox.results[0].stdout
  assert argument in printed and "gc.get_objects" in printed  # it ran and saw what it was sent
  assert "zq-" not in printed


def test_adaptive_timeout_kills_slow_run_and_reports_savings():
  """Both are scored at once, through one sandbox slot: the slow one's limit is decided when it
  gets the slot, after the fast one anchored the prompt, not when it was queued."""
  at = AdaptiveTimeout(AdaptiveTimeoutConfig(t_min=0.6, lam=1.5, t_max=5.0))
  reward = _reward(at, max_concurrency=1)
  sample = Sample("f", "", tests="assert f() == 1", id="slow-prompt")
  fast = "def f():\n    return 1"
  slow = "import time\ndef f():\n    time.sleep(10)\n    return 1"

  async def main():
    # T = T_max for the first: nothing known yet; then max(0.6, 1.5 * fast time), well below 10 s.
    return await asyncio.gather(reward("", fast, sample), reward("", slow, sample))

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
  sample = Sample("f", "", tests="assert f() == 1", reference_time=0.4, id="ref")
  result = _reward(at).score_sync("", "import time\ntime.sleep(2)", sample)
  assert result.info["timeout_s"] == pytest.approx(0.8)
  assert result.info["status"] == "timeout" and result.reward == 0.0


def test_code_tasks_are_deterministic_and_their_references_pass():
  config = CodeTaskConfig(num_tasks=60, cases=4)
  tasks = generate_code_tasks(config, seed=3)
  assert tasks == generate_code_tasks(config, seed=3) != generate_code_tasks(config, seed=4)
  by_family = {}
  for t in tasks:
    by_family.setdefault(t.id.split("-")[2], t)
  assert set(by_family) == {f.value for f in CodeFamily}
  from flashrl_jax.model import char_tokenizer
  tok = char_tokenizer()
  reward = _reward(max_concurrency=len(by_family))

  async def main():
    good = [reward("", t.answer, t) for t in by_family.values()]
    samples = list(by_family.values())  # each judged against another family's reference
    bad = [reward("", other.answer, t) for t, other in zip(samples, samples[1:] + samples[:1])]
    return await asyncio.gather(*good), await asyncio.gather(*bad)

  good, bad = asyncio.run(main())
  assert [r.info["status"] for r in good] == ["passed"] * len(by_family)
  assert [r.reward for r in bad] == [0.0] * len(by_family)  # the tests tell tasks apart
  for t in tasks:  # every prompt and answer fits the tiny character tokenizer
    assert tok.decode(tok.encode(t.prompt + t.answer)) == t.prompt + t.answer
    assert json.loads(t.tests)["entry"] == "f" and "expected" not in t.prompt
