"""sim_vs_measured on a synthetic metrics.jsonl: a simulated run, written in the controller's format.

The "measured" run is the simulator itself with known costs and another seed, so the calibrated
prediction should land close; the test checks the plumbing (format, fits, last line), not the
fidelity of the simulator to real hardware.
"""

import json
import pathlib
import subprocess
import sys

import pytest

from experiments.benchmarks import sim_vs_measured
from flashrl_jax import sim
from flashrl_jax.scheduling import LengthDistribution

REPO = pathlib.Path(__file__).resolve().parents[1]
SYNC = sim.SyncModel(export_s=0.2, pause_s=0.05, load_s=0.3, resume_s=0.05)


def _measured_run(tmp_path, mode: str, with_lengths: bool):
  training = (sim.AsyncTraining(alpha=2, train_gpus=1) if mode == "async"
              else sim.SyncTraining(train_gpus=1))
  truth = sim.SimConfig(
      gpus=3, slots=8, batch_prompts=8, group_size=4, steps=12, warmup_steps=1,
      lengths=LengthDistribution.with_mean(120, sigma=0.8, max_len=512), prompt_tokens=32,
      cost=sim.CostModel(decode=sim.LinearDecode(0.01, 0.002), train=sim.TrainModel(0.5, 2e-4),
                         sync=SYNC),
      training=training)
  lines = sim.simulate(truth, seed=123).to_metrics(
      handoff={f"time/{k}": v for k, v in vars(SYNC).items()})
  if not with_lengths:
    for line in lines:
      del line["response_lengths"]
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
  calibration = {
      "run": {"mode": mode, "async_ratio": 2, "batch_size": 8, "group_size": 4,
              "rollout_servers": 2, "slots": 8, "train_devices": 1, "prompt_tokens": 32,
              "max_len": 512},
      "decode": {"active": [1, 2, 4, 8], "step_s": [0.012, 0.014, 0.018, 0.026]},
      "warmup_steps": 1,
  }
  path = tmp_path / "calibration.json"
  path.write_text(json.dumps(calibration))
  return metrics, path


@pytest.mark.parametrize("mode, with_lengths", [("async", True), ("sync", False)])
def test_prediction_matches_a_synthetic_measured_run(tmp_path, mode, with_lengths):
  metrics, calibration = _measured_run(tmp_path, mode, with_lengths)
  report = sim_vs_measured.compare(sim_vs_measured.load_metrics(metrics),
                                   json.loads(calibration.read_text()), seeds=2)
  assert report["error"] < 0.15, report
  config = report["config"]
  assert config.cost.sync.total_s == pytest.approx(SYNC.total_s)
  assert config.cost.train.per_token_s == pytest.approx(2e-4, rel=0.3)


def test_command_line_prints_the_error_last(tmp_path):
  metrics, calibration = _measured_run(tmp_path, "async", True)
  out = subprocess.run(
      [sys.executable, "-m", "experiments.benchmarks.sim_vs_measured", f"--metrics={metrics}",
       f"--calibration={calibration}", "--seeds=1"],
      capture_output=True, text=True, check=True, timeout=120, cwd=REPO).stdout
  last = out.strip().splitlines()[-1]
  assert last.startswith("sim_error_vs_measured: ")
  assert 0.0 <= float(last.split(": ")[1]) < 0.2


def test_simulate_entry_point_writes_tables_and_plots(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.simulate", "--gpus=4,8", "--alphas=2",
       "--batch_prompts=4", "--group_size=2", "--slots=4", "--mean_len=300", "--max_len=2000",
       "--steps=2", "--seq_lens=300", "--seq_gpus=8", "--split_gpus=8", "--split_train=2,4",
       "--mech_gpus=4", "--mech_batches=4", f"--out={tmp_path}"],
      capture_output=True, text=True, check=True, timeout=120, cwd=REPO).stdout
  assert out.strip().splitlines()[-1].startswith("sim_async_speedup_at_8_gpus: ")
  for name in ("scaling.json", "scaling.csv", "scaling.png", "seqlen.csv", "seqlen.png",
               "split.csv", "mechanisms.csv"):
    assert (tmp_path / name).stat().st_size > 0
  rows = json.loads((tmp_path / "scaling.json").read_text())
  assert {(r["gpus"], r["mode"]) for r in rows} == {(4, "sync"), (4, "async"), (8, "sync"),
                                                     (8, "async")}
