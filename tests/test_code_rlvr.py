"""Code RLVR as a user launches it: `python -m experiments.train --config=experiments/configs/code_rlvr.py`
(a rollout server process, the trainer, the sandboxed code reward, RollPacker's adaptive timeout).

The policy is the config's tiny model warm-started on the tasks' reference solutions (trained once
and cached in `.cache/code_model`); it passes a task's hidden tests some of the time. Four tasks
recur every step, so the adaptive timeout has anchors to use. Checked: every consumed response was
judged by the sandbox under namespace isolation; the rewards the trainer consumed are exactly the
sandbox verdicts (reward 1 iff PASSED); some programs passed; once a prompt had a correct run, its
later runs got the adapted limit (lambda x its slowest correct run, at least T_min) instead of T_max; training advanced every step.
"""

import json
import os
import subprocess
import sys

import pytest

from flashrl_jax.envs import Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
STEPS = 3


@pytest.mark.slow
def test_code_rlvr_run_trains_on_sandbox_verdicts(tmp_path):
  from experiments.configs.code_rlvr import get_config
  adaptive = get_config().task.adaptive_timeout
  cmd = [sys.executable, "-m", "experiments.train", "--config=experiments/configs/code_rlvr.py",
         f"--workdir={tmp_path / 'run'}", f"--steps={STEPS}", "--batch_size=4", "--group_size=4",
         "--num_rollout_servers=1", "--plot=false", "--progress=false",
         "--set=task.code.num_tasks=4",
         # A sharper policy (same temperature for sampling and training) passes often enough for
         # 3 steps to show passes and adapted limits; at 1.0 this tiny model passes ~6%.
         "--set=rollout.temperature=0.5", "--set=train.temperature=0.5"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
  verdicts = {v.value for v in Verdict}
  passed = 0
  for r in records:
    n = r["num_samples"]
    assert n == 16 and sum(r["reward_status"].values()) == n, r["reward_status"]
    assert set(r["reward_status"]) <= verdicts
    assert set(r["reward_isolation"]) <= {"root_namespaces", "user_namespaces"}
    assert sum(r["reward_isolation"].values()) == n  # namespaced, every one of them
    step_passed = r["reward_status"].get("passed", 0)
    assert r["reward_mean"] == pytest.approx(step_passed / n)  # what the trainer consumed
    assert r["accuracy"] == pytest.approx(step_passed / n)
    passed += step_passed
  assert passed > 0, [r["reward_status"] for r in records]
  assert records[0]["reward_timeout_s_mean"] <= adaptive.t_max
  adapted = min(r["reward_timeout_s_min"] for r in records)
  assert adaptive.t_min <= adapted < adaptive.t_max  # lambda * (slowest correct run), clamped
