"""The sandbox with a non-root controller: user namespaces where the kernel allows them, a refusal
(and a loud warning when opted in) where it does not.

When the tests run as root (CI and the dev sessions do), `sandbox_unprivileged.py drop` runs the
controller side as uid 54321 for real (setuid, no capabilities); a machine without user namespaces
is reproduced by a user namespace whose `user.max_user_namespaces` is 0. When the tests do not run
as root they run the scenarios as themselves, and skip only what needs root to set up.
"""

import json
import os
import subprocess
import sys

import pytest

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_unprivileged.py")
UID = 54321
ROOT = os.geteuid() == 0


def _kernel_knobs() -> str:
  knobs = []
  for path in ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces",
               "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"):
    try:
      with open(path) as f:
        knobs.append(f"{os.path.basename(path)}={f.read().strip()}")
    except OSError:
      pass
  return ", ".join(knobs) or "no user-namespace sysctls"


def _userns_allowed() -> tuple[bool, str]:
  """Can an unprivileged process create a user namespace here? Asked of the kernel itself, as U
  (the sysctls alone do not tell: AppArmor or seccomp may refuse too)."""
  prefix = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"] if ROOT else []
  try:
    probe = subprocess.run(prefix + ["unshare", "--user", "true"], capture_output=True, text=True,
                           timeout=30)
  except FileNotFoundError as error:
    return False, f"util-linux missing: {error}"
  return probe.returncode == 0, f"{probe.stderr.strip()}; {_kernel_knobs()}"


def _scenario(name: str, *drop_flags: str) -> dict:
  cmd = ([sys.executable, HELPER, "drop", f"--uid={UID}", *drop_flags, "--", name] if ROOT
         else [sys.executable, HELPER, name])
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=os.path.dirname(HELPER) + "/.."))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_user_namespaces_isolate_code_from_a_non_root_controller():
  allowed, why = _userns_allowed()
  if not allowed:
    pytest.skip(f"this kernel forbids unprivileged user namespaces ({why}); "
                "the refusal path is tested instead")
  out = _scenario("isolated")
  assert out["controller_uid"] != 0
  assert (out["mode"], out["status"], out["warning"]) == ("user_namespaces", "completed", ""), out
  attack = out["attack"]
  assert attack["uid"] == 65534 and attack["uid"] != out["controller_uid"]  # an unmapped user
  # Only itself and the sandbox's trusted init: the trainer cannot even be named.
  assert attack["visible_pids"] in ([], [1, 2])
  for sig in ("SIGKILL", "SIGINT", "SIGTERM"):  # accepted and dropped: the run still completed
    assert attack[f"kill_init_{sig}"][0] == "ok"
  if attack["visible_pids"]:
    assert attack["init_root"][0] == attack["init_memory"][0] == "PermissionError"
  for name in ("kill_victim", "kill_controller", "kill_all"):
    assert attack[name][0] == "ProcessLookupError", (name, attack[name])
  for name in ("read_file", "write_file", "list_run_dir", "read_controller_memory"):
    assert attack[name][0] == "FileNotFoundError", (name, attack[name])
  assert attack["connect"][0] == "OSError"  # no interface in its network namespace
  assert attack["new_user_namespace"] == -1  # chrooted: no namespaces of its own
  assert out["damage"] == {"victim_alive": True, "file": "original", "usr1": 0,
                           "connected": False}
  peak, status, left = out["fork_bomb"]
  assert 2 <= peak <= 8 and status == "timeout" and left == 0  # RLIMIT_NPROC per user namespace
  rewards = out["rewards"]
  assert rewards.pop("honest") == 1.0
  assert rewards and all(r == 0.0 for r in rewards.values()), rewards


def test_without_user_namespaces_untrusted_code_is_refused_unless_opted_in():
  allowed, _ = _userns_allowed()
  if allowed and not ROOT:
    pytest.skip("user namespaces are allowed here and reproducing a kernel without them needs root")
  out = _scenario("unisolated", *(["--no-userns"] if allowed else []))
  assert out["controller_uid"] != 0
  assert out["check"].startswith("SandboxUnavailable: UNISOLATED")
  assert out["refused"] == {"status": "refused", "isolation": None, "ran": False}
  assert out["factory"] == "SandboxUnavailable"  # a code-reward run fails at start
  assert out["required_status"] == "setup_error"
  # Opted in: it runs, says so in every result and once in the log, and the documented gaps are
  # real (this is why it is refused by default).
  assert (out["mode"], out["status"]) == ("none", "completed")
  assert out["warning"].startswith("UNISOLATED") and out["warnings_logged"] == 1
  attack = out["attack"]
  assert attack["uid"] == out["controller_uid"]
  assert attack["kill_victim"][0] == attack["write_file"][0] == "ok"
  assert attack["read_controller_memory"] == ["ok", 16]
  assert out["damage"]["victim_alive"] is False and out["damage"]["file"] == "pwned"
  assert out["damage"]["usr1"] == 1
  assert attack["connect"][0] == "PermissionError" and not out["damage"]["connected"]
