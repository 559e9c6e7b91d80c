"""The train state: an explicit pytree that crosses `jit`, is donated each step and is checkpointed.

Why a plain pytree (and the NNX graphdef kept outside): the jitted step, orbax and the sharding
machinery all see the same leaves with the same structure. The state is created already sharded, by
a jitted initialiser whose `out_shardings` come from the model's logical names and a rules table, so
no full copy of the weights ever sits on one device.

Fields (all arrays; the structure is stable, checkpoints depend on it):
  params: `nnx.State` of the decoder's `nnx.Param`s (each keeps its logical-axis metadata).
  opt_state: the optax state of `make_optimizer(config.optimizer)` over `params`.
  step: int32, RL steps (`train_step` calls) applied.
  policy_version: int32, the version of the policy these params are; +1 per RL step.
  rng: uint32[2], a raw PRNG key (raw so that orbax stores it as a plain array); the step draws
    the minibatch order from it and stores the next key.
  skipped_updates: int32, optimizer updates skipped for non-finite gradients, ever.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from flashrl_jax.model import Decoder, ModelConfig, load_hf_state
from flashrl_jax.trainer._config import TrainConfig
from flashrl_jax.trainer._optimizer import make_optimizer
from flashrl_jax.trainer._sharding import TRAIN_RULES, Rules, shard_fn, state_shardings


@flax.struct.dataclass
class TrainState:
  params: nnx.State
  opt_state: Any
  step: jax.Array
  policy_version: jax.Array
  rng: jax.Array
  skipped_updates: jax.Array


def _model_fn(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh, rules: Rules,
              seed: int):
  shard = shard_fn(rules, mesh)
  return lambda: Decoder(model_config, rngs=nnx.Rngs(seed),
                         param_dtype=train_config.param_dtype.jnp,
                         dtype=train_config.compute_dtype.jnp, shard=shard)


def _split_params(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError(f"The decoder holds non-Param state the trainer would drop: {rest}.")
  return graphdef, params


def _state_from_params(params: nnx.State, train_config: TrainConfig, seed: int,
                       policy_version: int) -> TrainState:
  return TrainState(
      params=params,
      opt_state=make_optimizer(train_config.optimizer).init(params),
      step=jnp.zeros((), jnp.int32),
      policy_version=jnp.asarray(policy_version, jnp.int32),
      rng=jax.random.PRNGKey(seed),
      skipped_updates=jnp.zeros((), jnp.int32),
  )


def abstract_train_state(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh,
                         rules: Rules = TRAIN_RULES) -> tuple[nnx.GraphDef, TrainState]:
  """(graphdef, state of `jax.ShapeDtypeStruct`s carrying their target `NamedSharding`s).

  The abstract state is what orbax restores into (onto any mesh) and what `jit` uses as shardings.
  """
  graphdef, abstract = _abstract(model_config, train_config, mesh, rules)
  shardings = state_shardings(abstract, rules, mesh)
  with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return graphdef, jax.tree.map(with_sharding, abstract, shardings)


def train_state_shardings(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh,
                          rules: Rules = TRAIN_RULES) -> TrainState:
  """A TrainState-shaped pytree of `NamedSharding`s (jit in/out shardings)."""
  _, abstract = _abstract(model_config, train_config, mesh, rules)
  return state_shardings(abstract, rules, mesh)


def _abstract(model_config, train_config, mesh, rules):
  model_fn = _model_fn(model_config, train_config, mesh, rules, 0)
  graphdef, _ = _split_params(nnx.eval_shape(model_fn))

  def init():
    return _state_from_params(_split_params(model_fn())[1], train_config, 0, 0)

  return graphdef, jax.eval_shape(init)


def create_train_state(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh,
                       rules: Rules = TRAIN_RULES, *, seed: int = 0,
                       init_params: str | nnx.State | None = None,
                       policy_version: int = 0) -> tuple[nnx.GraphDef, TrainState]:
  """A fresh train state, sharded over `mesh` under `rules`; returns (graphdef, state).

  `init_params`: None (random init from `seed`), an HF checkpoint directory (each tensor is placed
  on its shards as it is read), or an `nnx.State` of Params (e.g. another model's weights).
  """
  model_fn = _model_fn(model_config, train_config, mesh, rules, seed)
  graphdef, abstract_params = _split_params(nnx.eval_shape(model_fn))
  shardings = train_state_shardings(model_config, train_config, mesh, rules)
  if init_params is None:
    init = lambda: _state_from_params(_split_params(model_fn())[1], train_config, seed,
                                      policy_version)
    return graphdef, jax.jit(init, out_shardings=shardings)()
  if isinstance(init_params, str):
    params = load_hf_state(init_params, model_config, abstract_params, shardings.params)
  else:
    params = jax.device_put(init_params, shardings.params)
  from_params = lambda p: _state_from_params(p, train_config, seed, policy_version)
  return graphdef, jax.jit(from_params, out_shardings=shardings)(params)


def merge_model(graphdef: nnx.GraphDef, params: nnx.State) -> Decoder:
  """The decoder with `params` (sharded arrays stay where they are)."""
  return nnx.merge(graphdef, params)
