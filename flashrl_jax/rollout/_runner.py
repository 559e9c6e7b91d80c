"""The device half of the rollout engine: sharded weights, the slot state, and the jitted steps.

Why it is separate from the scheduler: everything here is arrays with static shapes from a few
buckets, so nothing recompiles per request, and `warmup` compiles every shape the engine can meet.
The weights are a jit *argument* (an `nnx.State` placed on the rollout mesh), so a weight swap is a
pointer swap. The KV cache (`SlotCache`) is the only device state: both forward programs take it
donated and return it, so it is updated in place. Each slot's next input token, step count and
sampling options live on the host, where the scheduler needs them anyway, and go in with each call.
Prefill's sampling is a program of its own, compiled once per group size rather than into every
prefill shape (it was half of each program's compile time).

Prefill runs on a small group of prompts padded to a (group, length) bucket, on a fresh model cache
of the bucket's length, and copies it into the chosen slots (`SlotCache.insert_prefill`). Decode
runs the live slots only: the scheduler passes their slot indices padded to a batch bucket (powers of
two and the halfway points between them, `bucket_ladder`), and each row attends over the smallest
power-of-two span bucket that holds its own context, so a step costs what the live requests need,
whatever slots they sit in. Decode programs are compiled per batch bucket only: each holds every
span bucket as a branch its rows choose on the device (compiling one program per (batch, longest
span) pair as well built each span's branches again in every larger span's program). One
decode call runs up to `decode_block` steps in one program (forward, sampling and the next step's
input on the device, SGLang's `num_continuous_decode_steps`): at the small batches of a CPU server
most of a step is the fixed cost of a call, which the block pays once (hidden 64, 2 layers, 8 live
requests, one core: 0.26 ms per token-step one step per call, 0.14 at 4 per call, 0.12 at 8).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flashrl_jax._ladder import halfway_ladder
from flashrl_jax.model import (MANIFEST, Decoder, ModelConfig, load_hf_state, no_shard, read_config,
                               verify_version)
from flashrl_jax.rollout._sampling import RowSampling, Sampling, sample_with_top
from flashrl_jax.rollout._slot_cache import SlotCache

# Rollout is tensor-parallel only: whole weight copies per replica, split over `tensor`.
ROLLOUT_RULES: dict[str, str | None] = {
    "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
    "embed": None, "head_dim": None, "batch": None, "length": None}


def rollout_mesh(tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D `("tensor",)` mesh over the first `tp` devices."""
  devices = list(devices if devices is not None else jax.devices())
  if tp < 1 or tp > len(devices):
    raise ValueError(f"tp={tp} needs 1..{len(devices)} devices.")
  return Mesh(np.asarray(devices[:tp]), ("tensor",))


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 rules: dict[str, str | None] = ROLLOUT_RULES) -> P:
  """Maps logical axis names to mesh axes; an axis that does not divide its dimension replicates."""
  spec = []
  for name, dim in zip(names, shape):
    axis = rules.get(name) if name is not None else None
    spec.append(axis if axis is not None and dim % mesh.shape[axis] == 0 else None)
  return P(*spec)


def param_shardings(abstract_state: nnx.State, mesh: Mesh,
                    rules: dict[str, str | None] = ROLLOUT_RULES) -> nnx.State:
  """A state-shaped tree of `NamedSharding`s read from each parameter's `out_sharding` names."""
  logical = dict(nnx.to_flat_state(nnx.get_partition_spec(abstract_state)))
  flat = []
  for path, variable in nnx.to_flat_state(abstract_state):
    shape = variable.get_value().shape
    names = tuple(logical[path].get_value()) or (None,) * len(shape)
    flat.append((path, variable.replace(NamedSharding(mesh, logical_spec(names, shape, mesh,
                                                                          rules)))))
  return nnx.from_flat_state(flat)


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def pow2_buckets(lo: int, hi: int) -> list[int]:
  """Powers of two from `lo` (rounded up) below `hi`, then `hi` itself."""
  out, n = [], _pow2_at_least(lo)
  while n < hi:
    out.append(n)
    n *= 2
  return out + [hi]


def bucket_ladder(lo: int, hi: int) -> list[int]:
  """The sizes of `halfway_ladder` (1, 2, 3, 4, 6, 8, 12, 16, 24, ...; the trainer's micro-batch
  counts climb the same one) from `lo` (rounded up to one of them) below `hi`, then `hi` itself.

  Why the halfway points for decode batches: a batch is padded up to its bucket, and with powers of
  two alone 17-24 live requests computed 32 rows (the hidden-256 engine, one core: 5.7 ms a step at
  24 live padded to 32, 4.8 ms with a bucket of 24).
  """
  below = itertools.takewhile(lambda size: size < hi, halfway_ladder())
  return [size for size in below if size >= lo] + [hi]


