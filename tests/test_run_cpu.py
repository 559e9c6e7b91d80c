"""The async benchmark's CPU accounting of a run: the pure window arithmetic (`cpu_profile`), the
roles read off command lines, and the sampler against real child processes burning CPU."""

import os
import signal
import subprocess
import sys
import time

import pytest

from experiments._cpu_time import (CpuSampler, CpuSnapshot, cpu_ms_per_sample, cpu_profile,
                                   cpu_us_per_token, role_of, speedup_factors)


def test_roles_from_command_lines():
  assert role_of([sys.executable, "-m", "experiments.train", "--mode=async"]) == "controller"
  assert role_of([sys.executable, "-m", "flashrl_jax.rollout.server", "--port=0"]) == "servers"
  assert role_of([sys.executable, "-c",
                  "from flashrl_jax.controller._learner_process import main; main()", "7"]) \
      == "learner"
  assert role_of(["/usr/bin/bwrap", "--die-with-parent", "python3"]) == "other"


def test_profile_of_the_window_per_role():
  snapshots = [
      CpuSnapshot(0.0, 4, {10: ("controller", 5.0)}),  # warm-up: outside the window
      CpuSnapshot(1.0, 10, {10: ("controller", 6.0), 11: ("learner", 20.0),
                            12: ("servers", 30.0)}),
      CpuSnapshot(3.0, 30, {10: ("controller", 6.4), 11: ("learner", 21.0),
                            12: ("servers", 31.5), 13: ("servers", 0.5)}),  # 13 started after
      CpuSnapshot(4.0, 39, {10: ("controller", 8.0)}),  # before the last step: outside
      CpuSnapshot(5.0, 40, {10: ("controller", 9.0)}),  # after it (and its evaluation): outside
  ]
  profile = cpu_profile(snapshots, warmup=5, steps=40, cores=2)
  # 0.4 + 1.0 + (1.5 + 0.5) = 3.4 CPU seconds over 2 wall seconds on 2 cores, 20 steps.
  assert profile["cores_busy"] == pytest.approx(3.4 / 4)
  assert profile["ms_per_step"] == pytest.approx(
      {"controller": 20.0, "learner": 50.0, "servers": 100.0, "other": 0.0})
  assert profile["steps"] == 20 and profile["complete"]


def test_a_process_gone_inside_the_window_is_flagged_and_no_window_is_none():
  gone = [CpuSnapshot(0.0, 10, {10: ("controller", 1.0), 12: ("servers", 4.0)}),
          CpuSnapshot(1.0, 20, {10: ("controller", 1.5)})]
  profile = cpu_profile(gone, warmup=5, steps=40, cores=1)
  assert not profile["complete"]
  assert profile["cores_busy"] == pytest.approx(0.5)  # the server's second is lost, not negative
  assert cpu_profile([], warmup=5, steps=40, cores=2) is None
  assert cpu_profile(gone[:1], warmup=5, steps=40, cores=2) is None
  same_step = [CpuSnapshot(0.0, 10, {}), CpuSnapshot(1.0, 10, {})]
  assert cpu_profile(same_step, warmup=5, steps=40, cores=2) is None


