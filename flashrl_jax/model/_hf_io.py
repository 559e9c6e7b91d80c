"""HF safetensors I/O: one declarative mapping table per family, one generic loader and saver.

The same table drives import (`load_hf`), export for rollout servers (`save_hf`, what SGLang's
`/update_weights_from_disk` and `transformers.from_pretrained` read) and the round-trip tests. A
`Linear` entry records how many leading axes of our kernel are inputs: our kernels are
`[in..., out...]` (e.g. q_proj `[embed, heads, head_dim]`), HF's are `[prod(out), prod(in)]`.
Loading is all-or-nothing: a missing, unexpected, misshapen, non-float or non-finite tensor, an
unreadable config or a malformed index is an error (ValueError / OSError) that names it, and
nothing is returned; what is read must be a regular file inside the directory (a FIFO, a device or
an index entry pointing elsewhere is refused rather than read).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from flashrl_jax.model._config import Family, ModelConfig
from flashrl_jax.model._decoder import Decoder
from flashrl_jax.model._layers import ShardFn, no_shard
from flashrl_jax.model._manifest import plain_name, read_small_json, regular_file


@dataclasses.dataclass(frozen=True)
class Linear:
  num_in_axes: int


@dataclasses.dataclass(frozen=True)
class Direct:
  """Same values; `flatten` when HF stores a bias as `[heads*head_dim]` and we as `[heads, head_dim]`."""

  flatten: bool = False


@dataclasses.dataclass(frozen=True)
class TensorMap:
  hf_name: str
  path: tuple[str | int, ...]
  kind: Linear | Direct


_LAYER = [  # (hf suffix, path under layers[i], kind, families)
    ("self_attn.q_proj.weight", ("attn", "q_proj"), Linear(1), None),
    ("self_attn.k_proj.weight", ("attn", "k_proj"), Linear(1), None),
    ("self_attn.v_proj.weight", ("attn", "v_proj"), Linear(1), None),
    ("self_attn.o_proj.weight", ("attn", "o_proj"), Linear(2), None),
    ("self_attn.q_proj.bias", ("attn", "q_bias"), Direct(flatten=True), {Family.QWEN2}),
    ("self_attn.k_proj.bias", ("attn", "k_bias"), Direct(flatten=True), {Family.QWEN2}),
    ("self_attn.v_proj.bias", ("attn", "v_bias"), Direct(flatten=True), {Family.QWEN2}),
    ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), Direct(), {Family.QWEN3}),
    ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), Direct(), {Family.QWEN3}),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj"), Linear(1), None),
    ("mlp.up_proj.weight", ("mlp", "up_proj"), Linear(1), None),
    ("mlp.down_proj.weight", ("mlp", "down_proj"), Linear(1), None),
    ("input_layernorm.weight", ("input_norm", "scale"), Direct(), None),
    ("post_attention_layernorm.weight", ("post_attn_norm", "scale"), Direct(), None),
]

# Buffers some HF versions write that carry no parameters.
_IGNORABLE = re.compile(r".*rotary_emb\.inv_freq$")


def tensor_map(config: ModelConfig) -> list[TensorMap]:
  """The full HF-name <-> NNX-path table for `config`."""
  entries = [TensorMap("model.embed_tokens.weight", ("embed",), Direct()),
             TensorMap("model.norm.weight", ("final_norm", "scale"), Direct())]
  if not config.tie_word_embeddings:
    entries.append(TensorMap("lm_head.weight", ("lm_head",), Linear(1)))
  for i in range(config.num_layers):
    for suffix, path, kind, families in _LAYER:
      if families is None or config.family in families:
        entries.append(TensorMap(f"model.layers.{i}.{suffix}", ("layers", i, *path), kind))
  return entries


def to_hf_array(value: np.ndarray, kind: Linear | Direct) -> np.ndarray:
  if isinstance(kind, Linear):
    n_in = math.prod(value.shape[:kind.num_in_axes])
    return np.ascontiguousarray(value.reshape(n_in, -1).T)
  return np.ascontiguousarray(value.reshape(-1) if kind.flatten else value)


def from_hf_array(value: np.ndarray, kind: Linear | Direct, shape: tuple[int, ...]) -> np.ndarray:
  if isinstance(kind, Linear):
    return value.T.reshape(shape)
  return value.reshape(shape)


def _expected_hf_shape(shape: tuple[int, ...], kind: Linear | Direct) -> tuple[int, ...]:
  if isinstance(kind, Linear):
    return (math.prod(shape[kind.num_in_axes:]), math.prod(shape[:kind.num_in_axes]))
  return (math.prod(shape),) if kind.flatten else tuple(shape)


# --- reading ----------------------------------------------------------------------------------------

def _safetensors_files(path: str) -> dict[str, str]:
  """Tensor name -> file, from an index or a single `model.safetensors`."""
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path} is not a directory.")
  if os.path.exists(index):
    weight_map = read_small_json(index, "safetensors index")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map):
      raise ValueError(f"{index} has no `weight_map` object of tensor name -> file.")
    files = {name: os.path.join(path, plain_name(file, index)) for name, file in weight_map.items()}
    for file in set(files.values()):
      regular_file(file, "safetensors file")
    return files
  if os.path.exists(single):
    with safe_open(regular_file(single, "safetensors file"), framework="numpy") as f:
      return {name: single for name in f.keys()}
  others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
  if others:
    raise ValueError(f"{path} holds only non-safetensors weights {others}; flashrl_jax loads "
                     "safetensors only (pickle-based formats are never read).")
  raise FileNotFoundError(f"No model.safetensors or model.safetensors.index.json in {path}.")


def _read_tensors(files: dict[str, str], names: list[str]) -> dict[str, np.ndarray]:
  """Host NumPy arrays of `names` (bfloat16 through ml_dtypes), each file opened once: a rollout
  server reloads every policy version, and opening a file per tensor cost more than reading it."""
  by_file: dict[str, list[str]] = {}
  for name in names:
    by_file.setdefault(files[name], []).append(name)
  out = {}
  for file, wanted in by_file.items():
    try:
      with safe_open(file, framework="numpy") as f:
        for name in wanted:
          out[name] = f.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
      if isinstance(e, (ValueError, OSError)):
        raise
      raise ValueError(f"cannot read tensors from {file}: {e!r:.300}") from None
  return out


def read_config(path: str) -> ModelConfig:
  config_file = os.path.join(path, "config.json")
  if not os.path.exists(config_file):
    raise FileNotFoundError(f"No config.json in {path}.")
  hf = read_small_json(config_file, "config")
  if not isinstance(hf, dict):
    raise ValueError(f"{config_file} must hold a JSON object.")
  try:
    return ModelConfig.from_hf(hf)
  except ValueError:
    raise
  except Exception as e:  # noqa: BLE001 - a field of the wrong type (a list for an int, ...)
    raise ValueError(f"{config_file} has a field of the wrong type or shape: {e!r:.300}") from None


def load_hf_state(path: str, config: ModelConfig, abstract_state: nnx.State,
                  shardings: Any = None) -> nnx.State:
  """Fills `abstract_state` (from `nnx.eval_shape`) from the safetensors in `path`."""
  files = _safetensors_files(path)
  table = tensor_map(config)
  flat = dict(nnx.to_flat_state(abstract_state))
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  wanted = {entry.hf_name for entry in table}
  if config.tie_word_embeddings:
    wanted.add("lm_head.weight")  # Some exporters write the tied head too; it is ignored.
  unexpected = sorted(n for n in files if n not in wanted and not _IGNORABLE.match(n))
  missing = sorted(e.hf_name for e in table if e.hf_name not in files)
  if missing or unexpected:
    raise ValueError(f"Checkpoint {path} does not match {config.family.architecture}: "
                     f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                     f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}.")
  values = _read_tensors(files, [entry.hf_name for entry in table])
  arrays, placements = [], []
  for entry in table:
    variable = flat[entry.path]
    shape, dtype = variable.value.shape, variable.value.dtype
    value = values[entry.hf_name]
    expected = _expected_hf_shape(shape, entry.kind)
    if tuple(value.shape) != expected:
      raise ValueError(f"Tensor {entry.hf_name} in {path} has shape {tuple(value.shape)}, "
                       f"expected {expected} for this config.")
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise ValueError(f"Tensor {entry.hf_name} in {path} has dtype {value.dtype}; weights are "
                       "floating point.")
    array = from_hf_array(value, entry.kind, shape).astype(dtype)
    if not np.isfinite(array).all():  # NaN/inf weights would only ever produce NaN log-probs
      raise ValueError(f"Tensor {entry.hf_name} in {path} holds non-finite values.")
    sharding = flat_shardings.get(entry.path)
    arrays.append(array)
    placements.append(getattr(sharding, "value", sharding))
  # One transfer for all tensors: per-tensor calls cost more than the copies at small sizes.
  if all(p is not None for p in placements):
    placed = jax.device_put(arrays, placements)
  else:
    placed = [jax.device_put(a, p) if p is not None else jnp.asarray(a)
              for a, p in zip(arrays, placements)]
  for entry, array in zip(table, placed):
    flat[entry.path] = flat[entry.path].replace(array)
  return nnx.from_flat_state(flat)


def load_hf(path: str, *, dtype=jnp.float32, compute_dtype=None, shard: ShardFn = no_shard,
            shardings: Any = None) -> Decoder:
  """Loads an HF checkpoint directory into a `Decoder` (weights in `dtype`).

  `shardings`, when given, is a state-shaped pytree of `jax.sharding.Sharding` each tensor is placed
  with as it is read (so no full copy lands on one device).
  """
  config = read_config(path)
  compute_dtype = compute_dtype or dtype
  abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), param_dtype=dtype,
                                            dtype=compute_dtype, shard=shard))
  graphdef, abstract_state = nnx.split(abstract)
  return nnx.merge(graphdef, load_hf_state(path, config, abstract_state, shardings))


# --- writing ----------------------------------------------------------------------------------------

def hf_tensors(config: ModelConfig, state: nnx.State, dtype=None) -> dict[str, np.ndarray]:
  """The HF-named host arrays of a model state (gathered from devices)."""
  flat = dict(nnx.to_flat_state(state))
  tensors = {}
  for entry in tensor_map(config):
    value = np.asarray(jax.device_get(flat[entry.path].value))
    if dtype is not None:
      value = value.astype(dtype)
    tensors[entry.hf_name] = to_hf_array(value, entry.kind)
  return tensors


def hf_tensor_specs(config: ModelConfig, state: nnx.State,
                    dtype=None) -> list[tuple[TensorMap, tuple[int, ...], np.dtype]]:
  """`(entry, HF shape, dtype)` of every tensor an export writes, in writing order, from shapes
  only (nothing is gathered): what `HFDirWriter` plans its files from."""
  flat = dict(nnx.to_flat_state(state))
  out = []
  for entry in tensor_map(config):
    value = flat[entry.path].value
    out.append((entry, _expected_hf_shape(tuple(value.shape), entry.kind),
                np.dtype(dtype if dtype is not None else value.dtype)))
  return out


class HFDirWriter:
  """Writes an HF directory tensor by tensor: `add` each tensor in the planned order, then `close`.

  The safetensors files (sharded at `max_shard_bytes`) are planned from the shapes up front, and a
  file is written as soon as its last tensor arrives, so at most one file's tensors are held in
  memory: a model larger than this host's memory can be exported from gathered pieces.
  """

  def __init__(self, config: ModelConfig, specs: list[tuple[str, tuple[int, ...], np.dtype]],
               path: str, *, max_shard_bytes: int = 4 << 30):
    self.config, self.path, self.specs = config, path, list(specs)
    self.shards: list[list[str]] = [[]]
    size = 0
    for name, shape, dtype in self.specs:
      nbytes = math.prod(shape) * np.dtype(dtype).itemsize
      if self.shards[-1] and size + nbytes > max_shard_bytes:
        self.shards.append([])
        size = 0
      self.shards[-1].append(name)
      size += nbytes
    n = len(self.shards)
    self.files = (["model.safetensors"] if n == 1 else
                  [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    self._expected = {name: (tuple(shape), np.dtype(dtype)) for name, shape, dtype in self.specs}
    self._order = [name for name, _, _ in self.specs]
    self._shard_of = {name: i for i, names in enumerate(self.shards) for name in names}
    self._next = 0
    self._pending: dict[str, np.ndarray] = {}
    self.written: list[str] = []

  def add(self, name: str, value: np.ndarray) -> None:
    if self._next >= len(self._order) or name != self._order[self._next]:
      expected = self._order[self._next] if self._next < len(self._order) else "nothing"
      raise ValueError(f"HF export got tensor {name!r}, expected {expected!r} next.")
    shape, dtype = self._expected[name]
    if tuple(value.shape) != shape or value.dtype != dtype:
      raise ValueError(f"HF export: {name} is {value.dtype}{list(value.shape)}, planned "
                       f"{dtype}{list(shape)}.")
    self._next += 1
    self._pending[name] = value
    shard = self._shard_of[name]
    if name == self.shards[shard][-1]:  # the file is complete: write it, drop its tensors
      tensors = {n: self._pending.pop(n) for n in self.shards[shard]}
      save_file(tensors, os.path.join(self.path, self.files[shard]), metadata={"format": "pt"})
      self.written.append(self.files[shard])

  def close(self) -> list[str]:
    """Writes the index (sharded) and `config.json`; returns every file written."""
    if self._next != len(self._order):
      raise ValueError(f"HF export closed after {self._next} of {len(self._order)} tensors.")
    if len(self.shards) > 1:
      total = sum(math.prod(s) * d.itemsize for s, d in self._expected.values())
      index = {"metadata": {"total_size": total},
               "weight_map": {t: f for f, names in zip(self.files, self.shards) for t in names}}
      with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
      self.written.append("model.safetensors.index.json")
    dtype_name = str(self.specs[0][2])
    with open(os.path.join(self.path, "config.json"), "w") as f:
      json.dump(self.config.to_hf(dtype=dtype_name), f, indent=1)
    self.written.append("config.json")
    return list(self.written)


def write_hf_dir(config: ModelConfig, tensors: dict[str, np.ndarray], path: str, *,
                 max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes `config.json` and (sharded when large) safetensors into an existing dir; returns files."""
  writer = HFDirWriter(config, [(n, v.shape, v.dtype) for n, v in tensors.items()], path,
                       max_shard_bytes=max_shard_bytes)
  for name, value in tensors.items():
    writer.add(name, value)
  return writer.close()


def save_hf(model: Decoder, path: str, *, dtype=None, max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes `model` as an HF directory (config.json + safetensors, no pickle). Returns file names."""
  os.makedirs(path, exist_ok=True)
  tensors = hf_tensors(model.config, nnx.state(model, nnx.Param), dtype)
  return write_hf_dir(model.config, tensors, path, max_shard_bytes=max_shard_bytes)
