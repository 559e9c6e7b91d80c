"""A tiny deterministic training run that checkpoints every step, for the kill-and-resume test.

`python tests/ckpt_train.py DIR TOTAL OUT [REF]` resumes from the latest checkpoint in DIR (if
any), trains to TOTAL steps, printing `SAVED <step>` once each step is committed, and writes the
final train state to OUT as safetensors. With REF it first trains TOTAL steps from scratch without
checkpoints and writes that uninterrupted reference to REF (one process, one compilation).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from flashrl_jax.testing import tiny_config, tiny_model  # noqa: E402

_OPTIMIZER = optax.adamw(1e-2, weight_decay=0.01)


def init_state(seed: int = 0):
  """(graphdef, train state); the train state is a plain dict pytree, as the Checkpointer expects."""
  # Params from NumPy and the rest in one jit: eager initialisers would compile once per shape.
  model = nnx.eval_shape(lambda: tiny_model(tiny_config(num_layers=1)))
  graphdef, abstract = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), abstract)

  @jax.jit
  def init(params):
    return {"params": params, "opt_state": _OPTIMIZER.init(params), "step": jnp.int32(0),
            "version": jnp.int32(0), "rng": jax.random.key(seed)}
  return graphdef, init(params)


def make_train_step(graphdef):
  @jax.jit
  def train_step(state):
    rng, sub = jax.random.split(state["rng"])
    ids = jax.random.randint(sub, (2, 9), 0, 96)  # The batch depends on the RNG, so it must resume.

    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(ids[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    grads = jax.grad(loss_fn)(state["params"])
    updates, opt_state = _OPTIMIZER.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1, "version": state["version"] + 1, "rng": rng}
  return train_step


def flat_arrays(state) -> dict[str, np.ndarray]:
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    out[jax.tree_util.keystr(path)] = np.asarray(leaf)
  return out


def main(directory: str, total: int, out: str, reference: str | None) -> None:
  from safetensors.numpy import save_file

  from flashrl_jax.trainer._checkpoint import CheckpointConfig, Checkpointer

  graphdef, state = init_state()
  train_step = make_train_step(graphdef)
  if reference:
    ref_state = state
    while int(ref_state["step"]) < total:
      ref_state = train_step(ref_state)
    save_file(flat_arrays(ref_state), reference)
  ckpt = Checkpointer(CheckpointConfig(directory, max_to_keep=2, async_save=True))
  resumed = ckpt.restore_latest(jax.eval_shape(lambda: state))
  if resumed is not None:
    state, extra = resumed
    assert extra == {"cursor": int(state["step"]), "note": "data"}, extra
    print(f"RESUMED {int(state['step'])}", flush=True)
  while int(state["step"]) < total:
    state = train_step(state)
    step = int(state["step"])
    ckpt.save(step, state, {"cursor": step, "note": "data"})
    ckpt.wait()
    print(f"SAVED {step}", flush=True)
  ckpt.close()
  save_file(flat_arrays(state), out)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
