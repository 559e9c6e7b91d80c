"""The learner in a process of its own (`LearnerProcess`), checked against the same learner built in
this process: the same config, model and trajectories give the same losses, the same exported
weights and a checkpoint a new process restores. What is tried beyond that: an operation that fails
there (a malformed request) comes back as an error naming it, and the process goes on serving; a
learner that cannot be built (no model) says why; a killed learner process is reported, not waited
on; a killed controller leaves no learner process behind; every shipped config crosses the process
boundary unchanged (it travels as JSON, not pickle)."""

import dataclasses
import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments._cli import load_config_file
from flashrl_jax.controller import Learner, LearnerProcess, LearnerProcessError
from flashrl_jax.controller._config import config_from_json, config_to_json
from flashrl_jax.model import read_config
from flashrl_jax.testing import read_weights
from flashrl_jax.trainer import Op, random_trajectories

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(model: str, workdir: str):
  config = load_config_file(os.path.join(REPO, "experiments/configs/repeat.py"))
  train = config.train
  return config.replace(model_path=model, workdir=workdir, eval_every=0, batch_size=2,
                        group_size=4, train=train.replace(batch=dataclasses.replace(
                            train.batch, row_length=64, rows=2, sequences_per_row=4, max_response_length=16)))


def _trajectories(model: str, version: int):
  rng = np.random.default_rng(version)
  return random_trajectories(rng, 8, vocab_size=read_config(model).vocab_size,
                             prompt_lengths=(2, 8), response_lengths=(1, 16), group_size=4,
                             version=version)


def test_every_shipped_config_crosses_the_process_boundary_unchanged():
  for path in sorted(glob.glob(os.path.join(REPO, "experiments/configs/*.py"))):
    if path.endswith("__init__.py"):
      continue
    config = load_config_file(path)
    assert config_from_json(config_to_json(config)) == config, path


def test_same_updates_exports_and_checkpoints_as_in_this_process(run_model, tmp_path):
  config = _config(run_model, str(tmp_path))
  local = Learner.create(config, str(tmp_path / "local"))
  remote = LearnerProcess.start(config, str(tmp_path / "remote"))
  try:
    for version in range(3):
      batch = _trajectories(run_model, version)
      here, there = local.update(batch), remote.update(batch)
      for key, value in here.items():
        if "time" not in key and "per_second" not in key:
          assert there[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
      assert remote.policy_version == local.policy_version == version + 1
    ours, theirs = read_weights(local.export()), read_weights(remote.export())
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
      np.testing.assert_allclose(theirs[name], ours[name], rtol=1e-6, atol=1e-7, err_msg=name)
    remote.hold(3)
    remote.collect_garbage()  # one-way: answered by nothing, ordered before the next request
    remote.save(3, {"step": 3, "note": "after three updates"})
    assert remote.evaluate() == pytest.approx(local.evaluate(), rel=1e-5)
  finally:
    local.close()
    remote.close()
  again = LearnerProcess.start(config, str(tmp_path / "remote"))
  try:
    assert again.restore() == {"step": 3, "note": "after three updates"}
    assert again.policy_version == 3
    np.testing.assert_allclose(read_weights(again.export())["model.embed_tokens.weight"],
                               ours["model.embed_tokens.weight"], rtol=1e-6, atol=1e-7)
  finally:
    again.close()


def test_a_failed_operation_is_reported_and_the_process_goes_on(run_model, tmp_path):
  learner = LearnerProcess.start(_config(run_model, str(tmp_path)), str(tmp_path / "run"))
  try:
    with pytest.raises(LearnerProcessError, match="update failed in the learner process: TypeError"):
      learner._request(Op.UPDATE, arrays={"not_a_batch_field": np.zeros(3)})  # malformed
    learner.update(_trajectories(run_model, 0))
    assert learner.policy_version == 1
  finally:
    learner.close()


def test_a_learner_that_cannot_be_built_says_why(run_model, tmp_path):
  config = _config(run_model, str(tmp_path)).replace(model_path=str(tmp_path / "no_such_model"))
  with pytest.raises(LearnerProcessError, match="init failed .*no_such_model"):
    LearnerProcess.start(config, str(tmp_path / "run"))


def test_a_killed_learner_process_is_reported_not_waited_on(run_model, tmp_path):
  learner = LearnerProcess.start(_config(run_model, str(tmp_path)), str(tmp_path / "run"))
  os.kill(learner.pid, signal.SIGKILL)
  with pytest.raises(LearnerProcessError, match="killed by signal 9"):
    learner.update(_trajectories(run_model, 0))
  learner.close()  # nothing left to stop: returns at once


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return any(line.startswith("State:") and "Z" in line for line in f)  # reaped or a zombie
  except FileNotFoundError:
    return True


def test_a_killed_controller_leaves_no_learner_process(run_model, tmp_path):
  script = f"""
import os, signal, sys
sys.path.insert(0, {REPO!r})
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_learner_process import _config
from flashrl_jax.controller import LearnerProcess
learner = LearnerProcess.start(_config({run_model!r}, {str(tmp_path)!r}), {str(tmp_path / 'run')!r})
print(learner.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == -9, proc.stderr[-3000:]
  pid = int(proc.stdout.split()[-1])
  deadline = time.monotonic() + 30
  while not _gone(pid) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert _gone(pid), f"learner process {pid} outlived its controller"
