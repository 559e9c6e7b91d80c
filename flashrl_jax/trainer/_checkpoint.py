"""Orbax checkpoints of the train state plus the controller's JSON state, with a safe resume.

Why: an async RL run must never lose work on a crash. Each checkpoint step holds three orbax items:
`state` (every array of the train state: params, optimizer state, step, policy version, RNG key
data), `meta` (leaf names, shapes, dtypes and PRNG implementations, so a mismatched target is a
clear error rather than a silent mis-restore) and `extra` (an opaque JSON blob of controller/data
state from the caller). The train state may be any pytree of arrays (typed PRNG keys are stored as
their key data); it is stored as a nested dict keyed by its key paths, so a checkpoint is readable
without the code that wrote it.

Restoring uses the shardings of the abstract target, so a run saved on one mesh resumes on another.
A step that cannot be read (missing orbax commit marker, deleted or truncated file) is logged as an
error naming its directory and **moved aside** to `<directory>/quarantine/` (never deleted, and no
longer counted by keep-last-N); `restore_latest` then falls back to the previous good step.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

_log = logging.getLogger(__name__)

_FORMAT = 1
_COMMIT_MARKER = "commit_success.txt"  # Written by orbax once a step is fully committed.
_ITEMS = ("state", "meta", "extra")
QUARANTINE_DIR = "quarantine"

PyTree = Any


class CorruptCheckpointError(RuntimeError):
  """A checkpoint step directory is partial or unreadable."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Where and how checkpoints are kept.

  Attributes:
    directory: root directory; each step is a subdirectory named by its step number.
    max_to_keep: keep only the newest this many steps (older ones are deleted after a save).
    async_save: write in a background thread; `save` returns once arrays are copied to host.
  """

  directory: str
  max_to_keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    if not self.directory:
      raise ValueError("CheckpointConfig.directory must be a non-empty path.")
    if self.max_to_keep < 1:
      raise ValueError(f"CheckpointConfig.max_to_keep must be >= 1, got {self.max_to_keep}.")


# --- the train state as a nested dict of arrays ---------------------------------------------------

def _key_name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  raise TypeError(f"Unsupported pytree key {entry!r}.")


def _is_prng_key(leaf) -> bool:
  return jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key)


def _flatten(tree: PyTree) -> tuple[list[tuple[str, ...]], list[Any], Any]:
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [tuple(_key_name(e) for e in path) for path, _ in path_leaves]
  if len(set(paths)) != len(paths):
    raise ValueError("Two leaves of the train state map to the same checkpoint name; rename them.")
  return paths, [leaf for _, leaf in path_leaves], treedef


def _nest(paths: list[tuple[str, ...]], leaves: list[Any]) -> dict:
  out: dict = {}
  for path, leaf in zip(paths, leaves):
    node = out
    for part in path[:-1]:
      node = node.setdefault(part, {})
    node[path[-1]] = leaf
  return out


def _lookup(tree: dict, path: tuple[str, ...]) -> Any:
  for part in path:
    tree = tree[part]
  return tree


def _abstract_key_data(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """The uint32 data of an abstract key array, sharded like the keys (trailing axis unsharded)."""
  data = jax.eval_shape(jax.random.key_data, leaf)
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (data.ndim - len(sharding.spec))
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _leaf_meta(leaf) -> list:
  return [list(np.shape(leaf)), str(leaf.dtype)]


def _name(path: tuple[str, ...]) -> str:
  return "/".join(path)


# --- the checkpointer -----------------------------------------------------------------------------

class Checkpointer:
  """Saves and restores (train state, extra JSON) pairs by step with orbax's `CheckpointManager`.

  All processes of a multi-host run call every method (orbax coordinates the writes).
  """

  def __init__(self, config: CheckpointConfig):
    self.config = config
    self.directory = os.path.abspath(config.directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.max_to_keep, enable_async_checkpointing=config.async_save,
        create=True, cleanup_tmp_directories=True)  # Removes half-written steps of a dead writer.
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, train_state: PyTree, extra_json: dict | None = None) -> None:
    """Starts saving `train_state` and `extra_json` as `step` (returns before the write ends when
    async). The arrays are copied first, so `train_state` may be donated right after."""
    extra_json = {} if extra_json is None else extra_json
    json.dumps(extra_json)  # Fail here, not in the background thread, on a non-JSON value.
    paths, leaves, _ = _flatten(train_state)
    impls = {_name(p): str(jax.random.key_impl(x))
             for p, x in zip(paths, leaves) if _is_prng_key(x)}
    meta = {"format": _FORMAT, "step": int(step), "rng_impls": impls,
            "leaves": {_name(p): _leaf_meta(x) for p, x in zip(paths, leaves)}}
    arrays = [jax.random.key_data(x) if _is_prng_key(x) else x for x in leaves]
    args = ocp.args.Composite(state=ocp.args.StandardSave(_nest(paths, arrays)),
                              meta=ocp.args.JsonSave(meta), extra=ocp.args.JsonSave(extra_json))
    self._manager.save(int(step), args=args, force=True)

  def wait(self) -> None:
    """Blocks until every started save is committed (and old steps are pruned)."""
    self._manager.wait_until_finished()

  def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict]:
    """Restores `step` onto the shardings of `abstract_state` (a pytree of `jax.ShapeDtypeStruct`
    with `sharding` set, e.g. from `jax.eval_shape` of a sharded init; concrete arrays work too).

    Raises:
      CorruptCheckpointError: the step is partial or unreadable.
      ValueError: the step holds a differently shaped train state (a code/config mismatch, not
        corruption, so nothing is moved aside).
    """
    step_dir = self.step_dir(step)
    missing = [f for f in (_COMMIT_MARKER, *_ITEMS)
               if not os.path.exists(os.path.join(step_dir, f))]
    if missing:
      raise CorruptCheckpointError(f"Checkpoint {step_dir} is partial: {missing} missing "
                                   f"({_COMMIT_MARKER} is orbax's commit marker).")
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      meta = meta["meta"]
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(f"Checkpoint {step_dir} has unreadable metadata: {e}") from e
    paths, leaves, treedef = _flatten(abstract_state)
    _check_matches(step_dir, meta, paths, leaves)
    target = [_abstract_key_data(x) if _is_prng_key(x) else _abstract(x) for x in leaves]
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_nest(paths, target)),
                              extra=ocp.args.JsonRestore())
    try:
      restored = self._manager.restore(step, args=args)
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(f"Checkpoint {step_dir} is unreadable: {e}") from e
    arrays = []
    for path in paths:
      value = _lookup(restored["state"], path)
      impl = meta["rng_impls"].get(_name(path))
      arrays.append(value if impl is None else jax.random.wrap_key_data(value, impl=impl))
    extra = restored["extra"]
    return jax.tree_util.tree_unflatten(treedef, arrays), {} if extra is None else dict(extra)

  def restore_latest(self, abstract_state: PyTree) -> tuple[PyTree, dict] | None:
    """Restores the newest good step; None when there is no checkpoint (a fresh start).

    A corrupt step is logged as an error, moved to `<directory>/quarantine/` and skipped.
    Raises CorruptCheckpointError when checkpoints existed but none could be read.
    """
    self.wait()
    self._manager.reload()
    steps = self.all_steps()
    for step in reversed(steps):
      try:
        result, error = self.restore(step, abstract_state), None
      except CorruptCheckpointError as e:
        result, error = None, e
      if _all_processes_ok(error is None):  # One process's bad shard fails the step everywhere.
        return result
      moved_to = self._quarantine(step)
      _log.error("%s Moved it to %s; falling back to the previous checkpoint.",
                 error or f"Checkpoint {self.step_dir(step)} is unreadable on another process.",
                 moved_to)
    if steps:
      raise CorruptCheckpointError(f"No readable checkpoint in {self.directory}: steps {steps} "
                                   f"were all corrupt and moved to {QUARANTINE_DIR}/.")
    return None

  def _quarantine(self, step: int) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    dest = os.path.join(self.directory, QUARANTINE_DIR, f"{step}.{stamp}")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      os.rename(self.step_dir(step), dest)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"flashrl_ckpt_quarantine_{step}")
    self._manager.reload()
    return dest

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _all_processes_ok(ok: bool) -> bool:
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _abstract(leaf) -> jax.ShapeDtypeStruct:
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=getattr(leaf, "sharding", None))


def _check_matches(step_dir: str, meta: dict, paths, leaves) -> None:
  if meta.get("format") != _FORMAT:
    raise CorruptCheckpointError(f"Checkpoint {step_dir} has unknown format {meta.get('format')}.")
  saved = meta["leaves"]
  wanted = {_name(p): _leaf_meta(x) for p, x in zip(paths, leaves)}
  missing, unexpected = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
  differ = sorted(n for n in set(wanted) & set(saved) if wanted[n] != saved[n])
  if missing or unexpected or differ:
    raise ValueError(
        f"Checkpoint {step_dir} does not match the target train state: missing {missing[:8]}, "
        f"unexpected {unexpected[:8]}, shape/dtype differ "
        f"{[(n, saved[n], wanted[n]) for n in differ[:8]]}.")
