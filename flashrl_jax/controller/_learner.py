"""`Learner`: everything the controller asks of the trainer's devices, behind one small handle.

The loop trains (`update`), exports each new policy version for the fleet (`export`), checkpoints
(`save` / `restore`) and evaluates (`evaluate`). Each runs jitted programs over the global train
state, so in a multi-process run each is a collective every process must join. Process 0 runs the
loop; its learner sends each operation to the other processes (`ProcessGroup`) and then runs it
itself, while each other process runs `follow`: wait for the next operation, run the same code.
Every operation has one implementation (`_run_op`), whichever process runs it.

Each step's batch is packed on process 0 (the only one with the rollouts) and sent to the others
as packed host arrays, rather than each process reading its own shard from shared storage: a batch
is small next to the model, it needs no shared filesystem or second protocol, and every process
then places only its own shards on its devices (`host_to_global`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import Any, Callable

from flashrl_jax import envs
from flashrl_jax._backend import check_backend
from flashrl_jax.controller._config import RunConfig
from flashrl_jax.controller._eval import held_out_accuracy
from flashrl_jax.controller._source import task_source
from flashrl_jax.model import (CorruptVersionError, Decoder, load_tokenizer, read_config,
                               verify_version)
from flashrl_jax.trainer import (Batch, CheckpointConfig, Checkpointer, MeshConfig, Message, Op,
                                 ProcessGroup, Trainer, Trajectory, VersionStore,
                                 abstract_train_state, make_mesh)

log = logging.getLogger(__name__)


class Learner:
  """The trainer, its checkpoints and its exported versions.

  `evaluator(model) -> {name: value}`: the held-out metrics of a policy (None: no evaluation).
  `group`: process 0's group in a multi-process run (each operation is sent to the others first).
  """

  def __init__(self, trainer: Trainer, store: VersionStore, checkpointer: Checkpointer, *,
               keep_versions: int,
               evaluator: Callable[[Decoder], dict[str, float]] | None = None,
               group: ProcessGroup | None = None):
    self.trainer, self.store, self.checkpointer = trainer, store, checkpointer
    self.keep_versions, self.evaluator = keep_versions, evaluator
    self._held: int | None = None  # the version the fleet serves: kept by garbage collection
    self._group = group if group is not None and group.is_leader else None
    self.num_processes = group.num_processes if group is not None else 1

  @classmethod
  def create(cls, config: RunConfig, workdir: str, *, task: envs.TaskSource | None = None,
             group: ProcessGroup | None = None) -> Learner:
    """The run's learner: the same on every process (process 0 first tells the others to build
    theirs, since building the train state is a collective). `task`: the run's task source (its
    held-out sets are evaluated); built from the config when not given."""
    if group is not None and group.is_leader:
      group.send(Message(Op.INIT))
    check_backend(config.resources.platform, "the trainer")
    model_config = read_config(config.model_path)
    mesh = make_mesh(MeshConfig.parse(config.mesh))
    trainer = Trainer(model_config, config.train, mesh, seed=config.seed,
                      init_params=config.model_path)
    if config.precompile:
      log.info("train step compiled for %s micro-batches",
               trainer.warmup(max_sequences=config.samples_per_step))
    task = task if task is not None else task_source(config)
    evaluator = None
    # Exact evaluation needs one correct response per prompt: exact-match and reasoning-gym tasks.
    eval_sets = task.eval_sets() if config.task.reward in (
        envs.RewardKind.EXACT_MATCH, envs.RewardKind.REASONING_GYM) else {}
    if eval_sets and config.eval_samples:
      tokenizer = load_tokenizer(config.model_path)
      evaluator = lambda model: held_out_accuracy(model, tokenizer, eval_sets, task.reference,
                                                  config.rollout.temperature, mesh)
    # Several processes save synchronously: an async save's background thread would run orbax's
    # own collectives (barriers, broadcasts) concurrently with the next step's, in an order that
    # can differ between processes -- a deadlock.
    checkpointer = Checkpointer(CheckpointConfig(directory=os.path.join(workdir, "checkpoints"),
                                                 max_to_keep=config.keep_checkpoints,
                                                 async_save=group is None))
    # Process 0 owns the store (listing, reference counts, clean-up); the others only write through
    # `export_version`, where process 0 alone writes files.
    owner = group is None or group.is_leader
    store = VersionStore(os.path.join(workdir, "versions"), clean_stale=owner)
    return cls(trainer, store, checkpointer, keep_versions=config.keep_versions,
               evaluator=evaluator, group=group)

  @property
  def policy_version(self) -> int:
    return self.trainer.policy_version

  # --- operations (process 0: sent to the others, then run here) ---------------------------------

  def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
    if self._group is None:
      return self.trainer.update(trajectories)
    batch = self.trainer.pack(trajectories)
    return self._send_and_run(Op.UPDATE, arrays={f.name: getattr(batch, f.name)
                                                  for f in dataclasses.fields(batch)})

  def export(self) -> str:
    """Exports the current policy version, reusing an intact export left by a previous process
    (a damaged one is written again).

    Not fsynced: the servers read it through this machine's page cache the moment it is published,
    and the checkpoint, not the export, is what survives a crash (`durable=False`, see
    `flashrl_jax.trainer.export_version`); the fsyncs cost tens of ms per step on a busy disk.
    """
    path = self.store.path(self.policy_version)
    if os.path.exists(path):  # decided here only: the others join an export, never skip one
      try:
        verify_version(path)
        return path
      except CorruptVersionError as error:
        log.error("the export of version %d is damaged (%s); writing it again",
                  self.policy_version, error)
        self.store.discard(self.policy_version)
    return self._send_and_run(Op.EXPORT)

  def reexport(self) -> str:
    """Writes the current version's export again from the trainer's weights (servers refused the
    directory: it was damaged after it was written, or its disk fails)."""
    log.warning("writing policy version %d again", self.policy_version)
    self.store.discard(self.policy_version)
    return self.export()

  def hold(self, version: int) -> None:
    """Keeps `version`'s export from garbage collection (the fleet serves it: a restarted server
    loads it), releasing the one held before."""
    if version == self._held:
      return
    try:
      self.store.acquire(version)
    except FileNotFoundError:  # not exported by this run (the servers' initial weights)
      return
    if self._held is not None:
      self.store.release(self._held)
    self._held = version

  def collect_garbage(self) -> None:
    """Deletes exported versions beyond the newest `keep_versions` that nothing holds."""
    self.store.gc(keep_last=self.keep_versions)

  def evaluate(self) -> dict[str, float] | None:
    return None if self.evaluator is None else self._send_and_run(Op.EVALUATE)

  def save(self, step: int, extra: dict[str, Any]) -> None:
    self._send_and_run(Op.SAVE, {"step": step, "extra": extra})

  def restore(self) -> dict[str, Any] | None:
    """Restores the latest good checkpoint into the trainer; returns its extra state (or None).

    Exports newer than the restored policy are deleted: a killed run wrote them after its last
    checkpoint, so their weights are not the ones this run will train (and must never be served).
    """
    extra = self._send_and_run(Op.RESTORE)
    for stale in [v for v in self.store.versions() if v > self.policy_version]:
      log.warning("removing policy version %d exported after the restored checkpoint", stale)
      shutil.rmtree(self.store.path(stale))
    return extra

  def close(self, error: str | None = None) -> None:
    """Ends the run on every process (`error`: why process 0 stops early)."""
    if self._group is not None:
      self._group.send(Message(Op.STOP, {"error": error}))
    self.checkpointer.wait()
    self.checkpointer.close()
    if self._group is not None:
      self._group.close()

  def _send_and_run(self, op: Op, args: dict[str, Any] | None = None,
                    arrays: dict[str, Any] | None = None) -> Any:
    message = Message(op, args or {}, arrays or {})
    if self._group is not None:
      self._group.send(message)
    return self._run_op(message)

  def _run_op(self, message: Message) -> Any:
    """One operation, as every process runs it."""
    op, args = message.op, message.args
    if op is Op.UPDATE:
      return self.trainer.update_batch(Batch(**message.arrays))
    if op is Op.EXPORT:
      return self.store.export(self.trainer.model(), self.policy_version,
                               config=self.trainer.model_config, step=self.trainer.step,
                               durable=False)
    if op is Op.EVALUATE:
      return self.evaluator(self.trainer.model())
    if op is Op.SAVE:
      return self.checkpointer.save(int(args["step"]), self.trainer.state, args["extra"])
    if op is Op.RESTORE:
      target = abstract_train_state(self.trainer.model_config, self.trainer.config,
                                    self.trainer.mesh)[1]
      restored = self.checkpointer.restore_latest(target)
      if restored is None:
        return None
      state, extra = restored
      self.trainer.set_state(state)
      return extra
    raise ValueError(f"not a learner operation: {op}")


def follow(config: RunConfig, workdir: str, group: ProcessGroup) -> None:
  """A process other than 0: runs every operation process 0 sends until it stops the run.

  Raises RuntimeError when process 0 stopped the run because of an error.
  """
  message = group.receive()
  if message.op is not Op.INIT:
    raise RuntimeError(f"process 0 sent {message.op.value} before init")
  learner = Learner.create(config, workdir, group=group)
  while True:
    message = group.receive()
    if message.op is Op.STOP:
      learner.close()
      group.close()
      if message.args.get("error"):
        raise RuntimeError(f"process 0 stopped the run: {message.args['error']}")
      return
    learner._run_op(message)  # pylint: disable=protected-access


