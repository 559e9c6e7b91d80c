"""Versioned weight export: loads in transformers and our `load_hf` with the same logits, manifest
checksums catch tampering, a concurrent reader never sees a partial version, refcounted gc, and
crashed writers' temp dirs are cleaned."""

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from flashrl_jax.model import MANIFEST, CorruptVersionError, load_hf, verify_version
from flashrl_jax.testing import tiny_config, tiny_model
from flashrl_jax.trainer import (TrainConfig, VersionStore, abstract_train_state, export_version,
                                 make_mesh, version_dirname)
from tests.hf_helpers import rel_err

CONFIG = tiny_config()


def _random_params(seed: int) -> tuple[nnx.GraphDef, nnx.State]:
  """Random params large enough that logits are far from zero (from NumPy: nothing to compile)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: tiny_model(CONFIG)), nnx.Param)
  rng = np.random.default_rng(seed)

  def fill(path, x):
    base = 1.0 if "norm" in str(path) else 0.0
    return jnp.asarray(base + 0.3 * rng.standard_normal(x.shape), x.dtype)

  return graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


@pytest.fixture(scope="module")
def model():
  graphdef, params = _random_params(0)
  return nnx.merge(graphdef, params)


def _forward(model, ids):
  graphdef, params = nnx.split(model)
  return np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(ids))(params))


def test_export_loads_in_transformers_and_load_hf(tmp_path, model):
  import torch
  import transformers

  path = export_version(model, 3, str(tmp_path), config=CONFIG, step=11)
  assert path == str(tmp_path / "weight_v000003")
  manifest = verify_version(path)
  assert (manifest["version"], manifest["step"]) == (3, 11)
  assert set(manifest["files"]) == {"config.json", "model.safetensors"}

  ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 11))
  expected = _forward(model, jnp.asarray(ids, jnp.int32))
  ours = _forward(load_hf(path), jnp.asarray(ids, jnp.int32))
  np.testing.assert_array_equal(ours, expected)  # fp32 round trip: the very same weights
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf_model(torch.as_tensor(ids)).logits.numpy()
  assert rel_err(theirs, expected) < 1e-5


def test_export_of_a_train_state_in_bfloat16(tmp_path):
  _, abstract = abstract_train_state(CONFIG, TrainConfig(), make_mesh("fsdp:1"))
  _, params = _random_params(1)
  state = abstract.replace(params=params)  # Only `.params` is read.
  path = export_version(state, 0, str(tmp_path), config=CONFIG, dtype=jnp.bfloat16)
  assert verify_version(path)["step"] is None
  loaded = nnx.state(load_hf(path), nnx.Param)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(want.astype(jnp.bfloat16), np.float32))


def test_existing_version_is_never_overwritten(tmp_path, model):
  path = export_version(model, 1, str(tmp_path), config=CONFIG)
  before = verify_version(path)
  with pytest.raises(FileExistsError, match="already exists"):
    export_version(model, 1, str(tmp_path), config=CONFIG, step=99)
  assert verify_version(path) == before
  assert os.listdir(tmp_path) == [version_dirname(1)]  # No temp dir left behind.


def test_durable_export_fsyncs_and_handoff_export_skips_it(tmp_path, model, monkeypatch):
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
  durable = export_version(model, 1, str(tmp_path), config=CONFIG)
  assert len(synced) >= 4  # each file, the manifest, the version dir, the root
  synced.clear()
  handoff = export_version(model, 2, str(tmp_path), config=CONFIG, durable=False)
  assert not synced
  # Same files, same checksums: only the crash-durability differs.
  assert verify_version(handoff)["files"] == verify_version(durable)["files"]


def _flip_byte(path):
  file = os.path.join(path, "model.safetensors")
  data = bytearray(open(file, "rb").read())
  data[len(data) // 2] ^= 1
  open(file, "wb").write(data)


def _truncate(path):
  with open(os.path.join(path, "model.safetensors"), "r+b") as f:
    f.truncate(100)


@pytest.mark.parametrize("tamper,match", [
    (_flip_byte, "model.safetensors does not match its sha256"),
    (_truncate, "model.safetensors has 100 bytes"),
    (lambda p: os.remove(os.path.join(p, "config.json")), "differ from the manifest"),
    (lambda p: open(os.path.join(p, "extra.bin"), "w").close(), "differ from the manifest"),
    (lambda p: os.remove(os.path.join(p, MANIFEST)), "no readable manifest.json"),
])
def test_tampered_version_is_detected(tmp_path, model, tamper, match):
  path = export_version(model, 2, str(tmp_path), config=CONFIG)
  verify_version(path)
  tamper(path)
  with pytest.raises(CorruptVersionError, match=match):
    verify_version(path)


def test_concurrent_reader_never_sees_a_partial_version(tmp_path):
  """A reader thread lists, acquires, verifies and loads the latest version in a loop while the
  writer publishes versions (each marked by its number in one weight) and garbage-collects."""
  store = VersionStore(str(tmp_path))
  _, params = _random_params(2)
  versions, seen, failures, done = 12, set(), [], threading.Event()

  def reader():
    while not done.is_set():
      for name in os.listdir(tmp_path):  # Whatever is listed under a version name is complete.
        path = os.path.join(tmp_path, name)
        if name.startswith("weight_v") and not os.path.exists(os.path.join(path, MANIFEST)) \
            and os.path.isdir(path):
          failures.append(f"{name} listed without a manifest")
      latest = store.latest()
      if latest is None:
        continue
      try:
        path = store.acquire(latest)
      except FileNotFoundError:
        continue  # Collected between listing and acquiring: fine, it was never handed out.
      try:
        verify_version(path)
        embed = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
        if embed[0, 0] != latest:
          failures.append(f"version {latest} holds the weights of version {embed[0, 0]}")
        seen.add(latest)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"version {latest}: {e!r}")
      finally:
        store.release(latest)

  thread = threading.Thread(target=reader)
  thread.start()
  try:
    for version in range(1, versions + 1):
      embed = params["embed"].get_value().at[0, 0].set(version)
      params["embed"].set_value(embed)
      store.export(params, version, config=CONFIG, step=version)
      store.gc(keep_last=2)
      time.sleep(0.02)
  finally:
    done.set()
    thread.join(timeout=60)
  assert not failures, failures[:5]
  assert len(seen) >= 2, seen
  assert store.versions() == [versions - 1, versions]


def test_gc_never_deletes_an_acquired_version(tmp_path, model):
  store = VersionStore(str(tmp_path))
  for version in range(1, 6):
    store.export(model, version, config=CONFIG)
  assert store.versions() == [1, 2, 3, 4, 5] and store.latest() == 5
  assert store.acquire(2) == store.path(2)
  store.acquire(2)
  assert store.gc(keep_last=2) == [1, 3]
  assert store.versions() == [2, 4, 5]
  store.release(2)
  assert store.gc(keep_last=2) == [] and store.refcount(2) == 1
  store.release(2)
  assert store.gc(keep_last=2) == [2]
  assert store.versions() == [4, 5]
  with pytest.raises(ValueError, match="without a matching acquire"):
    store.release(2)
  with pytest.raises(FileNotFoundError):
    store.acquire(1)
  assert sorted(os.listdir(tmp_path)) == [version_dirname(4), version_dirname(5)]


def test_stale_temp_dirs_of_crashed_writers_are_cleaned_on_startup(tmp_path, model):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  host = os.uname().nodename
  names = {"dead": f".tmp-{dead.pid}-0a1b2c3d-weight_v000007-{host}",
           "alive": f".tmp-{os.getpid()}-0a1b2c3d-weight_v000008-{host}",
           "elsewhere": f".tmp-{dead.pid}-0a1b2c3d-weight_v000009-other-host",
           "trash": ".trash-0a1b2c3d-weight_v000001"}
  for name in names.values():
    os.makedirs(tmp_path / name)
    open(tmp_path / name / "model.safetensors", "wb").write(b"partial")
  export_version(model, 6, str(tmp_path), config=CONFIG)
  store = VersionStore(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted([names["alive"], names["elsewhere"],
                                                 version_dirname(6)])
  assert store.versions() == [6]
  assert VersionStore(str(tmp_path), clean_stale=False).versions() == [6]
