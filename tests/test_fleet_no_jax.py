"""The fleet package is the controller host's view of the rollout servers: it must import, and build
its client, without JAX (a CPU-only launcher or router host has none)."""

import subprocess
import sys

_PROBE = """
import sys
import flashrl_jax.fleet as fleet
client = fleet.RolloutClient(["http://127.0.0.1:1"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax"))
print(",".join(heavy))
"""


def test_fleet_imports_without_jax():
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                       check=True)
  assert out.stdout.strip() == "", f"fleet pulled in: {out.stdout.strip()}"


def test_fleet_imports_with_jax_blocked():
  # Stronger than looking at sys.modules: make any JAX import fail outright.
  probe = "import sys\nsys.modules['jax'] = None\nsys.modules['flax'] = None\n" + _PROBE
  subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                 check=True)
