"""Code-execution reward: run the response's function in the sandbox, judge it outside.

`sample.tests` holds hidden tests (`CodeTests`: an entry-point name and cases of arguments and
expected values, as JSON or as literal MBPP-style asserts). The response's program runs in the
sandbox with only the arguments; its return values come back as JSON and `grade` compares them in
this process, so nothing the program does can forge a pass (threat model: `docs/sandbox.md`).

The reward is natively async (a subprocess per run, awaited), so scoring many responses overlaps
with generation instead of blocking it. With an `AdaptiveTimeout`, each run's limit follows the
slowest correct run of the same prompt (RollPacker); without one, the sandbox's fixed limit applies.
The prompt key for the adaptive anchor is `sample.id` (else the prompt text), so ids must be
unique within a run. stdin/stdout-style judging is not implemented.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

from flashrl_jax.envs._adaptive_timeout import AdaptiveTimeout
from flashrl_jax.envs._code_grader import CodeTests, Verdict, grade
from flashrl_jax.envs._sandbox import Sandbox, SandboxUnavailable
from flashrl_jax.envs._types import RewardResult, Sample

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> tuple[str, bool]:
  """(program, format_ok): the last fenced block, or the whole response when there is none."""
  blocks = _FENCE.findall(response)
  if blocks:
    return blocks[-1], True
  return response, False


@dataclasses.dataclass
class CodeReward:
  """1.0 if the program's function returns every expected value, else 0.0.

  Awaitable: `await reward(prompt, response, sample)`. Raises `ValueError` for a sample whose tests
  cannot be judged (a data error, not the policy's) and `SandboxUnavailable` when the sandbox
  refuses to run untrusted code on this machine.
  """

  sandbox: Sandbox
  adaptive: AdaptiveTimeout | None = None

  async def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    del prompt
    try:
      tests = CodeTests.parse(sample.tests)
    except ValueError as error:
      raise ValueError(f"sample {sample.id or sample.prompt[:40]!r}: {error}") from None
    program, format_ok = extract_code(response)
    key = sample.id or sample.prompt
    # Decided when the run starts, not when it is queued: runs that finish meanwhile may anchor it.
    timeout = ((lambda: self.adaptive.timeout_for(key, sample.reference_time)) if self.adaptive
               else self.sandbox.config.timeout_s)
    result = await self.sandbox.run(program, entry=tests.entry, calls=tests.calls(),
                                    timeout_s=timeout)
    judged = grade(tests, result)
    if judged.verdict is Verdict.REFUSED:
      raise SandboxUnavailable(result.stderr.strip() or "the sandbox refused to run code")
    if self.adaptive is not None and judged.verdict is not Verdict.SETUP_ERROR:
      self.adaptive.record(key, result.elapsed_s, correct=judged.passed,
                           timed_out=judged.verdict is Verdict.TIMEOUT,
                           timeout_s=result.timeout_s)
    return RewardResult(float(judged.passed), {
        "format_ok": format_ok, "status": judged.verdict.value,
        "cases_passed": judged.cases_passed, "cases_total": judged.cases_total,
        "elapsed_s": result.elapsed_s, "timeout_s": result.timeout_s,
        "isolation": result.isolation.value if result.isolation else "",
        "stderr_tail": result.stderr[-500:]})

  def score_sync(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    """Blocking convenience for scripts; never call it from inside a running event loop."""
    return asyncio.run(self(prompt, response, sample))
