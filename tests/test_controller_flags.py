"""The absl front end: a bad flag or a contradictory combination fails before anything starts (no
server process, no run directory), with a message that names the problem."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flags,message", [
    (["--mode=sync", "--async_ratio=2"], "contradicts"),
    (["--rollout=sglang"], "needs --sglang_urls"),
    (["--sglang_urls=http://127.0.0.1:1"], "only used with --rollout=sglang"),
    (["--loss=reinforce"], "reinforce"),
    (["--async_ratio=-1"], "async_ratio must be >= 0"),
    (["--no_such_flag=1"], "no_such_flag"),
    (["--config=/does/not/exist.py"], "does not exist"),
    (["--model_path=/does/not/exist"], "not an HF directory"),
    (["--set=rollout.num_server=2"], "did you mean 'num_servers'"),
    (["--set=steps"], "path.to.field=value"),
    (["--env_fail_slow_prob=0.1"], "task.env is None"),
    (["--steps=3", "--set=steps=4"], "given twice"),
])
def test_bad_flags_fail_before_anything_starts(tmp_path, flags, message):
  workdir = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  assert message in proc.stderr + proc.stdout
  assert not workdir.exists(), "nothing may start for a bad command line"


def test_every_shipped_config_parses():
  sys.path.insert(0, ROOT)
  from experiments._cli import load_config_file
  configs = [f for f in os.listdir(os.path.join(ROOT, "experiments", "configs"))
             if f.endswith(".py") and not f.startswith("_")]
  assert "demo.py" in configs
  for name in configs:
    config = load_config_file(os.path.join(ROOT, "experiments", "configs", name))
    assert config.steps >= 1
