"""Our own answer-equivalence checker: the fallback when `math_verify` is not installed.

It covers what the RLVR math sets mostly need: integers, decimals, fractions (`a/b`,
`\\frac{a}{b}`), light LaTeX noise, and simple arithmetic expressions. Expressions are evaluated
exactly with `fractions.Fraction` over a whitelisted AST (no `eval`, no sympy), so `0.5`, `1/2`
and `\\frac{1}{2}` compare equal and `0.1 + 0.2` equals `0.3`. Anything it cannot evaluate is
compared as a normalised string.
"""

from __future__ import annotations

import ast
import fractions
import re

_LATEX_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "\\%", "%")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d])")
_MAX_POW = 64  # with the bit-length check below, keeps `9**9**9` from eating the CPU


def normalize(text: str) -> str:
  s = text.strip()
  s = _TEXT.sub(r"\1", s)
  for token in _LATEX_DROP:
    s = s.replace(token, "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  # Innermost-first until stable, so nested fractions unwrap.
  for _ in range(8):
    new = _FRAC.sub(r"(\1)/(\2)", s)
    new = _FRAC_SHORT.sub(r"(\1)/(\2)", new)
    if new == s:
      break
    s = new
  s = s.replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
  s = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), s)
  s = s.replace("{", "(").replace("}", ")")
  s = re.sub(r"\s+", "", s).rstrip(".")
  while s.startswith("(") and s.endswith(")") and _balanced_outer(s):
    s = s[1:-1]
  return s


def _balanced_outer(s: str) -> bool:
  """True if the first '(' closes at the last ')', i.e. the outer parens wrap everything."""
  depth = 0
  for i, c in enumerate(s):
    depth += c == "("
    depth -= c == ")"
    if depth == 0 and i < len(s) - 1:
      return False
  return depth == 0


def _eval(node: ast.AST) -> fractions.Fraction:
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
      and not isinstance(node.value, bool):
    return fractions.Fraction(repr(node.value)) if isinstance(node.value, float) \
        else fractions.Fraction(node.value)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = _eval(node.operand)
    return -value if isinstance(node.op, ast.USub) else value
  if isinstance(node, ast.BinOp):
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Add):
      return left + right
    if isinstance(node.op, ast.Sub):
      return left - right
    if isinstance(node.op, ast.Mult):
      return left * right
    if isinstance(node.op, ast.Div):
      return left / right  # ZeroDivisionError is caught by the caller
    if isinstance(node.op, ast.Pow) and right.denominator == 1 and abs(right) <= _MAX_POW:
      if max(left.numerator.bit_length(), left.denominator.bit_length()) * abs(right) > 4096:
        raise ValueError("power too large")
      return left ** int(right)
  raise ValueError(f"unsupported expression node {type(node).__name__}")


def to_number(text: str) -> fractions.Fraction | None:
  """Exact value of a numeric expression, or None if it is not one we can evaluate."""
  s = normalize(text)
  if not s or len(s) > 200:
    return None
  try:
    return _eval(ast.parse(s, mode="eval"))
  except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
    return None


def equivalent(predicted: str, reference: str, rel_tol: float = 1e-6) -> bool:
  a, b = to_number(predicted), to_number(reference)
  if a is not None and b is not None:
    if a == b:
      return True
    # Decimals a model rounded (0.3333333 vs 1/3) pass within a relative tolerance.
    return abs(float(a) - float(b)) <= rel_tol * max(1.0, abs(float(b)))
  return normalize(predicted).lower() == normalize(reference).lower() != ""
