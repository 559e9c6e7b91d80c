"""Code sandbox, with real subprocesses: every limit is exercised by code that tries to break it.

Each behaviour runs under AUTO (network/mount/PID namespaces when the machine allows them) and
under the FALLBACK mode, so both documented paths stay honest. Time limits are ~1 s.
"""

import asyncio
import glob
import os
import socket
import time
import uuid

import pytest

from flashrl_jax.envs import Isolation, Sandbox, SandboxConfig, SandboxStatus

MODES = [Isolation.AUTO, Isolation.FALLBACK]
_SANDBOX_UIDS = range(100_000, 100_000 + 256 * 256)


def _sandbox(isolation, **kw):
  kw.setdefault("timeout_s", 5.0)
  return Sandbox(SandboxConfig(memory_mb=256, isolation=isolation, **kw))


def _run(sandbox, code, tests=None, **kw):
  return asyncio.run(sandbox.run(code, tests, **kw))


@pytest.fixture(scope="module")
def namespaces():
  return _run(_sandbox(Isolation.AUTO), "pass").isolation == "namespaces"


def _sandbox_procs():
  """Live (non-zombie) processes whose real uid is a sandbox uid."""
  count = 0
  for entry in os.scandir("/proc"):
    try:
      with open(os.path.join(entry.path, "status")) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      uid = int(fields["Uid"].split()[0])
      count += uid in _SANDBOX_UIDS and not fields["State"].strip().startswith("Z")
    except (OSError, KeyError, ValueError):
      pass
  return count


@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
def test_correct_solution_passes_and_wrong_fails(iso):
  sb = _sandbox(iso)
  code = "import math\ndef hyp(a, b):\n    return math.sqrt(a * a + b * b)\nprint('hello')"
  ok = _run(sb, code, "assert hyp(3, 4) == 5")
  assert ok.status is SandboxStatus.PASSED and ok.passed, ok.stderr
  assert ok.stdout == "hello\n"
  assert ok.isolation == ("fallback" if iso is Isolation.FALLBACK else ok.isolation)
  bad = _run(sb, code, "assert hyp(3, 4) == 6")
  assert bad.status is SandboxStatus.FAILED and "AssertionError" in bad.stderr


@pytest.mark.parametrize("code", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                  "raise SystemExit"])
def test_early_exit_is_not_a_pass(code):
  result = _run(_sandbox(Isolation.AUTO), code, "assert False")
  assert result.status is SandboxStatus.FAILED


@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
def test_infinite_loop_killed_at_timeout(iso):
  start = time.monotonic()
  result = _run(_sandbox(iso), "while True:\n    pass", timeout_s=1.0)
  assert result.status is SandboxStatus.TIMEOUT
  assert 0.95 <= result.elapsed_s < 3.0 and time.monotonic() - start < 6.0


def test_sleeping_child_process_killed_with_group():
  code = "import subprocess, time\nsubprocess.Popen(['sleep', '30'])\ntime.sleep(30)"
  result = _run(_sandbox(Isolation.FALLBACK), code, timeout_s=1.0)
  assert result.status is SandboxStatus.TIMEOUT
  time.sleep(0.2)
  assert _sandbox_procs() == 0


@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("code", ["x = bytearray(4 * 1024 ** 3)",
                                  "xs = []\nwhile True:\n    xs.append(bytearray(10 ** 7))"])
def test_memory_bomb_stopped(iso, code):
  result = _run(_sandbox(iso), code, timeout_s=5.0)
  assert result.status is SandboxStatus.MEMORY_LIMIT, (result.status, result.stderr[-300:])
  assert result.elapsed_s < 4.0


@pytest.mark.skipif(os.geteuid() != 0, reason="per-run uids (what bounds RLIMIT_NPROC) need root")
@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
def test_fork_bomb_is_contained_and_stopped(iso):
  code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
          "        pass")
  peak = 0

  async def main():
    nonlocal peak
    task = asyncio.ensure_future(_sandbox(iso, max_processes=8).run(code, timeout_s=1.0))
    while not task.done():
      peak = max(peak, await asyncio.to_thread(_sandbox_procs))
      await asyncio.sleep(0.02)
    return await task

  start = time.monotonic()
  result = asyncio.run(main())
  assert result.status in (SandboxStatus.TIMEOUT, SandboxStatus.FAILED)
  assert time.monotonic() - start < 6.0
  assert 2 <= peak <= 8  # it did fork, and RLIMIT_NPROC capped it at max_processes
  time.sleep(0.2)
  assert _sandbox_procs() == 0  # and nothing survived the run


@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
def test_network_call_fails(iso):
  server = socket.create_server(("127.0.0.1", 0))
  server.settimeout(0.2)
  port = server.getsockname()[1]
  code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
          "s.sendall(b'leak')")
  try:
    result = _run(_sandbox(iso), code)
    assert result.status is SandboxStatus.FAILED
    assert any(e in result.stderr for e in ("PermissionError", "OSError", "ConnectionRefused"))
    with pytest.raises(socket.timeout):
      server.accept()  # the connection never reached the host
  finally:
    server.close()


