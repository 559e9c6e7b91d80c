"""Whole runs as a user launches them (`python -m experiments.train`: server processes + trainer over
loopback): both the sync baseline and async α=2 learn the demo task — the held-out probability of the
exact answer, computed without sampling noise, goes up — and the staleness of every consumed sample
respects the bound (0 for sync), three times over: from the weight versions the servers reported for
each sample's tokens, from the trainer's own per-token metric, and from the controller's histogram.
The sync run also has its servers refuse version 3 (corrupted between its export and its handoff):
a synchronous handoff writes it again and republishes it, and the run goes on."""

import json
import os
import subprocess
import sys

import pytest

# lr 3e-4, 128 samples/step. Sync gains 0.03+ by step 20. Async α=2 learns more slowly and more
# noisily early on: one CI run ended step 20 at -0.005 (0.556 -> 0.551), while by step 40 every
# α=2 run of the 3-seed ablation (RESULTS.md §1) and both demo runs were 0.05-0.12 above the start.
SYNC_STEPS, ASYNC_STEPS = 20, 40
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def demo_model():
  from experiments.configs.demo import DEMO_MODEL_DIR
  from experiments.warmstart import ensure_demo_model
  return ensure_demo_model(os.path.join(ROOT, DEMO_MODEL_DIR), progress=False)


def _run(workdir, steps, *flags, failpoints=""):
  cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", f"--steps={steps}",
         "--batch_size=16", "--group_size=8", "--learning_rate=3e-4", f"--eval_every={steps}",
         "--plot=true", "--progress=false", *flags]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", FLASHRL_FAILPOINTS=failpoints))
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode_flags,alpha,steps", [
    (["--mode=sync"], 0, SYNC_STEPS), (["--mode=async", "--async_ratio=2"], 2, ASYNC_STEPS)])
def test_run_learns_and_respects_staleness(tmp_path, demo_model, mode_flags, alpha, steps):
  failpoints = "published@3=corrupt" if alpha == 0 else ""
  records, log = _run(tmp_path / "run", steps, f"--model_path={demo_model}", *mode_flags,
                      failpoints=failpoints)
  if failpoints:
    assert "refused policy version 3" in log and "writing policy version 3 again" in log, log[-4000:]
    assert records[-1]["total/versions_refused"] == 1
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert [r["policy_version"] for r in records] == list(range(1, steps + 1))
  for r in records:
    # The servers' word: every token of a sample trained at version step-1 came from a version
    # at most α older (and none from the future).
    assert len(r["sample_min_token_version"]) == len(r["sample_ids"])
    assert all(0 <= r["step"] - 1 - v <= alpha for v in r["sample_min_token_version"]), r["step"]
    assert r["trainer/staleness_max"] <= alpha and r["trainer/staleness_negative_frac"] == 0
    stalenesses = [int(k) for k in r["staleness_hist"]]
    assert max(stalenesses) <= alpha, r["staleness_hist"]
    assert sum(r["staleness_hist"].values()) == r["num_samples"] == 128
    assert len(set(r["sample_ids"])) == 128
  all_ids = [i for r in records for i in r["sample_ids"]]
  assert len(all_ids) == len(set(all_ids)), "a sample was trained twice"
  before = records[0]["eval/initial_expected_accuracy"]
  after = records[-1]["eval/expected_accuracy"]
  assert after > before + 0.01, (mode_flags, before, after)
  assert os.path.exists(tmp_path / "run" / "reward.png")
  assert os.path.isdir(tmp_path / "run" / "tensorboard")
