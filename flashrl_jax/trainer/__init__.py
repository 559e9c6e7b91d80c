"""flashrl_jax.trainer: the sharded RL trainer (mesh, rules, train state, optimizer, jitted step).

The same code runs on one CPU device, fake CPU devices, a GPU or a multi-host slice; only the mesh
string changes. The train state is an explicit, already-sharded pytree (`TrainState`) and the NNX
graphdef is kept beside it. The controller holds a `Trainer` and calls `update(trajectories)`;
`Checkpointer` saves/restores the state, `export_version` publishes a policy version as an HF dir.
"""

from flashrl_jax.trainer._batch import Batch, Trajectory, batch_stats, pack, random_trajectories
from flashrl_jax.trainer._checkpoint import (CheckpointConfig, Checkpointer,
                                             CorruptCheckpointError)
from flashrl_jax.trainer._config import (AdvantageEstimator, BatchConfig, DType, OptimizerConfig,
                                         Schedule, TrainConfig)
from flashrl_jax.trainer._distributed import (DistributedConfig, host_to_global,
                                              initialize_distributed, to_host, tree_to_global)
from flashrl_jax.trainer._export import (CorruptVersionError, VersionStore, export_version,
                                         verify_version, version_dirname)
from flashrl_jax.trainer._mesh import AXES, MeshConfig, make_mesh
from flashrl_jax.trainer._optimizer import (apply_update, current_learning_rate, decay_mask,
                                            learning_rate_schedule, make_optimizer)
from flashrl_jax.trainer._rl_step import (batch_shardings, compute_advantages, make_train_step,
                                          minibatch_order, train_step)
from flashrl_jax.trainer._sharding import (ROLLOUT_RULES, TRAIN_RULES, Rules, logical_to_spec,
                                           named_sharding, replicated, shard_fn, state_shardings)
from flashrl_jax.trainer._state import (TrainState, abstract_train_state, create_train_state,
                                        merge_model, train_state_shardings)
from flashrl_jax.trainer._step import LossInputs, micro_batch_loss, minibatch_gradients
from flashrl_jax.trainer._trainer import Trainer

__all__ = [
    "AXES", "AdvantageEstimator", "Batch", "BatchConfig", "CheckpointConfig", "Checkpointer",
    "CorruptCheckpointError", "CorruptVersionError", "DType", "DistributedConfig", "VersionStore",
    "export_version", "verify_version", "version_dirname",
    "LossInputs", "MeshConfig", "OptimizerConfig", "ROLLOUT_RULES", "Rules", "Schedule",
    "TRAIN_RULES", "TrainConfig", "TrainState", "Trainer", "Trajectory", "abstract_train_state",
    "apply_update", "batch_shardings", "batch_stats", "compute_advantages", "create_train_state",
    "current_learning_rate", "decay_mask", "host_to_global", "initialize_distributed",
    "learning_rate_schedule", "logical_to_spec", "make_mesh", "make_optimizer", "make_train_step",
    "merge_model", "micro_batch_loss", "minibatch_order", "minibatch_gradients", "named_sharding", "pack",
    "random_trajectories", "replicated", "shard_fn", "state_shardings", "to_host", "train_step",
    "train_state_shardings", "tree_to_global",
]
