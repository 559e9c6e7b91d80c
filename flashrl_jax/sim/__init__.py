"""flashrl_jax.sim: a discrete-event simulator of the RL cluster, and the queue-scheduling bound.

Why: ROLL Flash's scaling claims (async 2.12× over sync at 128 GPUs, 1.53–2.24× across sequence
lengths) are made on hardware we do not have. This package models the cluster (K rollout workers
with a memory-bound decode step, a train pool, weight handoff, rewards, long-tail lengths) and runs
the controller's own scheduling policies on it — the staleness bound, sample buffer, pause modes and
length laws of `flashrl_jax.scheduling`, imported, not copied — so the same configuration can be
(a) checked against measured runs on this machine and (b) extrapolated to the paper's scale.
See docs/simulator.md.
"""

from flashrl_jax.sim._bound import (
    amortised_bound,
    barrier_makespan,
    list_schedule_makespan,
    queue_bound,
)
from flashrl_jax.sim._config import SimConfig
from flashrl_jax.sim._costs import (
    Context,
    CostModel,
    DecodeModel,
    LinearDecode,
    RooflineDecode,
    SyncModel,
    TabulatedDecode,
    TabulatedTrain,
    TrainModel,
    fit_linear_decode,
)
from flashrl_jax.sim._results import SimResult, StepRecord
from flashrl_jax.sim._rollout import BatchRollout, GroupPlacement, PromptReplication, QueueScheduling
from flashrl_jax.sim._scale import (
    Workload,
    mechanism_rows,
    qwen3_8b_config,
    scaling_rows,
    sequence_rows,
    split_rows,
)
from flashrl_jax.sim._simulate import simulate
from flashrl_jax.sim._training import AsyncTraining, SyncTraining

__all__ = [
    "AsyncTraining",
    "BatchRollout",
    "Context",
    "CostModel",
    "DecodeModel",
    "GroupPlacement",
    "LinearDecode",
    "PromptReplication",
    "QueueScheduling",
    "RooflineDecode",
    "SimConfig",
    "SimResult",
    "StepRecord",
    "SyncModel",
    "SyncTraining",
    "TabulatedDecode",
    "TabulatedTrain",
    "TrainModel",
    "Workload",
    "amortised_bound",
    "barrier_makespan",
    "fit_linear_decode",
    "list_schedule_makespan",
    "mechanism_rows",
    "queue_bound",
    "qwen3_8b_config",
    "scaling_rows",
    "sequence_rows",
    "simulate",
    "split_rows",
]
