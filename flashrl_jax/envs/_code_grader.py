"""Hidden tests for write-a-function tasks, and the grader that judges a sandboxed run against them.

The grader is the half of a code reward that the judged program must never reach, so it lives
here, in the controller's process, and the sandbox never sees it. `CodeTests` is plain data: an
entry-point name and cases of (arguments, expected value). Only the arguments go into the sandbox;
the program's return values come back as JSON (see `_sandbox_runner.py`) and `grade` compares them
with the expected values using `same`, a comparison of plain JSON data written here. No method of
any object the program made is ever called on this side, so an object that "equals everything",
an early `exit(0)`, a printed PASSED marker or a rewritten harness cannot turn into a pass: the
only way to pass is to return the expected values.

Tests are given as text in `Sample.tests`, either JSON
  {"entry": "f", "cases": [{"args": [1, 2], "kwargs": {}, "expected": 3}, ...]}
or MBPP-style Python asserts whose arguments and expected values are literals:
  assert f(1, 2) == 3        assert is_even(4)        assert not is_even(3)
(parsed with `ast`, never executed; truthy asserts mean `== True` / `== False`). Anything else is
rejected with the line that cannot be judged this way.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import json
import math
from typing import Any

from flashrl_jax.envs._sandbox import SandboxResult, SandboxStatus

_REL_TOL = _ABS_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class TestCase:
  args: tuple[Any, ...]
  expected: Any
  kwargs: tuple[tuple[str, Any], ...] = ()

  __test__ = False  # not a pytest class


@dataclasses.dataclass(frozen=True)
class CodeTests:
  """A function name and its hidden cases (all values plain JSON data)."""

  entry: str
  cases: tuple[TestCase, ...]

  __test__ = False

  def __post_init__(self):
    if not self.entry.isidentifier():
      raise ValueError(f"entry {self.entry!r} is not a Python identifier")
    if not self.cases:
      raise ValueError("CodeTests needs at least one case")
    for case in self.cases:
      _check_plain(case.args, "args")
      _check_plain(case.expected, "expected")
      _check_plain(dict(case.kwargs), "kwargs")

  def calls(self) -> list[tuple[list[Any], dict[str, Any]]]:
    """What crosses into the sandbox: arguments only, never the expected values."""
    return [(list(c.args), dict(c.kwargs)) for c in self.cases]

  def to_json(self) -> str:
    return json.dumps({"entry": self.entry, "cases": [
        {"args": list(c.args), "kwargs": dict(c.kwargs), "expected": c.expected}
        for c in self.cases]})

  @classmethod
  def parse(cls, text: str) -> "CodeTests":
    return _parse_cached(text)


def _check_plain(value: Any, what: str) -> None:
  try:
    json.dumps(value, allow_nan=True)
  except (TypeError, ValueError) as error:
    raise ValueError(f"test {what} must be plain JSON data: {error}") from None


def _jsonable(value: Any, where: str) -> Any:
  """A Python literal as JSON data (tuples become lists, as the runner reports them)."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (list, tuple)):
    return [_jsonable(v, where) for v in value]
  if isinstance(value, dict) and all(isinstance(k, str) for k in value):
    return {k: _jsonable(v, where) for k, v in value.items()}
  raise ValueError(f"{where}: {type(value).__name__} values cannot be judged as plain data")


def _parse_call(node: ast.expr, where: str) -> tuple[str, list[Any], dict[str, Any]]:
  if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
    raise ValueError(f"{where}: expected a call of a function by name, e.g. f(1, 2)")
  starred = any(isinstance(a, ast.Starred) for a in node.args)
  if starred or any(k.arg is None for k in node.keywords):
    raise ValueError(f"{where}: *args/**kwargs are not supported")
  try:
    args = [_jsonable(ast.literal_eval(a), where) for a in node.args]
    kwargs = {k.arg: _jsonable(ast.literal_eval(k.value), where) for k in node.keywords}
  except ValueError as error:
    raise ValueError(f"{where}: arguments must be literals ({error})") from None
  return node.func.id, args, kwargs


def _parse_assert(node: ast.stmt, where: str) -> tuple[str, TestCase]:
  if not isinstance(node, ast.Assert):
    raise ValueError(f"{where}: only `assert f(...) == literal` lines can be judged")
  test = node.test
  if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
    left, right = test.left, test.comparators[0]
    call, literal = (left, right) if isinstance(left, ast.Call) else (right, left)
    try:
      expected = _jsonable(ast.literal_eval(literal), where)
    except ValueError as error:
      raise ValueError(f"{where}: the expected value must be a literal ({error})") from None
  elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
    call, expected = test.operand, False
  else:
    call, expected = test, True
  name, args, kwargs = _parse_call(call, where)
  return name, TestCase(tuple(args), expected, tuple(sorted(kwargs.items())))


