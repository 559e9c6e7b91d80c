"""Subprocess worker for the trainer's multi-device tests: one RL step on several meshes.

Why a separate process: fake CPU devices (`--xla_force_host_platform_device_count`) and
`jax.distributed.initialize` must be configured before JAX is imported, which a pytest process has
already done. `run_step` is also imported by the tests to compute the single-device reference.

  python tests/trainer_worker.py --devices 8 --meshes "fsdp:1|fsdp:8" --out DIR
  python tests/trainer_worker.py --devices 2 --meshes fsdp:2,tensor:2 --out DIR \
      --coordinator 127.0.0.1:PORT --num-processes 2 --process-id 0
Writes `DIR/<mesh>.npz` (process 0 only): the step's metrics (`metric/<name>`) and every parameter
after the step (`param/<path>`).
"""

from __future__ import annotations

import argparse
import os
import sys


def step_config():
  from flashrl_jax.losses import LossConfig
  from flashrl_jax.trainer import BatchConfig, OptimizerConfig, TrainConfig
  # eps=1e-3 keeps Adam's first step linear in tiny gradients, so reduction-order noise in a
  # near-zero gradient cannot flip the sign of an update (which lr * sign(g) would).
  return TrainConfig(
      loss=LossConfig(name="decoupled_ppo", kl_coef=0.05),
      optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-3, weight_decay=0.1, schedule="cosine",
                                total_steps=10),
      batch=BatchConfig(row_length=32, rows=8, sequences_per_row=2, max_response_length=16),
      num_minibatches=2, temperature=0.7)


def step_inputs():
  import numpy as np
  from flashrl_jax.trainer import pack, random_trajectories
  rng = np.random.default_rng(1234)
  trajectories = random_trajectories(rng, 12, vocab_size=96, prompt_lengths=(2, 8),
                                     response_lengths=(2, 16), group_size=4, version=0)
  return pack(trajectories, step_config().batch, 2, min_micro_batches=2)


def run_step(mesh):
  """One RL step from a fixed seed and batch on `mesh`; returns host (metrics, flat params)."""
  from flax import nnx
  from flashrl_jax.testing import tiny_config
  from flashrl_jax.trainer import (TRAIN_RULES, batch_shardings, create_train_state,
                                   make_train_step, to_host, train_state_shardings, tree_to_global)
  config, model_config = step_config(), tiny_config()
  graphdef, state = create_train_state(model_config, config, mesh, seed=7)
  shardings = train_state_shardings(model_config, config, mesh)
  batch_sharding = batch_shardings(mesh, TRAIN_RULES, config.batch)
  step = make_train_step(graphdef, config, mesh, shardings, batch_sharding, shardings.params)
  ref_params = jax_copy(state.params)
  state, metrics = step(state, tree_to_global(step_inputs(), batch_sharding), ref_params)
  flat = {"/".join(map(str, path)): variable.get_value()
          for path, variable in nnx.to_flat_state(to_host(state.params))}
  return to_host(metrics), flat


def jax_copy(tree):
  import jax
  return jax.tree.map(lambda x: x.copy(), tree)


def save(path, metrics, params):
  import numpy as np
  np.savez(path, **{f"metric/{k}": v for k, v in metrics.items()},
           **{f"param/{k}": np.asarray(v) for k, v in params.items()})


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("--devices", type=int, required=True)
  parser.add_argument("--meshes", required=True, help="'|'-separated mesh specs")
  parser.add_argument("--out", required=True)
  parser.add_argument("--coordinator")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  from flashrl_jax.trainer import MeshConfig, initialize_distributed, make_mesh
  initialize_distributed(coordinator=args.coordinator, num_processes=args.num_processes,
                         process_id=args.process_id)
  for spec in args.meshes.split("|"):
    config = MeshConfig.parse(spec)
    mesh = make_mesh(config, jax.devices()[:config.num_devices])
    metrics, params = run_step(mesh)
    if jax.process_index() == 0:
      save(os.path.join(args.out, f"{spec}.npz"), metrics, params)
    print(f"done {spec}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
