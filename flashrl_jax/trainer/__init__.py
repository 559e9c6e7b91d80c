"""flashrl_jax.trainer: the sharded RL trainer (mesh, rules, train state, optimizer, jitted step).

The same code runs on one CPU device, fake CPU devices, a GPU or a multi-host slice; only the mesh
string changes. The train state is an explicit, already-sharded pytree (`TrainState`) and the NNX
graphdef is kept beside it. The controller holds a `Trainer` and calls `update(trajectories)`;
`Checkpointer` saves/restores the state, `export_version` publishes a policy version as an HF dir.
"""

from flashrl_jax.trainer._batch import (Batch, Trajectory, batch_stats, micro_batch_ladder, pack,
                                        random_trajectories)
from flashrl_jax.trainer._checkpoint import (CheckpointConfig, Checkpointer,
                                             CorruptCheckpointError)
from flashrl_jax.trainer._config import (AdvantageEstimator, BatchConfig, DType, OptimizerConfig,
                                         Schedule, TrainConfig)
from flashrl_jax.trainer._distributed import (AUTO, DistributedConfig, first_slurm_host,
                                              host_to_global, initialize_distributed,
                                              shutdown_distributed, to_host, tree_to_global)
from flashrl_jax.trainer._group import (EXIT_LOST, Message, Op, ProcessGroup, receive_message,
                                       send_message)
from flashrl_jax.trainer._export import VersionStore, export_version, version_dirname
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
    "abstract_train_state", "AdvantageEstimator", "apply_update", "AUTO", "AXES", "Batch",
    "batch_shardings", "batch_stats", "BatchConfig", "CheckpointConfig", "Checkpointer",
    "compute_advantages", "CorruptCheckpointError", "create_train_state",
    "current_learning_rate", "decay_mask", "DistributedConfig", "DType", "EXIT_LOST",
    "export_version", "first_slurm_host", "host_to_global", "initialize_distributed",
    "learning_rate_schedule", "logical_to_spec", "LossInputs", "make_mesh", "make_optimizer",
    "make_train_step", "merge_model", "MeshConfig", "Message", "micro_batch_loss",
    "micro_batch_ladder", "minibatch_gradients", "minibatch_order", "named_sharding", "Op",
    "OptimizerConfig", "pack",
    "ProcessGroup", "random_trajectories", "receive_message", "send_message", "replicated", "ROLLOUT_RULES", "Rules", "Schedule",
    "shard_fn", "shutdown_distributed", "state_shardings", "to_host", "TRAIN_RULES",
    "train_state_shardings", "train_step", "TrainConfig", "Trainer", "TrainState", "Trajectory",
    "tree_to_global", "version_dirname", "VersionStore",
]
