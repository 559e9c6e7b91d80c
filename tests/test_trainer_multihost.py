"""Two `jax.distributed` processes (loopback coordinator, CPU/gloo collectives) run one RL step over
a 4-device global mesh (2 fake devices each) and match the same step on one device."""

import os
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.test_trainer_sharded import compare, load  # noqa: E402
from tests.trainer_worker import run_step  # noqa: E402

SPEC = "fsdp:2,tensor:2"


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_single_process(tmp_path):
  port = free_port()
  env = {**os.environ, "PYTHONPATH": ROOT}
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "tests", "trainer_worker.py"), "--devices", "2",
       "--meshes", SPEC, "--out", str(tmp_path), "--coordinator", f"127.0.0.1:{port}",
       "--num-processes", "2", "--process-id", str(i)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outputs = []
  for proc in procs:
    try:
      outputs.append(proc.communicate(timeout=900)[0])
    finally:
      proc.kill()
  for proc, output in zip(procs, outputs):
    assert proc.returncode == 0, output[-4000:]

  from flashrl_jax.trainer import make_mesh
  metrics, params = run_step(make_mesh("fsdp:1"))
  reference = {**{f"metric/{k}": np.asarray(v) for k, v in metrics.items()},
               **{f"param/{k}": np.asarray(v) for k, v in params.items()}}
  compare(load(tmp_path / f"{SPEC}.npz"), reference, "2 processes")
