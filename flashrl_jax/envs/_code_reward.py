"""Code-execution reward: run the response's program against the sample's tests in the sandbox.

The reward is natively async (a subprocess per run, awaited), so scoring many responses overlaps
with generation instead of blocking it. With an `AdaptiveTimeout`, each run's limit follows the
slowest correct run of the same prompt (RollPacker); without one, the sandbox's fixed limit applies.

`sample.tests` is Python (MBPP/HumanEval-style asserts, or a `check(f)` call) executed in the same
namespace right after the program; stdin/stdout-style judging is not implemented. The prompt key for
the adaptive anchor is `sample.id` (else the prompt text), so ids must be unique within a run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

from flashrl_jax.envs._adaptive_timeout import AdaptiveTimeout
from flashrl_jax.envs._sandbox import Sandbox, SandboxStatus
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
  """1.0 if the program passes `sample.tests`, else 0.0. Awaitable: `await reward(p, r, sample)`."""

  sandbox: Sandbox
  adaptive: AdaptiveTimeout | None = None

  async def __call__(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    del prompt
    program, format_ok = extract_code(response)
    key = sample.id or sample.prompt
    timeout = (self.adaptive.timeout_for(key, sample.reference_time) if self.adaptive
               else self.sandbox.config.timeout_s)
    result = await self.sandbox.run(program, sample.tests, timeout_s=timeout)
    if self.adaptive is not None and result.status is not SandboxStatus.SETUP_ERROR:
      self.adaptive.record(key, result.elapsed_s, correct=result.passed,
                           timed_out=result.status is SandboxStatus.TIMEOUT, timeout_s=timeout)
    return RewardResult(float(result.passed), {
        "format_ok": format_ok, "status": result.status.value, "elapsed_s": result.elapsed_s,
        "timeout_s": timeout, "isolation": result.isolation, "stderr_tail": result.stderr[-500:]})

  def score_sync(self, prompt: str, response: str, sample: Sample) -> RewardResult:
    """Blocking convenience for scripts; never call it from inside a running event loop."""
    return asyncio.run(self(prompt, response, sample))
