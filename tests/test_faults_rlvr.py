"""Faults on the real RLVR path: `python -m experiments.train`, async α = 2, our JAX engine servers
(two processes), the real trainer, checkpoints and weight exports. Faults fire at exact points
(`flashrl_jax._failpoints`), in one run relaunched after each controller kill:

  launch 1: server 1's engine thread stopped during step 2's training; version 3 corrupted between
            its export and its handoff; the controller SIGKILLed during step 6's training;
  launch 2: the controller SIGKILLed while exporting version 7;
  launch 3: server 0 SIGKILLed mid-handoff of version 8 (paused, before loading); the controller
            SIGKILLed mid-handoff of version 9 (servers left paused);
  launch 4: no fault; it finishes step 10.

Checked on the run as a whole: every step logged once with its version; no sample id trained twice;
no prompt lost (each prompt the source handed out is trained, or pending in the final checkpoint);
the staleness bound holds for every sample, from the versions the servers reported per token; each
fault fired and was recovered from (the logs say so: a refused version superseded by the next,
servers restarted); each killed controller's servers stopped themselves. Also an α = 0 async run
(stub servers) whose servers refuse some prompts as invalid: it finishes, every sample fresh, each
refused prompt named in the records and counted in the summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from flashrl_jax.controller import read_metrics
from tests.train_process import REPO, alive, train_env

ALPHA, GROUP, STEPS = 2, 2, 10
LAUNCHES = [  # (failpoints, how the launch ends)
    ("train@1=kill_engine:1,published@3=corrupt,train@5=kill", "killed"),
    ("export@7=kill", "killed"),
    ("handoff@8=kill_server:0,handoff@9=kill", "killed"),
    ("", "finished"),
]
pytestmark = pytest.mark.slow


def _launch(args: list[str], failpoints: str, log_path: str, jax_cache: str,
            timeout_s: float = 900) -> int:
  env = train_env(jax_cache, FLASHRL_FAILPOINTS=failpoints)
  with open(log_path, "ab") as log:
    log.write(f"\n===== launch: FLASHRL_FAILPOINTS={failpoints!r}\n".encode())
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *args], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
      return proc.wait(timeout=timeout_s)
    finally:
      if proc.poll() is None:
        proc.kill()


def _command(workdir: str, model: str, *extra: str) -> list[str]:
  # A 26-token context (the servers' too): few shapes to compile (the servers warm up every one),
  # the same train step for both tests (one compilation), and a context the α = 0 run's stub
  # servers refuse the longer prompts for (prompt + 12 new tokens > 26; ours shorten the answer).
  # The synthetic repeat task: its prompts fit the 26-token context (the demo's reasoning-gym
  # prompts are ~53 tokens: every one would be refused).
  return ["--config=experiments/configs/repeat.py", f"--model_path={model}",
          f"--workdir={workdir}", "--mode=async",
          f"--steps={STEPS}", "--batch_size=2", f"--group_size={GROUP}", "--max_new_tokens=12",
          "--max_running_requests=4", "--checkpoint_every=1", "--eval_every=0", "--noplot",
          "--noprogress", "--set=train.batch.row_length=26",
          "--set=train.batch.max_response_length=12", *extra]


def _final_source(workdir: str, step: int = STEPS) -> dict:
  with open(os.path.join(workdir, "checkpoints", str(step), "extra", "metadata")) as f:
    return json.load(f)["source"]


def test_faults_on_the_rlvr_path_lose_nothing_and_train_nothing_twice(tmp_path, run_model,
                                                                      jax_cache):
  workdir, log_path = str(tmp_path / "run"), str(tmp_path / "train.log")
  args = _command(workdir, run_model, f"--async_ratio={ALPHA}", "--rollout=embedded",
                  "--num_rollout_servers=2")
  for failpoints, ending in LAUNCHES:
    rc = _launch(args, failpoints, log_path, jax_cache)
    log = open(log_path, errors="replace").read()
    if ending == "killed":
      assert rc == -9, f"{failpoints}: rc {rc}\n{log[-4000:]}"
      _assert_servers_stop_themselves(workdir)
    else:
      assert rc == 0, log[-6000:]
    for entry in filter(None, failpoints.split(",")):  # each fired, where it was planned
      point, _, action = entry.partition("=")
      assert f"failpoint {point}: {action.split(':')[0]}" in log, entry

  segments = log.split("===== launch")[1:]
  # Each fault hit what it aimed at, and the run went on.
  after_engine_kill = segments[0].split("failpoint train@1")[1]
  assert "HTTP 503" in after_engine_kill and "shut down" in after_engine_kill
  assert "out of rotation until it is back" in after_engine_kill
  # Async hands a version over behind the next training step: by the time the servers refuse
  # version 3, the trainer has moved on and version 4, freshly exported, supersedes it.
  assert "refused policy version 3" in segments[0] and "the next update publishes version 4" in (
      segments[0]) and "failpoint train@5" in segments[0].split("refused policy version 3")[1]
  assert "failed (" in segments[2].split("failpoint handoff@8")[1].split("failpoint handoff@9")[0]
  assert "prompts rejected by a server as invalid (dropped): 0;" in segments[3]  # the summary
  _assert_no_server_left(run_model)

  records = read_metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
  ids = [int(i) for r in records for i in r["sample_ids"]]
  assert len(ids) == len(set(ids)), "a sample was trained twice"
  # No prompt lost: every prompt handed out is trained (all of its samples) or pending.
  trained = {i // GROUP for i in ids}
  assert all(sum(i // GROUP == p for i in ids) == GROUP for p in trained)
  source = _final_source(workdir)
  pending = set(source["reissue"])
  assert not trained & pending
  assert trained | pending == set(range(source["next_index"]))
  last = records[-1]
  assert last["total/rejected_prompts"] == 0 and last["total/filtered_groups"] == 0
  # The bound, from what the servers reported: trained at version step-1, generated from >= that-α.
  for r in records:
    assert len(r["sample_min_token_version"]) == len(r["sample_ids"])
    assert all(0 <= r["step"] - 1 - v <= ALPHA for v in r["sample_min_token_version"]), r["step"]
    assert int(max(r["staleness_hist"], key=int)) <= ALPHA
  assert os.path.exists(os.path.join(workdir, "summary.json"))


def _assert_servers_stop_themselves(workdir: str) -> None:
  """A SIGKILLed controller's servers stop on their own, before anything restarts the run (each
  watches the process that started it: `fleet.exit_with_launcher`). The next controller's reaping
  of `server_pids.json` is the fallback, tested with stub servers (which do not watch) in
  tests/test_faults_run.py."""
  with open(os.path.join(workdir, "server_pids.json")) as f:
    pids = [entry["pid"] for entry in json.load(f)]
  assert pids
  deadline = time.monotonic() + 60
  while any(alive(pid) for pid in pids):
    assert time.monotonic() < deadline, f"servers {pids} outlived their killed controller"
    time.sleep(0.1)


def _assert_no_server_left(model: str) -> None:
  """No server process of this test's model outlives the run (restarts in flight included)."""
  deadline = time.monotonic() + 10
  while True:
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
      except OSError:
        continue
      if f"--model_path={model} " in cmdline + " " and "rollout.server" in cmdline:
        left.append((pid, cmdline[:200]))
    if not left or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  assert not left, left