def _wait_for(condition, timeout_s: float = 30.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "the sampler took no reading"
    time.sleep(0.01)


_RUN = """# experiments.train (a stand-in run: its command line names the run's module)
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", f"# {mark}\\nimport time\\n"
                                                  f"print('ready', flush=True)\\n{body}"],
                             stdout=subprocess.PIPE, text=True)
            for mark, body in (  # (the marks split: this command line must name neither)
                ("flashrl_jax.rollout." + "server",  # burns CPU
                 "end = time.process_time() + 60\\nwhile time.process_time() < end: pass"),
                ("flashrl_jax.controller." + "_learner_process", "time.sleep(60)"))]
for child in children:
  child.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def test_sampler_prices_a_real_process_tree(tmp_path):
  """A run process whose children are named as its server (burning CPU) and its learner
  (sleeping); a busy process outside the run's tree (this test's own child) is not counted."""
  metrics = tmp_path / "metrics.jsonl"
  outsider = subprocess.Popen([sys.executable, "-c", "# flashrl_jax.rollout.server\n"
                               "end = __import__('time').process_time() + 60\n"
                               "while __import__('time').process_time() < end: pass"])
  run = subprocess.Popen([sys.executable, "-c", _RUN], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
  try:
    assert run.stdout.readline() == "ready\n"  # start-ups done: outside the window
    with CpuSampler(str(tmp_path), run.pid, period_s=0.05) as sampler:
      time.sleep(0.3)  # no metrics yet: no snapshots
      assert sampler.snapshots == []
      with open(metrics, "a") as f:  # as a run writes its records: appended, flushed
        for records in (2, 4):
          f.write("{}\n" * records)
          f.flush()
          _wait_for(lambda: sampler.snapshots and sampler.snapshots[-1].steps == f.tell() // 3)
          time.sleep(1.0 if records == 2 else 0.0)
  finally:
    os.killpg(run.pid, signal.SIGKILL)
    run.communicate()
    outsider.kill()
    outsider.wait()
  assert [s.steps for s in sampler.snapshots] == [2, 6]  # one reading per new record batch
  metrics.write_text("{}\n")  # rewritten shorter: counted again from its start
  assert sampler.snapshot().steps == 1
  profile = cpu_profile(sampler.snapshots, warmup=2, steps=100, cores=2)
  assert {role for s in sampler.snapshots for role, _ in s.cpu_s.values()} == {
      "controller", "servers", "learner"}
  ms = profile["ms_per_step"]
  # The burning server ran for most of the window's ~1 s (four steps); the run and the learner
  # slept; the outsider burned as much but is not the run's.
  assert ms["servers"] > 100 and ms["learner"] < 20 and ms["controller"] < 20
  assert 0.15 < profile["cores_busy"] <= 0.55


def test_speedup_factors_multiply_to_the_throughput_ratio():
  """A consistent pair of runs on 2 cores, 32 samples a step: sync 0.1-s steps keeping 0.8 of the
  cores busy (160 CPU ms a step), async 0.05-s steps at 0.9 (90 ms): 2x the samples/s, of which
  0.9/0.8 from busier cores and 160/90 from cheaper samples."""

  def info(step_s, busy, cpu_ms, length):
    return {"step_s": step_s, "samples_per_s": 32 / step_s, "mean_response_length": length,
            "cpu": {"cores_busy": busy, "ms_per_step": {"controller": cpu_ms / 4,
                                                        "learner": cpu_ms / 4,
                                                        "servers": cpu_ms / 2, "other": 0.0}}}

  # Sync answers 40 tokens a sample, async 30: async's samples are cheaper partly by being shorter.
  sync, run = info(0.1, 0.8, 160.0, 40.0), info(0.05, 0.9, 90.0, 30.0)
  assert cpu_ms_per_sample(sync) == pytest.approx(5.0)
  assert cpu_us_per_token(sync) == pytest.approx(125.0)
  busy, per_sample, per_token = speedup_factors([(run, sync)])
  assert busy == pytest.approx(0.9 / 0.8) and per_sample == pytest.approx(160 / 90)
  assert per_token == pytest.approx((160 / 40) / (90 / 30))
  assert busy * per_sample == pytest.approx(run["samples_per_s"] / sync["samples_per_s"])
  tokens_per_s = lambda i: i["samples_per_s"] * i["mean_response_length"]
  assert busy * per_token == pytest.approx(tokens_per_s(run) / tokens_per_s(sync))
  run["cpu"] = None  # no readings: no factors, not a crash
  assert all(f != f for f in speedup_factors([(run, sync)]))
  assert cpu_ms_per_sample(run) != cpu_ms_per_sample(run)
