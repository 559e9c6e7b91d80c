"""Whole runs as a user launches them (`python -m experiments.train`: server processes + trainer
over loopback), and the staleness of every consumed sample respects the bound (0 for sync) three times
over: from the weight versions the servers reported for each sample's tokens, from the trainer's own
per-token metric, and from the controller's histogram.

- The demo (its default config: async α = 2 on reasoning-gym's `spell_backward`) learns: its
  sampled reward on the task rises by more than step-to-step noise reaches, and the held-out
  probability of the exact answer (computed without sampling noise on words the training stream
  never yields) does not fall.
- The sync baseline on the synthetic repeat task learns too, while its servers refuse version 3
  (corrupted between its export and its handoff): a synchronous handoff writes it again and
  republishes it, and the run goes on.
"""

import json
import os
import subprocess
import sys

import pytest

# The demo config as shipped (150 steps). Measured at c28661c, the machine otherwise idle, five
# runs (README, "Two commands"): the mean sampled reward (256 samples a step, a step's mean has a
# standard deviation of 0.033-0.041 early on) rose from 0.574-0.583 over steps 1-10 to
# 0.637-0.660 over steps 101-150, +0.056 to +0.086 (+0.071 on average); a policy that does not
# learn leaves it within ~0.012 (one standard error of the difference of the two means).
# REWARD_MARGIN is 2.4 standard errors above no rise and below every run's rise. The held-out
# P(exact answer) rose by +0.001 to +0.060 over seven runs at c28661c (0.066 -> 0.067 ... 0.125;
# the four with the default decode blocks +0.021 to +0.029): async timing changes which weights
# each token came from, so its rise is no stable bar; it must not fall.
DEMO_STEPS = 150
REWARD_MARGIN = 0.03
# Repeat task, lr 3e-4, 128 samples/step, sync with version 3 refused (measured 2026-11-26, three
# runs): the held-out accuracy first dips (0.556 -> 0.545 at step 10), then climbs: 0.577-0.582 at
# step 20, 0.640-0.647 at 30, 0.652-0.661 at 40. At 20 steps a run that climbed a little later
# ended at 0.536 (a CI run), so the check is at 40, where the rise (+0.10) is three times SYNC_MARGIN.
SYNC_STEPS = 40
SYNC_MARGIN = 0.03
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _train(workdir, steps, alpha, *flags, failpoints=""):
  cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", f"--steps={steps}",
         f"--eval_every={steps}", "--plot=true", "--progress=false", *flags]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", FLASHRL_FAILPOINTS=failpoints))
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert [r["policy_version"] for r in records] == list(range(1, steps + 1))
  samples = records[0]["num_samples"]
  for r in records:
    # The servers' word: every token of a sample trained at version step-1 came from a version
    # at most α older (and none from the future).
    assert len(r["sample_min_token_version"]) == len(r["sample_ids"])
    assert all(0 <= r["step"] - 1 - v <= alpha for v in r["sample_min_token_version"]), r["step"]
    assert r["trainer/staleness_max"] <= alpha and r["trainer/staleness_negative_frac"] == 0
    assert max(int(k) for k in r["staleness_hist"]) <= alpha, r["staleness_hist"]
    assert sum(r["staleness_hist"].values()) == r["num_samples"] == samples
    assert len(set(r["sample_ids"])) == samples
  all_ids = [i for r in records for i in r["sample_ids"]]
  assert len(all_ids) == len(set(all_ids)), "a sample was trained twice"
  assert os.path.exists(os.path.join(workdir, "reward.png"))
  assert os.path.isdir(os.path.join(workdir, "tensorboard"))
  return records, proc


@pytest.mark.slow
def test_demo_learns_a_reasoning_gym_task(tmp_path):
  from experiments.configs.demo import DEMO_MODEL_DIR
  from experiments.warmstart import ensure_demo_model
  model = ensure_demo_model(os.path.join(ROOT, DEMO_MODEL_DIR), progress=False)
  records, proc = _train(tmp_path / "run", DEMO_STEPS, 2, f"--model_path={model}")
  assert "reward_mean/spell_backward" in records[-1]  # per-dataset metrics of the task
  rewards = [r["reward_mean"] for r in records]
  early, late = sum(rewards[:10]) / 10, sum(rewards[100:]) / len(rewards[100:])
  assert late > early + REWARD_MARGIN, (early, late)
  before = records[0]["eval/initial_expected_accuracy/spell_backward"]
  after = records[-1]["eval/expected_accuracy/spell_backward"]
  assert after >= before, (before, after)
  assert f"held-out P(exact answer): {before:.3f} -> {after:.3f}" in proc.stdout


@pytest.mark.slow
def test_sync_baseline_learns_through_a_refused_version(tmp_path):
  from experiments.configs import repeat
  from experiments.warmstart import ensure_warmstart
  model = ensure_warmstart(os.path.join(ROOT, repeat.REPEAT_MODEL_DIR), repeat.repeat_task(),
                           steps=repeat.REPEAT_WARMSTART_STEPS, progress=False)
  records, proc = _train(tmp_path / "run", SYNC_STEPS, 0, "--config=experiments/configs/repeat.py",
                         f"--model_path={model}", "--mode=sync",
                         failpoints="published@3=corrupt")
  log = proc.stderr
  assert "refused policy version 3" in log and "writing policy version 3 again" in log, log[-4000:]
  assert records[-1]["total/versions_refused"] == 1
  before = records[0]["eval/initial_expected_accuracy"]
  after = records[-1]["eval/expected_accuracy"]
  assert after > before + SYNC_MARGIN, (before, after)
