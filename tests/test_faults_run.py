"""Whole-run fault drills with real processes: `python -m experiments.train` on the agentic config,
stub rollout servers (a fake model, so no server compiles), the real trainer and checkpoints.

- The controller SIGKILLed after step 2 and rerun with the same command resumes from its checkpoint:
  every step logged once, the policy version continues, no sample id trained twice, the prompts in
  flight at the checkpoint are trained after the resume, and its orphaned servers (stubs told to
  outlive their launcher, as real SGLang servers do) are reaped.
- A rollout server SIGKILLed mid-run, with slow and failing environments: the supervisor restarts it
  at the current policy version, no request is lost, every step completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from flashrl_jax.controller import read_metrics
from tests.rollout_stubs import configure
from tests.train_process import REPO, alive, train_env
pytestmark = pytest.mark.slow


def _command(workdir, model, *extra):
  return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/agentic.py",
          "--rollout=stub", f"--model_path={model}", f"--workdir={workdir}", "--noplot",
          "--noprogress", "--batch_size=2", "--group_size=2", "--checkpoint_every=1", *extra]


def _start(command, log_path, jax_cache, **env):
  with open(log_path, "ab") as log:
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=train_env(jax_cache, **env))


def _wait_for_step(workdir, step: int, proc, timeout_s: float = 300) -> None:
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f"run exited with {proc.returncode} before step {step}")
    if os.path.exists(path) and any(r["step"] >= step for r in read_metrics(path)):
      return
    time.sleep(0.1)
  raise AssertionError(f"step {step} not reached in {timeout_s}s")


def _committed_checkpoints(workdir) -> list[int]:
  root = os.path.join(workdir, "checkpoints")
  return [int(d) for d in (os.listdir(root) if os.path.isdir(root) else [])
          if d.isdigit() and os.path.exists(os.path.join(root, d, "commit_success.txt"))]


def _latest_checkpoint(workdir) -> int:
  return max(_committed_checkpoints(workdir))


def _wait_for_a_checkpoint(workdir, timeout_s: float = 120) -> None:
  """The step record is written before the checkpoint (so a crash between them loses no record):
  a kill right after step 2's record may precede every commit under load."""
  deadline = time.monotonic() + timeout_s
  while not _committed_checkpoints(workdir) and time.monotonic() < deadline:
    time.sleep(0.1)


def _check_records(records, steps):
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert [r["policy_version"] for r in records] == list(range(1, steps + 1))
  ids = [i for r in records for i in r["sample_ids"]]
  assert len(ids) == len(set(ids)) == steps * 4, "a sample was trained twice (or lost)"
  for key in [k for k in records[0] if k.startswith("total/")]:
    values = [r[key] for r in records]
    assert values == sorted(values), f"counter {key} went backwards: {values}"
  assert records[-1]["total/samples_trained"] == steps * 4


def test_trainer_sigkill_resumes_from_checkpoint(tmp_path, run_model, jax_cache):
  workdir, log_path = str(tmp_path / "run"), str(tmp_path / "train.log")
  command = _command(workdir, run_model, "--steps=5")
  # The stubs stand in for servers that do not stop with their launcher (real SGLang; ours do, see
  # tests/test_stopped_experiments.py), so the second run's reap is what stops them.
  first = _start(command, log_path, jax_cache, FLASHRL_STUB_OUTLIVES_LAUNCHER="1")
  try:
    _wait_for_step(workdir, 2, first)
    _wait_for_a_checkpoint(workdir)
    with open(os.path.join(workdir, "server_pids.json")) as f:
      orphans = [e["pid"] for e in json.load(f)]
  finally:
    first.kill()  # SIGKILL: no cleanup, servers left running in their own sessions
    first.wait()
  assert all(alive(pid) for pid in orphans)
  restored = _latest_checkpoint(workdir)
  with open(os.path.join(workdir, "checkpoints", str(restored), "extra", "metadata")) as f:
    extra = json.load(f)
  assert extra["policy_version"] == extra["step"] == restored
  in_flight = set(extra["source"]["reissue"])
  before = read_metrics(workdir)
  versions = os.path.join(workdir, "versions")
  exported_after_checkpoint = {  # weights the resumed run must not serve: rewritten, or gone
      name: os.stat(os.path.join(versions, name)).st_ino for name in os.listdir(versions)
      if name.startswith("weight_v") and int(name[len("weight_v"):]) > restored}

  second = _start(command, log_path, jax_cache)
  assert second.wait(timeout=300) == 0, open(log_path).read()[-3000:]
  assert not any(alive(pid) for pid in orphans)  # reaped by the second run
  records = read_metrics(workdir)
  _check_records(records, 5)
  # Resumed, not restarted: steps up to the checkpoint are the first run's, the rest were redone.
  assert records[:restored] == before[:restored]
  for name, inode in exported_after_checkpoint.items():
    path = os.path.join(versions, name)
    assert not os.path.exists(path) or os.stat(path).st_ino != inode, name
  trained_later = {int(i) // 1000 for r in records[restored:] for i in r["sample_ids"]}
  assert in_flight and in_flight <= trained_later, (in_flight, trained_later)


def _weight_version(url: str) -> int | None:
  try:
    with urllib.request.urlopen(url + "/model_info", timeout=2) as r:
      return int(json.load(r)["weight_version"])
  except (urllib.error.URLError, OSError, ValueError):
    return None


def test_rollout_server_sigkill_mid_run(tmp_path, run_model, jax_cache):
  workdir, log_path = str(tmp_path / "run"), str(tmp_path / "train.log")
  proc = _start(_command(workdir, run_model, "--steps=4", "--env_fail_slow_prob=0.2",
                         "--env_fail_stop_prob=0.1"), log_path, jax_cache)
  try:
    _wait_for_step(workdir, 1, proc)
    with open(os.path.join(workdir, "server_pids.json")) as f:
      victim = json.load(f)[0]
    configure(victim["url"], token_latency_s=0.02)  # so that requests are in flight when it dies
    time.sleep(0.5)
    os.killpg(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (_weight_version(victim["url"]) or 0) < 1:  # back, on the current weights
      assert time.monotonic() < deadline, "the killed server did not come back"
      time.sleep(0.05)
    assert proc.wait(timeout=300) == 0, open(log_path).read()[-3000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  records = read_metrics(workdir)
  _check_records(records, 4)
  last = records[-1]
  assert last["total/server_restarts"] >= 1 and last["total/server_failures"] >= 1
  assert last["total/episodes_dropped/generation"] == 0  # no request lost
  assert last["total/episodes_dropped/env_failure"] >= 1  # fail-stop environments were dropped
  assert all("env_step_s/count" in r for r in records) and "env_step_s/p90" in last
