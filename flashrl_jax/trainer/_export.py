"""Versioned HF safetensors exports of the policy: the checkpoint-based weight handoff.

Why: rollout servers (SGLang's `/update_weights_from_disk`, our own JAX server) load a new policy
from an HF directory `<root>/weight_v{version:06d}` (the convention in SGLANG_PROTOCOL.md). Two
things must hold while the trainer keeps publishing versions:

* A reader never sees a half-written version. A version is written into a hidden temp dir in the
  same root (`.tmp-<pid>-<rand>-weight_v...-<host>`), then one `os.rename` publishes it (atomic on
  POSIX within a filesystem). Its `manifest.json` (version, step, created time, sha256 and size per
  file) is written inside the temp dir, so a published version always carries the checksums to
  verify it by (`verify_version`, in `flashrl_jax.model`, which the rollout server runs before it
  loads a version). `durable=True` also fsyncs every file, the dir and the root, so the version
  survives a machine crash; a per-step handoff to servers reading the same page cache does not need
  that (the rename alone is atomic for them; a version torn by a crash fails `verify_version`), and
  the fsyncs cost tens of ms per step on a busy disk.
* A version never disappears under a server still loading or serving it. `VersionStore.gc` deletes
  only versions no caller holds (`acquire`/`release` reference counts, kept in the process that owns
  the store), and deletes by renaming to `.trash-...` first, so a listing never shows a torn one.

A writer that crashed leaves a temp dir; `VersionStore` removes those of dead processes on this host
when it starts. Multi-host: every process calls `export_version`; the parameters are gathered one
tensor at a time (a collective each) and process 0 writes each safetensors file as soon as its
tensors are in, so no process ever holds the whole model; all return once the version is published.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from typing import Any, Iterator

import jax
import numpy as np
import psutil
from flax import nnx
from jax.experimental import multihost_utils

from flashrl_jax import _failpoints as failpoints
from flashrl_jax.model import (MANIFEST, CorruptVersionError, HFDirWriter, ModelConfig,
                               hf_tensor_specs, sha256_file, to_hf_array, verify_version)
from flashrl_jax.trainer._distributed import to_host

_log = logging.getLogger(__name__)

_PREFIX = "weight_v"
_VERSION_RE = re.compile(rf"^{_PREFIX}(\d{{6,}})$")
_TMP = ".tmp-"
_TRASH = ".trash-"


def version_dirname(version: int) -> str:
  if version < 0:
    raise ValueError(f"A policy version is >= 0, got {version}.")
  return f"{_PREFIX}{version:06d}"


# --- writing --------------------------------------------------------------------------------------

def _params(state_or_model: Any) -> nnx.State:
  """The `nnx.Param` state of a `Decoder`, of a `TrainState` (`.params`), or the state itself."""
  if isinstance(state_or_model, nnx.Module):
    return nnx.state(state_or_model, nnx.Param)
  return getattr(state_or_model, "params", state_or_model)


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_version(config: ModelConfig, specs, tensors: Iterator[tuple[str, np.ndarray]],
                   version: int, step: int | None, root_dir: str, durable: bool = True) -> str:
  sync = _fsync if durable else (lambda path: None)
  final = os.path.join(root_dir, version_dirname(version))
  if os.path.exists(final):
    raise FileExistsError(f"Policy version {version} already exists at {final}; versions are "
                          "immutable once published (readers may hold it).")
  tmp = os.path.join(root_dir, f"{_TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
                               f"{version_dirname(version)}-{socket.gethostname()}")
  os.makedirs(tmp)
  try:
    files = {}
    writer = HFDirWriter(config, specs, tmp)
    for name, value in tensors:
      writer.add(name, value)
    for name in writer.close():
      path = os.path.join(tmp, name)
      sync(path)
      files[name] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    now = time.time()
    manifest = {"version": version, "step": step, "created_unix": now,
                "created": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
                "files": files}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1)
    sync(os.path.join(tmp, MANIFEST))
    sync(tmp)
    failpoints.hit("export", version)  # written, not yet published
    if os.path.exists(final):  # A concurrent writer of the same version won; keep theirs.
      raise FileExistsError(f"Policy version {version} appeared at {final} while writing it.")
    os.rename(tmp, final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  sync(root_dir)
  return final


def export_version(state_or_model: Any, version: int, root_dir: str, *, config: ModelConfig,
                   dtype=None, step: int | None = None, durable: bool = True) -> str:
  """Publishes the policy as the HF safetensors dir `<root_dir>/weight_v{version:06d}`; returns it.

  Args:
    state_or_model: a `Decoder`, a `TrainState` (its `.params` are exported) or an `nnx.State` of
      the decoder's Params; sharded arrays are gathered (a collective when multi-process).
    version: the policy version (the trainer's `policy_version`); must not exist yet.
    root_dir: the directory rollout servers read versions from (created if missing).
    config: the model config written to `config.json`.
    dtype: cast the weights to this dtype (e.g. `jnp.bfloat16`); default: as stored.
    step: the trainer step recorded in the manifest.
    durable: fsync the files, the dir and the root (survives a machine crash; see the module doc).
  """
  version_dirname(version)
  params = _params(state_or_model)
  flat = dict(nnx.to_flat_state(params))
  plan = hf_tensor_specs(config, params, dtype)

  def gathered() -> Iterator[tuple[str, np.ndarray]]:
    # One tensor at a time (a collective when multi-process): no process holds the whole model.
    for entry, _, tensor_dtype in plan:
      value = to_host(flat[entry.path].value).astype(tensor_dtype)
      yield entry.hf_name, to_hf_array(value, entry.kind)

  tensors = gathered()
  root_dir = os.path.abspath(root_dir)
  final = os.path.join(root_dir, version_dirname(version))
  error = None
  try:
    if jax.process_index() == 0:
      try:
        os.makedirs(root_dir, exist_ok=True)
        final = _write_version(config, [(e.hf_name, shape, d) for e, shape, d in plan], tensors,
                               version, step, root_dir, durable)
      except Exception as e:  # pylint: disable=broad-except
        error = e
  finally:
    for _ in tensors:  # every process joins every gather, whatever happened to the writer
      pass
  if error is not None:
    if jax.process_count() > 1:
      multihost_utils.broadcast_one_to_all(np.int32(0))
    raise error
  if jax.process_count() > 1:  # Others return only once process 0 has published (or failed).
    if not multihost_utils.broadcast_one_to_all(np.int32(1)):
      raise RuntimeError(f"Process 0 failed to export policy version {version} to {root_dir}.")
  return final


# --- the store ------------------------------------------------------------------------------------

class VersionStore:
  """The versions under one root: listing, reference counts, and garbage collection.

  One process (the controller / trainer process 0) owns a root's store: `acquire` and `release` are
  counted in memory here, by the caller, for each rollout server loading or serving a version.
  Readers elsewhere may list the root (`versions`, `latest`) with a store of their own made with
  `clean_stale=False`.
  """

  def __init__(self, root_dir: str, *, clean_stale: bool = True):
    self.root_dir = os.path.abspath(root_dir)
    os.makedirs(self.root_dir, exist_ok=True)
    self._refs: collections.Counter[int] = collections.Counter()
    self._lock = threading.Lock()
    if clean_stale:
      self.clean_stale()

  def path(self, version: int) -> str:
    return os.path.join(self.root_dir, version_dirname(version))

  def versions(self) -> list[int]:
    """Published versions, oldest first."""
    out = []
    for name in os.listdir(self.root_dir):
      match = _VERSION_RE.match(name)
      if match:
        out.append(int(match.group(1)))
    return sorted(out)

  def latest(self) -> int | None:
    versions = self.versions()
    return versions[-1] if versions else None

  def export(self, state_or_model: Any, version: int, *, config: ModelConfig, dtype=None,
             step: int | None = None, durable: bool = True) -> str:
    return export_version(state_or_model, version, self.root_dir, config=config, dtype=dtype,
                          step=step, durable=durable)

  def discard(self, version: int) -> None:
    """Deletes version `version` whatever holds it (a damaged export, to be written again)."""
    with self._lock:
      if not os.path.isdir(self.path(version)):
        return
      trash = os.path.join(self.root_dir, f"{_TRASH}{uuid.uuid4().hex[:8]}-"
                                          f"{version_dirname(version)}")
      os.rename(self.path(version), trash)
    shutil.rmtree(trash, ignore_errors=True)

  def acquire(self, version: int) -> str:
    """Marks `version` in use (gc keeps it until a matching `release`); returns its path."""
    with self._lock:
      path = self.path(version)
      if not os.path.isdir(path):
        raise FileNotFoundError(f"Policy version {version} is not published under {self.root_dir}.")
      self._refs[version] += 1
      return path

  def release(self, version: int) -> None:
    with self._lock:
      if self._refs[version] <= 0:
        raise ValueError(f"release({version}) without a matching acquire.")
      self._refs[version] -= 1
      if not self._refs[version]:
        del self._refs[version]

  def refcount(self, version: int) -> int:
    with self._lock:
      return self._refs[version]

  def gc(self, keep_last: int) -> list[int]:
    """Deletes versions older than the newest `keep_last` that nobody holds; returns them."""
    if keep_last < 1:
      raise ValueError(f"keep_last must be >= 1, got {keep_last}.")
    deleted, trash = [], []
    with self._lock:  # Unlist under the lock (acquire checks the listing); remove after it.
      for version in self.versions()[:-keep_last]:
        if not self._refs[version]:
          trash.append(os.path.join(self.root_dir, f"{_TRASH}{uuid.uuid4().hex[:8]}-"
                                                   f"{version_dirname(version)}"))
          os.rename(self.path(version), trash[-1])
          deleted.append(version)
    for path in trash:
      shutil.rmtree(path, ignore_errors=True)
    return deleted

  def clean_stale(self) -> list[str]:
    """Removes temp dirs of crashed writers on this host, and leftover trash; returns them."""
    host, removed = socket.gethostname(), []
    for name in os.listdir(self.root_dir):
      path = os.path.join(self.root_dir, name)
      if name.startswith(_TRASH):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
      elif name.startswith(_TMP):
        parts = name[len(_TMP):].split("-", 3)  # pid, random, weight_v..., host
        pid, writer_host = parts[0], parts[-1]
        if len(parts) != 4 or writer_host != host:
          _log.warning("Leaving %s: written from host %s, cannot tell if it is alive.", path,
                       writer_host)
        elif not pid.isdigit() or not psutil.pid_exists(int(pid)):
          _log.warning("Removing %s, left by a crashed writer.", path)
          shutil.rmtree(path, ignore_errors=True)
          removed.append(name)
    return removed