def test_alpha_zero_async_run_finishes_fresh_and_accounts_for_rejected_prompts(tmp_path,
                                                                                run_model,
                                                                                jax_cache):
  """Regression (e94da35: α = 0 dispatched nothing until a publish that waited for data), with a
  context so short that the servers refuse the longer prompts as invalid (HTTP 400: prompt +
  max_new_tokens over the context, as SGLang answers): each refused prompt is dropped, named in its
  step's record and counted in the final summary, the run does not stall (α = 0 must dispatch a
  replacement), and every other prompt is trained or pending."""
  workdir, log_path = str(tmp_path / "run"), str(tmp_path / "train.log")
  args = _command(workdir, run_model, "--async_ratio=0", "--rollout=stub",
                  "--num_rollout_servers=2")
  args = [a.replace(f"--steps={STEPS}", "--steps=3") for a in args]
  rc = _launch(args, "", log_path, jax_cache, timeout_s=600)
  log = open(log_path, errors="replace").read()
  assert rc == 0, log[-4000:]
  records = read_metrics(workdir)
  assert [r["step"] for r in records] == [1, 2, 3]
  for r in records:
    assert r["staleness_hist"] == {"0": r["num_samples"]}
    assert set(r["sample_min_token_version"]) == {r["step"] - 1}
  rejected = [p for r in records for p in r["rejected_prompt_ids"]]
  assert rejected and len(rejected) == len(set(rejected)) == records[-1]["total/rejected_prompts"]
  assert f"prompts rejected by a server as invalid (dropped): {len(rejected)};" in log
  trained = {int(i) // GROUP for r in records for i in r["sample_ids"]}
  source = _final_source(workdir, 3)
  pending = set(source["reissue"])
  assert not (trained & pending) and not (set(rejected) & (trained | pending))
  assert trained | pending | set(rejected) == set(range(source["next_index"]))
