"""A tiny RL run with the real `Trainer` that checkpoints every step, for the kill-and-resume test.

`python tests/ckpt_train.py DIR TOTAL OUT [REF]` resumes from the latest checkpoint in DIR (if
any), runs RL steps up to TOTAL, printing `SAVED <step>` once each step is committed, and writes the
final train state to OUT as safetensors. With REF it first runs TOTAL steps from scratch without
checkpoints and writes that uninterrupted reference to REF (same process, same compiled step).
The data of step s is a pure function of s (its cursor lives in the checkpoint's extra JSON).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from flashrl_jax.testing import tiny_config  # noqa: E402
from flashrl_jax.trainer import (BatchConfig, OptimizerConfig, TrainConfig, Trainer,  # noqa: E402
                                 abstract_train_state, make_mesh, random_trajectories, to_host)
from flashrl_jax.trainer._checkpoint import CheckpointConfig, Checkpointer  # noqa: E402

MODEL_CONFIG = tiny_config(num_layers=1)
TRAIN_CONFIG = TrainConfig(
    batch=BatchConfig(row_length=32, rows=2, sequences_per_row=2, max_response_length=16),
    optimizer=OptimizerConfig(learning_rate=1e-2, weight_decay=0.1))


def trajectories(step: int):
  """The RL batch consumed by step `step` (0-based)."""
  return random_trajectories(np.random.default_rng(step), 4, vocab_size=MODEL_CONFIG.vocab_size,
                             prompt_lengths=(2, 8), response_lengths=(2, 12))


def flat_arrays(state) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(to_host(state))[0]}


def main(directory: str, total: int, out: str, reference: str | None) -> None:
  from safetensors.numpy import save_file

  mesh = make_mesh("fsdp:1")
  trainer = Trainer(MODEL_CONFIG, TRAIN_CONFIG, mesh, seed=3)
  if reference:
    initial = to_host(trainer.state)  # The step donates the state; keep a copy to start again.
    while trainer.step < total:
      trainer.update(trajectories(trainer.step))
    save_file(flat_arrays(trainer.state), reference)
    trainer.set_state(initial)

  ckpt = Checkpointer(CheckpointConfig(directory, max_to_keep=2, async_save=True))
  _, abstract = abstract_train_state(MODEL_CONFIG, TRAIN_CONFIG, mesh)
  resumed = ckpt.restore_latest(abstract)
  if resumed is not None:
    state, extra = resumed
    trainer.set_state(state)
    assert extra == {"cursor": trainer.step, "note": "data"}, extra
    print(f"RESUMED {trainer.step}", flush=True)
  while trainer.step < total:
    trainer.update(trajectories(trainer.step))
    ckpt.save(trainer.step, trainer.state, {"cursor": trainer.step, "note": "data"})
    ckpt.wait()
    print(f"SAVED {trainer.step}", flush=True)
  ckpt.close()
  save_file(flat_arrays(trainer.state), out)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
