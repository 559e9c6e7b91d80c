"""Math verifier tables: extraction, equivalence (both backends), reward + format signal."""

import pytest

from flashrl_jax import envs
from flashrl_jax.envs import AnswerSource, MathReward, Sample, VerifierBackend

BACKENDS = [VerifierBackend.BUILTIN] + (
    [VerifierBackend.MATH_VERIFY] if envs.math_verify_available() else [])


@pytest.mark.parametrize("text, expected, source", [
    (r"so \boxed{42}", "42", AnswerSource.BOXED),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}", AnswerSource.BOXED),
    (r"\boxed{{3}}", "{3}", AnswerSource.BOXED),
    (r"\boxed{\frac{\sqrt{2}}{2}} done", r"\frac{\sqrt{2}}{2}", AnswerSource.BOXED),
    ("Thus the answer is 17.", "17", AnswerSource.ANSWER_IS),
    ("The final answer is $0.25$. Done", "0.25", AnswerSource.ANSWER_IS),
    ("Answer: 3/4", "3/4", AnswerSource.ANSWER_IS),
    ("we get 5 apples and then 12 pears", "12", AnswerSource.LAST_NUMBER),
    ("total -3.5", "-3.5", AnswerSource.LAST_NUMBER),
    ("I have no idea", None, AnswerSource.NONE),
    (r"\boxed{unclosed 5", "5", AnswerSource.LAST_NUMBER),
])
def test_extraction(text, expected, source):
  got = envs.extract_answer(text)
  assert (got.text, got.source) == (expected, source)
  assert got.format_ok == (source in (AnswerSource.BOXED, AnswerSource.ANSWER_IS))


@pytest.mark.parametrize("pred, ref, equal", [
    ("0.5", "1/2", True),
    (r"\frac{1}{2}", "0.5", True),
    (r"\dfrac12", "1/2", True),
    ("{3}", "3", True),
    ("1,000", "1000", True),
    ("2^{10}", "1024", True),
    (r"-\frac{3}{4}", "-0.75", True),
    (r"\frac{\frac{1}{2}}{2}", "1/4", True),
    ("0.1+0.2", "0.3", True),
    ("3.0", "3", True),
    (r"\text{7}", "7", True),
    ("0.5", "0.51", False),
    ("1/3", "0.33", False),
    ("2", "-2", False),
    ("x+1", "x+1", True),   # not numeric: normalised string equality
    ("x+1", "x+2", False),
    ("9**9**9", "1", False),  # refused, not computed
    ("1/0", "1", False),
])
def test_builtin_equivalence(pred, ref, equal):
  assert envs.equivalent(pred, ref) is equal


RESPONSES = [  # (response, reference, reward, format_ok)
    (r"The sum is \boxed{12}.", "12", 1.0, True),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0, True),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0, True),
    (r"\boxed{1/2}", "0.5", 1.0, True),
    (r"\boxed{{3}}", "3", 1.0, True),
    ("so the answer is 7", "7", 1.0, True),
    ("after all that: 8", "8", 1.0, False),
    (r"\boxed{13}", "12", 0.0, True),
    ("the answer is 11", "12", 0.0, True),
    ("I cannot solve this", "12", 0.0, False),
    ("", "12", 0.0, False),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("response, reference, reward, format_ok", RESPONSES)
def test_math_reward_table(backend, response, reference, reward, format_ok):
  result = MathReward(backend)("prompt", response, Sample("prompt", reference))
  assert result.reward == reward
  assert result.info["format_ok"] is format_ok
  assert result.info["correct"] is (reward == 1.0)


def test_format_penalty_only_when_format_wrong():
  fn = MathReward(VerifierBackend.BUILTIN, format_penalty=0.5)
  assert fn("", "it is 4", Sample("", "4")).reward == 0.5
  assert fn("", r"\boxed{4}", Sample("", "4")).reward == 1.0


def test_math_reward_in_worker_thread_skips_signal_timeouts():
  """math_verify's signal.alarm guard only works in the main thread; a pool thread must still work."""
  import concurrent.futures
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    result = pool.submit(MathReward(), "", r"\boxed{\frac{2}{4}}", Sample("", "0.5")).result()
  assert result.reward == 1.0


@pytest.mark.parametrize("response, answer, reward", [
    ("3 8 10", "3 8 10", 1.0),
    ("  3  8 10 \nmore junk", "3 8 10", 1.0),
    ("3 8 11", "3 8 10", 0.0),
    ("", "3", 0.0),
])
def test_exact_match(response, answer, reward):
  assert envs.ExactMatchReward()("", response, Sample("", answer)).reward == reward
