"""Whole runs as a user launches them (`python -m experiments.train`: server processes + trainer over
loopback): both the sync baseline and async α=2 learn the demo task — the held-out probability of the
exact answer, computed without sampling noise, goes up — and the staleness of every consumed sample
respects the bound (0 for sync)."""

import json
import os
import subprocess
import sys

import pytest

STEPS = 20  # lr 3e-4, 128 samples/step: sync and async α=2 both +0.03-0.07 by step 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def demo_model():
  from experiments.configs.demo import DEMO_MODEL_DIR
  from experiments.warmstart import ensure_warmstart
  return os.path.join(ROOT, ensure_warmstart(os.path.join(ROOT, DEMO_MODEL_DIR)))


def _run(workdir, *flags):
  cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", f"--steps={STEPS}",
         "--batch_size=16", "--group_size=8", "--learning_rate=3e-4", f"--eval_every={STEPS}",
         "--plot=true", "--progress=false", *flags]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("mode_flags,alpha", [(["--mode=sync"], 0),
                                              (["--mode=async", "--async_ratio=2"], 2)])
def test_run_learns_and_respects_staleness(tmp_path, demo_model, mode_flags, alpha):
  records = _run(tmp_path / "run", f"--model_path={demo_model}", *mode_flags)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
  for r in records:
    stalenesses = [int(k) for k in r["staleness_hist"]]
    assert max(stalenesses) <= alpha, r["staleness_hist"]
    assert sum(r["staleness_hist"].values()) == r["num_samples"] == 128
    assert len(set(r["sample_ids"])) == 128
  all_ids = [i for r in records for i in r["sample_ids"]]
  assert len(all_ids) == len(set(all_ids)), "a sample was trained twice"
  before = records[0]["eval/initial_expected_accuracy"]
  after = records[-1]["eval/expected_accuracy"]
  # Both modes must learn. In the 3-seed loss ablation (RESULTS.md §1, 40 steps), every sync and
  # α=2 run of PPO, TIS, CISPO and GRPO was 0.03-0.07 above its start by step 20.
  assert after > before + 0.01, (mode_flags, before, after)
  assert os.path.exists(tmp_path / "run" / "reward.png")
  assert os.path.isdir(tmp_path / "run" / "tensorboard")