class Runner:
  """Holds the model on the rollout mesh and runs prefill/decode on the slot state."""

  def __init__(self, model_path: str, *, num_slots: int, context_length: int, dtype=jnp.float32,
               mesh: Mesh | None = None, min_prefill_len: int = 16, max_prefill_batch: int = 4,
               min_decode_batch: int = 1, min_decode_span: int = 64, decode_block: int = 1):
    self.config: ModelConfig = read_config(model_path)
    self.mesh = mesh if mesh is not None else rollout_mesh(1)
    self.num_slots, self.context_length = num_slots, context_length
    self.min_prefill_len, self.max_prefill_batch = min_prefill_len, max_prefill_batch
    if decode_block < 1:
      raise ValueError(f"decode_block must be >= 1, got {decode_block}.")
    self.decode_block = decode_block
    self.dtype = dtype
    shard = no_shard if self.mesh.size == 1 else self._shard_activation
    abstract = nnx.eval_shape(lambda: Decoder(self.config, rngs=nnx.Rngs(0), param_dtype=dtype,
                                              dtype=dtype, shard=shard))
    self.graphdef, self.abstract_state = nnx.split(abstract)
    self.shardings = param_shardings(self.abstract_state, self.mesh)
    self.set_params(self.load_params(model_path))
    c = self.config
    spec = logical_spec((None, "kv_heads", None, None),
                        (num_slots + 1, c.num_kv_heads, context_length + 1, c.head_dim), self.mesh)
    self._cache_sharding = NamedSharding(self.mesh, spec)
    self._replicated = NamedSharding(self.mesh, P())
    self.cache = self._zero_cache()
    rows = num_slots + 1
    self._tokens = np.zeros(rows, np.int32)  # each slot's last sampled token: its next input
    self._steps = np.zeros(rows, np.int32)  # tokens generated so far (the sampler's counter)
    self._rows = RowSampling.host([], rows)  # each slot's sampling options
    self._batch_rows: tuple[tuple[int, ...], RowSampling] | None = None  # last decode batch's
    # The shapes a step can have: decode batches, prefill groups and lengths; and the span
    # buckets a decode row may attend over (branches inside each decode program, not shapes).
    self.decode_sizes = bucket_ladder(min(min_decode_batch, num_slots), num_slots)
    self.decode_spans = pow2_buckets(min(min_decode_span, context_length), context_length)
    self.prefill_groups = pow2_buckets(1, _pow2_at_least(max_prefill_batch))
    self.prefill_lengths = pow2_buckets(min(min_prefill_len, context_length), context_length)
    self._decode = jax.jit(self._decode_impl, donate_argnums=(1,), static_argnums=(8,))
    self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1,))
    self._sample = jax.jit(sample_with_top, static_argnums=(3,))

  # --- weights -----------------------------------------------------------------------------------

  def load_params(self, path: str) -> nnx.State:
    """Reads an HF directory into the running model's structure, completely, or raises.

    A directory with a `manifest.json` (every version the trainer exports) must match it file for
    file (sizes and sha256) before anything is read; its config must describe the running model
    (every field: weights for another rope theta or eos would be served wrong, silently); then
    every tensor must have its name, shape, a float dtype and finite values. Nothing here touches
    the weights being served, so a refusal leaves them serving.
    """
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
      verify_version(path)
    other = read_config(path)
    mine = self.config
    if other != mine:
      diff = {f.name: (getattr(other, f.name), getattr(mine, f.name))
              for f in dataclasses.fields(ModelConfig)
              if getattr(other, f.name) != getattr(mine, f.name)}
      raise ValueError(f"{path} describes another model than the running one: "
                       + ", ".join(f"{k}={a!r} (running: {b!r})" for k, (a, b) in diff.items()))
    return load_hf_state(path, self.config, self.abstract_state, self.shardings)

  def set_params(self, params: nnx.State) -> None:
    # The steps take the weights as a flat list of arrays: handing jit the `nnx.State` itself
    # made it flatten the tree in Python on every call (~0.3 ms a step, a third of a 1-row step).
    self.params = params
    self._leaves, self._treedef = jax.tree.flatten(params)

  # --- slot bookkeeping --------------------------------------------------------------------------

  def _shard_activation(self, x: jax.Array, names) -> jax.Array:
    spec = logical_spec(names, x.shape, self.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def _zero_cache(self) -> SlotCache:
    c = self.config
    # One position more than the longest span: a span covering the whole buffer made XLA:CPU copy
    # the whole (just written, donated) buffer before gathering from it, 6x slower per step at 8
    # live requests (hidden 256, context 544: 22.9 ms CPU vs 3.6 ms at span 512).
    return SlotCache.zeros(num_layers=c.num_layers, num_slots=self.num_slots,
                            max_length=self.context_length + 1, num_kv_heads=c.num_kv_heads,
                            head_dim=c.head_dim, dtype=self.dtype,
                            place=lambda x: jax.device_put(x, self._cache_sharding
                                                           if x.ndim == 4 else self._replicated))

  def reset(self) -> None:
    """Drops every slot's KV (all slots must be free)."""
    self.cache = self._zero_cache()

  def set_slots(self, rows: list[tuple[Sampling, int, tuple[int, ...]] | tuple[None, int, tuple]]
                ) -> None:
    """Sets every slot's sampling options (when they change; each decode batch takes its rows)."""
    self._rows = RowSampling.host(list(rows), self.num_slots + 1)
    self._batch_rows = None

  # --- steps -------------------------------------------------------------------------------------

  def prefill_bucket(self, lengths: Sequence[int]) -> tuple[int, int]:
    """The (group, length) bucket a group of prompts of these lengths is padded to."""
    t = next(n for n in self.prefill_lengths if n >= max(lengths))
    return next(g for g in self.prefill_groups if g >= len(lengths)), t

  def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int],
              rows: Sequence[tuple[Sampling, int, tuple[int, ...]]], steps: Sequence[int],
              top_n: int = 0) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Processes whole prompts into `slots`; returns each one's next token, its log-prob and the
    `top_n` most likely candidates (ids, log-probs) `[n, top_n]`."""
    g, t = self.prefill_bucket([len(p) for p in prompts])
    n = len(prompts)
    tokens = np.zeros((g, t), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    lengths = np.zeros(g, np.int32)
    lengths[:n] = [len(p) for p in prompts]
    slot_ids = np.full(g, self.num_slots, np.int32)  # padding rows land in the spare row
    slot_ids[:n] = slots
    step_arr = np.zeros(g, np.int32)
    step_arr[:n] = steps
    self.cache, logits = self._prefill(self._leaves, self.cache, tokens, lengths, slot_ids)
    new_tokens, logprobs, top = self._sample(logits, RowSampling.host(list(rows), g), step_arr,
                                             top_n)
    new_tokens, logprobs, (ids, lps) = jax.device_get((new_tokens, logprobs, top))
    self._tokens[slot_ids], self._steps[slot_ids] = new_tokens, step_arr + 1
    return new_tokens[:n], logprobs[:n], (ids[:n], lps[:n])

  def decode_batch(self, num_live: int) -> int:
    """The batch bucket a decode step over `num_live` requests is padded to."""
    return next(n for n in self.decode_sizes if n >= num_live)

  def decode(self, slots: Sequence[int], top_n: int = 0, steps: int = 1
             ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """`steps` tokens (1..`decode_block`) for each of `slots`, each step's output the next one's
    input (the caller keeps every request's last position, `steps - 1` past its cached length,
    inside the cache). Returns `[steps, len(slots)]` tokens and log-probs and the `top_n` most
    likely candidates `[steps, len(slots), top_n]`. A request that ends inside the block (stop
    token, length) has its later tokens computed too: the caller drops them."""
    if not 1 <= steps <= self.decode_block:
      raise ValueError(f"steps must be in 1..{self.decode_block}, got {steps}.")
    size = self.decode_batch(len(slots))
    batch = np.full(size, self.num_slots, np.int32)  # padding rows: the spare row
    batch[:len(slots)] = slots
    key = tuple(batch.tolist())
    if self._batch_rows is None or self._batch_rows[0] != key:  # the live set changed
      self._batch_rows = (key, jax.tree.map(lambda x: x[batch], self._rows))
    step_counts = self._steps[batch]
    self.cache, out = self._decode(self._leaves, self.cache, batch, self._tokens[batch],
                                   np.int32(len(slots)), step_counts, self._batch_rows[1],
                                   np.int32(steps), top_n)
    n = len(slots)
    tokens, logprobs, ids, lps = jax.device_get(out)
    self._tokens[batch[:n]] = tokens[steps - 1, :n]
    self._steps[batch[:n]] = step_counts[:n] + steps
    return tokens[:steps, :n], logprobs[:steps, :n], (ids[:steps, :n], lps[:steps, :n])

  def warmup(self, prefill_token_budget: int | None = None) -> int:
    """Compiles every program a step can run: each prefill (group, length) bucket a scheduler
    with this token budget can form (one prompt always fits) and each decode batch bucket;
    returns how many shapes ran.

    Dummy rows target the spare row, so live slots are untouched (only the spare's KV changes).
    """
    ran = 0
    for length in self.prefill_lengths:
      for g in self.prefill_groups:
        if g > 1 and prefill_token_budget is not None and g * length > prefill_token_budget:
          continue
        self.prefill([[0] * length] * g, [self.num_slots] * g, [(Sampling(), 0, ())] * g, [0] * g)
        ran += 1
    for size in self.decode_sizes:  # one program per batch bucket, whatever the steps per call
      spare, idle = np.full(size, self.num_slots, np.int32), RowSampling.host([], size)
      self.cache, _ = self._decode(self._leaves, self.cache, spare, spare, np.int32(0),
                                   np.zeros(size, np.int32), idle, np.int32(1), 0)
      ran += 1
    jax.block_until_ready(self.cache)
    return ran

  def compiled_count(self) -> int:
    """How many programs the runner holds compiled (weight swaps must not add any)."""
    return self._decode._cache_size() + self._prefill._cache_size() + self._sample._cache_size()

  # --- jitted bodies -----------------------------------------------------------------------------

  def _constrain(self, cache: SlotCache) -> SlotCache:
    pin = lambda x: jax.lax.with_sharding_constraint(x, self._cache_sharding)
    return cache.replace(ks=tuple(map(pin, cache.ks)), vs=tuple(map(pin, cache.vs)))

  def _prefill_impl(self, params: list[jax.Array], cache: SlotCache, tokens: jax.Array,
                    lengths: jax.Array, slots: jax.Array) -> tuple[SlotCache, jax.Array]:
    """Prompts `tokens` `[G, T]` into `slots` (padding rows: the spare); last-position logits."""
    model = nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, params))
    g, t = tokens.shape
    fresh = model.init_cache(g, t)
    hidden, fresh = model.extend(tokens, lengths, fresh)
    last = hidden[jnp.arange(g), jnp.maximum(lengths - 1, 0)]  # [G, D]
    return self._constrain(cache.insert_prefill(fresh, slots)), model.logits(last)

  def _decode_impl(self, params: list[jax.Array], cache: SlotCache, slots: jax.Array,
                   tokens: jax.Array, num_live: jax.Array, step_counts: jax.Array,
                   rows: RowSampling, steps: jax.Array, top_n: int
                   ) -> tuple[SlotCache, tuple[jax.Array, ...]]:
    """`steps` (<= `decode_block`) decode steps of batch rows `slots` `[b]` (the first `num_live`
    are requests, the rest pad with the spare row), starting from input `tokens` `[b]`, each row
    attending over its own span bucket; each step samples the next input. Returns the cache and
    `[decode_block, b]` tokens and log-probs, `[decode_block, b, top_n]` candidates (rows past
    `steps` are zeros)."""
    model = nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, params))
    b, block = slots.shape[0], self.decode_block
    advance = (jnp.arange(b) < num_live).astype(jnp.int32)  # padding rows write, never advance

    def step(i, carry):
      cache, tokens, (out_tokens, out_lps, out_ids, out_top) = carry
      hidden, view = model.extend(tokens[:, None], advance,
                                  cache.view(slots, self.context_length,
                                             tuple(self.decode_spans)))
      cache = self._constrain(view.commit(cache))
      new, lps, (ids, top) = sample_with_top(model.logits(hidden[:, 0]), rows, step_counts + i,
                                             top_n)
      outs = (out_tokens.at[i].set(new), out_lps.at[i].set(lps), out_ids.at[i].set(ids),
              out_top.at[i].set(top))
      return cache, new, outs

    outs = (jnp.zeros((block, b), jnp.int32), jnp.zeros((block, b), jnp.float32),
            jnp.zeros((block, b, top_n), jnp.int32), jnp.zeros((block, b, top_n), jnp.float32))
    cache, _, outs = jax.lax.fori_loop(0, steps, step, (cache, tokens, outs))
    return cache, outs


def describe(runner: Runner) -> dict[str, Any]:
  """Static facts about the runner for `/server_info`."""
  return {"tp_size": runner.mesh.size, "context_length": runner.context_length,
          "max_running_requests": runner.num_slots, "dtype": jnp.dtype(runner.dtype).name,
          "min_prefill_len": runner.min_prefill_len, "max_prefill_batch": runner.max_prefill_batch,
          "decode_batch_sizes": list(runner.decode_sizes),
          "decode_spans": list(runner.decode_spans),
          "num_continuous_decode_steps": runner.decode_block,
          "prefill_lengths": list(runner.prefill_lengths)}
