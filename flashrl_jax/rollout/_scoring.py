"""Prompt log-probs (SGLang's `input_token_logprobs` / `input_top_logprobs`) from a separate forward.

Why separate from decode: only a few requests ask for them (SGLang's frontend `select()` scores
choices this way; an RL trainer never does), so the decode and prefill programs stay as they are and
a request that asks pays for one extra full-sequence forward of its prompt on the current weights.
The vocabulary projection runs over chunks of positions, so at most one `[C, V]` block of logits is
alive at a time, and prompts are padded to power-of-two lengths so few programs are compiled.

Meaning, as in SGLang: the entry at prompt position i is `log_softmax(logits_{i-1})[token_i]`, raw
logits (no temperature); position 0 has no context, so its log-prob is None.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flashrl_jax.rollout._sampling import MAX_TOP_LOGPROBS, top_candidates

_CHUNK = 128


def _bucket(n: int, smallest: int = 16) -> int:
  return max(smallest, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class PromptScorer:
  """Scores whole prompts with the engine's model structure and whatever weights it is handed."""

  def __init__(self, graphdef: nnx.GraphDef):
    self._graphdef = graphdef
    self._score = jax.jit(self._score_impl, static_argnums=(2,))

  def score(self, params: nnx.State, prompt_ids: Sequence[int], top_n: int = 0
            ) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """(log-prob per position, top-`top_n` (id, log-prob) per position); position 0 is None/[]."""
    t = len(prompt_ids)
    tokens = np.zeros((1, _bucket(t)), np.int32)
    tokens[0, :t] = prompt_ids
    k = MAX_TOP_LOGPROBS if top_n else 0
    logp, top_ids, top_lps = jax.device_get(self._score(params, tokens, k))
    logprobs: list[float | None] = [None] + [float(x) for x in logp[1:t]]
    tops: list[list[tuple[int, float]]] = [[]]
    for i in range(1, t if top_n else 0):
      tops.append([(int(a), float(b)) for a, b in zip(top_ids[i, :top_n], top_lps[i, :top_n])])
    return logprobs, tops

  def _score_impl(self, params: nnx.State, tokens: jax.Array, k: int):
    model = nnx.merge(self._graphdef, params)
    hidden = model.hidden_states(tokens)[0]  # [T, D]; causal: the padding changes no prompt position
    t = hidden.shape[0]
    chunk = min(_CHUNK, t)
    # Position i is predicted from the hidden state at i - 1: shift the targets left by one.
    targets = jnp.concatenate([tokens[0, 1:], jnp.zeros((1,), jnp.int32)])
    h_chunks = hidden.reshape(t // chunk, chunk, -1)
    y_chunks = targets.reshape(t // chunk, chunk)

    def one(args):
      h, y = args
      logp = jax.nn.log_softmax(model.logits(h), axis=-1)  # [C, V]
      chosen = jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
      if not k:
        return chosen, jnp.zeros((chunk, 0), jnp.int32), jnp.zeros((chunk, 0), jnp.float32)
      ids, lps = top_candidates(logp, k)
      return chosen, ids, lps

    chosen, ids, lps = jax.lax.map(one, (h_chunks, y_chunks))
    # Entry i (i >= 1) is about token i, predicted at i - 1.
    shift = lambda a: jnp.concatenate([jnp.zeros_like(a[:1]), a[:-1]])
    return (shift(chosen.reshape(t)), shift(ids.reshape(t, k)), shift(lps.reshape(t, k)))
