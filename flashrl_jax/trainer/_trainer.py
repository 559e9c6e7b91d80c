"""`Trainer`: the thin stateful handle the controller holds (mesh, graphdef, state, jitted step).

Why a class at all: the controller needs one object to call `update(trajectories)` on, ask for the
policy version, and get a model to export; the pure pieces (`pack`, `train_step`) stay functions and
this only wires them together and times them. It holds no configuration of its own.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flashrl_jax.model import Decoder, ModelConfig, band_widths
from flashrl_jax.trainer._batch import Batch, Trajectory, batch_stats, micro_batch_ladder, pack
from flashrl_jax.trainer._config import TrainConfig
from flashrl_jax.trainer._distributed import to_host, tree_to_global
from flashrl_jax.trainer._rl_step import batch_shardings, make_train_step
from flashrl_jax.trainer._sharding import TRAIN_RULES, Rules
from flashrl_jax.trainer._state import (TrainState, create_train_state, merge_model,
                                        train_state_shardings)


# `warmup` also runs each compiled step once on a copy of the state up to this size (a copy of a
# large model's state would not fit beside it).
_RUN_AT_WARMUP_MAX_BYTES = 1 << 30


class Trainer:
  """Runs RL steps on a mesh. `update` packs, runs the jitted step, and returns host metrics.

  The reference model (for the KL term) is a frozen copy of the initial parameters, made only when
  `train_config.loss.kl_coef > 0`.
  """

  def __init__(self, model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh, *,
               rules: Rules = TRAIN_RULES, seed: int = 0, init_params: str | nnx.State | None = None,
               policy_version: int = 0):
    self.model_config, self.config, self.mesh, self.rules = model_config, train_config, mesh, rules
    self.graphdef, self.state = create_train_state(model_config, train_config, mesh, rules,
                                                   seed=seed, init_params=init_params,
                                                   policy_version=policy_version)
    self.state_shardings = train_state_shardings(model_config, train_config, mesh, rules)
    self.batch_shardings = batch_shardings(mesh, rules, train_config.batch)
    self.ref_params = None
    if train_config.uses_reference:
      # A real copy: the state's own buffers are donated to each step.
      self.ref_params = jax.jit(lambda p: jax.tree.map(lambda x: x.copy(), p),
                                out_shardings=self.state_shardings.params)(self.state.params)
    self._step = make_train_step(
        self.graphdef, train_config, mesh, self.state_shardings, self.batch_shardings,
        self.state_shardings.params if self.ref_params is not None else None)

  # --- state ---------------------------------------------------------------------------------------

  @property
  def policy_version(self) -> int:
    return int(to_host(self.state.policy_version))

  @property
  def step(self) -> int:
    return int(to_host(self.state.step))

  def set_state(self, state: TrainState) -> None:
    """Replaces the state (e.g. restored from a checkpoint); it is placed on this trainer's mesh."""
    self.state = jax.device_put(state, self.state_shardings)

  def model(self) -> Decoder:
    """The current policy as a `Decoder` over the sharded params (for export / evaluation)."""
    return merge_model(self.graphdef, self.state.params)

  # --- the RL step ---------------------------------------------------------------------------------

  def pack(self, trajectories: list[Trajectory]) -> Batch:
    return pack(trajectories, self.config.batch, self.config.num_minibatches)

  def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
    """One RL step on `trajectories`; returns metrics as Python floats.

    Every process must pass the same trajectories (each contributes its own shards of the batch).
    """
    start = time.perf_counter()
    host_batch = self.pack(trajectories)
    packed = time.perf_counter()
    metrics = self.update_batch(host_batch)
    metrics["pack_time_s"] += packed - start
    return metrics

  def update_batch(self, host_batch: Batch) -> dict[str, float]:
    """One RL step on a packed host batch (the same on every process); returns host metrics."""
    start = time.perf_counter()
    stats = batch_stats(host_batch)
    batch = tree_to_global(host_batch, self.batch_shardings)
    placed = time.perf_counter()
    metrics = {k: float(v) for k, v in to_host(self.step_on(batch)).items()}  # waits for the step
    step_time = time.perf_counter() - placed
    tokens = stats["tokens"] * self.config.ppo_epochs
    metrics |= {"step_time_s": step_time, "pack_time_s": placed - start,
                "tokens_per_second": tokens / step_time,
                "tokens": float(stats["tokens"]), "padding_fraction": stats["padding_fraction"],
                "micro_batches": float(host_batch.micro_batches)}
    return metrics

  def step_on(self, batch: Batch) -> dict[str, jax.Array]:
    """Runs the jitted step on a global batch (see `tree_to_global`); returns device metrics at once."""
    self.state, metrics = self._step(self.state, batch, self.ref_params)
    return metrics

  def warmup(self, max_sequences: int) -> list[int]:
    """Compiles the step for every micro-batch count a step of up to `max_sequences` trajectories
    can need (`micro_batch_ladder` up to one full-length trajectory per row) and, for a state up to
    `_RUN_AT_WARMUP_MAX_BYTES`, runs each once per attention form on a copy of the state (the
    state itself is untouched); returns the counts. A count first met mid-run would otherwise stop
    that step for a compilation, and its first run for ~0.1 s more.
    """
    config = self.config.batch
    per_minibatch = -(-max_sequences // self.config.num_minibatches)
    worst = -(-per_minibatch // config.rows)
    dummy = _dummies(self.config.num_minibatches, 2)
    counts = micro_batch_ladder(worst)
    run_too = sum(x.nbytes for x in jax.tree.leaves(self.state)) <= _RUN_AT_WARMUP_MAX_BYTES
    # Sequences as long as each attention band holds, and one needing the dense form: the step
    # picks its attention per micro-batch on device (`by_band`), one branch per form.
    longest = min(config.row_length, config.max_response_length + 1)
    lengths = [w for w in band_widths(config.row_length) if w < longest] + [longest]
    for m in counts:
      host = pack(dummy, config, self.config.num_minibatches, min_micro_batches=m)
      batch = tree_to_global(host, self.batch_shardings)
      self._step.lower(self.state, batch, self.ref_params).compile()  # cached for later calls
      if run_too:
        # A program's first run, and each attention branch's, costs more than later ones even
        # once compiled (XLA:CPU, the long-tail bench's step: +90-140 ms at 2, 3, 4 and 6
        # micro-batches): run each on a throwaway copy of the state (the step donates it), so no
        # step pays that mid-run.
        for length in lengths:
          host = pack(_dummies(self.config.num_minibatches, length), config,
                      self.config.num_minibatches, min_micro_batches=m)
          throwaway = jax.tree.map(lambda x: x.copy(), self.state)
          jax.block_until_ready(self._step(throwaway, tree_to_global(host, self.batch_shardings),
                                           self.ref_params))
    return counts

  def compilations(self) -> int:
    """How many shapes the jitted step has compiled for (a fixed handful in a healthy run)."""
    return self._step._cache_size()  # pylint: disable=protected-access


def _dummies(count: int, length: int) -> list[Trajectory]:
  """`count` trajectories of `length` tokens (1 prompt token), for warm-up runs."""
  return [Trajectory(sample_id=i, prompt_ids=np.ones(1, np.int32),
                     response_ids=np.ones(length - 1, np.int32),
                     behavior_logp=np.zeros(length - 1, np.float32), reward=float(i % 2),
                     group_id=i // 2) for i in range(count)]
