"""flashrl_jax.trainer: the sharded RL trainer (mesh, rules, train state, optimizer, jitted step).

The same code runs on one CPU device, fake CPU devices, a GPU or a multi-host slice; only the mesh
string changes. The train state is an explicit, already-sharded pytree (`TrainState`) and the NNX
graphdef is kept beside it.
"""

from flashrl_jax.trainer._config import (AdvantageEstimator, BatchConfig, DType, OptimizerConfig,
                                         Schedule, TrainConfig)
from flashrl_jax.trainer._mesh import AXES, MeshConfig, make_mesh
from flashrl_jax.trainer._optimizer import (apply_update, current_learning_rate, decay_mask,
                                            learning_rate_schedule, make_optimizer)
from flashrl_jax.trainer._sharding import (ROLLOUT_RULES, TRAIN_RULES, Rules, logical_to_spec,
                                           named_sharding, replicated, shard_fn, state_shardings)
from flashrl_jax.trainer._state import (TrainState, abstract_train_state, create_train_state,
                                        merge_model, train_state_shardings)

__all__ = [
    "AXES", "AdvantageEstimator", "BatchConfig", "DType", "MeshConfig", "OptimizerConfig",
    "ROLLOUT_RULES", "Rules", "Schedule", "TRAIN_RULES", "TrainConfig", "TrainState",
    "abstract_train_state", "apply_update", "create_train_state", "current_learning_rate",
    "decay_mask", "learning_rate_schedule", "logical_to_spec", "make_mesh", "make_optimizer",
    "merge_model", "named_sharding", "replicated", "shard_fn", "state_shardings",
    "train_state_shardings",
]
