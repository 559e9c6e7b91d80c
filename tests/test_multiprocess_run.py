"""One RL run across processes: `experiments.train` as 2 `jax.distributed` processes (2 fake CPU
devices each, an fsdp axis over all 4), process 0 running the async controller and 2 local stub
rollout servers, against the same run in 1 process on 4 devices.

One run, three lives, every scenario real processes killed with SIGKILL:
1. process 0 is killed after the step-2 checkpoint: the follower exits on its own, naming it;
2. restarted, the follower is killed after step 3: process 0 exits naming process 1, and stops its
   rollout servers;
3. restarted through `launch/local_multiprocess.sh`: it resumes and finishes, exit 0.
The run's metrics then hold steps 1-4 once each, `num_processes: 2`, no sample trained twice, and
per-step losses and log-ratios equal to the 1-process run's (float tolerance). α = 0 makes each
step's batch the same set of prompts in both runs, and the entropy bonus makes the loss non-zero
(the stub's responses are deterministic, so every group's rewards are equal and its advantages 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from flashrl_jax.controller import read_metrics
from flashrl_jax.fleet import free_port
from flashrl_jax.trainer import EXIT_LOST
from tests.train_process import REPO as ROOT
from tests.train_process import alive, train_env
STEPS = 4
pytestmark = pytest.mark.slow


def _flags(model, workdir, mesh):
  return ["--config=experiments/configs/repeat.py", "--rollout=stub", f"--model_path={model}",
          f"--workdir={workdir}", f"--mesh={mesh}", "--mode=async", "--async_ratio=0",
          f"--steps={STEPS}", "--batch_size=2", "--group_size=2", "--checkpoint_every=1",
          "--eval_every=0", "--noplot", "--noprogress", "--set=train.loss.entropy_coef=0.05",
          "--learning_rate=3e-2"]


def _env(cache, devices):
  return train_env(cache, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _start_pair(flags, cache, log_dir, life):
  port = free_port()
  procs = []
  for i in range(2):
    log = open(os.path.join(log_dir, f"life{life}_p{i}.log"), "w")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--num_processes=2", f"--process_id={i}",
         f"--coordinator=127.0.0.1:{port}", *flags], cwd=ROOT, env=_env(cache, 2), stdout=log,
        stderr=subprocess.STDOUT))
  return procs


def _wait_for_step(workdir, step, procs, timeout_s=600):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if any(p.poll() is not None for p in procs):
      raise AssertionError(f"a process exited before step {step}: {[p.poll() for p in procs]}")
    if os.path.exists(path) and any(r["step"] >= step for r in read_metrics(path)):
      return
    time.sleep(0.2)
  raise AssertionError(f"step {step} not reached in {timeout_s}s")


def _exits_within(proc, seconds):
  try:
    return proc.wait(seconds)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise AssertionError(f"process still running {seconds}s after the other one died") from None


def _log(log_dir, name):
  with open(os.path.join(log_dir, name)) as f:
    return f.read()


@pytest.mark.timeout(1200)  # 4 launches of 2 processes: 150-310 s here at load 8-14, 580 s at 14+
def test_two_processes_survive_kills_and_match_one_process(tmp_path, run_model):
  cache = str(tmp_path / "jax_cache")
  workdir = str(tmp_path / "run2")
  flags = _flags(run_model, workdir, "fsdp:4")

  # 1. Process 0 dies after a checkpoint: the follower stops by itself, naming process 0.
  procs = _start_pair(flags, cache, tmp_path, 1)
  try:
    _wait_for_step(workdir, 2, procs)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    assert _exits_within(procs[1], 60) == EXIT_LOST
  finally:
    for p in procs:
      p.kill()
  assert "process 0 of 2 was lost" in _log(tmp_path, "life1_p1.log")

  # 2. Restarted (it resumes); the follower dies: process 0 stops, naming it, servers and all.
  procs = _start_pair(flags, cache, tmp_path, 2)
  try:
    _wait_for_step(workdir, 3, procs)
    with open(os.path.join(workdir, "server_pids.json")) as f:
      server_pids = [e["pid"] for e in json.load(f)]
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    assert _exits_within(procs[0], 60) == EXIT_LOST
  finally:
    for p in procs:
      p.kill()
  assert "process 1 of 2 was lost" in _log(tmp_path, "life2_p0.log")
  assert not any(alive(pid) for pid in server_pids), "process 0 left its rollout servers running"

  # 3. Restarted with the launcher: it resumes from the step-3 checkpoint and finishes.
  with open(tmp_path / "life3.log", "w") as log:
    launch = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "--", *flags],
                            cwd=ROOT, env=_env(cache, 2), stdout=log, stderr=subprocess.STDOUT,
                            timeout=900)
  output = _log(tmp_path, "life3.log")
  errors = [line for line in output.splitlines()
            if line[:1] in "EF" and line[1:5].isdigit() or "Error" in line or "error" in line]
  assert launch.returncode == 0, "\n".join(errors[-40:]) + output[-2000:]

  # The same run in one process on the same global mesh shape (4 devices, fsdp over all).
  single_dir = str(tmp_path / "run1")
  single = subprocess.run([sys.executable, "-m", "experiments.train",
                           *_flags(run_model, single_dir, "fsdp:4")], cwd=ROOT, env=_env(cache, 4),
                          capture_output=True, text=True, timeout=900)
  assert single.returncode == 0, single.stderr[-3000:]

  records, reference = read_metrics(workdir), read_metrics(single_dir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
  assert all(r["num_processes"] == 2 for r in records)
  assert all(r["num_processes"] == 1 for r in reference)
  ids = [i for r in records for i in r["sample_ids"]]
  assert len(ids) == len(set(ids)) == STEPS * 4, "a sample was trained twice (or lost)"
  for got, want in zip(records, reference):
    assert sorted(got["sample_ids"], key=int) == sorted(want["sample_ids"], key=int)
    for key in ("loss", "log_ratio_mean", "approx_kl", "grad_norm"):
      np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-6, err_msg=key)
  assert abs(records[-1]["loss"]) > 1e-4 and records[-1]["grad_norm"] > 0  # a real update
  assert len({round(r["log_ratio_mean"], 6) for r in records}) > 1  # the policy moved
