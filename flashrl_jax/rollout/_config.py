"""Typed configuration and counters of the rollout engine.

Kept apart from the scheduler so the CLI edge (`server.py`), benchmarks and tests build an
`EngineConfig` without reading the engine's threading code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How one engine serves one model.

  `context_length` bounds prompt + output per request (default: the model's
  `max_position_embeddings`, at most 4096); it sizes the KV cache
  (per layer `[slots + 1, K, context + 1, H]`) and the largest prefill and decode buckets.
  """

  model_path: str
  max_running_requests: int = 8
  context_length: int | None = None
  dtype: Any = jnp.float32
  tp: int = 1
  min_prefill_len: int = 16
  max_prefill_batch: int = 4
  prefill_token_budget: int = 4096
  # Decode runs on the live slots padded to a batch bucket (powers of two and the halfway points
  # between them, >= min_decode_batch), each row attending over the power-of-two span
  # (>= min_decode_span) that holds its own context; `Engine.warmup` compiles one decode program
  # per batch bucket (each holds every span), so fewer buckets start faster.
  min_decode_batch: int = 1
  min_decode_span: int = 64
  # Decode steps per device call (SGLang's `num_continuous_decode_steps`): the block's steps run in
  # one program, so the fixed cost of a call is paid once per block; requests wait for a block to
  # end to be admitted, aborted or paused, and one that finishes inside it leaves the rest of its
  # block's tokens computed and dropped.
  num_continuous_decode_steps: int = 4
  weight_version: str = "default"
  seed: int = 0
  # Seconds the engine sleeps after each decode call, its tokens delivered: a server made slow on
  # purpose (a straggler in a fleet experiment; a test that must pause requests mid-generation
  # whatever the machine's speed). Not counted in `EngineStats.decode_s`.
  decode_delay_s: float = 0.0
  tokenizer_path: str | None = None  # default: model_path when it holds a tokenizer.json

  def __post_init__(self):
    if min(self.max_running_requests, self.max_prefill_batch, self.tp, self.min_decode_batch,
           self.min_decode_span, self.min_prefill_len, self.num_continuous_decode_steps) < 1:
      raise ValueError("max_running_requests, max_prefill_batch, tp, min_decode_batch, "
                       "min_decode_span, min_prefill_len and num_continuous_decode_steps must be "
                       f">= 1: {self}")
    if not self.decode_delay_s >= 0:
      raise ValueError(f"decode_delay_s must be >= 0, got {self.decode_delay_s}.")
    if self.context_length is not None and self.context_length < 2:
      raise ValueError(f"context_length must be >= 2, got {self.context_length}.")


@dataclasses.dataclass
class EngineStats:
  """Counters for benchmarks and `/server_info` (slot-steps = slots x decode steps)."""

  decode_steps: int = 0  # token steps (a call runs up to num_continuous_decode_steps of them)
  decode_calls: int = 0
  busy_slot_steps: int = 0  # slot-steps that produced a token (kept by its request)
  computed_slot_steps: int = 0  # slot-steps decode computed (the decode batch size, summed)
  prefill_calls: int = 0
  prefill_tokens: int = 0
  # Wall seconds inside decode steps and prefill calls (results on the host included): with the
  # counts they give the time of one decode iteration at the live requests a workload keeps.
  decode_s: float = 0.0
  prefill_s: float = 0.0
  generated_tokens: int = 0
  warmup_shapes: int = 0  # step shapes `Engine.warmup` ran
  warmup_s: float | None = None  # how long it took (None: never warmed up)
  engine_errors: int = 0  # failed device calls and iterations the engine recovered from

  def idle_fraction(self, num_slots: int) -> float:
    """Slot-steps in which a slot held no request (what static batching wastes)."""
    total = self.decode_steps * num_slots
    return 1.0 - self.busy_slot_steps / total if total else 0.0

  def wasted_compute_fraction(self) -> float:
    """Decode work spent on rows without a request (lower than idle: the batch shrinks)."""
    total = self.computed_slot_steps
    return 1.0 - self.busy_slot_steps / total if total else 0.0
