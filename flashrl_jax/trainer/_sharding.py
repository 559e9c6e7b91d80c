"""Logical-axis rules: the two small tables that map the model's axis names onto the mesh.

Why: the model names axes (`embed`, `heads`, `mlp`, `vocab`, `batch`, ...) and nothing else. Training
splits parameters over `fsdp` and `tensor` (FSDP + TP); rollout keeps whole copies per data replica
and splits only over `tensor` (TP), so generation never all-gathers weights per token. Changing the
table, not the model, changes the parallelism.

A mesh axis that does not divide a dimension (e.g. 2 KV heads on `tensor:4`) is dropped for that
array, which replicates it along that axis instead of failing or padding.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
)

ROLLOUT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
)


def _axes(value: MeshAxes) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: Mesh,
                    shape: Sequence[int] | None = None) -> P:
  """The `PartitionSpec` for an array whose axes have logical `names`.

  Unknown names and None replicate. With `shape`, mesh axes that do not divide the dimension (or are
  already used by an earlier dimension) are dropped.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(names):
    kept = []
    size = 1
    for axis in _axes(table.get(name)) if name is not None else ():
      n = mesh.shape[axis]
      if axis in used or (shape is not None and shape[i] % (size * n)):
        continue
      kept.append(axis)
      size *= n
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*spec)


def named_sharding(names: Sequence[str | None], rules: Rules, mesh: Mesh,
                   shape: Sequence[int] | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, rules, mesh, shape))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def state_shardings(abstract_state: Any, rules: Rules, mesh: Mesh) -> Any:
  """NamedShardings for every leaf of an `nnx.State` of Params (or a pytree containing them).

  Each Param's logical names come from its `out_sharding` metadata; leaves outside a Variable (e.g.
  optax's scalar `count`) are replicated.
  """

  def one(x):
    if isinstance(x, nnx.Variable):
      names = x.get_metadata().get("out_sharding") or (None,) * x.value.ndim
      return x.replace(named_sharding(names, rules, mesh, x.value.shape))
    return replicated(mesh)

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_fn(rules: Rules, mesh: Mesh):
  """The model's `shard(x, names)` callable: a sharding constraint under `rules` on `mesh`."""

  def shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, named_sharding(names, rules, mesh, x.shape))

  return shard
