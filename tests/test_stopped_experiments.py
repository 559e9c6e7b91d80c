"""An experiment stopped with `kill` (SIGTERM) leaves nothing of its own running.

Tried, each in an experiment process of its own, SIGTERMed while it waits:
- servers it started with `LocalServers` (as the machine probe of `sim_vs_measured` does): stopped;
- a child it waits on the three ways the launchers wait (`_children.run` as the benchmarks run
  `experiments.train` and the calibrations, `_children.stopped_on_exit` as `sim_vs_measured` runs
  one, `_runs._watch` as the sweeps do): the child is sent SIGTERM, not SIGKILL (so a run can stop
  its own servers), even when its pipe is full of the log lines it writes on its way out.

And one SIGKILLed (nothing of its own can run then): the real JAX servers it started with
`LocalServers` stop themselves, serving or still starting, and say why in their logs; so do the
protocol stubs (their own copy of the watcher: they import nothing from the package).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child that, on SIGTERM, writes 1 MB to stderr (more than a pipe holds: a parent that does not
# drain it would wait on it forever), then records that it was stopped by SIGTERM, and exits.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    marker = sys.argv[1]
    def on_term(signum, frame):
      sys.stderr.write("x" * 1_000_000)
      sys.stderr.flush()
      with open(marker, "w") as f:
        f.write("stopped by SIGTERM")
      sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    with open(marker + ".pid", "w") as f:
      f.write(str(os.getpid()))
    time.sleep(600)
""")

WAYS_TO_WAIT = {
    "children_run": "_children.run([sys.executable, '-c', CHILD, marker])",
    "stopped_on_exit": textwrap.dedent("""
        with _children.stopped_on_exit(subprocess.Popen(
            [sys.executable, '-c', CHILD, marker], stderr=subprocess.PIPE)) as child:
          child.wait()"""),
    "runs_watch": textwrap.dedent("""
        child = subprocess.Popen([sys.executable, '-c', CHILD, marker], stderr=subprocess.PIPE)
        _runs._watch(child, workdir, timeout_s=600, stall_s=600, log=print)"""),
}


def _experiment(body: str, *args: str) -> subprocess.Popen:
  """An experiment process: SIGTERM unwinds it (`unwind_on_sigterm`, as every launcher's `main`
  sets), then it runs `body`."""
  code = "\n".join([
      "import subprocess, sys, time",
      "from experiments import _children, _runs",
      "_children.unwind_on_sigterm()",
      f"CHILD = {CHILD!r}",
      "marker, workdir = sys.argv[1], sys.argv[2]",
      body])
  return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                          text=True)


def _wait_for(path: str, timeout_s: float = 60.0) -> str:
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path) or not open(path).read():
    assert time.monotonic() < deadline, f"{path} never written"
    time.sleep(0.05)
  return open(path).read()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a zombie has ended, its parent just has not reaped it
    return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("way", WAYS_TO_WAIT)
def test_a_stopped_experiment_stops_its_child_with_sigterm(tmp_path, way):
  marker = str(tmp_path / "marker")
  experiment = _experiment(WAYS_TO_WAIT[way], marker, str(tmp_path))
  child_pid = int(_wait_for(marker + ".pid"))
  experiment.send_signal(signal.SIGTERM)
  assert experiment.wait(60) == 128 + signal.SIGTERM
  assert _wait_for(marker, 5.0) == "stopped by SIGTERM"
  assert not _alive(child_pid)


def test_a_stopped_experiment_stops_the_servers_it_started(tmp_path):
  body = textwrap.dedent("""
      from tests.rollout_stubs import start_stubs
      with start_stubs(2, "stub", log_dir=workdir) as servers:
        print(servers.pid(0), servers.pid(1), flush=True)
        time.sleep(600)""")
  experiment = _experiment(body, str(tmp_path / "unused"), str(tmp_path))
  pids = [int(p) for p in experiment.stdout.readline().split()]
  assert len(pids) == 2 and all(_alive(p) for p in pids)
  experiment.send_signal(signal.SIGTERM)
  assert experiment.wait(60) == 128 + signal.SIGTERM
  assert not any(_alive(p) for p in pids)


# The experiment prints its servers' pids (and URLs) once they serve, or as each is spawned (they
# are still importing JAX when it is killed: they find their launcher gone when they start).
SERVERS_OF = {
    "serving": textwrap.dedent("""
        from tests.api_servers import start_servers, write_hf_checkpoint
        write_hf_checkpoint(workdir + "/model", seed=0)
        servers = start_servers(workdir + "/model", 2, log_dir=workdir)
        print(*(servers.pid(i) for i in range(2)), *servers.urls, flush=True)"""),
    "starting": textwrap.dedent("""
        def spawned(servers):
          if all(servers.pid(i) for i in range(2)):
            print(*(servers.pid(i) for i in range(2)), flush=True)
        from tests.api_servers import write_hf_checkpoint
        write_hf_checkpoint(workdir + "/model", seed=0)
        LocalServers.start(workdir + "/model", 2, extra_args=["--nowarmup"], log_dir=workdir,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), on_spawn=spawned)"""),
    "stubs": textwrap.dedent("""
        from tests.rollout_stubs import start_stubs
        servers = start_stubs(2, "stub", log_dir=workdir)
        print(*(servers.pid(i) for i in range(2)), *servers.urls, flush=True)"""),
}


@pytest.mark.parametrize("when", SERVERS_OF)
def test_servers_of_a_sigkilled_experiment_stop_themselves(tmp_path, when):
  body = "\n".join([
      "import os",
      "from flashrl_jax.fleet import LocalServers",
      SERVERS_OF[when],
      "time.sleep(600)"])
  experiment = _experiment(body, str(tmp_path / "unused"), str(tmp_path))
  pids = []
  try:
    line = experiment.stdout.readline().split()
    pids, urls = [int(p) for p in line[:2]], line[2:]
    assert len(pids) == 2, line
    for url in urls:  # serving while their launcher lives
      with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        assert resp.status == 200
    experiment.kill()
    experiment.wait(30)
    deadline = time.monotonic() + 120
    while any(_alive(p) for p in pids):
      assert time.monotonic() < deadline, "a server outlived its SIGKILLed launcher"
      time.sleep(0.1)
  finally:
    experiment.kill()
    experiment.wait(30)
    for pid in pids:  # only if the test failed
      if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
  logs = [open(tmp_path / name).read() for name in os.listdir(tmp_path) if name.endswith(".log")]
  assert len(logs) == 2 and all("is gone: stopping this" in text for text in logs), logs
