"""The launch scripts: start_local_servers.sh starts working servers and stops them on SIGTERM;
start_sglang_servers.sh prints the documented SGLang command lines (SGLang itself is not needed)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import urllib.error
import urllib.request

from flashrl_jax.fleet import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _status(url: str) -> int | None:
  try:
    with urllib.request.urlopen(url, timeout=2) as r:
      return r.status
  except (urllib.error.URLError, OSError):
    return None


def test_start_local_servers_script(tmp_path):
  port = free_port()
  env = dict(os.environ, MODULE="flashrl_jax.testing._stub", LOG_DIR=str(tmp_path),
             SERVER_ARGS="--vocab_size=50 --weight_version=w7")
  proc = subprocess.Popen(["bash", str(ROOT / "launch/start_local_servers.sh"), "1", "stub",
                           str(port)], env=env, stdout=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    url, log = proc.stdout.readline().split()
    assert url == f"http://127.0.0.1:{port}" and log.startswith(str(tmp_path))
    assert _status(url + "/health") == 200
    with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
      assert b'"w7"' in r.read()  # SERVER_ARGS reached the server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert _status(url + "/health") is None  # the launcher stopped its server
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)


def test_start_sglang_servers_dry_run():
  env = dict(os.environ, DRY_RUN="1", GPUS_PER_SERVER="2", SGLANG_ARGS="--dtype bfloat16",
             PYTHON="py")
  out = subprocess.run(["bash", str(ROOT / "launch/start_sglang_servers.sh"), "2", "/ckpt/v3",
                        "31000"], env=env, capture_output=True, text=True, check=True).stdout
  assert out.splitlines() == [
      f"CUDA_VISIBLE_DEVICES={gpus} py -m sglang.launch_server --model-path /ckpt/v3 "
      f"--port {port} --host 127.0.0.1 --tp-size 2 --dtype bfloat16"
      for gpus, port in [("0,1", 31000), ("2,3", 31001)]]