def _from_asserts(text: str) -> CodeTests:
  try:
    tree = ast.parse(text)
  except SyntaxError as error:
    raise ValueError(f"tests are neither JSON nor Python: {error}") from None
  names, cases = set(), []
  for node in tree.body:
    name, case = _parse_assert(node, f"tests line {node.lineno}")
    names.add(name)
    cases.append(case)
  if len(names) != 1:
    raise ValueError(f"tests must call exactly one function, got {sorted(names) or 'none'}")
  return CodeTests(names.pop(), tuple(cases))


def _from_json(doc: Any) -> CodeTests:
  if not isinstance(doc, dict) or not isinstance(doc.get("entry"), str) or not isinstance(
      doc.get("cases"), list):
    raise ValueError('JSON tests need {"entry": str, "cases": [...]}')
  cases = []
  for i, c in enumerate(doc["cases"]):
    if not (isinstance(c, dict) and isinstance(c.get("args", []), list) and "expected" in c
            and isinstance(c.get("kwargs", {}), dict)):
      raise ValueError(f'case {i}: need {{"args": [...], "expected": ...}} (optional "kwargs")')
    cases.append(TestCase(tuple(c.get("args", [])), c["expected"],
                          tuple(sorted(c.get("kwargs", {}).items()))))
  return CodeTests(doc["entry"], tuple(cases))


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> CodeTests:
  if not isinstance(text, str) or not text.strip():
    raise ValueError("a code task needs tests")
  if text.lstrip().startswith("{"):
    try:
      return _from_json(json.loads(text))
    except json.JSONDecodeError as error:
      raise ValueError(f"tests look like JSON but do not parse: {error}") from None
  return _from_asserts(text)


def same(expected: Any, got: Any) -> bool:
  """Equality of plain JSON data: bools only equal bools, numbers compare by value (floats within
  1e-9 relative/absolute, NaN equals NaN), lists element-wise, dicts by key set and values."""
  if isinstance(expected, bool) or isinstance(got, bool):
    return type(expected) is bool and type(got) is bool and expected == got
  if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
    if isinstance(expected, int) and isinstance(got, int):
      return expected == got
    try:
      if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
      return math.isclose(expected, got, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)
    except OverflowError:  # an int beyond float range against a float
      return False
  if isinstance(expected, str) or expected is None:
    return type(got) is type(expected) and got == expected
  if isinstance(expected, list):
    return (type(got) is list and len(got) == len(expected)
            and all(same(e, g) for e, g in zip(expected, got)))
  if isinstance(expected, dict):
    return (type(got) is dict and got.keys() == expected.keys()
            and all(same(expected[k], got[k]) for k in expected))
  return False


class Verdict(enum.Enum):
  PASSED = "passed"
  WRONG_ANSWER = "wrong_answer"    # every call returned, some value differs
  RUNTIME_ERROR = "runtime_error"  # the program or a call raised
  NO_RESULT = "no_result"          # exited or crashed before the runner reported
  TIMEOUT = "timeout"
  MEMORY_LIMIT = "memory_limit"
  KILLED = "killed"
  SETUP_ERROR = "setup_error"
  REFUSED = "refused"


_FROM_STATUS = {SandboxStatus.TIMEOUT: Verdict.TIMEOUT,
                SandboxStatus.MEMORY_LIMIT: Verdict.MEMORY_LIMIT,
                SandboxStatus.KILLED: Verdict.KILLED,
                SandboxStatus.SETUP_ERROR: Verdict.SETUP_ERROR,
                SandboxStatus.REFUSED: Verdict.REFUSED}


@dataclasses.dataclass(frozen=True)
class Grade:
  verdict: Verdict
  cases_passed: int
  cases_total: int

  @property
  def passed(self) -> bool:
    return self.verdict is Verdict.PASSED


def grade(tests: CodeTests, result: SandboxResult) -> Grade:
  """PASSED iff the runner completed and reported, for every case, a value `same` as expected."""
  total = len(tests.cases)
  if result.status in _FROM_STATUS:
    return Grade(_FROM_STATUS[result.status], 0, total)
  if result.results is None:
    verdict = Verdict.RUNTIME_ERROR if result.status is SandboxStatus.FAILED else Verdict.NO_RESULT
    return Grade(verdict, 0, total)
  if len(result.results) != total:
    return Grade(Verdict.NO_RESULT, 0, total)
  passed = sum("value" in r and same(c.expected, r["value"])
               for c, r in zip(tests.cases, result.results))
  if passed == total and result.status is SandboxStatus.COMPLETED:
    return Grade(Verdict.PASSED, passed, total)
  errored = (result.status is not SandboxStatus.COMPLETED
             or any("value" not in r for r in result.results))
  return Grade(Verdict.RUNTIME_ERROR if errored else Verdict.WRONG_ANSWER, passed, total)
