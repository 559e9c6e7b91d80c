"""Noise-free evaluation of an exact-answer task: the policy's probability of the correct answer.

Sampled reward at temperature 1 is a noisy estimate of `P(correct answer | prompt)`; for tasks with a
single correct answer string that probability can be computed exactly with one forward pass (the sum
of the answer tokens' log-probs, end-of-sequence included). The demo and the tests use it to show
that training moved the policy, independent of sampling noise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from flashrl_jax import envs
from flashrl_jax.model import Decoder, Tokenizer, token_logprobs


def answer_logprobs(model: Decoder, tokenizer: Tokenizer, samples: list[envs.Sample],
                    temperature: float = 1.0) -> np.ndarray:
  """`[N]` log P(answer + eos | prompt) under `softmax(logits / temperature)`."""
  rows = []
  for s in samples:
    prompt = tokenizer.encode(s.prompt)
    answer = tokenizer.encode(s.answer) + [tokenizer.eos_token_id]
    rows.append((prompt, answer))
  width = max(len(p) + len(a) for p, a in rows)
  ids = np.zeros((len(rows), width), np.int32)
  targets = np.zeros_like(ids)
  mask = np.zeros(ids.shape, np.float32)
  for i, (p, a) in enumerate(rows):
    seq = p + a
    ids[i, :len(seq)] = seq
    targets[i, :len(seq) - 1] = seq[1:]
    mask[i, len(p) - 1:len(seq) - 1] = 1.0
  hidden = model.hidden_states(jnp.asarray(ids))
  logp, _ = token_logprobs(hidden, model.unembedding(), jnp.asarray(targets),
                           temperature=temperature)
  return (np.asarray(logp) * mask).sum(-1)


def expected_accuracy(model: Decoder, tokenizer: Tokenizer, samples: list[envs.Sample],
                      temperature: float = 1.0) -> float:
  """Mean over `samples` of the probability that one sampled response is exactly the answer."""
  return float(np.mean(np.exp(answer_logprobs(model, tokenizer, samples, temperature))))