@pytest.mark.parametrize("iso", MODES, ids=lambda m: m.value)
def test_files_outside_scratch_do_not_persist(iso, namespaces):
  tag = uuid.uuid4().hex
  outside_abs = f"/tmp/flashrl_escape_{tag}"
  check_abs = iso is Isolation.AUTO and namespaces  # the fallback documents it cannot stop this
  code = (f"open('inside_{tag}.txt', 'w').write('x')\n"
          f"try:\n    open('../escape_{tag}', 'w').write('x')\nexcept OSError:\n    pass\n"
          + (f"open('{outside_abs}', 'w').write('x')\n" if check_abs else "")
          + "import os\nprint(os.getcwd())")
  before = set(glob.glob("/tmp/flashrl_sandbox_*"))
  result = _run(_sandbox(iso), code)
  assert result.passed, result.stderr
  assert not os.path.exists(outside_abs)
  assert not glob.glob(f"/tmp/**/*{tag}*", recursive=False)
  assert not glob.glob(f"/tmp/flashrl_sandbox_*/**/*{tag}*", recursive=True)
  assert set(glob.glob("/tmp/flashrl_sandbox_*")) <= before  # scratch dirs removed


def test_environment_is_scrubbed(monkeypatch):
  monkeypatch.setenv("FLASHRL_SECRET_TOKEN", "hunter2")
  monkeypatch.setenv("PYTHONPATH", "/evil")
  code = "import os, sys\nprint(sorted(os.environ))\nprint(os.environ['PATH'])\nprint(sys.path)"
  result = _run(_sandbox(Isolation.AUTO), code)
  assert result.passed, result.stderr
  keys, path, sys_path = result.stdout.splitlines()
  assert set(eval(keys)) <= {"PATH", "LANG", "LC_ALL", "TMPDIR", "HOME"}
  assert "hunter2" not in result.stdout and "/evil" not in sys_path
  assert path == "/usr/local/bin:/usr/bin:/bin"


def test_output_is_capped_and_still_graded():
  code = "import sys\nsys.stdout.write('x' * 2_000_000)\nsys.stderr.write('y' * 2_000_000)"
  result = _run(_sandbox(Isolation.AUTO, max_output_bytes=1000), code, "assert True")
  assert result.passed
  assert len(result.stdout) <= 1000 and len(result.stderr) <= 1000


def test_large_file_write_is_stopped():
  code = "open('big', 'wb').write(b'z' * (8 << 20))"
  result = _run(_sandbox(Isolation.AUTO, max_file_bytes=1 << 20), code)
  assert not result.passed


def test_concurrent_runs_keep_the_loop_responsive():
  """24 runs, each sleeping 0.5 s, overlap; the event loop keeps ticking meanwhile."""
  sb = _sandbox(Isolation.AUTO, max_concurrency=24)
  gaps = []

  async def ticker(stop):
    last = time.monotonic()
    while not stop.is_set():
      await asyncio.sleep(0.01)
      now = time.monotonic()
      gaps.append(now - last)
      last = now

  async def main():
    stop = asyncio.Event()
    tick = asyncio.ensure_future(ticker(stop))
    start = time.monotonic()
    results = await asyncio.gather(*[
        sb.run(f"import time\ntime.sleep(0.5)\nx = {i}", f"assert x == {i}") for i in range(24)])
    elapsed = time.monotonic() - start
    stop.set()
    await tick
    return results, elapsed

  results, elapsed = asyncio.run(main())
  assert all(r.passed for r in results), [r.stderr for r in results if not r.passed][:1]
  assert elapsed < 24 * 0.5 / 2  # far from serial
  assert max(gaps) < 0.5, max(gaps)  # the loop never stalled for long


def test_max_concurrency_bounds_runs_in_flight():
  sb = _sandbox(Isolation.AUTO, max_concurrency=2)

  async def main():
    start = time.monotonic()
    results = await asyncio.gather(*[sb.run("import time\ntime.sleep(0.3)") for _ in range(4)])
    return results, time.monotonic() - start

  results, elapsed = asyncio.run(main())
  assert all(r.passed for r in results)
  assert elapsed >= 0.6  # two waves of two
  assert all(r.elapsed_s < 0.3 + 1.0 for r in results)  # queueing time is not charged to a run


def test_namespaces_required_but_unavailable_is_setup_error(namespaces):
  if namespaces:
    assert _run(_sandbox(Isolation.NAMESPACES), "pass").passed
  else:
    assert _run(_sandbox(Isolation.NAMESPACES), "pass").status is SandboxStatus.SETUP_ERROR
