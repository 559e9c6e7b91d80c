"""`check_backend`: a process meant for an accelerator refuses to run on another backend.

Why: JAX falls back to the CPU when no GPU or TPU is visible (a wrong `CUDA_VISIBLE_DEVICES`, a
missing plugin), so a run meant for a GPU would otherwise train or decode on the CPU quietly, and
its timings would describe the wrong machine. The trainer's learner and the rollout server both
check, each in its own process.
"""

from __future__ import annotations

import jax


def check_backend(platform: str, part: str) -> None:
  """Raises RuntimeError when JAX's backend in this process is not `platform` (`part` names the
  process in the message: "the trainer", "this rollout server")."""
  backend = jax.default_backend()
  if backend != platform:
    raise RuntimeError(f"resources.platform is {platform!r} but JAX's backend in {part} is "
                       f"{backend!r} (devices {jax.devices()}): is the accelerator visible here "
                       f"(CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS) and JAX's plugin for it "
                       f"installed?")
